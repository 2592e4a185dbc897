"""What a job may cost is checked before it is queued: timeout ceiling, finite parameters,
memory budget, estimated run time; and methods chunk their passes to the memory budget."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from limelight.core.jobs import JobSpec, JobState
from limelight.errors import InvalidArgument
from limelight.jobs.budget import check_timeout
from limelight.jobs.execution import job_timeout
from limelight.jobs.runner import JobRunner
from limelight.jobs.sqlite_backend import SqliteJobBackend
from limelight.methods import gradients, slalom
from limelight.methods.base import MethodRegistry, model_shape
from limelight.models.loaded import LoadedModel
from limelight.settings import Settings

TEXT = "the acting was awful but the plot is great fun"


def _settings(tmp_path: Path, **kw: Any) -> Settings:
    return Settings(cache_dir=tmp_path, jobs="sqlite", **kw)


async def _submit_all(settings: Settings, model: LoadedModel, specs: list[JobSpec]) -> list[Any]:
    """Submit each spec to a journal without workers; the exception or the record of each."""
    runner = JobRunner(model, MethodRegistry.load(settings), settings)
    backend = SqliteJobBackend(settings, runner=None)
    await backend.start()  # no worker threads: jobs stay queued
    backend.runner = runner  # validates on submit
    out: list[Any] = []
    try:
        for spec in specs:
            try:
                out.append(await backend.submit(spec))
            except InvalidArgument as exc:
                out.append(exc)
        queued = await backend.list([JobState.QUEUED], 100)
        assert len(queued) == sum(not isinstance(o, Exception) for o in out)
    finally:
        await backend.stop(1.0)
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, -1.0, 1e9])
async def test_absurd_timeouts_are_rejected(
    tiny_model: LoadedModel, tmp_path: Path, timeout: float
) -> None:
    settings = _settings(tmp_path, job_timeout_max_s=120)
    (result,) = await _submit_all(
        settings, tiny_model, [JobSpec("gradient", TEXT, timeout_s=timeout)]
    )
    assert isinstance(result, InvalidArgument)
    assert "timeout_seconds" in result.message


@pytest.mark.asyncio
async def test_timeout_up_to_the_ceiling_is_accepted_and_the_default_is_capped(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    settings = _settings(tmp_path, job_timeout_max_s=120, job_timeout_s=600)
    (record,) = await _submit_all(settings, tiny_model, [JobSpec("gradient", TEXT, timeout_s=120)])
    assert record.state is JobState.QUEUED
    assert job_timeout(JobSpec("gradient", TEXT), settings) == 120


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("integrated_gradients", {"steps": math.inf}),
        ("integrated_gradients", {"steps": math.nan}),
        ("integrated_gradients", {"batch_size": -math.inf}),
        ("slalom", {"lr": math.nan}),
        ("slalom", {"lr": math.inf}),
    ],
)
async def test_non_finite_parameters_are_invalid_arguments(
    tiny_model: LoadedModel, tmp_path: Path, method: str, params: dict[str, Any]
) -> None:
    (result,) = await _submit_all(
        _settings(tmp_path), tiny_model, [JobSpec(method, TEXT, params=params)]
    )
    assert isinstance(result, InvalidArgument)
    assert "finite" in result.message


@pytest.mark.asyncio
async def test_a_job_that_cannot_fit_the_memory_budget_is_rejected_before_queueing(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    tokens = len(tiny_model.encode(TEXT, None, 512, "truncate"))
    one_row_mb = model_shape(tiny_model).row_bytes(tokens, backward=True) / 2**20
    settings = _settings(tmp_path, job_memory_mb=one_row_mb / 2)
    rejected, short = await _submit_all(
        settings,
        tiny_model,
        [JobSpec("integrated_gradients", TEXT), JobSpec("integrated_gradients", "fun")],
    )
    assert isinstance(rejected, InvalidArgument) and "memory" in rejected.message
    assert short.state is JobState.QUEUED  # a shorter text fits the same budget


def test_integrated_gradients_chunks_its_path_to_the_memory_budget(
    tiny_model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = len(tiny_model.encode(TEXT, None, 512, "truncate"))
    row_mb = model_shape(tiny_model).row_bytes(tokens, backward=True) / 2**20
    settings = _settings(tmp_path, job_memory_mb=3.5 * row_mb)
    rows: list[int] = []
    real = gradients.logit_from_embeddings

    def spy(model: Any, points: Any, *args: Any, **kw: Any) -> Any:
        rows.append(int(points.shape[0]))
        return real(model, points, *args, **kw)

    monkeypatch.setattr(gradients, "logit_from_embeddings", spy)
    runner = JobRunner(tiny_model, MethodRegistry.load(settings), settings)
    spec = JobSpec("integrated_gradients", TEXT, params={"steps": 16, "batch_size": 512})
    chunked = runner.run(spec)
    path = rows[:-1]  # the last pass evaluates the two ends of the path
    assert max(path) <= 3 and sum(path) == 16

    rows.clear()
    roomy = JobRunner(tiny_model, MethodRegistry.load(), _settings(tmp_path))
    whole = roomy.run(spec)
    assert rows[:-1] == [16]  # with room, the requested batch is kept
    assert chunked.attribution.scores == pytest.approx(whole.attribution.scores, abs=1e-5)


def test_slalom_queries_in_chunks_within_the_memory_budget(
    tiny_model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3 sampled tokens + [CLS] and [SEP]; forward only.
    row_mb = model_shape(tiny_model).row_bytes(5, backward=False) / 2**20
    settings = _settings(tmp_path, job_memory_mb=7.5 * row_mb)
    rows: list[int] = []
    real = slalom.Slalom._forward

    def spy(ctx: Any, ids: Any, types_row: Any, target: int) -> Any:
        rows.append(len(ids))
        return real(ctx, ids, types_row, target)

    monkeypatch.setattr(slalom.Slalom, "_forward", staticmethod(spy))
    runner = JobRunner(tiny_model, MethodRegistry.load(settings), settings)
    spec = JobSpec(
        "slalom",
        TEXT,
        params={"num_samples": 64, "query_batch_size": 4096, "epochs": 2, "fit": "paper"},
    )
    runner.run(spec)
    assert rows and max(rows) <= 7


@pytest.mark.asyncio
async def test_jobs_estimated_far_beyond_their_timeout_are_refused(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    settings = _settings(tmp_path)
    huge, fine = await _submit_all(
        settings,
        tiny_model,
        [
            JobSpec("slalom", TEXT, params={"num_samples": 100_000}, timeout_s=0.001),
            JobSpec("integrated_gradients", TEXT, params={"steps": 8}),
        ],
    )
    assert isinstance(huge, InvalidArgument) and "timeout" in huge.message
    assert fine.state is JobState.QUEUED


@pytest.mark.asyncio
async def test_searches_and_long_fits_are_estimated_too(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    # The searches cost about permutations x n and n^2 passes; a SLALOM fit of many epochs in
    # batches of one runs for hours outside the model. Each was accepted and then held a worker
    # until its timeout.
    from limelight.jobs.budget import estimate_seconds

    long_text = " ".join(["word"] * 400)
    specs = [
        JobSpec("shapley", long_text, params={"permutations": 256}, timeout_s=0.01),
        JobSpec("greedy_deletion", long_text, params={"max_fraction": 1.0}, timeout_s=0.01),
        JobSpec("greedy_insertion", long_text, params={"max_fraction": 1.0}, timeout_s=0.01),
        JobSpec(
            "slalom",
            TEXT,
            params={"num_samples": 20_000, "epochs": 10_000, "batch_size": 1},
            timeout_s=5.0,
        ),
        JobSpec("shapley", TEXT, params={"permutations": 2}, timeout_s=60.0),
        JobSpec("greedy_deletion", TEXT, timeout_s=60.0),
    ]
    settings = _settings(tmp_path)
    outcomes = await _submit_all(settings, tiny_model, specs)
    for spec, outcome in zip(specs[:4], outcomes[:4], strict=True):
        assert isinstance(outcome, InvalidArgument) and "timeout" in outcome.message, spec
    assert [o.state for o in outcomes[4:]] == [JobState.QUEUED, JobState.QUEUED]
    # The fit's own time counts whatever the model's speed.
    fit = {"num_samples": 20_000, "epochs": 10_000, "batch_size": 1}
    assert (estimate_seconds("slalom", fit, 10, 1e12) or 0) > 3600
    # Fewer rounds with a step share per round; an odd input of one token is still priced.
    assert estimate_seconds("greedy_deletion", {"step": 0.1}, 100, 1.0) == 5 * 98 * 100
    assert (estimate_seconds("shapley", {"permutations": 2}, 3, 1.0) or 0) > 0


@pytest.mark.asyncio
async def test_a_slalom_sample_that_cannot_fit_beside_the_pair_is_refused_before_queueing(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    # Every sample keeps the other text of a pair: with a pair at the token limit no sample
    # fits, and the job failed once it ran ("makes samples of 513 tokens").
    long_pair = " ".join(["word"] * (tiny_model.max_tokens + 50))
    settings = _settings(tmp_path)
    refused, fine = await _submit_all(
        settings,
        tiny_model,
        [
            JobSpec("slalom", "good movie", text_pair=long_pair),
            JobSpec("slalom", "good movie", text_pair="a short premise"),
        ],
    )
    assert isinstance(refused, InvalidArgument), refused
    assert "leave room for" in refused.message and "sample_length" in refused.message
    assert fine.state is JobState.QUEUED


def test_windows_are_priced_one_by_one_against_the_jobs_whole_timeout() -> None:
    """Under truncation=window a method runs on every window in turn: the estimate is the sum
    of the windows' (each priced at its own length), set against the job's own timeout."""
    from limelight.jobs.budget import check_cost

    # gradient: 3 token passes per token; at 1 token per second, windows of 16, 16 and 10
    # tokens take 3 x 42 = 126 s, more than 4 x 30 s and less than 4 x 32 s.
    check_cost("gradient", {}, 38, 1.0, 32.0, [16, 16, 10])
    with pytest.raises(InvalidArgument) as refused:
        check_cost("gradient", {}, 38, 1.0, 30.0, [16, 16, 10])
    message = refused.value.message
    assert "this 38-token text, explained in 3 overlapping windows of up to 16 tokens" in message
    assert "about 126 s" in message and "the job's timeout of 30 s" in message
    assert "fewer windows" in message


def test_a_tiny_timeout_is_refused_with_an_estimate_that_reads_as_one() -> None:
    """ "would take about 0 s ..., far beyond the job's timeout of 1e-09 s" read as nonsense:
    an estimate under 10 s keeps two significant digits."""
    from limelight.jobs.budget import check_cost

    with pytest.raises(InvalidArgument) as refused:
        check_cost("gradient", {}, 3, 1000.0, 1e-9)
    assert "about 0.009 s" in refused.value.message, refused.value.message


@pytest.mark.asyncio
async def test_a_windowed_jobs_refusal_names_the_document_and_the_jobs_timeout(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    """The audit's case: a long document in window mode was refused naming one window's size
    ("on 512 tokens") and a per-window share of the timeout ("its timeout of 60 s" for a job
    of 600 s), the same whatever timeout the job asked for, never mentioning windows."""
    long_text = " ".join([TEXT] * 12)
    document = len(tiny_model.tokenizer(long_text)["input_ids"])
    settings = _settings(tmp_path, truncation="window", max_tokens=16, window_stride=4)
    timeouts = [1e-6, 2e-6]
    outcomes = await _submit_all(
        settings,
        tiny_model,
        [JobSpec("greedy_deletion", long_text, timeout_s=t) for t in timeouts],
    )
    for timeout, refused in zip(timeouts, outcomes, strict=True):
        assert isinstance(refused, InvalidArgument), refused
        message = refused.message
        assert f"this {document}-token text, explained in " in message
        assert "overlapping windows of up to 16 tokens" in message
        assert f"the job's timeout of {timeout:g} s" in message


def test_a_timeout_just_over_the_maximum_is_not_printed_as_the_maximum() -> None:
    with pytest.raises(InvalidArgument, match=r"timeout_seconds 3600\.0001 exceeds .* 3600 s"):
        check_timeout(3600.0001, 3600.0)
    with pytest.raises(InvalidArgument, match=r"timeout_seconds 7200 exceeds .* 3600 s"):
        check_timeout(7200.0, 3600.0)
    check_timeout(3600.0, 3600.0)

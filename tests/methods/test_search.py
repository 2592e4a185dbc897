"""Shapley values, greedy deletion and greedy insertion against brute force on a tiny real
model."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from limelight.core.types import Encoded
from limelight.methods.base import JobContext, JobMethod, MethodRegistry
from limelight.methods.search import (
    Coalitions,
    batched_logits,
    class_values,
    greedy_deletion,
    greedy_insertion,
    shapley_values,
)
from limelight.models.loaded import LoadedModel, load_model

TEXT = "a dull and silly film"


def _value(
    model: LoadedModel, encoded: Encoded, present: dict[int, bool], target: int, replace: str
) -> float:
    """The game's value computed the slow, obvious way: edit the ids, run the model."""
    ids, types = [], []
    for i, tid in enumerate(encoded.input_ids):
        if i in present and not present[i]:
            if replace == "delete":
                continue
            tid = int(model.mask_token_id)  # type: ignore[arg-type]
        ids.append(tid)
        if encoded.token_type_ids is not None:
            types.append(encoded.token_type_ids[i])
    with torch.inference_mode():
        t = torch.tensor([ids])
        kwargs = model.adapter.base_inputs(
            t, torch.ones_like(t), torch.tensor([types]) if types else None
        )
        logits = model.model(**kwargs).logits.float()[0]
    others = [float(logits[c]) for c in range(logits.shape[0]) if c != target]
    return float(logits[target]) - math.log(sum(math.exp(v) for v in others))


def _exact_shapley(model: LoadedModel, encoded: Encoded, target: int, replace: str) -> np.ndarray:
    players = [i for i, tok in enumerate(encoded.tokens) if not tok.special]
    m = len(players)
    cache: dict[tuple[bool, ...], float] = {}

    def v(coalition: tuple[bool, ...]) -> float:
        if coalition not in cache:
            cache[coalition] = _value(
                model, encoded, dict(zip(players, coalition, strict=True)), target, replace
            )
        return cache[coalition]

    phi = np.zeros(len(encoded))
    for j, player in enumerate(players):
        total = 0.0
        for bits in itertools.product([False, True], repeat=m - 1):
            with_j = [*bits[:j], True, *bits[j:]]
            without = [*bits[:j], False, *bits[j:]]
            s = sum(bits)
            weight = math.factorial(s) * math.factorial(m - s - 1) / math.factorial(m)
            total += weight * (v(tuple(with_j)) - v(tuple(without)))
        phi[player] = total
    return phi


@pytest.mark.parametrize("replace", ["mask", "delete"])
def test_shapley_sampling_is_efficient_and_converges_to_the_exact_values(
    random_bert: LoadedModel, replace: str
) -> None:
    encoded = random_bert.encode(TEXT)
    target = 2
    players = [i for i, tok in enumerate(encoded.tokens) if not tok.special]
    everyone = {i: True for i in players}
    nobody = {i: False for i in players}
    full = _value(random_bert, encoded, everyone, target, replace)
    empty = _value(random_bert, encoded, nobody, target, replace)
    # Efficiency holds exactly for every sample size: the values add up to v(all) - v(none).
    cheap = shapley_values(random_bert, encoded, target, permutations=2, replace=replace)
    assert cheap.sum() == pytest.approx(full - empty, abs=1e-4)
    assert np.all(cheap[[i for i in range(len(encoded)) if i not in players]] == 0)
    exact = _exact_shapley(random_bert, encoded, target, replace)
    sampled = shapley_values(random_bert, encoded, target, permutations=200, replace=replace)
    scale = np.abs(exact).max()
    assert np.abs(sampled - exact).max() < 0.15 * scale, (sampled, exact)


def test_greedy_deletion_matches_a_brute_force_search(random_bert: LoadedModel) -> None:
    encoded = random_bert.encode(TEXT)
    target = 0
    players = [i for i, tok in enumerate(encoded.tokens) if not tok.special]
    present = {i: True for i in players}
    removed: list[int] = []
    for _ in range(math.ceil(0.5 * len(players))):
        trials = {
            i: _value(random_bert, encoded, {**present, i: False}, target, "mask")
            for i in players
            if present[i]
        }
        best = min(trials, key=lambda i: trials[i])
        removed.append(best)
        present[best] = False
    scores = greedy_deletion(random_bert, encoded, target, max_fraction=0.5)
    order = sorted(players, key=lambda i: -scores[i])
    assert order[: len(removed)] == removed
    kept = [i for i in players if i not in removed]
    assert all(scores[k] < scores[r] for k in kept for r in removed)


def test_greedy_deletion_in_rounds_matches_a_brute_force_search(random_bert: LoadedModel) -> None:
    """With a step, each round removes the step's share of tokens with the largest single
    drops given what earlier rounds removed, and rounds end at the deletion curve's fractions."""
    encoded = random_bert.encode(TEXT + " and the second half drags on far too long")
    target = 1
    players = [i for i, tok in enumerate(encoded.tokens) if not tok.special]
    m = len(players)
    present = {i: True for i in players}
    rounds: list[list[int]] = []
    removed = 0
    for fraction in (0.1, 0.2, 0.3, 0.4, 0.5):
        end = max(1, round(fraction * m))
        trials = {
            i: _value(random_bert, encoded, {**present, i: False}, target, "mask")
            for i in players
            if present[i]
        }
        chosen = sorted(trials, key=lambda i: (trials[i], i))[: end - removed]
        rounds.append(chosen)
        for i in chosen:
            present[i] = False
        removed = end
    scores = greedy_deletion(random_bert, encoded, target, max_fraction=0.5, step=0.1)
    order = sorted(players, key=lambda i: -scores[i])
    assert order[:removed] == [i for chosen in rounds for i in chosen]
    assert all(scores[k] < scores[order[removed - 1]] for k in players if present[k])


def test_signed_greedy_deletion_signs_each_token_by_its_measured_drop(
    random_bert: LoadedModel,
) -> None:
    """Signed: a token is positive exactly when removing it lowered the target's log-odds the
    last time the search measured it (brute force), and the order is the search's with the
    negative tokens moved behind the positive ones."""
    encoded = random_bert.encode(TEXT + " but the cast is wonderful")
    target = 1
    players = [i for i, tok in enumerate(encoded.tokens) if not tok.special]
    present = {i: True for i in players}
    current = _value(random_bert, encoded, present, target, "mask")
    last_drop: dict[int, float] = {}
    for _ in range(math.ceil(0.5 * len(players))):
        trials = {
            i: _value(random_bert, encoded, {**present, i: False}, target, "mask")
            for i in players
            if present[i]
        }
        last_drop.update({i: current - v for i, v in trials.items()})
        best = min(trials, key=lambda i: trials[i])
        present[best] = False
        current = trials[best]
    plain = greedy_deletion(random_bert, encoded, target, max_fraction=0.5)
    signed = greedy_deletion(random_bert, encoded, target, max_fraction=0.5, signed=True)
    assert {i for i in players if signed[i] > 0} == {i for i in players if last_drop[i] > 0}
    assert all(signed[i] != 0 for i in players)
    searched = sorted(players, key=lambda i: -plain[i])
    towards = [i for i in searched if last_drop[i] > 0]
    against = [i for i in searched if last_drop[i] <= 0]
    assert towards and against  # the text has both kinds, so the test can fail
    assert sorted(players, key=lambda i: -signed[i]) == towards + against


@pytest.mark.parametrize(("step", "replace"), [(0.0, "mask"), (0.1, "mask"), (0.0, "delete")])
def test_greedy_insertion_matches_a_brute_force_search(
    random_bert: LoadedModel, step: float, replace: str
) -> None:
    """From no token present, each round adds the token (or the step's share of tokens) whose
    single addition raises the target most given what earlier rounds added; signed, a token is
    positive exactly when its last measured gain was."""
    encoded = random_bert.encode(TEXT + " but the cast is wonderful")
    target = 1
    players = [i for i, tok in enumerate(encoded.tokens) if not tok.special]
    m = len(players)
    present = {i: False for i in players}
    current = _value(random_bert, encoded, present, target, replace)
    gains: dict[int, float] = {}
    added: list[int] = []
    ends = (
        [max(1, round(f * m)) for f in (0.1, 0.2, 0.3, 0.4, 0.5)]
        if step
        else list(range(1, math.ceil(0.5 * m) + 1))
    )
    for end in ends:
        trials = {
            i: _value(random_bert, encoded, {**present, i: True}, target, replace)
            for i in players
            if not present[i]
        }
        gains.update({i: v - current for i, v in trials.items()})
        chosen = sorted(trials, key=lambda i: (-trials[i], i))[: end - len(added)]
        added += chosen
        for i in chosen:
            present[i] = True
        current = _value(random_bert, encoded, present, target, replace)
    scores = greedy_insertion(random_bert, encoded, target, replace=replace, step=step)
    order = sorted(players, key=lambda i: -scores[i])
    assert order[: len(added)] == added
    assert all(scores[k] < scores[added[-1]] for k in players if not present[k])
    signed = greedy_insertion(random_bert, encoded, target, replace=replace, step=step, signed=True)
    assert {i for i in players if signed[i] > 0} == {i for i in players if gains[i] > 0}
    assert any(gains[i] <= 0 for i in players)  # the text has tokens of both kinds


def test_removal_keeps_ids_segments_and_tokens_aligned(random_bert: LoadedModel) -> None:
    encoded = random_bert.encode("the plot is thin", "but the cast is great")
    game = Coalitions(random_bert, encoded, "delete")
    present = np.ones((1, len(game.players)), dtype=bool)
    present[0, [0, 5]] = False
    (ids,), types = game.rows(present)
    dropped = {game.players[0], game.players[5]}
    assert ids == [t for i, t in enumerate(encoded.input_ids) if i not in dropped]
    assert types is not None and encoded.token_type_ids is not None
    assert types[0] == [t for i, t in enumerate(encoded.token_type_ids) if i not in dropped]
    masked = Coalitions(random_bert, encoded, "mask")
    (ids,), _ = masked.rows(present)
    assert (
        len(ids) == len(encoded)
        and [ids[i] for i in sorted(dropped)] == [random_bert.mask_token_id] * 2
    )


def test_class_values_are_log_odds() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    expected = 2.0 - math.log(math.exp(1.0) + math.exp(0.5))
    assert float(class_values(logits, 1)[0]) == pytest.approx(expected)
    assert float(class_values(torch.tensor([[0.7]]), 0)[0]) == pytest.approx(0.7)


def test_registered_as_job_methods_with_progress(
    random_bert: LoadedModel, make_ctx: Callable[..., JobContext]
) -> None:
    registry = MethodRegistry.load()
    encoded = random_bert.encode(TEXT)
    for name in ("shapley", "greedy_deletion", "greedy_insertion"):
        method = registry.get(name)
        assert isinstance(method, JobMethod)
        ctx = make_ctx(random_bert)
        out = method.run(ctx, encoded, 1, method.validate_params({}))
        assert out.scores.shape == (len(encoded),)
        assert ctx.progress and ctx.progress[-1][0] == pytest.approx(1.0)  # type: ignore[attr-defined]


def test_searches_keep_their_passes_within_the_job_memory(
    random_bert: LoadedModel, make_ctx: Callable[..., JobContext], monkeypatch: pytest.MonkeyPatch
) -> None:
    # batch_size=512 asked for: each forward still takes no more rows than
    # LIMELIGHT_JOB_MEMORY_MB holds, as gradients and SLALOM do.
    from limelight.methods import search

    seen: list[int] = []
    real = search.batched_logits

    def recording(model: object, rows: object, type_rows: object = None, batch_size: int = 64):  # type: ignore[no-untyped-def]
        seen.append(batch_size)
        return real(model, rows, type_rows, batch_size)  # type: ignore[arg-type]

    monkeypatch.setattr(search, "batched_logits", recording)
    registry = MethodRegistry.load()
    encoded = random_bert.encode(TEXT)
    ctx = make_ctx(random_bert, job_memory_mb=0.05)
    allowed = ctx.rows_per_pass(len(encoded), backward=False)
    assert allowed < 512
    for name in ("shapley", "greedy_deletion", "greedy_insertion"):
        method = registry.get(name)
        assert isinstance(method, JobMethod)
        seen.clear()
        method.run(ctx, encoded, 1, method.validate_params({"batch_size": 512}))
        assert seen and max(seen) <= allowed, name


def test_parameters_a_search_cannot_honour_are_refused_before_it_runs() -> None:
    from limelight.errors import InvalidArgument

    registry = MethodRegistry.load()
    with pytest.raises(InvalidArgument, match="permutations must be even"):
        registry.get("shapley").validate_params({"permutations": 3})
    assert registry.get("shapley").validate_params({"permutations": 4})["permutations"] == 4
    gradients = registry.get("integrated_gradients")
    with pytest.raises(InvalidArgument, match="riemann_trapezoid needs steps >= 2"):
        gradients.validate_params({"rule": "riemann_trapezoid", "steps": 1})
    assert gradients.validate_params({"rule": "riemann_middle", "steps": 1})["steps"] == 1


@pytest.fixture(scope="module")
def gpt2_pad_ends_texts(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> tuple[Path, LoadedModel]:
    """GPT-2 with no pad_token_id whose pad token ([SEP]) ends every text: the classifier's
    own forward refuses batches of several rows, and no pad id can be declared for it."""
    from tests.models.tiny_families import save_tiny

    directory = save_tiny(
        tmp_path_factory.mktemp("gpt2-sep-pad"),
        tokenizer_dir,
        "gpt2",
        tokenizer_values={"pad_token": "[SEP]"},
    )
    model = load_model(directory)
    assert model.config.pad_token_id is None
    return directory, model


def test_batched_logits_need_no_pad_token_id(gpt2_pad_ends_texts: tuple[Path, LoadedModel]) -> None:
    """Rows of different lengths in one padded batch, and an empty row (read as the pad token
    alone), give the logits transformers gives each row run alone."""
    from tests.models.tiny_families import stock_logits

    directory, model = gpt2_pad_ends_texts
    rows = [model.encode(t).input_ids for t in ("a witty and gorgeous film", "dull", TEXT)]
    got = batched_logits(model, [*rows, []], batch_size=8)
    expected = stock_logits(directory, [*rows, [model.pad_id]])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("search", ["shapley", "greedy_deletion", "greedy_insertion"])
def test_searches_run_on_a_classifier_without_a_pad_token_id(
    gpt2_pad_ends_texts: tuple[Path, LoadedModel], search: str
) -> None:
    _, model = gpt2_pad_ends_texts
    encoded = model.encode(TEXT)
    if search == "shapley":
        scores = shapley_values(model, encoded, 0, permutations=2, replace="delete")
    else:
        run = greedy_insertion if search == "greedy_insertion" else greedy_deletion
        scores = run(model, encoded, 0, replace="delete")
    assert scores.shape == (len(encoded),) and np.isfinite(scores).all()
    assert np.abs(scores).sum() > 0

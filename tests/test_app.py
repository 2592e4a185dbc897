"""The composition root's start-up build of the lexicon table (``LIMELIGHT_LEXICON_BUILD``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from limelight.app import prepare_lexicon
from limelight.errors import FailedPrecondition
from limelight.methods.lexicon import LexiconLookup
from limelight.models.lexicon_table import LEXICON_DIRNAME, cached_lexicon_dir
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.serving import torch_serving_runtime
from limelight.settings import Settings
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar

TEXT = "a witty , gorgeous film"


def settings(cache: Path, **overrides: Any) -> Settings:
    # `auto` explicitly: the test session pins the default method to NormXLogit.
    values: dict[str, Any] = {
        "jobs": "off",
        "cache_dir": cache,
        "lexicon_build": True,
        "default_method": "auto",
    }
    return Settings(**{**values, **overrides})


def test_builds_into_the_cache_once_and_equals_the_cli_table(
    random_bert_dir: Path, lexicon_bert_dir: Path, tmp_path: Path
) -> None:
    model = load_model(random_bert_dir)
    out = prepare_lexicon(settings(tmp_path), model)
    assert out == cached_lexicon_dir(model, tmp_path)
    assert not (random_bert_dir / LEXICON_DIRNAME).exists()  # the model's directory untouched
    # The same table `limelight lexicon` writes beside a copy of the same weights.
    np.testing.assert_allclose(
        np.load(out / "table.npy"),
        np.load(lexicon_bert_dir / LEXICON_DIRNAME / "table.npy"),
        atol=1e-6,
    )
    assert json.loads((out / "card.json").read_text())["model_version"] == model.version
    built = (out / "table.npy").stat().st_mtime_ns
    assert prepare_lexicon(settings(tmp_path), model) is None  # found: not built again
    assert (out / "table.npy").stat().st_mtime_ns == built


@pytest.mark.parametrize(
    "overrides",
    [
        {"lexicon_build": False},
        {"default_method": "normxlogit"},
        {"default_method": "distilled"},
    ],
)
def test_nothing_is_built_when_the_default_method_does_not_serve_it(
    random_bert_dir: Path, tmp_path: Path, overrides: dict[str, Any]
) -> None:
    assert prepare_lexicon(settings(tmp_path, **overrides), load_model(random_bert_dir)) is None
    assert not (tmp_path / "lexicons").exists()


def test_nothing_is_built_when_auto_serves_a_distilled_head(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    assert prepare_lexicon(settings(tmp_path), load_model(bert_tiny_dir)) is None
    assert not (tmp_path / "lexicons").exists()


def test_the_table_beside_the_model_is_used_rather_than_built(
    lexicon_bert_dir: Path, tmp_path: Path
) -> None:
    assert prepare_lexicon(settings(tmp_path), load_model(lexicon_bert_dir)) is None
    assert not (tmp_path / "lexicons").exists()


def test_a_failed_build_falls_back_under_auto_and_stops_a_named_default(
    random_bert_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")  # the cache directory cannot be created: the build fails
    model = load_model(random_bert_dir)
    assert prepare_lexicon(settings(blocked), model) is None  # auto: NormXLogit is served
    assert "building the lexicon table" in caplog.text and "failed" in caplog.text
    with pytest.raises(FailedPrecondition, match=r"could not be built into .*LIMELIGHT_CACHE_DIR"):
        prepare_lexicon(settings(blocked, default_method="lexicon_lookup"), model)


def test_worker_processes_starting_together_build_it_once(
    random_bert_dir: Path, tmp_path: Path
) -> None:
    # Real processes, as `limelight serve --workers N` starts them: each calls the start-up
    # build; the lock lets one build while the others wait and then find it.
    script = (
        "import sys; from pathlib import Path\n"
        "from limelight.app import prepare_lexicon\n"
        "from limelight.models.loaded import load_model\n"
        "from limelight.settings import Settings\n"
        "s = Settings(jobs='off', cache_dir=Path(sys.argv[2]), lexicon_build=True,\n"
        "             default_method='auto')\n"
        "print('built' if prepare_lexicon(s, load_model(Path(sys.argv[1]))) else 'found')\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(random_bert_dir), str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = sorted(p.communicate(timeout=300)[0].strip() for p in procs)
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert results == ["built", "found", "found"]


def test_a_sidecar_builds_it_at_start_up_and_serves_it(
    random_bert_dir: Path, tmp_path: Path, start_sidecar: Callable[..., RunningSidecar]
) -> None:
    cache = tmp_path / "cache"
    side = start_sidecar(
        model_dir=random_bert_dir,
        default_method="auto",
        jobs="off",
        cache_dir=cache,
        lexicon_build=True,
    )
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(side.target))
    e = stub.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation
    assert e.method == "lexicon_lookup"
    model = load_model(random_bert_dir)
    enc = model.encode(TEXT)
    outputs = torch_serving_runtime(model, cache).run_inline(
        InlineBatch.from_encoded([enc], model.pad_id)
    )
    lookup = LexiconLookup().attribute(outputs, 0, len(enc))[:, e.target_index]
    np.testing.assert_allclose(e.scores, lookup, atol=1e-6)
    # The table's rows themselves, looked up by hand.
    table = np.load(cached_lexicon_dir(model, cache) / "table.npy")
    expected = table[enc.input_ids, e.target_index]
    expected[enc.special_mask] = 0.0
    np.testing.assert_allclose(e.scores, expected, atol=1e-6)


def test_a_graph_given_to_the_torch_runtime_is_said_to_be_unused(
    bert_tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from limelight.app import build_application
    from limelight.metrics import Metrics

    graph = tmp_path / "model.onnx"
    with caplog.at_level("WARNING", logger="limelight.app"):
        app = build_application(
            Settings(model_dir=bert_tiny_dir, jobs="off", onnx_path=graph), Metrics()
        )
    assert app.service.runtime.name == "torch"
    (said,) = [r.getMessage() for r in caplog.records if "onnx_path" in r.getMessage()]
    assert str(graph) in said and "--runtime onnx" in said


def test_drift_turned_off_says_so_on_metrics(random_bert_dir: Path) -> None:
    """With no monitor nothing set the reference state: the dashboard's state panel was empty."""
    from prometheus_client import CollectorRegistry

    from limelight.app import build_drift
    from limelight.metrics import Metrics

    metrics = Metrics(CollectorRegistry())
    settings = Settings(drift_enabled=False)
    assert build_drift(settings, load_model(random_bert_dir), metrics, "normxlogit") is None
    get = metrics.registry.get_sample_value
    states = {
        s: get("limelight_drift_reference_state", {"state": s})
        for s in ("building", "ready", "disabled")
    }
    assert states == {"building": 0.0, "ready": 0.0, "disabled": 1.0}

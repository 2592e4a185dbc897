"""`limelight lexicon` as a user runs it, and a sidecar serving its table by default."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from limelight.cli.main import main
from limelight.methods.lexicon import LexiconLookup
from limelight.methods.normxlogit import NormXLogit
from limelight.models.lexicon_table import OUTPUT_NAME, cached_lexicon_dir
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.serving import torch_serving_runtime
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar

TEXT = "a witty , gorgeous film"


def test_build_then_current_then_forced(
    random_bert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(random_bert_dir, model_dir)
    args = ["lexicon", "--model", str(model_dir), "--batch-size", "4096", "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"wrote {model_dir / 'limelight_lexicon'}: 30,522 entries x 3 classes" in out
    assert "`auto` now serves `lexicon_lookup`" in out
    assert "restart a running server" not in out  # it reloads on its own (tests/test_reload.py)
    table = model_dir / "limelight_lexicon" / "table.npy"
    built = table.stat().st_mtime_ns
    assert main(args) == 0
    assert "is current for model version" in capsys.readouterr().out
    assert table.stat().st_mtime_ns == built
    assert main([*args, "--force"]) == 0
    assert "wrote" in capsys.readouterr().out


def test_a_read_only_model_directory_gets_its_table_in_the_cache(
    random_bert_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The tests run as root, for whom every directory is writable: deny the write check alone.
    import limelight.models.lexicon_table as lexicon_table

    monkeypatch.setattr(lexicon_table.os, "access", lambda path, mode: False)
    cache = tmp_path / "cache"
    args = ["lexicon", "--model", str(random_bert_dir), "--cache-dir", str(cache), "--no-progress"]
    assert main([*args, "--batch-size", "4096"]) == 0
    out = capsys.readouterr().out
    model = load_model(random_bert_dir)
    assert f"wrote {cached_lexicon_dir(model, cache)}" in out
    assert "read-only" in out
    assert not (random_bert_dir / "limelight_lexicon").exists()
    assert main(args) == 0
    assert f"{cached_lexicon_dir(model, cache)} is current" in capsys.readouterr().out
    # What the server reads with the same cache directory.
    assert OUTPUT_NAME in torch_serving_runtime(model, cache).head_names
    assert OUTPUT_NAME not in torch_serving_runtime(model).head_names


def test_auto_serves_the_lookup_with_normxlogit_alongside(
    lexicon_bert_dir: Path, start_sidecar: Callable[..., RunningSidecar]
) -> None:
    model = load_model(lexicon_bert_dir)
    enc = model.encode(TEXT)
    outputs = torch_serving_runtime(model).run_inline(InlineBatch.from_encoded([enc], model.pad_id))
    side = start_sidecar(model_dir=lexicon_bert_dir, default_method="auto", jobs="off")
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(side.target))
    e = stub.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation
    assert e.method == "lexicon_lookup"
    lookup = LexiconLookup().attribute(outputs, 0, len(enc))[:, e.target_index]
    np.testing.assert_allclose(e.scores, lookup, atol=1e-6)
    normx = NormXLogit().attribute(outputs, 0, len(enc))[:, e.target_index]
    np.testing.assert_allclose(e.extra_scores["normxlogit"].values, normx, atol=1e-5)


def test_asking_for_the_lookup_without_a_table(
    random_bert_dir: Path, start_sidecar: Callable[..., RunningSidecar]
) -> None:
    side = start_sidecar(model_dir=random_bert_dir, default_method="auto", jobs="off")
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(side.target))
    assert stub.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation.method == (
        "normxlogit"
    )
    with pytest.raises(grpc.RpcError) as refused:
        stub.Explain(pb.ExplainRequest(text=TEXT, method="lexicon_lookup"), timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "limelight lexicon --model" in (refused.value.details() or "")
    # The server keeps serving.
    assert stub.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation.scores

"""A graph's description (``limelight.onnx.json``) damaged or missing: a damaged one beside the
model is treated as a stale graph, one named with ``--onnx-path`` is refused with a line naming
it; a graph without its description is checked against the served model from what the graph
itself shows, and refused where it is another model's."""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

import pytest

from limelight.cli.main import describe_error
from limelight.errors import ModelLoadError
from limelight.models.explainer_head import HEAD_DIRNAME, inline_heads
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.onnx_export import (
    describe,
    export_onnx,
    heads_mismatch,
    quantize_int8,
)
from limelight.runtimes.onnx_runtime import DEFAULT_GRAPH, OnnxRuntime, cached_graph
from limelight.settings import Settings
from tests.tiny_bert import save_tiny_bert


def cut_short(graph: Path) -> Path:
    """``graph``'s description cut after 100 bytes, as an interrupted copy leaves it."""
    meta = describe(graph)
    meta.write_bytes(meta.read_bytes()[:100])
    return meta


@pytest.fixture
def model_copy(bert_tiny_dir: Path, tmp_path: Path) -> Path:
    """The BERT-tiny demo (with its distilled head) copied without any graph."""
    return Path(
        shutil.copytree(bert_tiny_dir, tmp_path / "model", ignore=shutil.ignore_patterns("*.onnx*"))
    )


def test_a_damaged_description_beside_the_model_is_exported_again_into_the_cache(
    model_copy: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = load_model(model_copy)
    beside = export_onnx(model, model_copy / DEFAULT_GRAPH, heads=inline_heads(model))
    meta = cut_short(beside)
    damaged = meta.read_bytes()
    settings = Settings(runtime="onnx", cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="limelight.runtimes.onnx_runtime"):
        runtime = OnnxRuntime.for_model(model, settings)
    assert runtime.graph == cached_graph(model, settings.cache_dir)
    assert "distilled" in runtime.head_names
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(meta) in w and "damaged" in w for w in warnings), warnings
    assert meta.read_bytes() == damaged  # the model's directory is not written into


def test_a_damaged_description_beside_the_model_without_export_is_refused(
    model_copy: Path, tmp_path: Path
) -> None:
    model = load_model(model_copy)
    meta = cut_short(export_onnx(model, model_copy / DEFAULT_GRAPH))
    settings = Settings(runtime="onnx", cache_dir=tmp_path / "cache", onnx_export=False)
    with pytest.raises(ModelLoadError, match="damaged") as refused:
        OnnxRuntime.for_model(model, settings)
    assert str(meta) in refused.value.message


def test_a_named_graph_with_a_damaged_description_is_refused_in_one_line(
    model_copy: Path, tmp_path: Path
) -> None:
    model = load_model(model_copy)
    graph = export_onnx(model, tmp_path / "mine.onnx", heads=inline_heads(model))
    meta = cut_short(graph)
    settings = Settings(runtime="onnx", cache_dir=tmp_path / "cache", onnx_path=graph)
    with pytest.raises(ModelLoadError) as refused:
        OnnxRuntime.for_model(model, settings)
    message, status = describe_error(refused.value, argparse.Namespace(command="serve"))
    assert "\n" not in message
    assert str(meta) in message and "damaged" in message
    assert f"limelight export-onnx --model {model_copy} --out {graph}" in message
    # As a damaged graph (ONNX Runtime cannot load it) is reported.
    assert status == 1
    assert not (tmp_path / "cache" / "onnx").exists()  # never replaced by an export


def bare_copy(graph: Path, out: Path) -> Path:
    """``graph`` copied without its description."""
    shutil.copy(graph, out)
    return out


def test_a_graph_of_a_model_of_another_width_is_refused(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    # 2 labels as the demo, but 32 wide where the demo is 128 (as MiniLM's graph is 384).
    other = load_model(save_tiny_bert(tmp_path / "other", bert_tiny_dir, ["a", "b"], seed=0))
    graph = bare_copy(export_onnx(other, tmp_path / "other.onnx"), tmp_path / "bare.onnx")
    model = load_model(bert_tiny_dir)
    with pytest.raises(ModelLoadError, match=r"token embeddings are 30522 x 32; .* 30522 x 128"):
        OnnxRuntime(graph, model)


def two_of_a_kind(bert_tiny_dir: Path, tmp_path: Path) -> tuple[LoadedModel, LoadedModel]:
    """Two models of one shape and labels, other weights (seeds)."""
    first, second = (
        load_model(save_tiny_bert(tmp_path / f"seed{seed}", bert_tiny_dir, ["a", "b"], seed=seed))
        for seed in (0, 1)
    )
    return first, second


def test_a_graph_of_another_model_of_the_same_shape_is_refused_by_its_probe(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    mine, other = two_of_a_kind(bert_tiny_dir, tmp_path)
    graph = bare_copy(export_onnx(other, tmp_path / "other.onnx"), tmp_path / "bare.onnx")
    with pytest.raises(ModelLoadError, match="probe input are not model") as refused:
        OnnxRuntime(graph, mine)
    assert "another model" in refused.value.message
    assert f"limelight export-onnx --model {mine.directory}" in refused.value.message


def test_the_model_s_own_int8_graph_without_its_description_still_serves(
    bert_tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = load_model(bert_tiny_dir)
    int8 = quantize_int8(export_onnx(model, tmp_path / "g.onnx"), tmp_path / "g.int8.onnx")
    describe(int8).unlink()
    with caplog.at_level(logging.WARNING, logger="limelight.runtimes.onnx_runtime"):
        runtime = OnnxRuntime(int8, model)
    assert runtime.graph == int8
    assert any("has no description" in r.getMessage() for r in caplog.records)


def test_a_graph_without_description_is_not_said_to_carry_no_head(
    bert_tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = load_model(bert_tiny_dir)
    heads = inline_heads(model)
    assert heads and (bert_tiny_dir / HEAD_DIRNAME).is_dir()  # the demo has its head
    graph = bare_copy(export_onnx(model, tmp_path / "g.onnx", heads=heads), tmp_path / "b.onnx")
    reason = heads_mismatch(graph, heads)
    assert "no inline head" not in reason
    assert "no description" in reason and "cannot be verified" in reason

    settings = Settings(runtime="onnx", cache_dir=tmp_path / "cache", onnx_path=graph)
    with caplog.at_level(logging.WARNING, logger="limelight.runtimes.onnx_runtime"):
        runtime = OnnxRuntime.for_model(model, settings)
    assert "distilled" in runtime.head_names  # it does carry it, and serves it
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "no inline head" not in text and "cannot be verified" in text

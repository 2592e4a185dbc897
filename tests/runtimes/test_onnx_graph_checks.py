"""The ONNX runtime checks a graph against the served model at load, and a graph that fails to
load costs nothing in the graph cache."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from limelight.errors import ModelLoadError
from limelight.models.explainer_head import HEAD_DIRNAME
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.onnx_export import describe, export_onnx
from limelight.runtimes.onnx_runtime import DEFAULT_GRAPH, OnnxRuntime, cached_graph
from limelight.settings import Settings
from tests.conftest import RunningSidecar


@pytest.fixture(scope="module")
def foreign_graph(tmp_path_factory: pytest.TempPathFactory, bert_tiny_multilabel_dir: Path) -> Path:
    """The multi-label demo's graph copied without its description (4 labels, not 2)."""
    graph = export_onnx(
        load_model(bert_tiny_multilabel_dir), tmp_path_factory.mktemp("foreign") / "g.onnx"
    )
    describe(graph).unlink()
    return graph


def warm_batch(runtime: OnnxRuntime) -> InlineBatch:
    model = runtime.model
    return InlineBatch.from_encoded([model.encode("Limelight warm-up.", None)], model.pad_id)


def test_another_model_s_graph_without_its_description_is_refused_at_load(
    foreign_graph: Path, bert_tiny_dir: Path
) -> None:
    model = load_model(bert_tiny_dir)
    with pytest.raises(ModelLoadError, match=r"gives 4 logits; model .* has 2 labels") as refused:
        OnnxRuntime(foreign_graph, model)
    assert str(foreign_graph) in refused.value.message
    assert "another model" in refused.value.message


def test_a_sidecar_on_another_model_s_graph_does_not_start(
    start_sidecar: Callable[..., RunningSidecar],
    foreign_graph: Path,
    bert_tiny_dir: Path,
    tmp_path: Path,
) -> None:
    with pytest.raises(ModelLoadError, match="gives 4 logits"):
        start_sidecar(
            model_dir=bert_tiny_dir,
            runtime="onnx",
            onnx_path=foreign_graph,
            jobs="off",
            cache_dir=tmp_path / "cache",
        )


def leave_label_axis_open(graph_path: Path, out: Path) -> Path:
    """``graph_path`` with the label axis of its outputs left open: each reshaped to its own
    shape computed when it runs, which shape inference cannot follow to a number."""
    import onnx
    from onnx import helper

    graph = onnx.load(str(graph_path))
    wide = {"logits", "token_logits", "normxlogit"}
    for node in graph.graph.node:
        node.output[:] = [f"{name}_inner" if name in wide else name for name in node.output]
        node.input[:] = [f"{name}_inner" if name in wide else name for name in node.input]
    for name in wide:
        graph.graph.node.extend(
            [
                helper.make_node("Shape", [f"{name}_inner"], [f"{name}_shape"]),
                helper.make_node("Reshape", [f"{name}_inner", f"{name}_shape"], [name]),
            ]
        )
    for output in graph.graph.output:
        if output.name in wide:
            output.type.tensor_type.shape.dim[-1].dim_param = "labels"
    onnx.save(graph, str(out))
    return out


def test_a_graph_that_leaves_its_label_axis_open_is_checked_at_its_first_run(
    foreign_graph: Path, bert_tiny_dir: Path, tmp_path: Path
) -> None:
    model = load_model(bert_tiny_dir)
    own = export_onnx(model, tmp_path / "own.onnx")
    # Without a description, the graph is run on a probe input at load: refused there.
    opened = leave_label_axis_open(foreign_graph, tmp_path / "open.onnx")
    with pytest.raises(ModelLoadError, match=r"gives 4 logits; model .* has 2 labels"):
        OnnxRuntime(opened, model)
    # With a description that names the served model (copied beside the wrong graph), nothing
    # is run at load: the label axis is checked at its first run (warm-up).
    shutil.copy(describe(own), describe(opened))
    runtime = OnnxRuntime(opened, model)
    assert runtime.session.get_outputs()[0].shape[-1] == "labels"  # nothing to check at load
    with pytest.raises(ModelLoadError, match=r"gives 4 logits; model .* has 2 labels"):
        runtime.warmup(warm_batch(runtime))
    # The model's own graph, its label axis open too: checked at its first run, and served.
    own_open = leave_label_axis_open(own, tmp_path / "own-open.onnx")
    shutil.copy(describe(own), describe(own_open))
    runtime = OnnxRuntime(own_open, model)
    runtime.warmup(warm_batch(runtime))
    assert runtime.forward_logits(warm_batch(runtime)).shape == (1, 2)


def test_the_model_s_own_graph_without_its_description_still_serves(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    model = load_model(bert_tiny_dir)
    described = export_onnx(model, tmp_path / "described.onnx")
    bare = tmp_path / "bare.onnx"
    shutil.copy(described, bare)
    runtime = OnnxRuntime(bare, model)
    batch = warm_batch(runtime)
    runtime.warmup(batch)
    np.testing.assert_allclose(
        runtime.run_inline(batch).logits, OnnxRuntime(described, model).run_inline(batch).logits
    )


def test_a_graph_without_the_inline_outputs_is_refused_at_load(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    model = load_model(bert_tiny_dir)
    plain = export_onnx(model, tmp_path / "plain.onnx", kind="plain")
    describe(plain).unlink()  # the description would name it a plain graph
    with pytest.raises(ModelLoadError, match="no embedding_norms, token_logits output"):
        OnnxRuntime(plain, model)


def test_a_graph_that_fails_to_load_leaves_the_cached_graph_in_the_cache(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    ignore = shutil.ignore_patterns("*.onnx*", HEAD_DIRNAME)
    model_dir = Path(shutil.copytree(bert_tiny_dir, tmp_path / "model", ignore=ignore))
    settings = Settings(runtime="onnx", cache_dir=tmp_path / "cache")
    model = load_model(model_dir)
    OnnxRuntime.for_model(model, settings)  # exported into the cache, served from it
    cached = cached_graph(model, settings.cache_dir)
    exported = cached.stat().st_mtime_ns

    # A damaged graph beside the model, its description intact: picked first, fails to load.
    beside = export_onnx(model, model_dir / DEFAULT_GRAPH)
    beside.write_bytes(beside.read_bytes()[:4096])
    with pytest.raises(ModelLoadError, match=r"ONNX Runtime cannot load .* damaged or partly"):
        OnnxRuntime.for_model(model, settings)
    assert cached.exists() and describe(cached).exists()

    # Once it is gone, the next start serves the cached graph without exporting it again.
    beside.unlink()
    describe(beside).unlink()
    assert OnnxRuntime.for_model(model, settings).graph == cached
    assert cached.stat().st_mtime_ns == exported


def test_a_damaged_cached_graph_is_exported_again(bert_tiny_dir: Path, tmp_path: Path) -> None:
    """The cached graph is the sidecar's own: one cut short there (its description intact) is
    exported again at the next start, not refused at every start until someone removes it."""
    ignore = shutil.ignore_patterns("*.onnx*", HEAD_DIRNAME)
    model_dir = Path(shutil.copytree(bert_tiny_dir, tmp_path / "model", ignore=ignore))
    settings = Settings(runtime="onnx", cache_dir=tmp_path / "cache")
    model = load_model(model_dir)
    first = OnnxRuntime.for_model(model, settings)
    cached = cached_graph(model, settings.cache_dir)
    assert first.graph == cached
    batch = warm_batch(first)
    expected = first.run_inline(batch).logits
    cached.write_bytes(cached.read_bytes()[:4096])

    again = OnnxRuntime.for_model(model, settings)
    assert again.graph == cached
    np.testing.assert_allclose(again.run_inline(batch).logits, expected, atol=1e-6)

    # Without exports allowed it is refused, with the command that writes that very file.
    cached.write_bytes(cached.read_bytes()[:4096])
    no_export = Settings(runtime="onnx", cache_dir=tmp_path / "cache", onnx_export=False)
    with pytest.raises(ModelLoadError, match="damaged or partly") as refused:
        OnnxRuntime.for_model(model, no_export)
    assert f"limelight export-onnx --model {model.directory} --out {cached}`" in (
        refused.value.message
    )


def test_an_int8_graph_that_fails_to_load_names_the_command_that_writes_it(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    model = load_model(bert_tiny_dir)
    graph = tmp_path / "served.int8.onnx"
    graph.write_bytes(b"not a graph")
    with pytest.raises(ModelLoadError) as refused:
        OnnxRuntime(graph, model)
    command = f"limelight export-onnx --model {model.directory} --out {tmp_path / 'served.onnx'}"
    assert f"`{command} --int8`" in refused.value.message

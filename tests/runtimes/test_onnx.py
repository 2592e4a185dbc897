"""ONNX Runtime's inline path equals the torch path (logits and NormXLogit) within 1e-4."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from limelight.errors import FailedPrecondition
from limelight.methods.normxlogit import NormXLogit
from limelight.models.explainer_head import HEAD_DIRNAME, OUTPUT_NAME, inline_heads
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.graph_cache import SERVED_FROM
from limelight.runtimes.onnx_export import (
    export_onnx,
    graph_mismatch,
    module_digest,
    read_description,
)
from limelight.runtimes.onnx_runtime import (
    DEFAULT_GRAPH,
    OnnxRuntime,
    cached_graph,
    choose_graph,
    choose_providers,
    settle_graph_cache,
)
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar
from tests.models.tiny_families import save_tiny
from tests.tiny_bert import save_tiny_bert


def resolve_graph(model: LoadedModel, settings: Settings) -> Path:
    """The graph a start would serve, with the cache settled as after a successful load."""
    graph = choose_graph(model, settings)
    settle_graph_cache(model, settings, graph)
    return graph


TEXTS = [
    ("a witty film", None),
    ("a long and very boring movie about nothing at all , really", None),
    ("a man sleeps", "a person is resting on a couch"),
]


def assert_parity(model: LoadedModel, graph: Path, in_graph: bool = True) -> None:
    """``in_graph``: the graph returns NormXLogit itself, checked against the method's own
    computation from the torch runtime's outputs."""
    encoded = [model.encode(t, p) for t, p in TEXTS]
    batch = InlineBatch.from_encoded(encoded, model.pad_id)
    a = TorchRuntime(model).run_inline(batch)
    b = OnnxRuntime(graph, model).run_inline(batch)
    assert (b.normxlogit is not None) is in_graph
    assert a.normxlogit is None
    np.testing.assert_allclose(b.logits, a.logits, atol=1e-4, rtol=1e-4)
    method = NormXLogit()
    for row, enc in enumerate(encoded):
        np.testing.assert_allclose(
            method.attribute(b, row, len(enc)),
            method.attribute(a, row, len(enc)),
            atol=1e-4,
            rtol=1e-4,
        )


def test_demo_model_parity_incl_text_pairs(bert_tiny_dir: Path, tmp_path: Path) -> None:
    model = load_model(bert_tiny_dir)
    assert_parity(model, export_onnx(model, tmp_path / "g.onnx"))


def test_minilm_parity(minilm_dir: Path, tmp_path: Path) -> None:
    model = load_model(minilm_dir)
    assert_parity(model, export_onnx(model, tmp_path / "g.onnx"))


@pytest.mark.parametrize(
    "model_type,extra",
    # The tiny GPT-2, as stock, has no pad_token_id; the export is tested with one.
    [("distilbert", {}), ("roberta", {}), ("gpt2", {"pad_token_id": 0})],
)
def test_other_architectures(
    model_type: str, extra: dict[str, Any], tmp_path: Path, tokenizer_dir: Path
) -> None:
    model = load_model(save_tiny(tmp_path, tokenizer_dir, model_type, **extra))
    assert_parity(model, export_onnx(model, tmp_path / "g.onnx"))


def test_graph_is_bound_to_its_model(
    bert_tiny_dir: Path, random_bert_dir: Path, tmp_path: Path
) -> None:
    graph = export_onnx(load_model(bert_tiny_dir), tmp_path / "g.onnx")
    with pytest.raises(FailedPrecondition, match="export-onnx"):
        OnnxRuntime(graph, load_model(random_bert_dir))


def test_cuda_request_without_provider_falls_back_to_cpu() -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("a CUDA provider is present")
    assert choose_providers("cuda") == ["CPUExecutionProvider"]
    assert choose_providers("cpu") == ["CPUExecutionProvider"]


def test_serve_with_onnx_runtime(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    model = load_model(bert_tiny_dir)
    graph = export_onnx(model, tmp_path / "served.onnx")
    onnx_side = start_sidecar(model_dir=bert_tiny_dir, runtime="onnx", onnx_path=graph, jobs="off")
    torch_side = start_sidecar(model_dir=bert_tiny_dir, jobs="off")
    request = pb.ExplainRequest(text="an utterly charming , witty film", all_classes=True)
    a = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(onnx_side.target))
    b = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(torch_side.target))
    ra, rb = a.Explain(request, timeout=30), b.Explain(request, timeout=30)
    assert a.GetModel(pb.GetModelRequest(), timeout=10).runtime == "onnx"
    assert ra.label == rb.label
    np.testing.assert_allclose(ra.probabilities, rb.probabilities, atol=1e-4)
    np.testing.assert_allclose(ra.explanation.scores, rb.explanation.scores, atol=1e-4)


def test_a_missing_or_stale_graph_is_exported_into_the_cache_with_the_heads_beside_the_model(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    model_dir = Path(
        shutil.copytree(bert_tiny_dir, tmp_path / "model", ignore=shutil.ignore_patterns("*.onnx*"))
    )
    head = tmp_path / "head"
    (model_dir / HEAD_DIRNAME).rename(head)  # a model without its distilled head
    settings = Settings(runtime="onnx", cache_dir=tmp_path / "cache")
    model = load_model(model_dir)

    graph = resolve_graph(model, settings)
    assert graph == cached_graph(model, settings.cache_dir) and graph.exists()
    assert read_description(graph)["heads"] == {}
    written = graph.stat().st_mtime_ns
    assert resolve_graph(model, settings) == graph
    assert graph.stat().st_mtime_ns == written  # current: not exported again

    head.rename(model_dir / HEAD_DIRNAME)  # a head trained after the export
    heads = inline_heads(model)
    assert resolve_graph(model, settings) == graph
    assert read_description(graph)["heads"] == {OUTPUT_NAME: module_digest(heads[OUTPUT_NAME])}
    runtime = OnnxRuntime.for_model(model, settings)
    assert runtime.head_names == {OUTPUT_NAME}
    encoded = [model.encode(t, p) for t, p in TEXTS]
    batch = InlineBatch.from_encoded(encoded, model.pad_id)
    np.testing.assert_allclose(
        runtime.run_inline(batch).extra[OUTPUT_NAME],
        TorchRuntime(model, heads=heads).run_inline(batch).extra[OUTPUT_NAME],
        atol=1e-4,
        rtol=1e-4,
    )
    assert not list(model_dir.glob("*.onnx*"))  # nothing written into the model's directory

    # A current graph beside the model (`limelight export-onnx`) is the user's: served first.
    beside = export_onnx(model, model_dir / DEFAULT_GRAPH, heads=heads)
    assert resolve_graph(model, settings) == beside


def _new_version(model_dir: Path, tag: str) -> LoadedModel:
    """The model in ``model_dir`` as a new version (its config changed: a new fingerprint)."""
    config = model_dir / "config.json"
    config.write_text(config.read_text().replace("{", f'{{"limelight_test_{tag}": 1, ', 1))
    return load_model(model_dir)


def test_the_graphs_of_a_directory_s_earlier_versions_leave_the_cache_once_unused(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    def copy(name: str) -> Path:
        ignore = shutil.ignore_patterns("*.onnx*", HEAD_DIRNAME)
        return Path(shutil.copytree(bert_tiny_dir, tmp_path / name, ignore=ignore))

    settings = Settings(runtime="onnx", cache_dir=tmp_path / "cache")
    a, b = copy("a"), copy("b")  # two directories of the same version share its graph
    first = resolve_graph(load_model(a), settings)
    assert resolve_graph(load_model(b), settings) == first
    listed = (first.parent / SERVED_FROM).read_text().split()
    assert listed == [str(a.resolve()), str(b.resolve())]
    old = first.parent.parent / "written-before-the-bookkeeping"  # lists nobody: left alone
    old.mkdir()
    (old / DEFAULT_GRAPH).write_bytes(b"")

    second = resolve_graph(_new_version(a, "a1"), settings)  # a moves on; b still serves the first
    assert second.parent != first.parent and second.exists() and first.exists()
    assert (first.parent / SERVED_FROM).read_text().split() == [str(b.resolve())]
    third = resolve_graph(_new_version(b, "b1"), settings)
    assert not first.parent.exists()  # nobody serves it any more
    assert second.exists() and third.exists() and old.exists()
    fourth = resolve_graph(_new_version(a, "a2"), settings)
    assert not second.parent.exists() and fourth.exists() and third.exists()
    # Served from beside the model: its earlier versions leave the cache all the same.
    export_onnx(_new_version(b, "b2"), b / DEFAULT_GRAPH)
    assert resolve_graph(load_model(b), settings) == b / DEFAULT_GRAPH
    assert not third.parent.exists() and fourth.exists()
    assert sorted(p.name for p in (tmp_path / "cache" / "onnx").iterdir() if p.is_dir()) == sorted(
        [fourth.parent.name, old.name]
    )


def test_a_head_digest_follows_its_weights(bert_tiny_dir: Path) -> None:
    head = inline_heads(load_model(bert_tiny_dir))[OUTPUT_NAME]
    before = module_digest(head)
    assert module_digest(head) == before
    with torch.no_grad():
        next(head.parameters()).add_(1e-3)
    assert module_digest(head) != before


def test_without_export_a_missing_graph_is_refused_and_a_given_one_is_served_as_it_is(
    bert_tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = Path(
        shutil.copytree(bert_tiny_dir, tmp_path / "model", ignore=shutil.ignore_patterns("*.onnx*"))
    )
    model = load_model(model_dir)
    settings = Settings(runtime="onnx", cache_dir=tmp_path / "cache", onnx_export=False)
    with pytest.raises(FailedPrecondition, match="export-onnx"):
        resolve_graph(model, settings)
    # A graph named by the user without the head beside the model: a warning, never rewritten.
    given = export_onnx(model, tmp_path / "mine.onnx")
    written = given.stat().st_mtime_ns
    mine = Settings(runtime="onnx", cache_dir=tmp_path / "cache", onnx_path=given)
    with caplog.at_level(logging.WARNING):
        assert resolve_graph(model, mine) == given
    assert "serving it as exported" in caplog.text and OUTPUT_NAME in caplog.text
    assert given.stat().st_mtime_ns == written
    assert not (tmp_path / "cache").exists()


def test_a_graph_of_an_earlier_format_still_serves_and_is_exported_again(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """Format 1 graphs carried no ``normxlogit`` output: the runtime serves them (the method
    multiplies), and the sidecar's own graph of that format is replaced at the next start."""
    import onnx

    model = load_model(bert_tiny_dir)
    current = export_onnx(model, tmp_path / "current.onnx")
    earlier = tmp_path / "earlier.onnx"
    graph = onnx.load(str(current))
    kept = [o for o in graph.graph.output if o.name != "normxlogit"]
    del graph.graph.output[:]
    graph.graph.output.extend(kept)
    onnx.save(graph, str(earlier))
    description = read_description(current) | {"format": "limelight-onnx/1"}
    description["outputs"] = [o for o in description["outputs"] if o != "normxlogit"]
    Path(str(earlier) + ".json").write_text(json.dumps(description))

    encoded = [model.encode(t, p) for t, p in TEXTS]
    batch = InlineBatch.from_encoded(encoded, model.pad_id)
    old, new = OnnxRuntime(earlier, model).run_inline(batch), OnnxRuntime(current, model)
    assert old.normxlogit is None
    method = NormXLogit()
    for row, enc in enumerate(encoded):
        np.testing.assert_allclose(
            method.attribute(old, row, len(enc)),
            method.attribute(new.run_inline(batch), row, len(enc)),
            atol=1e-6,
        )
    assert "earlier Limelight" in graph_mismatch(earlier, model, {})
    assert graph_mismatch(current, model, {}) == ""


def test_a_regressor_s_graph_leaves_normxlogit_to_the_method(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """A regressor's NormXLogit is the distance to the prediction, not the product: its graph
    has no ``normxlogit`` output and the method computes it, as on torch."""
    model = load_model(save_tiny_bert(tmp_path, tokenizer_dir, ["score"], seed=0))
    graph = export_onnx(model, tmp_path / "g.onnx")
    assert "normxlogit" not in read_description(graph)["outputs"]
    assert_parity(model, graph, in_graph=False)

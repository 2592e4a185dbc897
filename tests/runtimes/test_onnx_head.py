"""The explainer head written as ONNX nodes (``runtimes.onnx_head``) computes what the module
computes, padding included, for context and per-token heads, and binds itself to the graph's
description so that a graph with traced heads is exported again."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from limelight.models.explainer_head import ExplainerHead
from limelight.runtimes.onnx_export import heads_mismatch, module_digest
from limelight.runtimes.onnx_head import HEAD_GRAPH_FORMAT, HeadInputs, head_nodes, splice_heads

K, C, LAYERS = 24, 3, [0, 2]


def random_head(attention_heads: int, width: int = 16) -> ExplainerHead:
    """A head whose every weight is random: layer norms that are not the identity too, and a
    linear head's (``width=0``) standardisation."""
    torch.manual_seed(attention_heads)
    head = ExplainerHead(LAYERS, K, C, width=width, attention_heads=attention_heads).eval()
    with torch.no_grad():
        for p in [*head.parameters(), *head.buffers()]:
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return head


def inputs(batch: int = 3, n: int = 9) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    mask = np.ones((batch, n), dtype=np.int64)
    mask[1, 6:] = 0
    mask[2, 2:] = 0
    return {
        "tap_0": rng.normal(size=(batch, n, K)).astype(np.float32) * 3,
        "tap_2": rng.normal(size=(batch, n, K)).astype(np.float32) + 1,
        "embedding_norms": rng.uniform(0.5, 20, size=(batch, n)).astype(np.float32),
        "token_logits": rng.normal(size=(batch, n, C)).astype(np.float32),
        "attention_mask": mask,
    }


def module_scores(head: ExplainerHead, feed: dict[str, np.ndarray]) -> np.ndarray:
    hidden = [torch.from_numpy(feed["tap_0"]), None, torch.from_numpy(feed["tap_2"])]
    with torch.no_grad():
        return head(  # type: ignore[no-any-return]
            hidden,  # type: ignore[arg-type]
            torch.from_numpy(feed["embedding_norms"]),
            torch.from_numpy(feed["token_logits"]),
            torch.from_numpy(feed["attention_mask"]),
        ).numpy()


def head_graph(head: ExplainerHead, hidden_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """A graph of the head alone, its inputs named as in the inline graph."""
    value = helper.make_tensor_value_info
    names = {0: "tap_0", 2: "tap_2"}
    nodes, weights = head_nodes(head, HeadInputs(hidden=names), "scores")
    graph = helper.make_graph(
        nodes,
        "head",
        [value(n, hidden_type, ["b", "n", K]) for n in names.values()]
        + [
            value("embedding_norms", TensorProto.FLOAT, ["b", "n"]),
            value("token_logits", TensorProto.FLOAT, ["b", "n", C]),
            value("attention_mask", TensorProto.INT64, ["b", "n"]),
        ],
        [value("scores", TensorProto.FLOAT, ["b", "n", C])],
        weights,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def run(model: onnx.ModelProto, feed: dict[str, np.ndarray], output: str) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    result: np.ndarray = session.run([output], {k: v for k, v in feed.items() if k in wanted})[0]
    return result


@pytest.mark.parametrize(("attention_heads", "width"), [(2, 16), (0, 16), (0, 0)])
def test_the_written_head_computes_what_the_module_computes(
    attention_heads: int, width: int
) -> None:
    head = random_head(attention_heads, width)
    feed = inputs()
    expected = module_scores(head, feed)
    got = run(head_graph(head), feed, "scores")
    valid = feed["attention_mask"].astype(bool)
    assert np.abs(expected[valid]).max() > 0.5  # the comparison is not between zeros
    np.testing.assert_allclose(got[valid], expected[valid], atol=1e-4, rtol=1e-4)
    # Padding's content never reaches a real token.
    moved = {**feed, "tap_2": (feed["tap_2"] + 100.0 * (~valid)[..., None]).astype(np.float32)}
    np.testing.assert_allclose(run(head_graph(head), moved, "scores")[valid], got[valid], atol=1e-5)
    # Fused: no node reads a shape, and attention is one node.
    ops = [node.op_type for node in head_graph(head).graph.node]
    assert "Shape" not in ops and "Softmax" not in ops
    assert ops.count("Attention") == (1 if attention_heads else 0)
    if width == 0:  # a linear head: a product per hidden state, standardisation folded, summed
        assert ops == ["MatMul"] * len(head.layers) + ["Sum"]


def test_splice_replaces_the_taps_and_casts_half_precision() -> None:
    """Into a graph that left fp16 hidden states as outputs (a model loaded in half
    precision): the taps leave the outputs, the head's output joins them, the head reads the
    hidden states cast to float32."""
    head = random_head(2)
    value = helper.make_tensor_value_info
    fp16_in = ["h0", "h2"]
    nodes = [
        helper.make_node("Identity", ["h0"], ["tap_0"]),
        helper.make_node("Identity", ["h2"], ["tap_2"]),
        helper.make_node("Identity", ["norms_in"], ["embedding_norms"]),
        helper.make_node("Identity", ["logits_in"], ["token_logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "exported",
        [value(n, TensorProto.FLOAT16, ["b", "n", K]) for n in fp16_in]
        + [
            value("norms_in", TensorProto.FLOAT, ["b", "n"]),
            value("logits_in", TensorProto.FLOAT, ["b", "n", C]),
            value("attention_mask", TensorProto.INT64, ["b", "n"]),
        ],
        [
            value("embedding_norms", TensorProto.FLOAT, ["b", "n"]),
            value("token_logits", TensorProto.FLOAT, ["b", "n", C]),
            value("tap_0", TensorProto.FLOAT16, ["b", "n", K]),
            value("tap_2", TensorProto.FLOAT16, ["b", "n", K]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    splice_heads(model, {"distilled": head}, {0: "tap_0", 2: "tap_2"}, {"distilled": "head_x"}, C)
    assert [o.name for o in model.graph.output] == ["embedding_norms", "token_logits", "head_x"]
    feed = inputs()
    half = {
        "h0": feed["tap_0"].astype(np.float16),
        "h2": feed["tap_2"].astype(np.float16),
        "norms_in": feed["embedding_norms"],
        "logits_in": feed["token_logits"],
        "attention_mask": feed["attention_mask"],
    }
    rounded = {
        **feed,
        "tap_0": half["h0"].astype(np.float32),
        "tap_2": half["h2"].astype(np.float32),
    }
    valid = feed["attention_mask"].astype(bool)
    np.testing.assert_allclose(
        run(model, half, "head_x")[valid],
        module_scores(head, rounded)[valid],
        atol=1e-4,
        rtol=1e-4,
    )


def test_a_graph_with_traced_heads_is_stale(tmp_path: Path) -> None:
    """A description naming the right heads but not how they were written (graphs exported
    before the heads were written by hand) asks for a new export; one that names the current
    way is current."""
    head = random_head(2)
    graph = tmp_path / "limelight.onnx"
    graph.write_bytes(b"")
    description = {"kind": "inline", "outputs": ["logits", "head_distilled"]}
    description["heads"] = {"distilled": module_digest(head)}  # type: ignore[assignment]
    Path(str(graph) + ".json").write_text(json.dumps(description))
    assert "traced" in heads_mismatch(graph, {"distilled": head})
    description["head_graph"] = HEAD_GRAPH_FORMAT
    Path(str(graph) + ".json").write_text(json.dumps(description))
    assert heads_mismatch(graph, {"distilled": head}) == ""

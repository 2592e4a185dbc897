"""The explainer head as ONNX nodes written by hand, spliced into the exported inline graph.

Traced by the exporter, BERT-tiny's head became 61 nodes: a dozen only to read the batch and
sequence sizes for its reshapes, the attention written out as split, squeeze, transpose,
matmul, softmax and the mask built in five more. On a model whose whole forward is 0.3–0.4 ms
ONNX Runtime's cost is mostly per node, so the head cost 0.3 of a forward at batch 1. Written
with ONNX Runtime's fused operators (``com.microsoft``: ``Attention`` over the packed
projection with the padding mask, ``SkipLayerNormalization`` for each residual sum followed by
a layer norm, ``BiasGelu``) the same computation is 25 nodes, the same numbers up to float
rounding (tested against the module, padding included).

These operators are ONNX Runtime's own (CPU and CUDA): the inline graph is written for ONNX
Runtime, which is what serves it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from limelight.models.explainer_head import ExplainerHead

HEAD_GRAPH_FORMAT = "onnxruntime-fused/1"
"""How the heads inside an inline graph were written; a graph whose description names another
(or none: traced heads, before this) is exported again."""
CONTRIB = "com.microsoft"
_EPS = 1e-5  # the module's layer norms, and its standardisation of the hidden states


@dataclass
class HeadInputs:
    """Names of the graph's tensors a head reads."""

    hidden: Mapping[int, str]
    """A hidden state [B, n, k] by layer index."""
    embedding_norms: str = "embedding_norms"
    token_logits: str = "token_logits"
    attention_mask: str = "attention_mask"


@dataclass
class _Writer:
    prefix: str
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)

    def const(self, name: str, value: torch.Tensor | np.ndarray) -> str:
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
        if array.dtype.kind == "f":
            array = array.astype(np.float32)
        full = f"{self.prefix}const/{name}"  # apart from the nodes' outputs
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), full))
        return full

    def weight(self, name: str, linear: torch.Tensor) -> str:
        """A torch ``Linear`` weight [out, in] as the right-hand side of MatMul [in, out]."""
        return self.const(name, linear.detach().t())

    def node(
        self,
        op: str,
        inputs: list[str],
        outputs: list[str] | str,
        domain: str = "",
        **attrs: Any,
    ) -> str:
        """Add a node (named after its first output); returns that output's name."""
        names = [outputs] if isinstance(outputs, str) else outputs
        self.nodes.append(
            helper.make_node(op, inputs, names, name=names[0], domain=domain, **attrs)
        )
        return names[0]


def head_nodes(
    head: ExplainerHead, inputs: HeadInputs, output: str
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes and weights that compute ``head``'s scores [B, n, C] into ``output``."""
    w = _Writer(prefix=f"{output}/")
    p = w.prefix
    if head.linear:
        # The standardisation folded in; each hidden state through its slice of the map, the
        # slices and the bias summed in one node. (One product over the states concatenated
        # first was 1-2 % of BERT-tiny's short forward slower: the copy costs more than it saves.)
        folded_weight, folded_bias = head.folded()
        states = [inputs.hidden[layer] for layer in head.layers]
        k = folded_weight.shape[1] // len(states)
        terms = [
            w.node(
                "MatMul",
                [x, w.weight(f"linear_{i}", folded_weight[:, i * k : (i + 1) * k])],
                f"{p}linear_{i}",
            )
            for i, x in enumerate(states)
        ]
        w.node("Sum", [*terms, w.const("linear_bias", folded_bias)], output)
        return w.nodes, w.initializers
    assert head.readout is not None
    k = head.hidden_size
    weight = head.proj.weight
    tail = len(head.layers) * k

    # Projection: log(1 + ‖h₀‖) and the per-token logits through one product, then each
    # layer's standardised hidden state through its slice of the projection; summed.
    log_norm = w.node(
        "Add", [inputs.embedding_norms, w.const("one", np.array(1.0, dtype=np.float32))], p + "n1"
    )
    log_norm = w.node("Log", [log_norm], p + "log1p")
    log_norm = w.node("Unsqueeze", [log_norm, w.const("last", np.array([-1]))], p + "log1p_col")
    extra = w.node("Concat", [log_norm, inputs.token_logits], p + "extra", axis=-1)
    terms = [w.node("MatMul", [extra, w.weight("w_extra", weight[:, tail:])], p + "p_extra")]
    ones, zeros = w.const("ones_k", np.ones(k)), w.const("zeros_k", np.zeros(k))
    for i, layer in enumerate(head.layers):
        standard = w.node(
            "LayerNormalization",
            [inputs.hidden[layer], ones, zeros],
            f"{p}standard_{layer}",
            axis=-1,
            epsilon=_EPS,
        )
        layer_weight = w.weight(f"w_layer_{layer}", weight[:, i * k : (i + 1) * k])
        terms.append(w.node("MatMul", [standard, layer_weight], f"{p}p_layer_{layer}"))
    partial = terms[0]
    for i, term in enumerate(terms[1:-1]):
        partial = w.node("Add", [partial, term], f"{p}sum_{i}")

    def add_and_norm(
        last: str, skip: str | None, bias: str, norm: torch.nn.Module, tag: str
    ) -> tuple[str, str]:
        """``norm(skip + last + bias)`` and the sum itself: one fused node when there is a
        skip, as in a transformer's residual."""
        gamma = w.const(f"{tag}_gamma", norm.get_parameter("weight"))
        beta = w.const(f"{tag}_beta", norm.get_parameter("bias"))
        if skip is None:
            total = w.node("Add", [last, bias], f"{p}{tag}_sum")
            normed = w.node(
                "LayerNormalization", [total, gamma, beta], f"{p}{tag}", axis=-1, epsilon=_EPS
            )
            return normed, total
        outs = [f"{p}{tag}", f"{p}{tag}_mean", f"{p}{tag}_inv_std", f"{p}{tag}_sum"]
        w.node(
            "SkipLayerNormalization",
            [last, skip, gamma, beta, bias],
            outs,
            domain=CONTRIB,
            epsilon=_EPS,
        )
        return outs[0], outs[3]

    skip = partial if len(terms) > 1 else None
    last = terms[-1]
    proj_bias = w.const("proj_bias", head.proj.bias)
    block = head.context
    if block is not None:
        normed, x = add_and_norm(last, skip, proj_bias, block.norm1, "norm1")
        mask = w.node("Cast", [inputs.attention_mask], p + "mask", to=TensorProto.INT32)
        attended = w.node(
            "Attention",
            [normed, w.weight("qkv", block.qkv.weight), w.const("qkv_bias", block.qkv.bias), mask],
            p + "attention",
            domain=CONTRIB,
            num_heads=block.heads,
            mask_filter_value=-1e4,  # the module's additive mask
        )
        out = w.node("MatMul", [attended, w.weight("out", block.out.weight)], p + "out")
        normed, x = add_and_norm(out, x, w.const("out_bias", block.out.bias), block.norm2, "norm2")
        (w1, b1), (w2, b2) = _weight_and_bias(block.ff[0]), _weight_and_bias(block.ff[2])
        hidden = w.node("MatMul", [normed, w.weight("ff1", w1)], p + "ff1")
        hidden = w.node("BiasGelu", [hidden, w.const("ff1_bias", b1)], p + "gelu", domain=CONTRIB)
        last = w.node("MatMul", [hidden, w.weight("ff2", w2)], p + "ff2")
        readout, _ = add_and_norm(last, x, w.const("ff2_bias", b2), head.readout[0], "readout_norm")
    else:
        readout, _ = add_and_norm(last, skip, proj_bias, head.readout[0], "readout_norm")
    weight, bias = _weight_and_bias(head.readout[1])
    scores = w.node("MatMul", [readout, w.weight("readout", weight)], p + "readout")
    w.node("Add", [scores, w.const("readout_bias", bias)], output)
    return w.nodes, w.initializers


def _weight_and_bias(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return module.get_parameter("weight"), module.get_parameter("bias")


def splice_heads(
    graph: onnx.ModelProto,
    heads: Mapping[str, ExplainerHead],
    taps: Mapping[int, str],
    outputs: Mapping[str, str],
    num_labels: int,
) -> None:
    """Add each head (by ``outputs[name]``) to ``graph`` reading the hidden states the export
    left as the graph outputs ``taps`` (by layer), and drop those outputs. Inputs of another
    float type (a model loaded in half precision) are cast first, as the module does."""
    kept = [o for o in graph.graph.output if o.name not in set(taps.values())]
    types = {o.name: o.type.tensor_type.elem_type for o in graph.graph.output}

    def as_float(name: str) -> str:
        if types.get(name, TensorProto.FLOAT) == TensorProto.FLOAT:
            return name
        cast = f"{name}/float"
        graph.graph.node.append(
            helper.make_node("Cast", [name], [cast], name=cast, to=TensorProto.FLOAT)
        )
        return cast

    inputs = HeadInputs(
        hidden={layer: as_float(name) for layer, name in taps.items()},
        embedding_norms=as_float("embedding_norms"),
        token_logits=as_float("token_logits"),
    )
    taken = {i.name for i in graph.graph.input}
    if inputs.attention_mask not in taken and any(h.context is not None for h in heads.values()):
        # The exporter drops an input no node reads (a model that ignores padding); the
        # context block reads it.
        graph.graph.input.append(
            helper.make_tensor_value_info(
                inputs.attention_mask, TensorProto.INT64, ["batch", "sequence"]
            )
        )
    for head_name, head in heads.items():
        nodes, weights = head_nodes(head, inputs, outputs[head_name])
        graph.graph.node.extend(nodes)
        graph.graph.initializer.extend(weights)
        kept.append(
            helper.make_tensor_value_info(
                outputs[head_name], TensorProto.FLOAT, ["batch", "sequence", num_labels]
            )
        )
    del graph.graph.output[:]
    graph.graph.output.extend(kept)
    if not any(o.domain == CONTRIB for o in graph.opset_import):
        graph.opset_import.append(helper.make_opsetid(CONTRIB, 1))

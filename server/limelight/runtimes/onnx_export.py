"""Export a classifier to ONNX with the NormXLogit inputs as graph outputs.

The inline graph returns ``logits`` [B, C], ``embedding_norms`` [B, n], ``token_logits``
[B, n, C] — everything the inline path needs, so ONNX Runtime serves the whole explanation —
and, for classifiers, ``normxlogit`` [B, n, C], their product: one node in the graph instead
of a NumPy operation after it on every request (which costs several times more, on caches the
graph has just run over).
Batch and sequence axes are dynamic. ``kind="plain"`` exports the bare classifier (logits only),
the benchmark baseline.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from limelight.errors import FailedPrecondition, ModelLoadError
from limelight.models.adapters import HeadAdapter
from limelight.models.explainer_head import ExplainerHead
from limelight.models.loaded import LoadedModel
from limelight.runtimes.onnx_head import HEAD_GRAPH_FORMAT, splice_heads

OPSET = 17
#: The description's ``format``: what the inline graph computes. 2: NormXLogit is an output (and
#: the per-token head is written without reshapes where the model's head allows); a graph of an
#: earlier format still serves, and is exported again where the sidecar exports its own.
GRAPH_FORMAT = "limelight-onnx/2"
GraphKind = Literal["inline", "plain"]
#: Architectures whose export was checked for parity with torch (tests/conformance), with
#: every pooling they declare (ModernBERT cls and mean, EuroBERT bos, mean and late).
EXPORTABLE = (
    "bert",
    "distilbert",
    "roberta",
    "xlm-roberta",
    "deberta-v2",
    "gpt2",
    "llama",
    # checked with tiny random-init models (tests/conformance/test_onnx_architectures.py)
    "albert",
    "arcee",
    "bart",
    "big_bird",
    "bigbird_pegasus",
    "biogpt",
    "bloom",
    "camembert",
    "convbert",
    "ctrl",
    "data2vec-text",
    "deberta",
    "doge",
    "electra",
    "ernie",
    "esm",
    "esmc",
    "eurobert",
    "exaone4",
    "falcon",
    "flaubert",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gpt-sw3",
    "gpt_bigcode",
    "gpt_neo",
    "gpt_neox",
    "gptj",
    "gte",
    "hunyuan_v1_dense",
    "ibert",
    "jina_embeddings_v3",
    "megatron-bert",
    "mbart",
    "minicpm3",
    "ministral",
    "ministral3",
    "mistral",
    "mobilebert",
    "modernbert",
    "modernbert-decoder",
    "mpnet",
    "mpt",
    "mra",
    "mt5",
    "mvp",
    "nemotron",
    "nomic_bert",
    "nystromformer",
    "olmo",
    "olmo2",
    "olmo3",
    "openai-gpt",
    "opt",
    "persimmon",
    "phi",
    "phi3",
    "plbart",
    "qwen2",
    "qwen3",
    "rembert",
    "roberta-prelayernorm",
    "roc_bert",
    "roformer",
    "seed_oss",
    "smollm3",
    "squeezebert",
    "stablelm",
    "starcoder2",
    "t5",
    "ultrabert",
    "umt5",
    "xlm",
    "xlm-roberta-xl",
    "xlnet",
    "xmod",
)
_HISTC = "mixture-of-experts routing uses aten::histc, which has no ONNX export"
_PARTIAL_ROPE = (
    "the TorchScript exporter fails on its partial rotary embedding (a concatenation of tensors "
    "of different ranks)"
)
_SOLVE = "its linear-attention layers use aten::linalg_solve_triangular, which has no ONNX export"
#: Not exportable, with the reason (the converter or ONNX Runtime fails on them; checked with
#: tiny random-init models).
NOT_EXPORTABLE = {
    "axk1": _HISTC,
    "axk2": "the TorchScript exporter fails on its expert routing (aten::scatter: an internal "
    "PyTorch assertion)",
    "deepseek_v2": "its rotary embedding uses complex numbers (aten::polar), which have no "
    "ONNX export",
    "deepseek_v3": _HISTC,
    "diffllama": "aten::rms_norm has no ONNX export at opset 17",
    "fnet": "its Fourier transform (aten::fft_fftn) has no ONNX export at opset 17",
    "glm": _PARTIAL_ROPE,
    "glm4": _PARTIAL_ROPE,
    "gpt_oss": _HISTC,
    "helium": "its attention exports but fails in ONNX Runtime (a Reshape node)",
    "hunyuan_v1_moe": _HISTC,
    "jamba": _HISTC,
    "jetmoe": "its mixture of attention experts exports but fails in ONNX Runtime (a Split node)",
    "longformer": "its sliding-window attention exports but fails in ONNX Runtime",
    "minimax": _HISTC,
    "mistral4": _HISTC,
    "mixtral": _HISTC,
    "phimoe": _HISTC,
    "qwen2_moe": _HISTC,
    "qwen3_5_text": _SOLVE,
    "qwen3_moe": _HISTC,
    "qwen3_next": _SOLVE,
    "yoso": "Limelight runs its rows unpadded one at a time (its attention does not mask pad "
    "tokens); a traced graph would fix that loop to the export batch's lengths",
}


EXTRA_PREFIX = "head_"


class _InlineGraph(nn.Module):
    """The classifier's inline outputs, and the hidden states of ``tap_layers`` as outputs
    ``tap_<layer>`` for the heads, which are written into the graph after the export
    (:mod:`limelight.runtimes.onnx_head`) instead of traced."""

    def __init__(self, adapter: HeadAdapter, tap_layers: list[int], scores: bool) -> None:
        super().__init__()
        self.adapter = adapter
        self.inner = adapter.model  # registers the weights as a submodule
        self.tap_layers = tap_layers
        self.scores = scores  # NormXLogit's product as an output (classifiers)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        out = self.adapter.run_base(input_ids, attention_mask, token_type_ids)
        token_logits = self.adapter.head(out.last_hidden_state)
        # As the torch runtime: the pooled token's row of the per-token logits, not the head
        # run a second time on the pooled vector (ONNX Runtime pays per node on small models).
        logits = self.adapter.logits_from(out.last_hidden_state, attention_mask, token_logits)
        norms = out.hidden_states[0].norm(dim=-1)
        scores = [norms.unsqueeze(-1) * token_logits] if self.scores else []
        taps = [out.hidden_states[layer] for layer in self.tap_layers]
        return (logits, norms, token_logits, *scores, *taps)


class _PlainGraph(nn.Module):
    def __init__(self, adapter: HeadAdapter) -> None:
        super().__init__()
        self.adapter = adapter
        self.inner = adapter.model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kwargs = self.adapter.base_inputs(input_ids, attention_mask, token_type_ids)
        return self.inner(**kwargs).logits  # type: ignore[no-any-return]


def input_names(model: LoadedModel) -> list[str]:
    names = ["input_ids", "attention_mask"]
    if model.adapter.uses_token_type_ids:
        names.append("token_type_ids")
    return names


def export_onnx(
    model: LoadedModel,
    out: Path,
    kind: GraphKind = "inline",
    heads: Mapping[str, ExplainerHead] | None = None,
) -> Path:
    """Write the graph to ``out`` (and a JSON sidecar describing it); returns ``out``.

    ``heads`` (inline graphs only): explainer heads, written into the graph as outputs
    ``head_<name>`` (:mod:`limelight.runtimes.onnx_head`).
    """
    heads = dict(heads or {}) if kind == "inline" else {}
    if model.architecture in NOT_EXPORTABLE:
        raise FailedPrecondition(
            f"ONNX export of {model.architecture!r} is not supported: "
            f"{NOT_EXPORTABLE[model.architecture]}; serve it with --runtime torch"
        )
    if model.architecture not in EXPORTABLE:
        raise FailedPrecondition(
            f"ONNX export of {model.architecture!r} has not been checked for parity; "
            f"exportable: {', '.join(EXPORTABLE)}"
        )
    if model.device.type != "cpu":
        raise FailedPrecondition("export from a model loaded on the CPU")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    names = input_names(model)
    sample = model.encode("Limelight export sample, long enough to vary.", None)
    example: list[torch.Tensor] = [
        torch.tensor([sample.input_ids, sample.input_ids]),
        torch.ones((2, len(sample)), dtype=torch.long),
    ]
    if "token_type_ids" in names:
        example.append(torch.zeros((2, len(sample)), dtype=torch.long))
    tap_layers = sorted({layer for head in heads.values() for layer in head.layers})
    taps = {layer: f"tap_{layer}" for layer in tap_layers}
    # A regressor's NormXLogit is another formula, which the method computes after the pass.
    scores = model.num_labels > 1
    graph: nn.Module = (
        _InlineGraph(model.adapter, tap_layers, scores)
        if kind == "inline"
        else _PlainGraph(model.adapter)
    )
    served = ["logits"]
    if kind == "inline":
        served += ["embedding_norms", "token_logits"] + (["normxlogit"] if scores else [])
    traced = served + list(taps.values())
    outputs = served + [EXTRA_PREFIX + name for name in heads]
    axes: dict[str, dict[int, str]] = {n: {0: "batch", 1: "sequence"} for n in names}
    axes["logits"] = {0: "batch"}
    for name in traced[1:]:
        axes[name] = {0: "batch", 1: "sequence"}
    graph.eval()
    with torch.no_grad(), warnings.catch_warnings():
        # The tracer warns about Python branches on shapes and the exporter about index
        # operators; the graph's parity with torch at other batch sizes and lengths is tested
        # (tests/runtimes/test_onnx.py, the conformance suite), so these say nothing to a user.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.onnx")
        torch.onnx.export(
            graph,
            tuple(example),
            str(out),
            input_names=names,
            output_names=traced,
            dynamic_axes=axes,
            opset_version=OPSET,
            # The TorchScript exporter, deprecated but not removed in the pinned torch: the
            # torch.export-based one's graphs serve 7-39 % slower here and need onnxscript
            # (docs/benchmarks.md, "torch's new ONNX exporter").
            dynamo=False,
        )
    import onnx

    written = onnx.load(str(out), load_external_data=False)
    if heads:
        # Weights kept outside the file (a model over 2 GB) stay where the exporter put them.
        splice_heads(
            written,
            heads,
            taps,
            {name: EXTRA_PREFIX + name for name in heads},
            model.num_labels,
        )
        onnx.save(written, str(out))
    # The exporter leaves out an input that no node reads (the mask of a model that ignores
    # padding and reads its logits at the first token): describe the graph as written.
    taken = {i.name for i in written.graph.input}
    describe(out).write_text(
        json.dumps(
            {
                "format": GRAPH_FORMAT,
                "kind": kind,
                "model_version": model.version,
                "architecture": model.architecture,
                "inputs": [name for name in names if name in taken],
                "outputs": outputs,
                "heads": {name: module_digest(head) for name, head in heads.items()},
                **({"head_graph": HEAD_GRAPH_FORMAT} if heads else {}),
                "opset": OPSET,
            },
            indent=2,
        )
    )
    return out


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A path beside ``out`` to write a graph and its description to, moved into place when the
    block ends (graph, then description), so that a process loading ``out`` meanwhile — a
    running sidecar's reloader — reads the old graph or the new one, never half of one. On an
    error (a full disk, Ctrl-C) the old graph stays and the partial files go."""
    partial = out.with_name(f".{os.getpid()}.{out.name}")
    try:
        yield partial
        os.replace(partial, out)
        os.replace(describe(partial), describe(out))
    finally:
        for leftover in (partial, describe(partial)):
            leftover.unlink(missing_ok=True)


def quantize_int8(graph: Path, out: Path) -> Path:
    """Dynamic int8 quantisation of ``graph``'s weights into ``out`` (with its description),
    staged like the graph itself. The inline heads stay in float: a few thousand weights,
    written with ONNX Runtime's own operators, which the quantiser's type inference cannot
    follow."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    nodes = onnx.load(str(graph), load_external_data=False).graph.node
    heads = [n.name for n in nodes if n.name.startswith(EXTRA_PREFIX)]
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))  # the quantiser logs each tensor on the root logger
    try:
        with staged(out) as partial:
            quantize_dynamic(
                str(graph),
                str(partial),
                weight_type=QuantType.QInt8,
                nodes_to_exclude=heads,
                extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
            )
            shutil.copy(describe(graph), describe(partial))
    finally:
        root.setLevel(level)
    return out


def describe(path: Path) -> Path:
    """The JSON file beside a graph that binds it to one model version."""
    return Path(str(path) + ".json")


class DamagedDescription(ModelLoadError):
    """The description beside a graph cannot be read (cut short by an interrupted copy, or not
    JSON): the graph cannot be bound to a model version, so it is not served as it is."""

    def __init__(self, graph: Path, reason: str, model_dir: Path | None = None) -> None:
        self.graph, self.reason = graph, reason
        model = f" --model {model_dir}" if model_dir is not None else ""
        super().__init__(
            f"the description of ONNX graph {graph} is damaged ({describe(graph)}: {reason}): "
            f"which model it was exported from cannot be read; remove both files, or export "
            f"the graph again with `limelight export-onnx{model} --out {graph}`"
        )

    def for_model(self, model_dir: Path) -> DamagedDescription:
        """The same error, its remedy naming the served model's directory."""
        return DamagedDescription(self.graph, self.reason, model_dir)


def read_description(path: Path) -> dict[str, Any]:
    """The description beside the graph at ``path``; {} when there is none. Raises
    :class:`DamagedDescription` when it is there but unreadable."""
    meta = describe(path)
    if not meta.exists():
        return {}
    try:
        data = json.loads(meta.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError: a file cut short or garbled
        raise DamagedDescription(path, _first_line(exc)) from None
    if not isinstance(data, dict):
        raise DamagedDescription(path, f"a JSON {type(data).__name__}, not an object")
    return data


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def module_digest(module: nn.Module) -> str:
    """A digest of a module's weights: how a graph's description names each inline head it
    carries, so that a head trained again after the export is told apart from the one inside."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def heads_mismatch(graph: Path, heads: Mapping[str, nn.Module]) -> str:
    """Empty when the graph at ``graph`` carries exactly ``heads`` (by their weights); otherwise
    which heads it carries and which it was asked for."""
    meta = read_description(graph)
    wanted = {name: module_digest(head) for name, head in heads.items()}
    if not meta:
        # No description (a graph copied without it): which heads it carries, if any, is not
        # recorded anywhere; say so rather than guess. Without heads to serve there is nothing
        # to compare (the runtime serves the head outputs the graph has).
        if not wanted:
            return ""
        return (
            f"{graph} has no description ({describe(graph).name}): whether it carries "
            f"{_named_heads(wanted)} beside the model cannot be verified"
        )
    outputs = meta.get("outputs", [])
    # Descriptions written before heads were recorded: a graph without head outputs is current
    # for a model without heads; one with them cannot be told from a stale one.
    carried = meta.get("heads", None if any(o.startswith(EXTRA_PREFIX) for o in outputs) else {})
    if carried == wanted and wanted and meta.get("head_graph") != HEAD_GRAPH_FORMAT:
        return f"{graph} carries its heads as an earlier Limelight wrote them (traced)"
    if carried == wanted:
        return ""
    return (
        f"{graph} carries {_named_heads(carried)}, but the model's directory holds "
        f"{_named_heads(wanted)}"
    )


def graph_mismatch(graph: Path, model: LoadedModel, heads: Mapping[str, nn.Module]) -> str:
    """Empty when ``graph`` is an inline graph of ``model`` that carries exactly ``heads``;
    otherwise why it cannot serve them."""
    if not graph.exists():
        return f"there is no graph at {graph}"
    try:
        meta = read_description(graph)
    except DamagedDescription as exc:  # as a stale graph: exported again where it is the cache's
        return f"{describe(graph)} is damaged ({exc.reason})"
    if not meta:
        return f"{graph} has no description ({describe(graph).name}): its model is not recorded"
    if meta.get("kind", "inline") != "inline":
        return f"{graph} is a plain graph"
    if meta.get("model_version") != model.version:
        return (
            f"{graph} was exported from model version {meta.get('model_version')}, "
            f"but the served model is {model.version}"
        )
    if meta.get("format") != GRAPH_FORMAT:
        return f"{graph} was exported by an earlier Limelight ({meta.get('format')})"
    return heads_mismatch(graph, heads)


def _named_heads(digests: Mapping[str, str] | None) -> str:
    if digests is None:
        return "inline heads it does not name (exported before heads were recorded)"
    if not digests:
        return "no inline head"
    return "the inline heads " + ", ".join(f"{n} ({d})" for n, d in sorted(digests.items()))

"""ONNX Runtime for the inline path (CPU provider; CUDA provider with onnxruntime-gpu)."""

from __future__ import annotations

import contextlib
import copy
import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from limelight.core.types import FloatArray
from limelight.errors import FailedPrecondition, ModelLoadError
from limelight.locks import file_lock, held_elsewhere
from limelight.models.explainer_head import ExplainerHead, inline_heads
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.base import InlineBatch, InlineOutputs, Runtime
from limelight.runtimes.graph_cache import served_from, write_served_from
from limelight.runtimes.onnx_export import (
    EXTRA_PREFIX,
    DamagedDescription,
    describe,
    export_onnx,
    graph_mismatch,
    heads_mismatch,
    read_description,
    staged,
)
from limelight.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_GRAPH = "limelight.onnx"

#: The outputs every inline graph gives, which ``run_inline`` reads.
SERVED_OUTPUTS = ("logits", "embedding_norms", "token_logits")
#: The outputs with one score per label on their last axis (besides the ``head_*`` ones).
_LABEL_WIDE = ("logits", "token_logits", "normxlogit")


def choose_providers(device: str) -> list[str]:
    """CUDA when asked for (or ``auto``) and present; otherwise CPU, with a warning."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if device.startswith("cuda") or device == "auto":
        if "CUDAExecutionProvider" in available:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        if device != "auto":
            log.warning(
                "CUDA requested but onnxruntime has no CUDA provider (install the [gpu] extra); "
                "falling back to the CPU provider"
            )
    return ["CPUExecutionProvider"]


def graph_feed(batch: InlineBatch, input_names: list[str]) -> dict[str, np.ndarray]:
    """The inputs a graph with ``input_names`` takes from ``batch``. A graph whose nodes never
    read the mask (a model that ignores padding, its logits read at the first token) is
    exported without that input; token types are zeros where the tokenizer gives none."""
    feed = {"input_ids": batch.input_ids}
    if "attention_mask" in input_names:
        feed["attention_mask"] = batch.attention_mask
    if "token_type_ids" in input_names:
        types = batch.token_type_ids
        feed["token_type_ids"] = types if types is not None else np.zeros_like(batch.input_ids)
    return feed


class OnnxRuntime(Runtime):
    name = "onnx"

    def __init__(
        self,
        graph: Path,
        model: LoadedModel,
        providers: list[str] | None = None,
        threads: int = 0,
    ) -> None:
        import onnxruntime as ort

        try:
            meta = read_description(graph)
        except DamagedDescription as exc:
            raise exc.for_model(model.directory) from None
        if meta.get("kind", "inline") != "inline":
            raise FailedPrecondition(f"{graph} is a plain graph; export it with kind=inline")
        if meta and meta.get("model_version") != model.version:
            raise FailedPrecondition(
                f"{graph} was exported from model version {meta.get('model_version')}, "
                f"but the served model is {model.version}; run `limelight export-onnx` again"
            )
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads > 0:
            options.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(
                str(graph), sess_options=options, providers=providers or ["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime raises its own types (InvalidProtobuf, Fail, …)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelLoadError(
                f"ONNX Runtime cannot load {graph} ({first}): a damaged or partly written "
                f"graph; remove it, or export it again with `{export_command(graph, model)}`"
            ) from exc
        self.input_names = [i.name for i in self.session.get_inputs()]
        outputs = self.session.get_outputs()
        self.output_names = [o.name for o in outputs]
        self.graph = graph
        self.model = model
        missing = [name for name in SERVED_OUTPUTS if name not in self.output_names]
        if missing:
            raise ModelLoadError(
                f"{graph} has no {', '.join(missing)} output: not an inline graph of a Limelight "
                f"classifier; create one with `limelight export-onnx --model {model.directory}`"
            )
        # A graph without its description names no model version: its label axis is what
        # tells another model's graph apart, before it answers a request with labels the served
        # model does not have. Checked here where the graph declares it, else on the first run.
        self._width_unchecked = False
        for output in outputs:
            if output.name not in _LABEL_WIDE and not output.name.startswith(EXTRA_PREFIX):
                continue
            width = output.shape[-1] if output.shape else None
            if isinstance(width, int):
                self._check_width(output.name, width)
            elif output.name == "logits":
                self._width_unchecked = True
        # Where each output lies in a run's list, found once: a request's Python work after the
        # graph runs on cold caches and costs several times what it does in a loop (measured:
        # the per-call name lookups and conversions were 2 % of BERT-tiny's short forward pass).
        self._positions = [self.output_names.index(name) for name in SERVED_OUTPUTS]
        #: Graphs exported before it was an output, and regression graphs, have no NormXLogit.
        self._scores = (
            self.output_names.index("normxlogit") if "normxlogit" in self.output_names else None
        )
        self._extra = [
            (i, name.removeprefix(EXTRA_PREFIX))
            for i, name in enumerate(self.output_names)
            if name.startswith(EXTRA_PREFIX)
        ]
        #: Graphs exported from a float16 or bfloat16 model return their outputs in that type.
        self._float32 = all(o.type == "tensor(float)" for o in outputs)
        if not meta:
            self._check_undescribed()

    def _check_undescribed(self) -> None:
        """A graph without its description names no model version: check it against the served
        model by what the graph itself shows, and refuse it where it is provably another
        model's (its label count is checked above)."""
        import onnx

        proto = onnx.load(str(self.graph), load_external_data=False)  # shapes, not weights
        model, graph = self.model, self.graph
        embedding = _embedding_shape(proto, self.input_names)
        ours = _model_embedding_shape(model)
        if embedding is not None and ours is not None and embedding != ours:
            raise ModelLoadError(
                f"graph {graph} has no description ({describe(graph).name}) and its token "
                f"embeddings are {embedding[0]} x {embedding[1]}; model {model.name} "
                f"({model.directory}) has {ours[0]} x {ours[1]}: it was exported from another "
                f"model; create this model's graph with `limelight export-onnx --model "
                f"{model.directory}`"
            )
        # Then one short probe through the graph and through torch (milliseconds for a small
        # model, a forward pass for a large one; only here, where no description vouches for
        # the graph): two models of the same shape and labels give different scores. The
        # embedding norms come from the embedding table alone (int8 moves them by ~0.2 %);
        # the per-token logits from every layer (int8 moved them by up to 37 % on a MiniLM
        # sentence, a model's own float graph by ~1e-6, another model's by 25 % to 130 %): a
        # quantised graph is held to the norms and to logits that are not unrelated.
        quantised = any(
            t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
            for t in proto.graph.initializer
        )
        del proto
        from limelight.runtimes.torch_runtime import TorchRuntime

        probe = model.encode("Limelight probe: one short sentence, scored by both.", None)
        batch = InlineBatch.from_encoded([probe], model.pad_id)
        values = self.session.run(None, self._feed(batch))
        self._check_width("logits", int(values[self._positions[0]].shape[-1]))
        self._width_unchecked = False
        expected = TorchRuntime(model).run_inline(batch)
        norms = _relative(values[self._positions[1]], expected.embedding_norms)
        logits = _relative(values[self._positions[2]], expected.token_logits)
        limits = (0.05, 0.75) if quantised else (0.05, 0.05)
        if norms > limits[0] or logits > limits[1]:
            raise ModelLoadError(
                f"graph {graph} has no description ({describe(graph).name}) and its outputs on "
                f"a probe input are not model {model.name}'s ({model.directory}): they differ "
                f"by {norms:.0%} in the embedding norms and {logits:.0%} in the per-token "
                f"logits (at most {limits[0]:.0%} and {limits[1]:.0%} expected of a"
                f"{' quantised' if quantised else ''} graph of this model): it was exported "
                f"from another model; create this model's graph with `limelight export-onnx "
                f"--model {model.directory}`"
            )
        log.warning(
            "%s has no description (%s): which model it was exported from is not recorded; "
            "its outputs on a probe input match model %s's (within %.1g), so it is served",
            graph,
            describe(graph).name,
            model.name,
            max(norms, logits),
        )

    @classmethod
    def for_model(cls, model: LoadedModel, settings: Settings) -> OnnxRuntime:
        graph = choose_graph(model, settings)
        import torch

        from limelight.cpus import inference_threads

        # torch's count, as load_served_model set it: the same share of the CPUs
        threads = inference_threads(settings, torch.get_num_threads())
        providers = choose_providers(settings.device)
        try:
            runtime = cls(graph, model, providers, threads)
        except ModelLoadError as exc:
            # The cached graph is the sidecar's own: one damaged there (a disk error, a copy cut
            # short) is exported again, rather than failing every start until someone removes it.
            cached = cached_graph(model, settings.cache_dir)
            if settings.onnx_path is not None or not settings.onnx_export or graph != cached:
                raise
            log.warning("the cached graph cannot be served (%s); exporting it again", exc.message)
            with file_lock(cached.parent / ".export.lock"):
                export_served_graph(model, cached, inline_heads(model))
            runtime = cls(graph, model, providers, threads)
        if settings.onnx_path is not None and not read_description(graph):
            # Without a description, whether it carries the heads is said once the runtime has
            # checked the graph against the model: a graph refused there is not "served".
            why = heads_mismatch(graph, inline_heads(model))
            if why:
                log.warning("%s; serving it as it is (run `limelight export-onnx` again)", why)
        # Only now: a graph that fails to load must not have cost the cached graph of the same
        # version, which the next start (the bad graph removed) serves without exporting again.
        settle_graph_cache(model, settings, graph)
        return runtime

    @property
    def head_names(self) -> frozenset[str]:
        return frozenset(
            n.removeprefix(EXTRA_PREFIX) for n in self.output_names if n.startswith(EXTRA_PREFIX)
        )

    def _check_width(self, output: str, width: int) -> None:
        """Refuse a graph whose ``output`` gives ``width`` scores per row where the served model
        has another number of labels (a graph exported from another model)."""
        labels = self.model.num_labels
        if width == labels:
            return
        what = "logits" if output == "logits" else f"scores per label in its {output} output"
        raise ModelLoadError(
            f"graph {self.graph} gives {width} {what}; model {self.model.name} "
            f"({self.model.directory}) has {labels} label{'s' if labels != 1 else ''}: it was "
            f"exported from another model; create this model's graph with "
            f"`limelight export-onnx --model {self.model.directory}`"
        )

    def _feed(self, batch: InlineBatch) -> dict[str, np.ndarray]:
        return graph_feed(batch, self.input_names)

    def run_inline(self, batch: InlineBatch) -> InlineOutputs:
        values = self.session.run(None, self._feed(batch))
        if self._width_unchecked:  # a label axis the graph leaves open: its first run (warm-up)
            self._check_width("logits", int(values[self._positions[0]].shape[-1]))
            self._width_unchecked = False
        if not self._float32:
            values = [np.asarray(value, dtype=np.float32) for value in values]
        at = self._positions
        return InlineOutputs(
            logits=values[at[0]],
            embedding_norms=values[at[1]],
            token_logits=values[at[2]],
            extra={name: values[i] for i, name in self._extra},
            normxlogit=None if self._scores is None else values[self._scores],
        )

    def forward_logits(self, batch: InlineBatch) -> FloatArray:
        (logits,) = self.session.run(["logits"], self._feed(batch))
        if self._width_unchecked:
            self._check_width("logits", int(logits.shape[-1]))
            self._width_unchecked = False
        return np.asarray(logits, dtype=np.float32)


def _relative(got: np.ndarray, expected: FloatArray) -> float:
    """How far ``got`` is from ``expected``, relative to the size of ``expected``."""
    got = np.asarray(got, dtype=np.float32)
    if got.shape != expected.shape:
        return float("inf")
    return float(np.linalg.norm(got - expected) / (np.linalg.norm(expected) + 1e-6))


def _embedding_shape(proto: object, inputs: list[str]) -> tuple[int, int] | None:
    """The [vocabulary, hidden] shape of the table the graph looks ``input_ids`` up in, where
    it is a plain initializer (not where the exporter or a quantiser wrote it otherwise)."""
    graph = proto.graph  # type: ignore[attr-defined]
    tables = {t.name: tuple(t.dims) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] == "input_ids":
            dims = tables.get(node.input[0])
            if dims is not None and len(dims) == 2 and "input_ids" in inputs:
                return int(dims[0]), int(dims[1])
    return None


def _model_embedding_shape(model: LoadedModel) -> tuple[int, int] | None:
    """The [vocabulary, hidden] shape of the served model's token embeddings, where it has one
    table (every Hugging Face model; None for one that does not say)."""
    try:
        shape = tuple(model.model.get_input_embeddings().weight.shape)
    except (AttributeError, NotImplementedError):
        return None
    return (int(shape[0]), int(shape[1])) if len(shape) == 2 else None


def export_command(graph: Path, model: LoadedModel) -> str:
    """The ``limelight export-onnx`` command that writes ``graph`` again (an int8 graph is
    written beside its float one, ``X.onnx`` and ``X.int8.onnx``)."""
    command = f"limelight export-onnx --model {model.directory}"
    int8 = graph.name.endswith(".int8.onnx")
    out = graph.with_name(graph.name.removesuffix(".int8.onnx") + ".onnx") if int8 else graph
    if out != model.directory / DEFAULT_GRAPH:
        command += f" --out {out}"
    return command + (" --int8" if int8 else "")


def cached_graph(model: LoadedModel, cache_dir: Path) -> Path:
    """Where the sidecar exports a graph itself: in the cache, never into the model's directory
    (which may be read-only, and whose graph is the user's)."""
    return cache_dir / "onnx" / model.version / DEFAULT_GRAPH


def settle_graph_cache(model: LoadedModel, settings: Settings, graph: Path) -> None:
    """Record that ``graph`` serves ``model``: the graphs of the model directory's earlier
    versions leave the cache (:func:`prune_cached_graphs`); a graph named by
    ``settings.onnx_path`` leaves the cache as it is."""
    if settings.onnx_path is not None:
        return
    with contextlib.suppress(OSError):  # bookkeeping: never fail a start on it
        cached = graph == cached_graph(model, settings.cache_dir)
        prune_cached_graphs(model, settings.cache_dir, serving_cached=cached)


def choose_graph(model: LoadedModel, settings: Settings) -> Path:
    """The graph that serves ``model``: ``settings.onnx_path`` as given; otherwise the graph
    beside the model when it carries the inline heads beside the model, else one exported into
    the cache when it is missing or stale there (``settings.onnx_export``; once, under a lock,
    when several processes start together). Removes nothing from the cache."""
    heads = inline_heads(model)
    if settings.onnx_path is not None:
        graph = Path(settings.onnx_path)
        if not graph.exists():
            raise FailedPrecondition(
                f"no ONNX graph at {graph}; create it with "
                f"`limelight export-onnx --model {model.directory} --out {graph}`"
            )
        try:  # the user's own files: a damaged description is refused, never replaced
            described = bool(read_description(graph))
        except DamagedDescription as exc:
            raise exc.for_model(model.directory) from None
        reason = heads_mismatch(graph, heads) if described else ""  # else: in ``for_model``
        if reason:  # the user's own graph: served as it is, never overwritten
            log.warning("%s; serving it as exported (run `limelight export-onnx` again)", reason)
        return graph
    return _graph_beside_or_cached(model, settings, heads)


def _graph_beside_or_cached(
    model: LoadedModel, settings: Settings, heads: Mapping[str, ExplainerHead]
) -> Path:
    beside = model.directory / DEFAULT_GRAPH
    reason = graph_mismatch(beside, model, heads)
    if not reason:
        return beside
    damaged = _damaged(beside, model)
    if damaged is not None:
        if not settings.onnx_export:
            raise damaged
        # Like a stale graph beside the model: the sidecar serves one of its own from the
        # cache (it never writes into the model's directory), and says which file to mend.
        log.warning(
            "%s; serving the inline graph in %s instead", damaged.message, settings.cache_dir
        )
    cached = cached_graph(model, settings.cache_dir)
    if not graph_mismatch(cached, model, heads):
        return cached
    if not settings.onnx_export:
        if beside.exists():  # the runtime refuses another model version's graph
            log.warning("%s; serving it as exported (LIMELIGHT_ONNX_EXPORT is off)", reason)
            return beside
        raise FailedPrecondition(
            f"no ONNX graph at {beside}; create it with `limelight export-onnx --model "
            f"{model.directory}`, or let the sidecar export one (LIMELIGHT_ONNX_EXPORT=true)"
        )
    with file_lock(cached.parent / ".export.lock"):
        if graph_mismatch(cached, model, heads):  # not exported by another process meanwhile
            log.info("%s: exporting the inline graph into %s", reason, cached)
            export_served_graph(model, cached, heads)
    return cached


def _damaged(graph: Path, model: LoadedModel) -> DamagedDescription | None:
    """The error of the damaged description beside ``graph``, or None."""
    if not graph.exists():
        return None
    try:
        read_description(graph)
    except DamagedDescription as exc:
        return exc.for_model(model.directory)
    return None


def prune_cached_graphs(model: LoadedModel, cache_dir: Path, serving_cached: bool) -> list[Path]:
    """Keep the graph cache to the versions in use: with ``serving_cached`` (``model`` is served
    by its version's graph in the cache) that folder lists ``model``'s directory; the other
    folders listing it (earlier versions; without ``serving_cached``, its version's too) are
    removed once they list no other directory. Each new model version exports a graph of its
    own, and a pod's cache volume has a size limit. Folders written before this bookkeeping list
    nobody and are left alone (`limelight cache prune --unrecorded` removes them). Returns the
    folders removed."""
    root = cache_dir / "onnx"
    if not root.is_dir():
        return []
    mine, serving = str(model.directory.resolve()), cached_graph(model, cache_dir).parent
    removed = []
    with file_lock(root / ".served-from.lock"):
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            listed = served_from(folder)
            if folder == serving and serving_cached:
                if mine not in listed:
                    write_served_from(folder, [*listed, mine])
            elif mine in listed:
                others = [d for d in listed if d != mine]
                if others:  # another directory with that version still uses it
                    write_served_from(folder, others)
                elif not held_elsewhere(folder / ".export.lock"):
                    shutil.rmtree(folder, ignore_errors=True)
                    removed.append(folder)
    for folder in removed:
        log.info("removed %s from the cache: %s is no longer served from it", folder, mine)
    return removed


def export_served_graph(model: LoadedModel, out: Path, heads: Mapping[str, ExplainerHead]) -> None:
    """Export ``model`` with ``heads`` to ``out`` from its CPU weights, :func:`staged`."""
    started = time.perf_counter()
    if model.device.type != "cpu":  # the exporter traces on the CPU
        model = load_model(model.directory, device="cpu", name=model.name)
        heads = {name: copy.deepcopy(head).cpu() for name, head in heads.items()}
    with staged(out) as partial:
        export_onnx(model, partial, heads=heads)
    log.info(
        "exported the inline graph of %s (%s) in %.1f s",
        model.name,
        ", ".join(heads) or "no extra outputs",
        time.perf_counter() - started,
    )

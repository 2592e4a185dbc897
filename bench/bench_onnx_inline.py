"""Where the ONNX inline graph's time goes: plain classifier, inline outputs without the head,
inline outputs with the head, timed interleaved in one process (median over rounds).

    .venv/bin/python bench/bench_onnx_inline.py --model DIR --out GRAPHS --tag now

exports the three graphs of ``DIR`` (its distilled head included) with the installed code under
the tag ``now`` into ``GRAPHS`` and times them. To compare two versions of the export code, export
the other with that version's sources first and name both tags:

    git worktree add /tmp/before COMMIT
    PYTHONPATH=/tmp/before/server .venv/bin/python bench/bench_onnx_inline.py --model DIR \\
        --out GRAPHS --tag before --export-only
    .venv/bin/python bench/bench_onnx_inline.py --model DIR --out GRAPHS --tag now --compare before

Every ratio is against the plain graph of the first tag, timed in the same rounds. `limelight
bench` measures the served path (tokenised batches, output conversion) and moves by ±0.1 between
runs on a shared 2-core VM; this script times the graphs alone, which is what an export change
moves.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

KINDS = ("plain", "nohead", "head")


def export(model_dir: Path, out: Path, tag: str) -> None:
    from limelight.models.explainer_head import inline_heads
    from limelight.models.loaded import load_model
    from limelight.runtimes.onnx_export import export_onnx

    model = load_model(model_dir)
    export_onnx(model, out / f"{tag}-plain.onnx", kind="plain")
    export_onnx(model, out / f"{tag}-nohead.onnx")
    export_onnx(model, out / f"{tag}-head.onnx", heads=inline_heads(model))


def session(path: Path, threads: int) -> Any:
    """An ONNX Runtime session as the sidecar opens one (all graph optimisations)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="model directory")
    parser.add_argument("--out", type=Path, required=True, help="folder for the graphs")
    parser.add_argument("--tag", default="now", help="name of this export")
    parser.add_argument("--export-only", action="store_true")
    parser.add_argument("--compare", default="", help="tags exported before, timed beside --tag")
    parser.add_argument("--shapes", default="16x1,16x32,150x1,150x32", help="TOKENSxBATCH,...")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per timed call group")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    export(args.model, args.out, args.tag)
    if args.export_only:
        return
    tags = [args.tag, *(t for t in args.compare.split(",") if t)]
    names = [f"{args.tag}-plain"] + [f"{t}-{k}" for t in tags for k in KINDS[1:]]
    sessions = {n: session(args.out / f"{n}.onnx", args.threads) for n in names}
    rng = np.random.default_rng(0)
    print("| tokens | batch | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for shape in args.shapes.split(","):
        n, b = (int(v) for v in shape.split("x"))
        ids = rng.integers(1000, 5000, size=(b, n)).astype(np.int64)
        inputs = {
            "input_ids": ids,
            "attention_mask": np.ones_like(ids),
            "token_type_ids": np.zeros_like(ids),
        }
        reps = max(3, args.tokens // (n * b))
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name, s in sessions.items():
                feed = {i.name: inputs[i.name] for i in s.get_inputs()}
                s.run(None, feed)
                start = time.perf_counter()
                for _ in range(reps):
                    s.run(None, feed)
                times[name].append((time.perf_counter() - start) / reps * 1e3)
        med = {name: statistics.median(v) for name, v in times.items()}
        base = med[names[0]]
        cells = [f"{med[name]:.3g} ms ({med[name] / base:.2f}×)" for name in names]
        print(f"| {n} | {b} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

"""Faithfulness of the inline head by width and training seed, on the labels already on disk.

    .venv/bin/python bench/bench_head_width.py --demo bert-tiny --widths 64,32,16 --seeds 0,1,2
    .venv/bin/python bench/bench_head_width.py --demo minilm --epochs 5 --widths 64,32,16

For each width and seed it trains a head exactly as the demo build does (`train_head`) on the
teacher labels cached beside the demo model (build it first: `limelight build-demo`), then
scores it on held-out test reviews (`--n` sampled with `--seed-data`, the sample of
`limelight eval --n N --seed S`): deletion and sufficiency AOPC with `[MASK]`, and deletion
with the top tokens removed. Each row's Δ is paired against the first width at the same seed.
Every unit of width is paid on every request, so the narrowest width that holds its
faithfulness is the one to serve (docs/distillation.md, "Narrower heads").
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from limelight.core.types import Encoded, FloatArray
from limelight.demo.build import DEMO_HEADS, ensure_demo_model
from limelight.distill.train import TeacherExample, TrainConfig, train_head
from limelight.evaluation.data import load_examples
from limelight.evaluation.runner import EvalConfig, Evaluator
from limelight.models.explainer_head import head_dir
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings


def cached_labels(model_dir: Path, teacher: str) -> list[TeacherExample]:
    """The demo head's training labels (the resumable cache the demo build wrote)."""
    path = head_dir(load_model(model_dir)).with_name(f"limelight_distilled.teacher-{teacher}.jsonl")
    if not path.exists():
        raise SystemExit(f"no cached labels at {path}: run `limelight build-demo` first")
    rows = [json.loads(line) for line in path.read_text().splitlines()[1:]]  # line 1: header
    return [TeacherExample(r["text"], r["target"], r["scores"]) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--demo", choices=sorted(DEMO_HEADS), default="bert-tiny")
    parser.add_argument("--widths", default="64,32,16")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds")
    parser.add_argument("--epochs", type=int, help="default: the demo recipe's")
    parser.add_argument("--n", type=int, default=120, help="held-out test reviews")
    parser.add_argument("--seed-data", type=int, default=0, help="seed of the review sample")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    model = load_model(model_dir)
    examples = cached_labels(model_dir, DEMO_HEADS[args.demo].teacher)
    epochs = args.epochs or DEMO_HEADS[args.demo].epochs
    data = load_examples("rotten_tomatoes", model.labels, n=args.n, seed=args.seed_data)
    masked = Evaluator(model, EvalConfig(replace="mask", game_fractions=()))
    removed = Evaluator(model, EvalConfig(replace="delete", game_fractions=()))
    encoded = masked.encode(data.examples)
    predicted = [int(p) for p in masked.predict(encoded).argmax(axis=1)]
    print(f"{args.demo}: {len(examples)} cached labels, {epochs} epochs, {args.n} test reviews")
    print("| width | seed | parameters | deletion | sufficiency | removed | Δ deletion | "
          "Δ sufficiency | Δ removed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    widths = [int(w) for w in args.widths.split(",")]
    first: dict[int, list[np.ndarray]] = {}
    for width in widths:
        for seed in (int(s) for s in args.seeds.split(",")):
            heads = 4 if width >= 64 else 2
            config = TrainConfig(width=width, attention_heads=heads, epochs=epochs, seed=seed)
            start = time.monotonic()
            head, _ = train_head(model, examples, config)
            runtime = TorchRuntime(model, {"distilled": head})

            def explain(enc: Encoded, target: int, runtime: TorchRuntime = runtime) -> FloatArray:
                batch = InlineBatch.from_encoded([enc], model.pad_id)  # as the sidecar serves it
                return np.asarray(runtime.run_inline(batch).extra["distilled"][0, :, target])

            m = masked.evaluate_method("head", explain, data.examples, encoded, predicted)
            r = removed.evaluate_method("head", explain, data.examples, encoded, predicted)
            per = [
                np.asarray(m.aopc_deletion_per_input),
                np.asarray(m.aopc_sufficiency_per_input),
                np.asarray(r.aopc_deletion_per_input),
            ]
            base = first.setdefault(seed, per)
            deltas = ["–"] * 3  # the first width is the baseline of its seed
            if base is not per:
                deltas = [
                    f"{d.mean():+.3f} ± {d.std(ddof=1) / np.sqrt(len(d)):.3f}"
                    for d in (mine - theirs for mine, theirs in zip(per, base, strict=True))
                ]
            params = sum(p.numel() for p in head.parameters())
            means = " | ".join(
                f"{v.mean():+.3f}" if i == 1 else f"{v.mean():.3f}" for i, v in enumerate(per)
            )
            print(
                f"| {width} | {seed} | {params:,} | {means} | {' | '.join(deltas)} |"
                f"  <!-- {time.monotonic() - start:.0f} s -->",
                flush=True,
            )


if __name__ == "__main__":
    main()

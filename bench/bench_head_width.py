"""Faithfulness of the inline head by width and training seed, on the labels already on disk.

    .venv/bin/python bench/bench_head_width.py --demo bert-tiny --widths 64,32,16 --seeds 0,1,2
    .venv/bin/python bench/bench_head_width.py --demo minilm --epochs 5 --widths 64,32,16
    .venv/bin/python bench/bench_head_width.py --demo bert-tiny --widths 16 --seeds 0 \
        --train ";loop_steps=1000,loop_estimator=straight_through"
    .venv/bin/python bench/bench_head_width.py --demo bert-tiny --widths 16 --blocks 1,2 --seeds 0,1
    .venv/bin/python bench/bench_head_width.py --demo minilm --widths 32 --seeds 0,1 \
        --labels demo,/tmp/g4000/head.teacher-greedy_deletion.jsonl --loop-texts 3000

For each width and seed it trains a head exactly as the demo build does (`train_head`) on the
teacher labels cached beside the demo model (build it first: `limelight build-demo`), then
scores it on held-out test reviews (`--n` sampled with `--seed-data`, the sample of
`limelight eval --n N --seed S`): deletion and sufficiency AOPC with `[MASK]`, and deletion
with the top tokens removed. ``--train`` gives variants of the training (``TrainConfig`` fields,
``;`` between variants, the first — empty: the demo's — is the baseline). Each row's Δ is
paired against the first width and variant at the same seed.
Every unit of width is paid on every request, so the narrowest width that holds its
faithfulness is the one to serve (docs/distillation-lab.md, "Narrower heads"). ``--blocks 1,2``
also trains heads with a second context block stacked on the first (the served head has one),
to see whether depth helps. ``--labels`` trains on other label sets — a label cache that
`limelight distill` wrote, or ``A+B`` for the union of two — each against the first at the same
seed; ``--loop-texts`` gives variants with loop steps the demo build's unlabelled reviews.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from limelight.core.types import Encoded, FloatArray
from limelight.demo.build import DEMO_HEADS, ensure_demo_model
from limelight.distill.build import training_texts
from limelight.distill.train import TeacherExample, TrainConfig, train_head
from limelight.evaluation.data import load_examples
from limelight.evaluation.runner import EvalConfig, Evaluator
from limelight.models import explainer_head
from limelight.models.explainer_head import ExplainerHead, head_dir
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings


def cached_labels(model_dir: Path, teacher: str) -> list[TeacherExample]:
    """The demo head's training labels (the resumable cache the demo build wrote)."""
    path = head_dir(load_model(model_dir)).with_name(f"limelight_distilled.teacher-{teacher}.jsonl")
    if not path.exists():
        raise SystemExit(f"no cached labels at {path}: run `limelight build-demo` first")
    return read_labels(path)


def read_labels(path: Path) -> list[TeacherExample]:
    """The labels of a teacher's resumable cache (line 1 is its header)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    return [TeacherExample(r["text"], r["target"], r["scores"]) for r in rows]


def label_sets(spec: str, model_dir: Path, teacher: str) -> dict[str, list[TeacherExample]]:
    """``"demo,/x.jsonl,demo+/x.jsonl"`` → each set's labels by name: ``demo`` is the demo
    head's cache, a path a cache `limelight distill` wrote, ``A+B`` both sets (a text in both
    is trained on both labels)."""
    return {
        name: [
            example
            for part in name.split("+")
            for example in (
                cached_labels(model_dir, teacher) if part == "demo" else read_labels(Path(part))
            )
        ]
        for name in spec.split(",")
    }


@contextmanager
def context_blocks(n: int) -> Iterator[None]:
    """Heads built inside this block stack ``n`` context blocks (the served head has one)."""
    single = explainer_head._ContextBlock

    class Stacked(nn.Module):
        def __init__(self, width: int, heads: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([single(width, heads) for _ in range(n)])

        def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x, key_bias)
            return x

    explainer_head._ContextBlock = Stacked if n > 1 else single  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        explainer_head._ContextBlock = single  # type: ignore[misc]


def train_variants(spec: str) -> list[dict[str, Any]]:
    """``"a=1,b=0.5;c=x"`` → ``[{"a": 1, "b": 0.5}, {"c": "x"}]`` (``TrainConfig`` overrides)."""
    variants: list[dict[str, Any]] = []
    for variant in spec.split(";"):
        fields: dict[str, Any] = {}
        for pair in filter(None, variant.split(",")):
            name, value = pair.split("=")
            for kind in (int, float, str):
                try:
                    fields[name.strip()] = kind(value)
                    break
                except ValueError:
                    continue
        variants.append(fields)
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--demo", choices=sorted(DEMO_HEADS), default="bert-tiny")
    parser.add_argument("--widths", default="64,32,16")
    parser.add_argument("--blocks", default="1", help="context blocks to stack (1: as served)")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds")
    parser.add_argument("--epochs", type=int, help="default: the demo recipe's")
    parser.add_argument("--n", type=int, default=120, help="held-out test reviews")
    parser.add_argument("--seed-data", type=int, default=0, help="seed of the review sample")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--train", default="", help="training variants (see above)")
    parser.add_argument("--labels", default="demo", help="label sets (see above)")
    parser.add_argument(
        "--loop-texts",
        type=int,
        default=0,
        help="unlabelled training reviews for variants with loop steps (the demo build's)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    model = load_model(model_dir)
    demo = DEMO_HEADS[args.demo]
    sets = label_sets(args.labels, model_dir, demo.teacher)
    epochs = args.epochs or demo.train.epochs
    counts = ", ".join(f"{name}: {len(labels)}" for name, labels in sets.items())
    print(f"{args.demo}: labels ({counts}), {epochs} epochs, {args.n} test reviews")
    # The demo build's unlabelled loop reviews: the training split's after its labelled ones.
    texts, _ = training_texts("rotten_tomatoes", demo.n_texts + args.loop_texts, 100)
    loop_texts = texts[demo.n_texts :]
    print("| labels | width | blocks | training | seed | parameters | deletion | sufficiency | "
          "removed | Δ deletion | Δ sufficiency | Δ removed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    widths = [int(w) for w in args.widths.split(",")]
    scorer = HeldOut(model, args.n, args.seed_data)
    first: dict[int, list[np.ndarray]] = {}
    blocks = [int(b) for b in args.blocks.split(",")]
    grid = itertools.product(sets.items(), widths, blocks, train_variants(args.train))
    for (name, examples), width, depth, variant in grid:
        for seed in (int(s) for s in args.seeds.split(",")):
            heads = 4 if width >= 64 else 2
            fields: dict[str, Any] = {"epochs": epochs, **variant}
            fields.setdefault("attention_heads", heads)  # a variant may set it (0: none)
            config = TrainConfig(width=width, seed=seed, **fields)
            start = time.monotonic()
            with context_blocks(depth):
                head, _ = train_head(
                    model, examples, config, loop_texts=loop_texts if config.loop_steps else ()
                )
            per = scorer.score(head)
            base = first.setdefault(seed, per)  # each seed's first row: the baseline
            params = sum(p.numel() for p in head.parameters())
            trained = ", ".join(f"{k}={v}" for k, v in variant.items()) or "demo"
            labelled = "+".join(Path(part).name for part in name.split("+"))
            print(
                f"| {labelled} ({len(examples)}) | {width} | {depth} | {trained} | "
                f"{seed} | {params:,} | {scorer.cells(per, base)} |  "
                f"<!-- {time.monotonic() - start:.0f} s -->",
                flush=True,
            )


class HeldOut:
    """Held-out test reviews (the sample of `limelight eval --n N --seed S`) and a head's
    faithfulness on them, served as the sidecar serves it: deletion and sufficiency AOPC with
    ``[MASK]``, and deletion with the top tokens removed, per review."""

    def __init__(self, model: LoadedModel, n: int, seed: int) -> None:
        self.model = model
        self.data = load_examples("rotten_tomatoes", model.labels, n=n, seed=seed)
        self.masked = Evaluator(model, EvalConfig(replace="mask", game_fractions=()))
        self.removed = Evaluator(model, EvalConfig(replace="delete", game_fractions=()))
        self.encoded = self.masked.encode(self.data.examples)
        self.predicted = [int(p) for p in self.masked.predict(self.encoded).argmax(axis=1)]

    def score(self, head: ExplainerHead) -> list[np.ndarray]:
        """Per review: deletion, sufficiency, removed."""
        runtime = TorchRuntime(self.model, {"distilled": head})

        def explain(enc: Encoded, target: int) -> FloatArray:
            batch = InlineBatch.from_encoded([enc], self.model.pad_id)  # as the sidecar serves
            return np.asarray(runtime.run_inline(batch).extra["distilled"][0, :, target])

        return self.score_explainer(explain)

    def score_explainer(self, explain: Callable[[Encoded, int], FloatArray]) -> list[np.ndarray]:
        """Per review: deletion, sufficiency, removed of any explainer (text, class → scores)."""
        args = (self.data.examples, self.encoded, self.predicted)
        m = self.masked.evaluate_method("head", explain, *args)
        r = self.removed.evaluate_method("head", explain, *args)
        return [
            np.asarray(m.aopc_deletion_per_input),
            np.asarray(m.aopc_sufficiency_per_input),
            np.asarray(r.aopc_deletion_per_input),
        ]

    @staticmethod
    def cells(per: list[np.ndarray], base: list[np.ndarray]) -> str:
        """Table cells: the three means, then their paired differences from ``base`` (– for
        the baseline itself)."""
        means = [f"{v.mean():+.3f}" if i == 1 else f"{v.mean():.3f}" for i, v in enumerate(per)]
        deltas = ["–"] * 3
        if base is not per:
            deltas = [
                f"{d.mean():+.3f} ± {d.std(ddof=1) / np.sqrt(len(d)):.3f}"
                for d in (mine - theirs for mine, theirs in zip(per, base, strict=True))
            ]
        return " | ".join(means + deltas)


if __name__ == "__main__":
    main()

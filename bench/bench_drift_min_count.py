"""How many explanations of a label a drift comparison needs: the divergence of unchanged
traffic from its reference, by how many explanations of the label the window holds.

    .venv/bin/python bench/bench_drift_min_count.py --demo bert-tiny
    .venv/bin/python bench/bench_drift_min_count.py --demo minilm

The reference is the served default method's attributions of the Rotten Tomatoes validation
split (what ``limelight drift-reference build`` writes); each window is ``n`` explanations of one
label drawn at random from the held-out test split, ``--draws`` times per ``n``. Unchanged
traffic: every divergence is sampling noise, and what it reaches with few explanations is what
``drift_min_count`` keeps from raising alerts. docs/drift.md has the figures.
"""

from __future__ import annotations

import argparse
import random

import numpy as np

from limelight.core.service import served_inline_method
from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import rotten_tomatoes
from limelight.drift.build import explain_texts, profile_of
from limelight.drift.monitor import REFERENCE_CAPACITY_FACTOR
from limelight.drift.profile import MIN_BIN_SHARE, compare
from limelight.methods.base import MethodRegistry
from limelight.models.loaded import load_model
from limelight.progress import progress_bar
from limelight.runtimes.serving import torch_serving_runtime
from limelight.settings import Settings

SIZES = (25, 50, 75, 100, 150, 200, 300, 500)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", default="bert-tiny", choices=["bert-tiny", "minilm"])
    parser.add_argument("--draws", type=int, default=40, help="windows per size (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    settings = Settings(demo_model=args.demo)
    model = load_model(ensure_demo_model(args.demo, settings.cache_dir), "cpu")
    runtime = torch_serving_runtime(model, settings.cache_dir)
    method = served_inline_method(settings, runtime, MethodRegistry.load(settings))
    capacity = settings.drift_sketch_size
    texts = {split: [e.text for e in rotten_tomatoes(split)] for split in ("validation", "test")}
    with progress_bar(total=sum(map(len, texts.values())), desc="explaining", unit="text") as bar:
        reference_obs = explain_texts(model, texts["validation"], runtime=runtime, method=method,
                                      progress=bar)  # fmt: skip
        held_out = explain_texts(model, texts["test"], runtime=runtime, method=method, progress=bar)
    reference = profile_of(reference_obs, model.labels, capacity * REFERENCE_CAPACITY_FACTOR)
    rng = random.Random(args.seed)
    by_label = {label: [o for o in held_out if o.label == label] for label in model.labels}
    print(f"{args.demo}, {method.name}; reference {dict(reference.label_counts)}")
    threshold = settings.drift_alert_threshold
    print(
        "JSD of held-out windows of n explanations of a label: mean / 95th percentile over "
        f"{args.draws} draws (alert threshold {threshold})"
    )
    print("| n | " + " | ".join(model.labels) + " |")
    print("|---|" + "---|" * len(model.labels))
    for n in SIZES:
        cells = []
        for label in model.labels:
            pool = by_label[label]
            values = []
            for _ in range(args.draws):
                window = profile_of(rng.sample(pool, min(n, len(pool))), model.labels, capacity)
                cmp = compare(reference.sketches[label], window.sketches[label], MIN_BIN_SHARE)
                values.append(cmp.divergence)
            cells.append(f"{np.mean(values):.4f} / {np.percentile(values, 95):.4f}")
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

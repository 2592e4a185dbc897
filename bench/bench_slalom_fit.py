"""SLALOM fit settings: time against fidelity on held-out samples.

    .venv/bin/python bench/bench_slalom_fit.py [--model bert-tiny|minilm|DIR] [--n 12]

For each held-out Rotten Tomatoes review of 12-30 words (class 1 explained), the ``slalom`` job
method draws 2 x ``--samples`` samples, fits on the first half with each setting below and
reports the surrogate's mean squared error on the fitted half and on the other half, next to an
ordinary least-squares linear model on token counts fitted on the same half. Every setting sees
the same samples (same seed). Fit time = the job's time minus that of a 1-epoch run on the same
samples (which pays for the same model queries).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import rotten_tomatoes
from limelight.methods.base import JobContext
from limelight.methods.slalom import FIT_PRESETS, Slalom
from limelight.models.loaded import load_model
from limelight.settings import Settings

FULL = 100_000
SETTINGS: dict[str, dict[str, Any]] = {
    "paper: 60 epochs x 128, lr 0.005": FIT_PRESETS["paper"],
    "100 full-batch epochs, lr 0.05": {"epochs": 100, "lr": 0.05, "batch_size": FULL},
    "150 full-batch epochs, lr 0.05": {"epochs": 150, "lr": 0.05, "batch_size": FULL},
    "300 full-batch epochs, lr 0.05 (default)": FIT_PRESETS["converged"],
    "200 epochs x 128, lr 0.02": {"epochs": 200, "lr": 0.02, "batch_size": 128},
    "1000 full-batch epochs, lr 0.05": {"epochs": 1000, "lr": 0.05, "batch_size": FULL},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert-tiny", help="demo model name or directory")
    parser.add_argument("--n", type=int, default=12, help="reviews")
    parser.add_argument("--samples", type=int, default=500, help="fitted samples per review")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    directory = Path(args.model)
    if not directory.is_dir():
        directory = ensure_demo_model(args.model, Settings().cache_dir, progress=False)
    model = load_model(directory)
    ctx = JobContext(model=model, settings=Settings())
    reviews = [r for r in rotten_tomatoes("test") if 12 <= len(r.text.split()) <= 30][: args.n]
    method = Slalom()
    rows: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in SETTINGS}
    variances = []
    for i, review in enumerate(reviews):
        enc = model.encode(review.text)
        common = {"seed": i, "num_samples": 2 * args.samples, "holdout": 0.5}

        def run(extra: dict[str, Any], enc: Any = enc, common: dict[str, Any] = common) -> Any:
            start = time.perf_counter()
            out = method.run(ctx, enc, 1, method.validate_params({**common, **extra}))
            return time.perf_counter() - start, out.details

        base_s, _ = run({"epochs": 1})
        for name, fit in SETTINGS.items():
            seconds, d = run(fit)
            rows[name].append(
                (seconds - base_s, d["mse"], d["heldout_mse"], d["linear_heldout_mse"])
            )
            variances.append(d["heldout_mse"] / max(1e-12, 1.0 - d["heldout_r2"]))
    print(f"model {model.name}, {len(reviews)} reviews, {args.samples} fitted + {args.samples}")
    print(f"held-out samples each; held-out output variance {np.mean(variances):.2f}\n")
    print("| fit | fit time (s, mean) | train MSE | held-out MSE |")
    print("|---|---|---|---|")
    for name, values in rows.items():
        a = np.array(values)
        print(f"| {name} | {a[:, 0].mean():.2f} | {a[:, 1].mean():.2f} | {a[:, 2].mean():.2f} |")
    linear = np.array(next(iter(rows.values())))[:, 3].mean()
    print(f"| linear model on token counts (OLS) | – | – | {linear:.2f} |")


if __name__ == "__main__":
    main()

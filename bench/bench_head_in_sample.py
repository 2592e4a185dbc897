"""How far the inline head gets on the very reviews it is scored on: a training-set diagnostic.

    .venv/bin/python bench/bench_head_in_sample.py --demo minilm --loop-steps 800 \
        --checkpoints 100,200,400,600 --teacher greedy_deletion --params step=0.1,signed=true \
        --epochs 30,150,400 --threads 2

Held-out scores say how well a head generalises; this says what the head and its training can
reach at all. Starting from the demo head's first stage (its cached labels, as the demo build
trains it), it

- runs the classifier-in-the-loop stage on the scored test reviews themselves (the demo's loop
  recipe, ``--loop-reward`` and ``--points`` to vary it), scored at each checkpoint, and
- regresses fresh heads on ``--teacher``'s labels of those same reviews for ``--epochs``
  (labels cached in ``--out``),

and prints each head's deletion, sufficiency and removed AOPC with the paired difference from
the first stage. None of these figures is a quality claim: the heads have seen the reviews
(docs/distillation-lab.md, "What limits the MiniLM head").
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from bench_head_width import HeldOut, cached_labels

from limelight.demo.build import DEMO_HEADS, ensure_demo_model
from limelight.distill.train import (
    TrainConfig,
    _train_in_the_loop,
    _unlabelled_items,
    teacher_attributions,
    train_head,
)
from limelight.models.loaded import load_model
from limelight.settings import Settings


def parse_params(spec: str) -> dict[str, object]:
    """``"step=0.1,signed=true"`` → ``{"step": 0.1, "signed": True}``."""
    params: dict[str, object] = {}
    for pair in filter(None, spec.split(",")):
        name, value = pair.split("=")
        if value.lower() in ("true", "false"):
            params[name] = value.lower() == "true"
            continue
        try:
            params[name] = float(value) if "." in value else int(value)
        except ValueError:
            params[name] = value
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--demo", choices=sorted(DEMO_HEADS), default="minilm")
    parser.add_argument("--n", type=int, default=120, help="test reviews (seed 0)")
    parser.add_argument("--loop-steps", type=int, default=800, help="0: no loop diagnostic")
    parser.add_argument("--checkpoints", default="100,200,400,600")
    parser.add_argument("--loop-reward", help="default: the demo's")
    parser.add_argument(
        "--points", type=int, help="curve points per text and step (default: the demo's)"
    )
    parser.add_argument("--teacher", default="", help="a job method whose labels to regress on")
    parser.add_argument("--params", default="", help="the teacher's parameters, a=1,b=true")
    parser.add_argument("--epochs", default="30,150,400")
    parser.add_argument("--out", type=Path, default=Path("/tmp/limelight-in-sample"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    demo = DEMO_HEADS[args.demo]
    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    model = load_model(model_dir)
    scorer = HeldOut(model, args.n, 0)
    texts = [example.text for example in scorer.data.examples]
    stage1 = TrainConfig(
        width=demo.train.width,
        attention_heads=demo.train.attention_heads,
        epochs=demo.train.epochs,
        seed=0,
    )
    head, _ = train_head(model, cached_labels(model_dir, demo.teacher), stage1)
    base = scorer.score(head)
    print("| head | deletion | sufficiency | removed | Δ deletion | Δ sufficiency | Δ removed |")
    print("|---|---|---|---|---|---|---|")
    print(f"| the demo's first stage (held out) | {scorer.cells(base, base)} |", flush=True)

    if args.loop_steps:
        looped = replace(
            stage1,
            loop_steps=args.loop_steps,
            loop_reward=args.loop_reward or demo.train.loop_reward,
            loop_points=args.points or demo.train.loop_points,
            loop_samples=demo.train.loop_samples,
            loop_shift_weight=demo.train.loop_shift_weight,
            read_precision=demo.train.read_precision,
        )
        checkpoints = {int(c) for c in args.checkpoints.split(",") if c}
        items = _unlabelled_items(model, head, texts, looped)

        def progress(stage: str, step: int, total: int) -> None:
            if step in checkpoints or step == total:
                per = scorer.score(head)
                name = f"+ {step} loop steps on these reviews ({looped.loop_reward})"
                print(f"| {name} | {scorer.cells(per, base)} |", flush=True)

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            _train_in_the_loop(model, head, items, looped, np.random.default_rng(0), progress)

    if args.teacher:
        args.out.mkdir(parents=True, exist_ok=True)
        params = parse_params(args.params)
        cache = args.out / f"{args.demo}-{args.teacher}-{args.params or 'default'}.jsonl"
        labels = teacher_attributions(model, Settings(), args.teacher, params, texts, cache)
        for epochs in (int(e) for e in args.epochs.split(",")):
            config = replace(stage1, epochs=epochs)
            fitted, _ = train_head(model, labels, config)
            per = scorer.score(fitted)
            name = f"{args.teacher} ({args.params}) labels of these reviews, {epochs} epochs"
            print(f"| {name} | {scorer.cells(per, base)} |", flush=True)


if __name__ == "__main__":
    main()

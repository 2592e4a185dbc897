"""The zeroth-order classifier-in-the-loop stage on the BERT-tiny demo head.

    .venv/bin/python bench/bench_head_policy_loop.py --steps 2000 --temperature 0.25 --seeds 0,1

Trains the demo head's stage 1 on the cached labels exactly as the demo build does, then the
same followed by ``--steps`` of the loop stage (``TrainConfig.loop_estimator``: ``policy``,
token orders sampled from the head's scores and scored by the classifier's own deletion curve;
or ``straight_through``), and scores both on held-out test reviews, paired at the same seed
(docs/distillation.md, "What was tried").
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from bench_head_width import HeldOut, cached_labels

from limelight.demo.build import DEMO_HEADS, ensure_demo_model
from limelight.distill.train import TrainConfig, train_head
from limelight.models.loaded import load_model
from limelight.settings import Settings


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--estimator", default="policy", choices=["policy", "straight_through"])
    parser.add_argument("--temperature", type=float, default=0.25)
    parser.add_argument("--lr", type=float, help="default: the estimator's")
    parser.add_argument("--samples", type=int, default=4, help="sampled orders per text")
    parser.add_argument("--seeds", default="0,1", help="training seeds")
    parser.add_argument("--n", type=int, default=120, help="held-out test reviews")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = ensure_demo_model("bert-tiny", Settings().cache_dir)
    model = load_model(model_dir)
    demo = DEMO_HEADS["bert-tiny"]
    examples = cached_labels(model_dir, demo.teacher)
    scorer = HeldOut(model, args.n, 0)
    print("| training | seed | deletion | sufficiency | removed | Δ deletion | Δ sufficiency | "
          "Δ removed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        stage1 = TrainConfig(
            width=demo.width, attention_heads=demo.attention_heads, epochs=demo.epochs, seed=seed
        )
        head, _ = train_head(model, examples, stage1)
        base = scorer.score(head)
        print(f"| demo | {seed} | {scorer.cells(base, base)} |", flush=True)
        looped = replace(
            stage1,
            loop_steps=args.steps,
            loop_estimator=args.estimator,
            loop_temperature=args.temperature,
            loop_lr=args.lr,
            loop_samples=args.samples,
        )
        head, _ = train_head(model, examples, looped)
        per = scorer.score(head)
        name = f"+ {args.steps} {args.estimator} steps (τ {args.temperature})"
        print(f"| {name} | {seed} | {scorer.cells(per, base)} |", flush=True)


if __name__ == "__main__":
    main()

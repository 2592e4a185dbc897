"""The zeroth-order classifier-in-the-loop stage on a demo head.

    .venv/bin/python bench/bench_head_policy_loop.py --steps 2000 --temperature 0.25 --seeds 0,1
    .venv/bin/python bench/bench_head_policy_loop.py --demo minilm --steps 500 --loop-texts 4000

Trains the demo head's stage 1 on the cached labels exactly as the demo build does, then the
same followed by ``--steps`` of the loop stage (``TrainConfig.loop_estimator``: ``policy``,
token orders sampled from the head's scores and scored by the classifier's own deletion curve;
or ``straight_through``), and scores both on held-out test reviews, paired at the same seed
(docs/distillation.md, "What was tried"). The loop trains on the labelled texts and, with
``--loop-texts N``, on N more training reviews without labels (it reads the classifier only).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
import torch
from bench_head_width import HeldOut, cached_labels

from limelight.demo import datasets
from limelight.demo.build import DEMO_HEADS, ensure_demo_model
from limelight.distill.train import (
    TeacherExample,
    TrainConfig,
    _items,
    _train_in_the_loop,
    _unlabelled_items,
    train_head,
)
from limelight.models.explainer_head import ExplainerHead
from limelight.models.loaded import LoadedModel, load_model
from limelight.settings import Settings

VALIDATION = 100
"""The last training reviews, held out by the demo build to check its head: never trained on."""


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--demo", choices=sorted(DEMO_HEADS), default="bert-tiny")
    parser.add_argument("--loop-texts", type=int, default=0, help="unlabelled reviews for the loop")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--estimator", default="policy", choices=["policy", "straight_through"])
    parser.add_argument("--temperature", type=float, default=0.25)
    parser.add_argument("--lr", type=float, help="default: the estimator's")
    parser.add_argument("--samples", type=int, default=4, help="sampled orders per text")
    parser.add_argument("--reward", default="mask", help="mask, delete, keep, joined by +")
    parser.add_argument("--seeds", default="0,1", help="training seeds")
    parser.add_argument("--n", type=int, default=120, help="held-out test reviews")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--checkpoints", default="", help="also score the head after these steps (e.g. 100,200)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    model = load_model(model_dir)
    demo = DEMO_HEADS[args.demo]
    examples = cached_labels(model_dir, demo.teacher)
    labelled = {e.text for e in examples}
    reviews = [e.text for e in datasets.rotten_tomatoes("train")]
    unlabelled = [t for t in reviews[: len(reviews) - VALIDATION] if t not in labelled]
    loop_texts = unlabelled[: args.loop_texts]
    scorer = HeldOut(model, args.n, 0)
    print("| training | seed | deletion | sufficiency | removed | Δ deletion | Δ sufficiency | "
          "Δ removed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        run_seed(args, model, examples, loop_texts, scorer, seed)


def run_seed(
    args: argparse.Namespace,
    model: LoadedModel,
    examples: list[TeacherExample],
    loop_texts: list[str],
    scorer: HeldOut,
    seed: int,
) -> None:
    """One training seed: the demo's stage 1, then the loop stage on it (scored at the
    checkpoints and at the end), each row paired against stage 1 alone."""
    demo = DEMO_HEADS[args.demo]
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
        loop_reward=args.reward,
    )
    extra = f", + {len(loop_texts)} unlabelled texts" if loop_texts else ""
    checkpoints = {int(c) for c in args.checkpoints.split(",") if c}

    def report(step: int, head: ExplainerHead) -> None:
        per = scorer.score(head)
        name = f"+ {step} {args.estimator} steps (τ {args.temperature}, {args.reward}){extra}"
        print(f"| {name} | {seed} | {scorer.cells(per, base)} |", flush=True)

    if not checkpoints:
        report(args.steps, train_head(model, examples, looped, loop_texts=loop_texts)[0])
        return
    # The loop stage on this stage-1 head (another draw of batches than `train_head`'s),
    # scored between its steps.
    items = _items(model, head, examples, looped.label_scale)
    if loop_texts:
        items += _unlabelled_items(model, head, loop_texts, looped)

    def progress(stage: str, step: int, total: int) -> None:
        if step in checkpoints and step < total:
            report(step, head)

    _train_in_the_loop(model, head, items, looped, np.random.default_rng(seed), progress)
    head.eval()
    report(args.steps, head)


if __name__ == "__main__":
    main()

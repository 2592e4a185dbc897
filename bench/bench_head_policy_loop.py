"""The zeroth-order classifier-in-the-loop stage on a demo head.

    .venv/bin/python bench/bench_head_policy_loop.py --steps 2000 --temperature 0.25 --seeds 0,1
    .venv/bin/python bench/bench_head_policy_loop.py --demo minilm --steps 500 --loop-texts 4000

Trains the demo head's stage 1 on the cached labels exactly as the demo build does, then the
same followed by ``--steps`` of the loop stage (``TrainConfig.loop_estimator``: ``policy``,
token orders sampled from the head's scores and scored by the classifier's own deletion curve;
or ``straight_through``), and scores both on held-out test reviews, paired at the same seed
(docs/distillation-lab.md, "Training variants"). The loop trains on the labelled texts and, with
``--loop-texts N``, on N more training reviews without labels (it reads the classifier only).
``--average 0.99,0.998`` also scores moving averages of the loop's weights at every checkpoint,
paired with the last step's weights of the same run (``TrainConfig.loop_average``).
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

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
    _WeightAverage,
    predict_scores,
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
    parser.add_argument(
        "--reward", default="mask", help="mask, delete, keep, joined by +, weights in front"
    )
    parser.add_argument(
        "--points", type=int, default=5, help="curve points read per text and step (1-5)"
    )
    parser.add_argument(
        "--shift",
        type=float,
        default=0.0,
        help="loop_shift_weight (default 0: the loops measured before the option; the demo: 1)",
    )
    parser.add_argument(
        "--read-precision",
        default="float32",
        choices=["float32", "bfloat16"],
        help="precision of the loop's reward forwards (TrainConfig.read_precision)",
    )
    parser.add_argument(
        "--average",
        default="",
        help="weight-average decays (e.g. 0.99,0.995): with --checkpoints each is also scored "
        "at every checkpoint next to the last step's weights; without, the first is trained "
        "(TrainConfig.loop_average)",
    )
    parser.add_argument("--seeds", default="0,1", help="training seeds")
    parser.add_argument("--n", type=int, default=120, help="held-out test reviews")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--checkpoints", default="", help="also score the head after these steps (e.g. 100,200)"
    )
    parser.add_argument(
        "--against",
        nargs="*",
        type=Path,
        default=[],
        help="eval.json files of `limelight eval --n N` (seed 0, mask or delete): each head is "
        "also paired against their methods, review by review",
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
    references = [json.loads(path.read_text()) for path in args.against]
    drawn = [e.source_index for e in scorer.data.examples]
    for path, ref in zip(args.against, references, strict=True):
        # eval.json records which reviews it drew (since 2 December 2026): pair only the same
        if "inputs" in ref and [i["index"] for i in ref["inputs"]] != drawn:
            raise SystemExit(f"{path}: not the reviews of --n {args.n} --seed 0")
    print("| training | seed | deletion | sufficiency | removed | Δ deletion | Δ sufficiency | "
          "Δ removed | tokens < 0 | lower half |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        run_seed(args, model, examples, loop_texts, scorer, seed, references)


def run_seed(
    args: argparse.Namespace,
    model: LoadedModel,
    examples: list[TeacherExample],
    loop_texts: list[str],
    scorer: HeldOut,
    seed: int,
    references: list[dict[str, Any]],
) -> None:
    """One training seed: the demo's stage 1, then the loop stage on it (scored at the
    checkpoints and at the end), each row paired against stage 1 alone."""
    demo = DEMO_HEADS[args.demo]
    stage1 = TrainConfig(
        width=demo.train.width,
        attention_heads=demo.train.attention_heads,
        epochs=demo.train.epochs,
        seed=seed,
    )
    head, _ = train_head(model, examples, stage1)
    base = scorer.score(head)
    print(
        f"| demo | {seed} | {scorer.cells(base, base)} | {signs(model, scorer, head)} |", flush=True
    )
    if references:
        print(against(references, base), flush=True)
    looped = replace(
        stage1,
        loop_steps=args.steps,
        loop_estimator=args.estimator,
        loop_temperature=args.temperature,
        loop_lr=args.lr,
        loop_samples=args.samples,
        loop_reward=args.reward,
        loop_points=args.points,
        loop_shift_weight=args.shift,
        read_precision=args.read_precision,
    )
    extra = f", + {len(loop_texts)} unlabelled texts" if loop_texts else ""
    checkpoints = {int(c) for c in args.checkpoints.split(",") if c}

    decays = [float(d) for d in args.average.split(",") if d]

    def report(step: int, head: ExplainerHead, decay: float = 0.0) -> None:
        per = scorer.score(head)
        points = f", {args.points} of 5 points" if args.points < 5 else ""
        points += f", shift anchor {args.shift}" if args.shift else ""
        points += ", bfloat16 rewards" if args.read_precision == "bfloat16" else ""
        points += f", weights averaged ({decay})" if decay else ""
        name = (
            f"+ {step} {args.estimator} steps (τ {args.temperature}, {args.reward}{points}){extra}"
        )
        print(
            f"| {name} | {seed} | {scorer.cells(per, base)} | {signs(model, scorer, head)} |",
            flush=True,
        )
        if references:
            print(against(references, per), flush=True)

    if not checkpoints:
        decay = decays[0] if decays else 0.0
        looped = replace(looped, loop_average=decay)
        report(args.steps, train_head(model, examples, looped, loop_texts=loop_texts)[0], decay)
        return
    # The loop stage on this stage-1 head (another draw of batches than `train_head`'s),
    # scored between its steps.
    items = _items(model, head, examples, looped.label_scale)
    if loop_texts:
        items += _unlabelled_items(model, head, loop_texts, looped)

    # Weight averages kept beside the loop (the loop itself trains the last step's weights).
    averages = [(d, _WeightAverage(head, d)) for d in decays]
    averaged = copy.deepcopy(head)

    def progress(stage: str, step: int, total: int) -> None:
        for _, average in averages:
            average.update()
        if step in checkpoints or step == total:
            report(step, head)
            for decay, average in averages:
                averaged.load_state_dict(head.state_dict())
                averaged.load_state_dict(average.state, strict=False)
                report(step, averaged.eval(), decay)

    # Seeded like `train_head`'s loop, so that two runs of one seed draw the same orders.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _train_in_the_loop(model, head, items, looped, np.random.default_rng(seed), progress)


def signs(model: LoadedModel, scorer: HeldOut, head: ExplainerHead) -> str:
    """What the heat-maps show: the share of tokens scored against the explained class, and
    the mean of each text's lower half of scores over its largest magnitude."""
    negative, total, lower = 0, 0, []
    for enc, target in zip(scorer.encoded, scorer.predicted, strict=True):
        scores = predict_scores(model, head, enc)[~enc.special_mask, target]
        negative += int((scores < 0).sum())
        total += len(scores)
        half = np.sort(scores)[: len(scores) // 2]
        if len(half):
            lower.append(half.mean() / (np.abs(scores).max() + 1e-12))
    return f"{negative / total:.2f} | {np.mean(lower):+.2f}"


def against(references: list[dict[str, Any]], per: list[np.ndarray]) -> str:
    """Lines under a table row: the head less each method of ``references`` (eval.json
    dicts), paired per review — deletion and sufficiency against a mask run, deletion
    against a run with the tokens removed."""
    lines = []
    for ref in references:
        removed = ref["config"]["replace"] == "delete"
        for method in ref["methods"]:
            columns = [("removed", 2, "aopc_deletion")] if removed else [
                ("deletion", 0, "aopc_deletion"), ("sufficiency", 1, "aopc_sufficiency")
            ]  # fmt: skip
            cells = []
            for label, i, key in columns:
                theirs = np.asarray(method[f"{key}_per_input"])
                if len(theirs) != len(per[i]):
                    raise SystemExit(f"{ref['command']}: {len(theirs)} reviews, not {len(per[i])}")
                d = per[i] - theirs
                cells.append(f"{label} {d.mean():+.3f} ± {d.std(ddof=1) / np.sqrt(len(d)):.3f}")
            lines.append(f"    vs {method['name']}: " + ", ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    main()

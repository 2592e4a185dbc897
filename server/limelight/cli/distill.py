"""`limelight distill`: train the inline explainer head for any classifier."""

from __future__ import annotations

import argparse
import datetime
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from limelight.cli.common import (
    add_model_args,
    parse_params,
    real,
    settings_from_args,
    setup_logging,
    whole,
)
from limelight.errors import InvalidArgument

if TYPE_CHECKING:
    from limelight.distill.config import Mixture


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from limelight.distill.config import DEFAULT_TEACHER, LABEL_SCALES, TEACHERS, TrainConfig

    defaults = TrainConfig()
    p = subparsers.add_parser(
        "distill",
        help="train the one-pass inline explainer head for a model",
        description="Label texts with a teacher (resumable: labels are kept beside the head), "
        "train a small head on the inline forward pass's hidden states, optionally with the "
        "classifier in the loop on the faithfulness objective, validate it on held-out texts "
        "and save it beside the model. The server serves it by default (method `distilled`).",
    )
    add_model_args(p)
    p.add_argument(
        "--data",
        default="rotten_tomatoes",
        help="rotten_tomatoes or drugscom (training split), or a CSV, TSV or JSONL file with "
        "a 'text' column",
    )
    p.add_argument(
        "--teacher",
        default=DEFAULT_TEACHER,
        choices=list(TEACHERS),
        help=f"the job method whose attributions label the training texts (default: "
        f"{DEFAULT_TEACHER})",
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="teacher parameter (default for shapley: permutations=2)",
    )
    p.add_argument(
        "--mix",
        metavar="TEACHER:WEIGHT",
        help="mix a second teacher's labels in at this share, e.g. greedy_insertion:0.5 "
        "(buys sufficiency at a cost in deletion; labels are kept beside the first's)",
    )
    p.add_argument(
        "--mix-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="parameter of the --mix teacher",
    )
    p.add_argument("--n", type=whole(1), default=1000, help="training texts (default: 1000)")
    p.add_argument(
        "--validation",
        type=whole(0),
        default=100,
        help="held-out texts from the end of the data (0: none, and no validation report)",
    )
    p.add_argument(
        "--epochs",
        type=whole(1),
        default=defaults.epochs,
        help=f"epochs of the amortisation stage, regressing on the teacher's labels (default: "
        f"{defaults.epochs})",
    )
    p.add_argument(
        "--loop-steps",
        type=whole(0),
        default=defaults.loop_steps,
        help="steps with the classifier in the loop after the amortisation epochs",
    )
    p.add_argument(
        "--loop-estimator",
        choices=["policy", "straight_through"],
        default=defaults.loop_estimator,
        help="how the loop learns what masking the head's top tokens does: policy (sampled "
        "token orders scored by the classifier's deletion curve; default) or straight_through "
        "(the mask's derivative, measured worse; kept to reproduce earlier heads)",
    )
    p.add_argument(
        "--loop-reward",
        default=defaults.loop_reward,
        help="policy loop: the curves a token order is scored by, joined by + — mask "
        "(deletion with the mask token; default), delete (deletion with the tokens cut out), "
        "keep (sufficiency); a weight may precede a term, e.g. mask+0.25keep",
    )
    p.add_argument(
        "--loop-shift-weight",
        type=real(0.0),
        default=defaults.loop_shift_weight,
        help="policy loop: hold each text's mean score where the amortisation left it, with "
        f"this weight (default {defaults.loop_shift_weight:g}; the loop cannot see a shift and "
        "without it drifts the tokens it does not rank first below zero in the heat-maps)",
    )
    p.add_argument(
        "--loop-points",
        type=whole(1),
        default=defaults.loop_points,
        help="policy loop: curve points (of the five fractions 10-50 %%) each text reads per "
        "step, drawn at random; 5 (default) reads all, 1 makes a step five times cheaper",
    )
    p.add_argument(
        "--loop-samples",
        type=whole(1),
        default=defaults.loop_samples,
        help=f"policy loop: token orders sampled per text and step (default "
        f"{defaults.loop_samples}); each costs one forward pass per curve point and reward term",
    )
    p.add_argument(
        "--loop-average",
        type=real(0.0),
        default=defaults.loop_average,
        help="policy loop: keep an exponential moving average of the head's weights over the "
        "steps with this decay and leave it instead of the last step's weights (0: off, the "
        "default; the MiniLM demo head: 0.998, steadier and better than the last step's "
        "weights: docs/distillation.md)",
    )
    p.add_argument(
        "--read-precision",
        choices=["float32", "bfloat16"],
        default=defaults.read_precision,
        help="precision of the forward passes the build only reads (the teacher's labels, the "
        "loop's rewards): bfloat16 is about twice as fast on CPUs with bfloat16 instructions "
        "(elsewhere the build falls back to float32); the head itself is always float32",
    )
    p.add_argument(
        "--loop-texts",
        type=whole(0),
        default=0,
        help="policy loop: this many more texts of --data, after the --n labelled ones, "
        "without labels (the loop reads the classifier only)",
    )
    p.add_argument(
        "--width",
        type=whole(0),
        default=defaults.width,
        help=f"the head's width (default: {defaults.width}); every unit is paid on every "
        "request: MiniLM's demo head uses 32, which measured level with 64; 0 (with "
        "--attention-heads 0): a linear head, one product over the hidden states, the cheapest "
        "(BERT-tiny's demo head)",
    )
    p.add_argument(
        "--attention-heads",
        type=whole(0),
        default=defaults.attention_heads,
        help=f"attention heads of the head's context block (default: "
        f"{defaults.attention_heads}; must divide --width; 0: no context block, a per-token "
        "head reading context only through the classifier's hidden states, the cheapest)",
    )
    p.add_argument(
        "--label-scale",
        default=defaults.label_scale,
        choices=list(LABEL_SCALES),
        help="per-text scaling of the teacher's scores: rms keeps their signs (default), "
        "standard centres them",
    )
    p.add_argument("--seed", type=whole(0), default=0, help="the training seed (default: 0)")
    p.add_argument("--out", type=Path, help="head directory (default: beside the model)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from limelight.app import load_served_model
    from limelight.distill.build import HeadRecipe, build_head, report
    from limelight.distill.config import DEFAULT_TEACHER_PARAMS, TrainConfig
    from limelight.distill.train import LOOP_FRACTIONS, loop_reward_terms
    from limelight.models.explainer_head import head_dir

    if (args.width == 0 and args.attention_heads) or (
        args.attention_heads and args.width % args.attention_heads
    ):
        # Before the labels: they can take hours, the head is built after them.
        raise InvalidArgument(
            f"--width {args.width} must be a positive multiple of --attention-heads "
            f"{args.attention_heads} (or --attention-heads 0: no context block; or --width 0 "
            "with --attention-heads 0: a linear head)"
        )
    try:
        loop_reward_terms(args.loop_reward)
    except ValueError as exc:
        raise InvalidArgument(f"--loop-reward: {exc}") from None
    if not 1 <= args.loop_points <= len(LOOP_FRACTIONS):
        raise InvalidArgument(f"--loop-points {args.loop_points}: 1 to {len(LOOP_FRACTIONS)}")
    if args.loop_average >= 1.0:
        raise InvalidArgument(f"--loop-average {args.loop_average}: 0 (off) or a decay below 1")
    if args.loop_texts and (args.loop_estimator != "policy" or not args.loop_steps):
        raise InvalidArgument("--loop-texts trains the policy loop: give --loop-steps too")
    settings = settings_from_args(args)
    setup_logging("WARNING")
    if args.mix_param and not args.mix:
        raise InvalidArgument("--mix-param sets a parameter of the --mix teacher: give --mix too")
    mixture = parse_mixture(args.mix, args.mix_param) if args.mix else None
    model = load_served_model(settings)
    if args.loop_texts and model.is_multi_label:
        raise InvalidArgument("--loop-texts: only for single-label models")
    params = dict(DEFAULT_TEACHER_PARAMS.get(args.teacher, {}))
    params.update(parse_params(args.param))
    recipe = HeadRecipe(
        teacher=args.teacher,
        teacher_params=params,
        data=args.data,
        n_texts=args.n,
        validation_texts=args.validation,
        train=TrainConfig(
            epochs=args.epochs,
            loop_steps=args.loop_steps,
            loop_estimator=args.loop_estimator,
            loop_reward=args.loop_reward,
            loop_points=args.loop_points,
            loop_samples=args.loop_samples,
            loop_shift_weight=args.loop_shift_weight,
            loop_average=args.loop_average,
            read_precision=args.read_precision,
            width=args.width,
            attention_heads=args.attention_heads,
            label_scale=args.label_scale,
            seed=args.seed,
        ),
        mixture=mixture,
        loop_texts=args.loop_texts,
    )
    _, card, out = build_head(model, settings, recipe, args.out, progress=not args.no_progress)
    print(report(card))
    if card.train_texts < args.n:
        print(
            f"note: the data held {card.train_texts:,} training texts of the {args.n:,} asked "
            f"(--n), after {card.validation_texts:,} held out for validation"
        )
    print(f"saved to {out}")
    if out.resolve() == head_dir(model).resolve():
        print(f"served by default: limelight serve --model {model.directory}")
    else:  # the server loads the head from beside the model only
        for line in serve_hint(out, head_dir(model)):
            print(line)
    return 0


def serve_hint(out: Path, dest: Path, now: datetime.datetime | None = None) -> list[str]:
    """How to serve a head written to ``out`` instead of beside the model (``dest``).

    ``mv OUT DEST`` alone would move the new head *into* a head already at ``dest``, which
    stays served; that one is moved aside first, under a name no head has, and kept."""
    quote = shlex.quote
    move = f"mv {quote(str(out))} {quote(str(dest))}"
    if not dest.exists():
        lines = ["to serve it, move it beside the model:", f"  {move}"]
    else:
        stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
        aside = dest.with_name(f"{dest.name}.replaced-{stamp}")
        lines = [
            f"to serve it instead of the head beside the model (kept as {aside.name}):",
            f"  mv {quote(str(dest))} {quote(str(aside))} && {move}",
        ]
    lines.append(
        "a running sidecar serves it at its next look (LIMELIGHT_RELOAD_INTERVAL_S) or on SIGHUP; "
        "start one with limelight serve --model "
        f"{quote(str(dest.parent))} (--demo builds the demo's own head back)"
    )
    return lines


def parse_mixture(spec: str, params: list[str]) -> Mixture:
    """``TEACHER:WEIGHT`` (and ``KEY=VALUE`` parameters) -> a :class:`Mixture`."""
    from limelight.distill.config import DEFAULT_TEACHER_PARAMS, TEACHERS, Mixture

    teacher, sep, raw = spec.rpartition(":")
    try:
        weight = float(raw) if sep else float("nan")
    except ValueError:
        weight = float("nan")
    if teacher not in TEACHERS or not 0.0 < weight < 1.0:
        raise InvalidArgument(
            f"--mix expects TEACHER:WEIGHT with a teacher of {', '.join(TEACHERS)} and a weight "
            f"strictly between 0 and 1, got {spec!r}"
        )
    chosen = dict(DEFAULT_TEACHER_PARAMS.get(teacher, {}))
    chosen.update(parse_params(params))
    return Mixture(teacher, chosen, weight)

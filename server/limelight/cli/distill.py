"""`limelight distill`: train the distilled inline explainer from a job method's attributions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from limelight.cli.common import add_model_args, settings_from_args, setup_logging


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "distill",
        help="distil an expensive method into a one-pass inline explainer",
        description="Compute teacher attributions (resumable), train a small head on the "
        "inline forward pass's features, validate it on held-out texts and save it beside the "
        "model; then `limelight serve --default-method distilled` serves it.",
    )
    add_model_args(p)
    p.add_argument(
        "--data",
        default="rotten_tomatoes",
        help="rotten_tomatoes (train split), drugscom, or a CSV/JSONL/text file",
    )
    p.add_argument(
        "--teacher",
        default="integrated_gradients",
        choices=["slalom", "integrated_gradients", "lrp", "grad_x_input"],
    )
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--n", type=int, default=400, help="texts to distil from")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="head directory (default: beside the model)")
    p.set_defaults(func=run)


def _texts(data: str, n: int) -> list[str]:
    from limelight.demo import datasets

    if data == "rotten_tomatoes":
        examples = datasets.rotten_tomatoes("train")
    elif data == "drugscom":
        examples = datasets.drugscom("train")
    else:
        examples = datasets.read_labelled(Path(data))
    return [e.text for e in examples[:n]]


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from limelight.app import load_served_model
    from limelight.cli.explain import _params
    from limelight.distill.head import head_dir, save_head
    from limelight.distill.train import distill

    settings = settings_from_args(args)
    setup_logging("WARNING")
    model = load_served_model(settings)
    texts = _texts(args.data, args.n)
    out = args.out or head_dir(model)
    cache = out.with_name(out.name + f".teacher-{args.teacher}.jsonl")
    with tqdm(total=len(texts), desc=f"teacher {args.teacher}", unit="text") as bar:

        def advance(n: int) -> None:
            bar.update(n)

        head, card = distill(
            model,
            settings,
            texts,
            args.teacher,
            _params(args.param),
            cache,
            seed=args.seed,
            width=args.width,
            epochs=args.epochs,
            progress=advance,
            data_name=f"{args.data} (first {len(texts)})",
        )
    save_head(head, card, out)
    print(json.dumps(card.validation, indent=2))
    print(
        f"saved the distilled head ({card.parameters} parameters) to {out}\n"
        f"held-out Spearman vs {args.teacher}: {card.validation['spearman_vs_teacher']:.3f}\n"
        f"serve it: limelight serve --model {model.directory} --default-method distilled"
    )
    return 0

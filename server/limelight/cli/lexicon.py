"""`limelight lexicon`: build the classifier's lexicon table beside the model."""

from __future__ import annotations

import argparse
import time

from limelight.cli.common import add_model_args, settings_from_args, setup_logging


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "lexicon",
        help="build the lexicon table served inline by models without a distilled head",
        description="Run the classifier once over its whole vocabulary (each token alone, "
        "against the empty text) and save the change in every class's log-odds beside the "
        "model. The server then looks every request's tokens up in it: the inline method "
        "`lexicon_lookup`, which `auto` serves when no distilled head lies beside the model "
        "(a distilled head reads context and ranks better; see `limelight distill`).",
    )
    add_model_args(p)
    p.add_argument(
        "--batch-size", type=int, default=512, help="vocabulary entries per forward (default 512)"
    )
    p.add_argument("--force", action="store_true", help="rebuild even when the table is current")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from limelight.app import load_served_model
    from limelight.errors import InvalidArgument
    from limelight.methods.base import JobContext
    from limelight.methods.lexicon import build_table, vocabulary_size
    from limelight.models.explainer_head import inline_heads
    from limelight.models.lexicon_table import (
        LexiconCard,
        lexicon_dir,
        lexicon_unavailable_reason,
        save_lexicon,
    )

    if args.batch_size < 1:
        raise InvalidArgument("--batch-size must be at least 1")
    settings = settings_from_args(args)
    setup_logging(settings.log_level)
    model = load_served_model(settings)
    out = lexicon_dir(model)
    if not args.force and not lexicon_unavailable_reason(model):
        print(f"{out} is current for model version {model.version} (--force rebuilds it)")
        return 0
    began = time.perf_counter()
    size = vocabulary_size(model)
    with tqdm(total=size, desc="lexicon", unit="token", disable=args.no_progress) as bar:

        def report(fraction: float, message: str) -> None:
            bar.update(round(fraction * size) - bar.n)

        context = JobContext(model=model, settings=settings, report=report)
        table = build_table(context, args.batch_size)
        bar.update(size - bar.n)
    matrix = table.matrix(model.is_multi_label, list(model.tokenizer.all_special_ids))
    seconds = time.perf_counter() - began
    card = LexiconCard(
        model_version=model.version,
        vocabulary=int(matrix.shape[0]),
        num_labels=int(matrix.shape[1]),
        reference=table.reference,
        seconds=round(seconds, 1),
    )
    save_lexicon(matrix, card, out)
    print(
        f"wrote {out}: {card.vocabulary:,} entries x {card.num_labels} classes in {seconds:.1f} s "
        f"(reference: the {card.reference})"
    )
    if inline_heads(model):
        print("a distilled head lies beside the model: `auto` still serves it (it reads context)")
    else:
        print("`auto` now serves `lexicon_lookup` on this model (restart a running server)")
    return 0

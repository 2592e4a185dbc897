"""`limelight lexicon`: build the classifier's lexicon table beside the model."""

from __future__ import annotations

import argparse

from limelight.cli.common import add_model_args, settings_from_args, setup_logging, whole


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "lexicon",
        help="build the lexicon table served inline by models without a distilled head",
        description="Run the classifier once over its whole vocabulary (each token alone, "
        "against the empty text) and save the change in every class's log-odds beside the "
        "model. The server then looks every request's tokens up in it: the inline method "
        "`lexicon_lookup`, which `auto` serves when no distilled head lies beside the model "
        "(a distilled head reads context and ranks better; see `limelight distill`). Where the "
        "model's directory is read-only the table goes to the cache directory, where the "
        "sidecar looks too (it can also build it at start-up: LIMELIGHT_LEXICON_BUILD).",
    )
    add_model_args(p)
    p.add_argument(
        "--batch-size",
        type=whole(1),
        default=512,
        help="vocabulary entries per forward (default 512)",
    )
    p.add_argument("--force", action="store_true", help="rebuild even when the table is current")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from limelight.app import load_served_model
    from limelight.methods.base import JobContext
    from limelight.methods.lexicon import vocabulary_size, write_lexicon
    from limelight.models.explainer_head import inline_heads
    from limelight.models.lexicon_table import find_lexicon_dir, lexicon_output_dir
    from limelight.progress import progress_bar

    settings = settings_from_args(args)
    setup_logging(settings.log_level)
    model = load_served_model(settings)
    found = find_lexicon_dir(model, settings.cache_dir)
    if not args.force and found is not None:
        print(f"{found} is current for model version {model.version} (--force rebuilds it)")
        return 0
    out = lexicon_output_dir(model, settings.cache_dir)
    size = vocabulary_size(model)
    with progress_bar(
        total=size, desc="lexicon", unit="token", enabled=not args.no_progress
    ) as bar:

        def report(fraction: float, message: str) -> None:
            bar.update(round(fraction * size) - bar.n)

        card = write_lexicon(
            JobContext(model=model, settings=settings, report=report), out, args.batch_size
        )
        bar.update(size - bar.n)
    print(
        f"wrote {out}: {card.vocabulary:,} entries x {card.num_labels} classes in "
        f"{card.seconds:.1f} s (reference: the {card.reference})"
    )
    if out != model.directory / out.name:
        print(
            "(the model's directory is read-only: the table went to the cache directory, where "
            "a sidecar with the same LIMELIGHT_CACHE_DIR finds it)"
        )
    if inline_heads(model):
        print("a distilled head lies beside the model: `auto` still serves it (it reads context)")
    else:
        print(
            "`auto` now serves `lexicon_lookup` on this model (a running sidecar takes it up "
            "within its reload interval, or at once on SIGHUP; no restart)"
        )
    return 0

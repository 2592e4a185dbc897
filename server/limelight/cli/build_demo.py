"""`limelight build-demo`: build (or find) the cached demo classifiers."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import cast

from limelight.cli.common import whole


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``build-demo`` subcommand."""
    p = subparsers.add_parser(
        "build-demo",
        help="build the demo classifiers from packaged data (cached)",
        description="Fine-tune the demo classifiers on the packaged Rotten Tomatoes reviews and "
        "cache them. A model is rebuilt only when its recipe changes (or with --force). "
        "Prints where each model is and its held-out accuracy.",
    )
    p.add_argument(
        "--model",
        choices=["minilm", "bert-tiny", "bert-tiny-multilabel", "all"],
        default="all",
        help="which demo model to build (default: all)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        help="cache directory (default: $LIMELIGHT_CACHE_DIR or ~/.cache/limelight)",
    )
    p.add_argument("--force", action="store_true", help="rebuild even when cached")
    p.add_argument(
        "--threads", type=whole(1), help="torch threads for training (default: the idle cores)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the requested demo models; exit 1 when one fails its accuracy gate."""
    from limelight.demo.build import DemoCard, ensure_demo_model
    from limelight.demo.recipes import DEMO_NAMES, DemoBuildError, DemoName, demo_model_dir
    from limelight.errors import LimelightError
    from limelight.settings import Settings

    settings = Settings(**({"cache_dir": args.cache_dir} if args.cache_dir else {}))
    threads = args.threads or (settings.torch_threads or None)
    names = list(DEMO_NAMES) if args.model == "all" else [cast("DemoName", args.model)]
    status = 0
    for name in names:
        started = time.perf_counter()
        try:
            cached = not args.force and demo_model_dir(name, settings.cache_dir).is_dir()
            directory = ensure_demo_model(
                name,
                settings.cache_dir,
                progress=not args.quiet,
                force=args.force,
                threads=threads,
            )
        except DemoBuildError as exc:
            print(f"{name}: FAILED: {exc}", file=sys.stderr)
            status = 1
            continue
        except LimelightError as exc:
            print(f"{name}: error: {exc}", file=sys.stderr)
            return 2
        elapsed = time.perf_counter() - started
        card = DemoCard.read(directory)
        print(f"{name}: {directory}")
        print(
            f"  test accuracy {card.accuracy:.4f} ({card.n_test} held-out reviews), "
            f"validation {card.validation_accuracy:.4f}"
            + (" (exact match: every label right)" if card.metrics else "")
        )
        if card.metrics:
            per_label = ", ".join(f"{k} {v:.3f}" for k, v in card.metrics["per_label_f1"].items())
            print(
                f"  micro-F1 {card.metrics['micro_f1']:.4f}, macro-F1 "
                f"{card.metrics['macro_f1']:.4f} on {card.metrics['split']} ({per_label})"
            )
        print(
            f"  built {card.built_at} in {card.build_seconds:.0f} s"
            + (f" ({card.cpu_seconds:.0f} CPU-s)" if card.cpu_seconds else "")
            + f" on {card.threads} thread(s)"
            + (" (cached)" if cached else f"; this run took {elapsed:.0f} s")
        )
    return status

"""`limelight eval-pool`: several `limelight eval` runs of one model and dataset as one
report, every input counted once (docs/evaluation.md, "Pooling runs")."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "eval-pool",
        help="pool several `limelight eval` runs (other seeds, same model and data) into one "
        "report of deletion and sufficiency AOPC with paired differences",
    )
    p.add_argument(
        "runs",
        nargs="+",
        type=Path,
        metavar="RUN",
        help="an --out folder of `limelight eval` (or its eval.json)",
    )
    p.add_argument(
        "--reference",
        help="the method paired against every other one (default: the first run's first method)",
    )
    p.add_argument("--out", type=Path, help="also write pooled.md and pooled.json into this folder")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from limelight.evaluation.pool import pool, read_run, write

    report = pool([read_run(path) for path in args.runs], reference=args.reference)
    print(report.markdown(), end="")
    if args.out is not None:
        paths = write(report, args.out)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0

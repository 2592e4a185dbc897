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
    from limelight.errors import InvalidArgument
    from limelight.evaluation.pool import eval_json, pool, read_run, write

    seen: dict[Path, Path] = {}
    for path in args.runs:
        first = seen.setdefault(eval_json(path).resolve(), path)
        if first is not path:  # pooling a run with itself would count it twice as agreement
            raise InvalidArgument(f"{path} and {first} are the same run: give each run once")
    report = pool([read_run(path) for path in args.runs], reference=args.reference)
    print(report.markdown(), end="")
    if args.out is not None:
        paths = write(report, args.out)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0

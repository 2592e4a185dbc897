"""`limelight calibrate-heads`: find the positional and syntactic heads for head-masked LRP."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from limelight.cli.common import real, whole
from limelight.errors import InvalidArgument
from limelight.models.head_mask import MASK_FILENAME


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "calibrate-heads",
        help="find important attention heads and write the LRP head mask",
        description="Run the classifier over a dataset, mark positional heads (one relative "
        "offset dominates the most-attended key) and syntactic heads (the dependent of an "
        "nsubj/obj/amod/advmod arc attends most to its head word, by spaCy), print a layer x "
        "head map and write the mask file the lrp method reads.",
    )
    p.add_argument(
        "--model", dest="model_dir", type=Path, required=True, help="classifier directory"
    )
    p.add_argument(
        "--data",
        type=Path,
        help="CSV/TSV/JSONL with a 'text' field, or a plain text file with one text per line "
        "(default: the Rotten Tomatoes training reviews)",
    )
    p.add_argument("--text-field", default="text", help="text column/field of --data")
    p.add_argument(
        "--n", type=whole(0), default=500, help="texts to use (random sample; default 500; 0: all)"
    )
    p.add_argument("--seed", type=whole(0), default=0, help="sampling seed")
    p.add_argument("--max-tokens", type=whole(4), default=128, help="tokens per text (default 128)")
    p.add_argument(
        "--positional-threshold",
        type=real(0.0, 1.0),
        default=0.8,
        help="share of positions one offset must exceed for a positional head (default 0.8)",
    )
    p.add_argument(
        "--syntactic-threshold",
        type=real(0.0, 1.0),
        default=0.5,
        help="accuracy on one relation a syntactic head must exceed (default 0.5)",
    )
    p.add_argument(
        "--min-relation-count",
        type=whole(1),
        default=10,
        help="arcs of a relation needed before it can mark a head syntactic (default 10)",
    )
    p.add_argument(
        "--no-syntax", action="store_true", help="positional heads only (no spaCy needed)"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--out", type=Path, help=f"mask file (default: <model dir>/{MASK_FILENAME})")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def read_texts(path: Path | None, text_field: str = "text") -> tuple[list[str], str]:
    """Texts for calibration and a description of where they came from."""
    if path is None:
        from limelight.demo.datasets import rotten_tomatoes

        return [e.text for e in rotten_tomatoes("train")], "rotten_tomatoes:train"
    from limelight.demo.datasets import read_labelled, read_text_lines

    if path.suffix.lower() in (".csv", ".tsv", ".jsonl", ".json", ".ndjson"):
        texts = [e.text for e in read_labelled(path, text_field=text_field)]
    else:
        texts = read_text_lines(path)  # a line that is not UTF-8 is named, with its number
    if not texts:
        raise InvalidArgument(f"{path}: no text in it")
    return texts, str(path)


def run(args: argparse.Namespace) -> int:
    from limelight.models.head_calibration import (
        calibrate,
        load_parser,
        mask_document,
        write_mask,
    )
    from limelight.models.loaded import load_model
    from limelight.progress import progress_bar

    # Mistakes (no model, unreadable data) end in `limelight.cli.main`, one line like every
    # other command's.
    model = load_model(args.model_dir, device=args.device)
    texts, source = read_texts(args.data, args.text_field)
    if args.n and len(texts) > args.n:
        texts = random.Random(args.seed).sample(texts, args.n)
    parser = None if args.no_syntax else load_parser()

    def bar(items: list[str]) -> object:
        return progress_bar(items, desc="calibrating heads", unit="text", enabled=not args.quiet)

    cal = calibrate(
        model,
        texts,
        positional_threshold=args.positional_threshold,
        syntactic_threshold=args.syntactic_threshold,
        min_relation_count=args.min_relation_count,
        max_tokens=args.max_tokens,
        parser=parser,
        progress=bar,  # type: ignore[arg-type]
    )
    out = args.out or Path(model.directory) / MASK_FILENAME
    write_mask(mask_document(cal, model, source), out)
    important = cal.important()
    kept = sum(len(v) for v in important.values())
    total = model.num_layers * model.num_heads
    print(cal.head_map())
    print(f"{kept} of {total} heads important over {cal.texts} texts; mask written to {out}")
    return 0

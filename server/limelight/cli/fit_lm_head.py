"""`limelight fit-lm-head`: give a classifier without a masked-LM head one, for Decoded Grad-CAM.

Fits a BERT-style decoder head (dense + GELU + LayerNorm + output projection tied to the
frozen input embeddings + bias) on the frozen encoder with the masked-LM objective (15% of the
positions; 80/10/10 mask/random/keep), saves it to ``<model dir>/limelight_lm_head/`` bound to
the model's fingerprint, and prints how well it decodes every layer back to the input tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from limelight.cli.common import real, whole
from limelight.errors import InvalidArgument


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "fit-lm-head",
        help="fit a masked-LM decoder head on a frozen encoder (for decoded_gradcam)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        dest="model_dir",
        type=Path,
        help="classifier directory (default: the demo model from --demo / LIMELIGHT_DEMO_MODEL)",
    )
    parser.add_argument(
        "--demo",
        dest="demo_model",
        choices=["minilm", "bert-tiny"],
        help="the demo model to fit a head for when --model is not given",
    )
    parser.add_argument("--cache-dir", type=Path, help="cache of built demo models")
    parser.add_argument(
        "--data",
        type=Path,
        help="unlabelled text: .txt (one text per line), .csv/.tsv or .jsonl with a text "
        "field (default: the Rotten Tomatoes training reviews)",
    )
    parser.add_argument("--text-field", default="text", help="text column of CSV/JSONL data")
    parser.add_argument("--steps", type=whole(1), help="optimisation steps (overrides --epochs)")
    parser.add_argument(
        "--epochs", type=real(0.0, above=True), help="passes over the data (default: 600 steps)"
    )
    parser.add_argument(
        "--batch-size", type=whole(1), default=32, help="texts per step (default: 32)"
    )
    parser.add_argument(
        "--lr", type=real(0.0, above=True), default=1e-2, help="peak learning rate (AdamW)"
    )
    parser.add_argument("--max-length", type=whole(8), default=128, help="tokens per text")
    parser.add_argument("--eval-texts", type=whole(1), default=300, help="held-out texts to score")
    parser.add_argument(
        "--seed", type=whole(0), default=0, help="data order and masking (default: 0)"
    )
    parser.add_argument(
        "--encoder-precision",
        choices=["float32", "bfloat16"],
        default="float32",
        help="precision of the frozen encoder's reads while fitting: bfloat16 is faster on "
        "CPUs with bfloat16 instructions (float32 elsewhere); the head is float32 either way",
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    parser.add_argument(
        "--out",
        "--output",  # its first name, kept; --out as every other command writes
        dest="output",
        type=Path,
        help="the head's folder (default: <model dir>/limelight_lm_head)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def read_texts(path: Path, text_field: str = "text") -> list[str]:
    """Texts from a .txt file (one per line) or a CSV/TSV/JSONL file's ``text_field``."""
    from limelight.demo.datasets import read_labelled, read_text_lines

    if not path.is_file():
        raise InvalidArgument(f"{path} does not exist or is not a file")
    if path.suffix.lower() in (".txt", ".text", ""):
        texts = read_text_lines(path)
    else:
        texts = [ex.text for ex in read_labelled(path, text_field=text_field)]
    if not texts:  # the fit would fail far from here, on an empty batch
        raise InvalidArgument(f"{path}: no text in it")
    return texts


def _default_texts() -> list[str]:
    from limelight.demo.datasets import rotten_tomatoes

    return [ex.text for ex in rotten_tomatoes("train")]


def _resolve_model_dir(args: argparse.Namespace) -> Path:
    if args.model_dir is not None:
        return Path(args.model_dir)
    from limelight.demo.build import ensure_demo_model
    from limelight.settings import Settings

    values = {
        k: v
        for k, v in (("demo_model", args.demo_model), ("cache_dir", args.cache_dir))
        if v is not None
    }
    settings = Settings(**values)
    return ensure_demo_model(settings.demo_model, settings.cache_dir)


def run(args: argparse.Namespace) -> int:
    from limelight.models.lm_head import (
        FitConfig,
        fit_and_save_lm_head,
        fit_progress,
        fitted_head_dir,
        format_decode_table,
    )
    from limelight.models.loaded import load_model
    from limelight.progress import progress_bar

    model_dir = _resolve_model_dir(args)
    model = load_model(model_dir, device=args.device or "cpu")
    texts = read_texts(args.data, args.text_field) if args.data else _default_texts()
    source = str(args.data) if args.data else "rotten_tomatoes:train"
    config = FitConfig(
        steps=args.steps if args.steps is not None else FitConfig.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        max_length=args.max_length,
        seed=args.seed,
        encoder_precision=args.encoder_precision,
    )
    bar = progress_bar(desc="fit-lm-head", unit="step", enabled=not args.no_progress)
    progress = fit_progress(bar)
    try:
        fitted = fit_and_save_lm_head(
            model,
            texts,
            source,
            config,
            epochs=args.epochs if args.steps is None else None,
            eval_texts=args.eval_texts,
            output=args.output,
            progress=progress,
        )
    finally:
        bar.close()
    result = fitted.result
    print(
        f"saved the LM head to {fitted.directory} (model {model.name}, fingerprint {model.version})"
    )
    print(
        f"{fitted.steps} steps in {fitted.seconds:.0f} s; final loss "
        f"{fitted.meta.extra['final_loss']:.3f}; masked-token top-1 on {fitted.eval_texts} "
        f"held-out texts: {result.masked_top1:.3f}"
    )
    print("decoding each layer's hidden states of unmasked held-out text back to its tokens:")
    print(format_decode_table(result.decode))
    if args.output is not None and Path(args.output) != fitted_head_dir(model.directory):
        print(
            "note: Limelight only finds the head at <model dir>/limelight_lm_head; "
            "move it there to use it",
            file=sys.stderr,
        )
    sys.stdout.flush()
    return 0

"""`limelight eval`: faithfulness of attribution methods on a labelled dataset (docs/evaluation.md).

Writes ``eval.md`` (table), ``eval.json`` (every number, every curve) and ``eval.png`` (curves
per method) into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from limelight.cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    add_model_args,
    fail,
    listed,
    real,
    settings_from_args,
    whole,
)
from limelight.errors import InvalidArgument

if TYPE_CHECKING:
    from limelight.methods.base import MethodRegistry

#: The served default first (the inline head; skipped, with the reason, where the model has
#: none), then NormXLogit, the job methods and the random baseline.
DEFAULT_METHODS = (
    "distilled,normxlogit,decoded_gradcam,lrp,slalom,grad_x_input,integrated_gradients,random"
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "eval",
        help="measure explanation faithfulness (AOPC, hiding/revealing games, overlap, evidence)",
    )
    add_model_args(p)
    p.add_argument(
        "--data",
        help="rotten_tomatoes, drugscom, or a CSV/TSV/JSONL file (default: the demo model's own "
        "data: drugscom for bert-tiny-multilabel, else rotten_tomatoes)",
    )
    p.add_argument("--split", default="test", help="split of a built-in dataset (default: test)")
    p.add_argument("--text-field", default="text", help="a file's text column (default: text)")
    p.add_argument(
        "--label-field", default="label", help="a file's gold label column (default: label)"
    )
    p.add_argument(
        "--evidence-field",
        default="evidence",
        help="a JSONL file's human rationale field, for the overlap metrics (default: evidence; "
        "optional)",
    )
    p.add_argument(
        "--label-map",
        default="",
        help="dataset label -> model label, e.g. negative=rotten,positive=fresh,neutral=none",
    )
    p.add_argument(
        "--methods",
        help=f"comma-separated methods; peers: lime, shap (default: {DEFAULT_METHODS}). The "
        "exit status is 1 when one of them failed, or one named here was skipped",
    )
    p.add_argument("--n", type=whole(0), default=50, help="examples sampled (default: 50; 0 = all)")
    p.add_argument("--seed", type=whole(0), default=0, help="sampling and random-baseline seed")
    p.add_argument(
        "--replace",
        choices=["mask", "delete"],
        default="mask",
        help="perturbation: replace with the mask token or delete (default: mask)",
    )
    p.add_argument(
        "--fractions",
        type=listed(real(0.0, 1.0, above=True)),
        default="0.1,0.2,0.3,0.4,0.5",
        help="token fractions of the AOPC curves, each above 0 and at most 1",
    )
    p.add_argument(
        "--game-steps", type=whole(1), default=10, help="points of the games' curves beyond 0"
    )
    p.add_argument(
        "--overlap-k",
        type=listed(whole(1)),
        default="5,10,20,50",
        help="top-k sizes for token overlap",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="truncate inputs to this length")
    p.add_argument("--batch-size", type=whole(1), default=64, help="perturbed inputs per forward")
    p.add_argument(
        "--params",
        nargs="*",
        default=[],
        metavar="METHOD.KEY=VALUE",
        help="method parameters, e.g. integrated_gradients.steps=16 slalom.num_samples=500",
    )
    p.add_argument(
        "--peer-budget", type=whole(1), default=200, help="model calls per LIME/SHAP input"
    )
    p.add_argument(
        "--lm-head", dest="lm_head_dir", type=Path, help="masked-LM checkpoint for decoded_gradcam"
    )
    p.add_argument("--out", type=Path, default=Path("eval-results"), help="output folder")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="recompute every attribution: by default the expensive ones (LIME, SHAP and the "
        "job methods) are kept in OUT/attributions/ as they are computed, and a later run with "
        "the same --out reads back those of the same method, parameters, model and text "
        "(an interrupted run resumes; a retrained head is compared without recomputing them)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def parse_params(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["m.k=v", ...]`` -> ``{m: {k: v}}``; values parsed as JSON when they parse."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        method, dot, name = key.partition(".")
        if not sep or not dot or not method or not name:
            raise InvalidArgument(f"--params expects METHOD.KEY=VALUE, got {item!r}")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(method, {})[name] = value
    return out


def parse_label_map(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        src, sep, dst = part.partition("=")
        if not sep:
            raise InvalidArgument(f"--label-map expects NAME=MODEL_LABEL, got {part!r}")
        out[src.strip()] = dst.strip()
    return out


def default_data(model_dir: Path | None, demo_model: str) -> str:
    """The demo model's own dataset, or Rotten Tomatoes for a user's model."""
    from limelight.demo.recipes import DEMO_DATASETS

    if model_dir is not None:
        return "rotten_tomatoes"
    return DEMO_DATASETS.get(demo_model, "rotten_tomatoes")


def run(args: argparse.Namespace) -> int:
    from limelight.app import load_served_model
    from limelight.core.windows import check_token_limit
    from limelight.evaluation.benchmark import machine
    from limelight.evaluation.data import load_examples
    from limelight.evaluation.explainers import build_explainers
    from limelight.evaluation.report import EvalReport, write
    from limelight.evaluation.runner import EvalConfig, Evaluator, MethodResult, token_idf
    from limelight.evaluation.store import FOLDER, AttributionStore, reuse_notes
    from limelight.progress import progress_bar

    settings = settings_from_args(args, jobs="off", drift_enabled=False)
    # The default list skips what a model lacks (no inline head, no LM head) as a matter of
    # course; a method the user named and did not get is a failed run.
    named = args.methods is not None
    names = [m.strip() for m in (args.methods or DEFAULT_METHODS).split(",") if m.strip()]
    params = parse_params(args.params)
    registry = _check_methods(names, params, settings)  # before the model loads
    if args.lm_head_dir is not None and not args.lm_head_dir.expanduser().is_dir():
        raise InvalidArgument(f"--lm-head {args.lm_head_dir}: no such directory")
    make_out_dir(args.out)  # an unwritable --out fails now, not at the end
    model = load_served_model(settings)
    # The sidecar's own check: under it the tokenizer ignored the limit (1) or every text was
    # its special tokens alone (2), and the figures were all zero.
    tokenizer = model.tokenizer
    check_token_limit(
        min(args.max_tokens, model.max_tokens),
        tokenizer.num_special_tokens_to_add(pair=False),
        tokenizer.num_special_tokens_to_add(pair=True),
    )
    if args.data is None:
        args.data = default_data(args.model_dir, settings.demo_model)
    limits = _thresholds(model, settings)
    config = EvalConfig(
        fractions=tuple(sorted(args.fractions)),
        game_fractions=tuple(round(i / args.game_steps, 6) for i in range(args.game_steps + 1)),
        replace=args.replace,
        overlap_ks=tuple(sorted(args.overlap_k)),
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        label_thresholds=dict(zip(model.labels, limits, strict=True)) if limits else None,
    )
    data = load_examples(
        args.data,
        model.labels,
        n=args.n or None,
        seed=args.seed,
        split=args.split,
        text_field=args.text_field,
        label_field=args.label_field,
        evidence_field=args.evidence_field,
        label_map=parse_label_map(args.label_map),
        multi_label=model.is_multi_label,
    )
    if not data.examples:  # a data error like the others (a header without rows): usage
        return fail(args, f"{args.data}: no examples to evaluate (no rows)", EXIT_USAGE)
    explainers, skipped = build_explainers(
        model,
        names,
        settings,
        params,
        registry=registry,
        peer_budget=args.peer_budget,
        seed=args.seed,
        store=AttributionStore(args.out / FOLDER, model.version, reuse=not args.fresh),
    )
    evaluator = Evaluator(model, config)
    examples = list(data.examples)
    encoded = evaluator.encode(examples)
    probs = evaluator.predict(encoded)
    predicted = [int(p) for p in probs.argmax(axis=1)]
    notes = list(data.notes)
    targets: list[int | None] = [None] * len(examples)
    if model.is_multi_label:
        examples, encoded, predicted = _per_label(limits, examples, encoded, probs)
        targets = list(predicted)
        accuracy = None
        notes.append(
            "multi-label: one item per (text, predicted label) at the served thresholds (the "
            "most probable label when none passes); AOPC perturbs that label's own sigmoid "
            "probability; a game item agrees while its label is still explained (at or over "
            "its threshold, or the most probable when none passes); no gold accuracy"
        )
    else:
        gold = [(p, e.gold) for p, e in zip(predicted, examples, strict=True) if e.gold is not None]
        accuracy = sum(p == g for p, g in gold) / len(gold) if gold else None
        notes.append("target class = the model's prediction on the unperturbed input")
    idf = token_idf(model, [e.text for e in data.examples], config.max_tokens)
    if args.replace == "mask" and model.mask_token_id is None:
        notes.append("the tokenizer has no mask token: perturbed tokens are deleted instead")
    if "lime" in explainers or "shap" in explainers:
        notes.append(f"LIME / SHAP Partition budget: {args.peer_budget} model calls per input")
    if args.params:
        notes.append("method parameters: " + " ".join(args.params))

    def tick() -> None:
        bar.update(1)

    results: list[MethodResult] = []
    bar = progress_bar(
        total=len(explainers) * len(examples),
        desc="eval",
        unit="expl",
        enabled=not args.no_progress,
    )
    with bar:
        for name in names:
            if name in skipped:
                results.append(MethodResult(name=name, status="skipped", reason=skipped[name]))
                continue
            bar.set_description(name)
            try:
                results.append(
                    evaluator.evaluate_method(
                        name,
                        explainers[name],
                        examples,
                        encoded,
                        predicted,
                        idf,
                        tick=tick,
                    )
                )
            except Exception as exc:  # one broken method must not lose the others' results
                results.append(MethodResult(name=name, status="failed", reason=repr(exc)))
    notes += reuse_notes(explainers, names)
    report = EvalReport(
        model=model.name,
        dataset=f"{data.name}, {len(data.examples)} of {data.total}",
        config=config,
        results=results,
        accuracy=accuracy,
        notes=notes,
        command="limelight " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        machine=machine(),
        inputs=[
            {"index": e.source_index, "target": t} for e, t in zip(examples, targets, strict=True)
        ],
    )
    paths = write(report, args.out)
    print(paths["markdown"].read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    missing = [r for r in results if r.status == "failed" or (named and r.status == "skipped")]
    if missing:  # the report is written; the status tells a script the run is not complete
        listing = ", ".join(f"{r.name} ({r.status})" for r in missing)
        return fail(
            args,
            f"not evaluated: {listing}; the reasons are in {paths['markdown']}",
            EXIT_FAILURE,
        )
    return 0


def make_out_dir(folder: Path) -> None:
    """Create ``--out`` (and its parents); a file in the way is named as such, not reported as
    the system's "File exists" or "Not a directory"."""
    blocker = file_in_the_way(folder)
    if blocker == folder:
        raise InvalidArgument(f"--out {folder} is a file, not a directory")
    if blocker is not None:
        raise InvalidArgument(f"--out {folder}: {blocker} is a file, not a directory")
    folder.mkdir(parents=True, exist_ok=True)


def file_in_the_way(folder: Path) -> Path | None:
    """The first of ``folder`` and its parents that exists, where it is not a directory."""
    for path in (folder, *folder.parents):
        if path.exists():
            return None if path.is_dir() else path
    return None


def _check_methods(
    names: list[str], params: dict[str, dict[str, Any]], settings: Any
) -> MethodRegistry:
    """The registry the run will use, once every name in ``--methods`` and ``--params`` is
    one it knows: a misspelt method is a usage error, not a silently skipped row."""
    from limelight.evaluation.explainers import PEERS
    from limelight.methods.base import MethodRegistry

    registry = MethodRegistry.load(settings)
    known = [*registry.names(), *PEERS]
    if not names:
        raise InvalidArgument("--methods: give at least one method")
    unknown = [n for n in names if n not in known]
    if unknown:
        listing = ", ".join(sorted(known))
        raise InvalidArgument(
            f"--methods: unknown {', '.join(map(repr, unknown))} (known: {listing})"
        )
    stray = sorted(set(params) - set(names))
    if stray:
        raise InvalidArgument(
            f"--params for {', '.join(map(repr, stray))}, which --methods does not evaluate "
            f"({', '.join(names)})"
        )
    return registry


def _thresholds(model: Any, settings: Any) -> list[float]:
    """Multi-label: each label's threshold, as the sidecar reads them from the settings
    (LIMELIGHT_LABEL_THRESHOLD / LIMELIGHT_LABEL_THRESHOLDS); none for other models."""
    from limelight.core.prediction import label_thresholds

    if not model.is_multi_label:
        return []
    return label_thresholds(model.labels, settings.label_threshold, settings.label_thresholds)


def _per_label(
    limits: list[float], examples: list[Any], encoded: list[Any], probs: Any
) -> tuple[list[Any], list[Any], list[int]]:
    """Multi-label: every (text, explained label) pair becomes one evaluated item, the label
    explained as the sidecar would explain it (each predicted label at or over its threshold in
    ``limits``, else the top one)."""
    import numpy as np

    out_examples, out_encoded, out_targets = [], [], []
    for example, enc, row in zip(examples, encoded, probs, strict=True):
        active = [int(c) for c in np.argsort(-row, kind="stable") if row[c] >= limits[c]]
        for target in active or [int(np.argmax(row))]:
            out_examples.append(dataclasses.replace(example, gold=None))
            out_encoded.append(enc)
            out_targets.append(target)
    return out_examples, out_encoded, out_targets

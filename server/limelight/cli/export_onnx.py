"""`limelight export-onnx`: write the inline ONNX graph (logits + NormXLogit inputs)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from limelight.cli.common import add_model_args, settings_from_args, setup_logging, whole
from limelight.settings import Settings

#: ``--fidelity-n`` when it is not given.
FIDELITY_N = 200


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "export-onnx",
        help="export the inline path to ONNX (for `serve --runtime onnx`)",
        description="Export a graph whose outputs are the logits, the embedding norms and the "
        "per-token head logits, with dynamic batch and sequence axes.",
    )
    add_model_args(p)
    p.add_argument("--out", type=Path, help="output file (default: <model dir>/limelight.onnx)")
    p.add_argument(
        "--int8", action="store_true", help="also apply dynamic int8 quantisation (weights)"
    )
    p.add_argument(
        "--fidelity-n",
        type=whole(1),  # no default here: given without --int8 it is refused, not ignored
        help=f"with --int8: held-out texts for the int8 report (default {FIDELITY_N}; the "
        "demo's own test data; for --model, rotten_tomatoes reviews)",
    )
    p.set_defaults(func=run)


def same_prediction(a: np.ndarray, b: np.ndarray, thresholds: Sequence[float] | None) -> bool:
    """Whether two rows of logits give the same answer: the same top class, or, multi-label
    (``thresholds``, one per label), the same set of labels whose sigmoid reaches its
    threshold (the arg-max says nothing of which labels a multi-label model predicts)."""
    from limelight.core.prediction import MULTI_LABEL, predict

    if thresholds is None:
        return int(np.argmax(a)) == int(np.argmax(b))
    chosen = [set(predict(row, MULTI_LABEL, thresholds).active) for row in (a, b)]
    return chosen[0] == chosen[1]


def held_out_texts(dataset: str, n: int) -> list[str]:
    """The first ``n`` texts of a built-in dataset's test split (held out of a demo's training:
    ``limelight.demo.recipes.DEMO_DATASETS``)."""
    from limelight.demo.datasets import drugscom, rotten_tomatoes

    read = {"rotten_tomatoes": rotten_tomatoes, "drugscom": drugscom}[dataset]
    return [e.text for e in read("test")[:n]]


def fidelity_report(
    model_dir: Path,
    fp32: Path,
    int8: Path,
    n: int,
    dataset: str = "rotten_tomatoes",
    thresholds: Sequence[float] | None = None,
) -> dict[str, float]:
    """Agreement of predictions (:func:`same_prediction`; ``thresholds`` for a multi-label
    model) on ``n`` held-out texts of ``dataset``, and rank correlation of attributions, int8 vs
    fp32: NormXLogit (``mean_spearman``) and each inline head's scores
    (``mean_spearman_<head>``), for the fp32 graph's most probable class."""
    from scipy.stats import spearmanr

    from limelight.methods.normxlogit import NormXLogit
    from limelight.models.loaded import load_model
    from limelight.runtimes.base import InlineBatch
    from limelight.runtimes.onnx_runtime import OnnxRuntime

    model = load_model(model_dir)
    reference, quantised = OnnxRuntime(fp32, model), OnnxRuntime(int8, model)
    method = NormXLogit()
    agree, correlations = 0, []
    per_head: dict[str, list[float]] = {}
    texts = held_out_texts(dataset, n)
    for start in range(0, len(texts), 16):
        encoded = [model.encode(t) for t in texts[start : start + 16]]
        batch = InlineBatch.from_encoded(encoded, model.pad_id)
        a, b = reference.run_inline(batch), quantised.run_inline(batch)
        for row, enc in enumerate(encoded):
            predicted = int(np.argmax(a.logits[row]))
            agree += int(same_prediction(a.logits[row], b.logits[row], thresholds))
            keep = ~enc.special_mask
            sa = method.attribute(a, row, len(enc))[keep, predicted]
            sb = method.attribute(b, row, len(enc))[keep, predicted]
            if len(sa) > 1:
                correlations.append(float(spearmanr(sa, sb).statistic))
                for name, scores in a.extra.items():
                    ha = scores[row, : len(enc)][keep, predicted]
                    hb = b.extra[name][row, : len(enc)][keep, predicted]
                    per_head.setdefault(name, []).append(float(spearmanr(ha, hb).statistic))
    return {
        "texts": float(len(texts)),
        "prediction_agreement": agree / max(len(texts), 1),
        "mean_spearman": _mean(correlations),
        **{f"mean_spearman_{name}": _mean(values) for name, values in per_head.items()},
    }


def _mean(values: list[float]) -> float:
    return float(np.nanmean(values)) if values else float("nan")


def _which_model(args: argparse.Namespace, settings: Settings, directory: Path) -> str:
    """How ``serve`` names the exported model: a demo by its name (served so, it keeps what a
    demo brings, such as its base checkpoint's LM head for Decoded Grad-CAM), else its
    directory."""
    if settings.model_dir is not None:
        return f"--model {directory}"
    named = f"--demo {settings.demo_model}"
    return named + (f" --cache-dir {args.cache_dir}" if args.cache_dir is not None else "")


def _check_out(out: Path) -> None:
    """``--out`` names the graph's file: refuse a directory there, or a file on its way."""
    from limelight.cli.eval import file_in_the_way
    from limelight.errors import InvalidArgument

    if out.is_dir():
        raise InvalidArgument(
            f"--out {out} is a directory: name the graph's file (e.g. {out / 'limelight.onnx'})"
        )
    blocker = file_in_the_way(out.parent)
    if blocker is not None:
        raise InvalidArgument(f"--out {out}: {blocker} is a file, not a directory")


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    setup_logging(settings.log_level)
    from limelight.app import load_served_model
    from limelight.models.explainer_head import inline_heads
    from limelight.runtimes.onnx_export import export_onnx, read_description, staged
    from limelight.runtimes.onnx_runtime import DEFAULT_GRAPH

    if args.fidelity_n is not None and not args.int8:  # before the model loads
        from limelight.errors import InvalidArgument

        raise InvalidArgument("--fidelity-n goes with --int8: it sizes the int8 graph's report")
    if args.out is not None:
        _check_out(args.out)
    model = load_served_model(settings)
    out = args.out or model.directory / DEFAULT_GRAPH
    heads = inline_heads(model)
    try:
        with staged(out) as partial:  # a sidecar serving `out` reloads the whole new graph
            export_onnx(model, partial, heads=heads)
    except OSError as exc:
        if exc.filename is None or Path(exc.filename).parent != out.parent:
            raise
        from limelight.errors import FailedPrecondition

        # The staged file's name is ours, not the user's: say which file could not be written.
        raise FailedPrecondition(
            f"cannot write {out} ({exc.strerror or exc}): name a writable file with --out, or "
            "let `limelight serve --runtime onnx` export the graph into its cache"
        ) from exc
    if heads:
        print(f"included inline heads: {', '.join(heads)}")
    outputs = ", ".join(read_description(out).get("outputs", []))  # as written, heads included
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB; outputs: {outputs};")
    print("dynamic batch and sequence axes)")
    if args.int8:
        from limelight.cli.eval import default_data
        from limelight.core.prediction import label_thresholds
        from limelight.runtimes.onnx_export import quantize_int8

        quantised = quantize_int8(out, out.with_name(out.stem + ".int8.onnx"))
        # the demo's own held-out data (drugsCom for the multi-label demo), else movie reviews
        dataset = default_data(settings.model_dir, settings.demo_model)
        thresholds = (
            label_thresholds(model.labels, settings.label_threshold, settings.label_thresholds)
            if model.is_multi_label
            else None
        )
        report = fidelity_report(
            model.directory, out, quantised, args.fidelity_n or FIDELITY_N, dataset, thresholds
        )
        print(f"wrote {quantised} ({quantised.stat().st_size / 1e6:.1f} MB)")
        print(f"int8 fidelity on {int(report['texts'])} held-out texts of {dataset} (test):")
        compared = (
            "the same labels predicted, at sigmoid >= "
            + ", ".join(f"{name} {t}" for name, t in zip(model.labels, thresholds, strict=True))
            if thresholds is not None
            else "the same top class"
        )
        agreement = report["prediction_agreement"]
        print(f"  prediction agreement with fp32:        {agreement:.3f} ({compared})")
        print(f"  Spearman of NormXLogit vs fp32 (mean): {report['mean_spearman']:.3f}")
        for name in heads:
            value = report[f"mean_spearman_{name}"]
            print(f"  Spearman of the {name} head vs fp32: {value:.3f}")
    serve = f"limelight serve {_which_model(args, settings, model.directory)} --runtime onnx"
    if out.resolve() == (model.directory / DEFAULT_GRAPH).resolve():
        # found beside the model without --onnx-path, which would pin it: a head written
        # later is then exported and served by the sidecar itself
        print(f"serve it with: {serve}")
    else:
        print(f"serve it with: {serve} --onnx-path {out}")
    if args.int8:
        print(f"or the int8 graph: {serve} --onnx-path {quantised}")
    return 0

"""`limelight drift` (report from a running sidecar) and `limelight drift-reference build`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from limelight.cli.common import (
    add_client_args,
    add_model_args,
    client_error_line,
    client_error_status,
    fail,
    settings_from_args,
    setup_logging,
    whole,
)

DEFAULT_DATA = "rotten_tomatoes:validation"
DEFAULT_OUT = Path("limelight-drift-reference.json")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "drift",
        help="show attribution drift of a running sidecar",
        description="Ask a sidecar (GetDrift) how the attribution of each predicted label "
        "drifted from the reference, and which tokens gained or lost share.",
    )
    add_client_args(p)
    p.add_argument("--top-k", type=whole(1), default=10, help="tokens per direction (default 10)")
    p.add_argument("--plot", type=Path, help="also write a PNG chart of the report here")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the report as JSON (the SDK's DriftReport.to_dict(); a divergence not "
        "measured is null)",
    )
    p.add_argument(
        "--fail-on-alert", action="store_true", help="exit with status 3 when a label alerts"
    )
    p.set_defaults(func=run_drift)

    ref = subparsers.add_parser(
        "drift-reference",
        help="build a drift reference file from a dataset",
        description="Reference files for `limelight serve --drift-reference`.",
    )
    actions = ref.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build",
        help="run the inline explanation over a dataset and write the reference",
        description="Runs the served default inline method (the distilled head when one lies "
        "beside the model, else the lexicon lookup when a lexicon table does, else NormXLogit; "
        "--default-method to choose) over a labelled or "
        "unlabelled dataset and writes the per-label token profile the drift monitor compares "
        "its window with. A server refuses a reference built from another method.",
    )
    add_model_args(build)
    build.add_argument(
        "--default-method",
        help="inline method of the server the reference is for (default: what it serves, auto)",
    )
    build.add_argument(
        "--lexicon-build",
        action="store_const",
        const=True,
        help="as the server with LIMELIGHT_LEXICON_BUILD: build the lexicon table into the cache "
        "when the default method serves it and none is found",
    )
    build.add_argument(
        "--data",
        help="CSV/TSV/JSONL file with a text column, or a built-in set: "
        "rotten_tomatoes:{train,validation,test} or drugscom:{train,test} "
        f"(default {DEFAULT_DATA}; drugscom:test for --demo bert-tiny-multilabel)",
    )
    build.add_argument("--text-field", default="text", help="text column of --data files")
    build.add_argument("--pair-field", help="second-segment column for text-pair models")
    build.add_argument("--n", type=whole(1), help="use the first N texts (default: all)")
    build.add_argument("--batch-size", type=whole(1), default=32, help="texts per forward pass")
    build.add_argument(
        "--max-tokens",
        type=whole(1),
        help="token limit per text, as the server's (LIMELIGHT_MAX_TOKENS; default the model's)",
    )
    build.add_argument(
        "--truncation",
        choices=["truncate", "reject", "window"],
        help="as the server's: reject leaves out texts over the limit; truncate and window "
        "explain their first tokens",
    )
    build.add_argument(
        "--sketch-size",
        dest="drift_sketch_size",
        type=int,
        help="tokens tracked per label by the window sketch (the reference keeps 4x)",
    )
    build.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output file (default {DEFAULT_OUT})"
    )
    build.add_argument("--no-progress", action="store_true", help="no progress bar")
    build.set_defaults(func=run_build)


# --- drift-reference build ------------------------------------------------------------------------


def load_texts(
    spec: str, text_field: str = "text", pair_field: str | None = None
) -> tuple[list[str], list[str | None] | None]:
    """Texts (and second segments, if any) of a built-in set (``name:split``) or a file."""
    from limelight.demo import datasets

    name, _, split = spec.partition(":")
    if name in ("rotten_tomatoes", "rt") and not Path(spec).exists():
        examples = datasets.rotten_tomatoes(split or "validation")  # type: ignore[arg-type]
    elif name == "drugscom" and not Path(spec).exists():
        examples = datasets.drugscom(split or "test")  # type: ignore[arg-type]
    else:
        examples = datasets.read_labelled(Path(spec), text_field=text_field, pair_field=pair_field)
    pairs = [e.text_pair for e in examples] if any(e.text_pair for e in examples) else None
    return [e.text for e in examples], pairs


def run_build(args: argparse.Namespace) -> int:
    from limelight.app import prepare_lexicon
    from limelight.core.service import served_inline_method
    from limelight.drift.build import build_reference
    from limelight.drift.served import served_identity
    from limelight.errors import FailedPrecondition, InvalidArgument
    from limelight.methods.base import MethodRegistry
    from limelight.models.loaded import load_model
    from limelight.progress import progress_bar
    from limelight.runtimes.serving import torch_serving_runtime

    settings = settings_from_args(args)
    setup_logging(settings.log_level)
    if args.data is None:
        args.data = DEFAULT_DATA
        if settings.model_dir is None and settings.demo_model == "bert-tiny-multilabel":
            args.data = "drugscom:test"
    texts, pairs = load_texts(args.data, args.text_field, args.pair_field)
    if args.n is not None:
        texts = texts[: args.n]
        pairs = pairs[: len(texts)] if pairs is not None else None
    if not texts:
        return fail(args, f"no texts in {args.data}", 2)
    model_dir = settings.model_dir
    if model_dir is None:
        from limelight.demo.build import ensure_demo_model

        model_dir = ensure_demo_model(settings.demo_model, settings.cache_dir)
    model = load_model(model_dir, settings.device, default_max_tokens=settings.max_tokens)
    prepare_lexicon(settings, model)  # what the server would build at start-up
    runtime = torch_serving_runtime(model, settings.cache_dir)
    method = served_inline_method(settings, runtime, MethodRegistry.load(settings))
    reason = method.unavailable_reason(model)
    if reason:
        raise FailedPrecondition(f"{method.name}: {reason}")
    # Recorded in the file: a sidecar that serves anything else sets it aside.
    served = served_identity(settings, model, method.name)
    with progress_bar(
        total=len(texts), desc="drift reference", unit="text", enabled=not args.no_progress
    ) as bar:
        reference = build_reference(
            model,
            texts,
            sketch_size=settings.drift_sketch_size,
            runtime=runtime,
            method=method,
            batch_size=args.batch_size,
            progress=bar,
            source={"data": args.data, "n": len(texts), "truncation": settings.truncation},
            pairs=pairs,
            thresholds=served.thresholds,
            served=served,
            truncation=settings.truncation,
        )
    label_counts = reference.profile.label_counts
    if reference.profile.count == 0:
        raise InvalidArgument(
            f"no explanation went into the reference: none of the {len(texts)} text(s) was "
            "predicted as any label; nothing was written"
        )
    reference.save(args.out)
    for label, count in label_counts.items():
        if count < settings.drift_min_count:
            print(
                f"warning: {count} text(s) predicted as {label}, fewer than the "
                f"{settings.drift_min_count} a label needs to be compared "
                "(LIMELIGHT_DRIFT_MIN_COUNT): that label's drift cannot be measured against "
                "this reference (add texts of it)",
                file=sys.stderr,
            )
    counts = ", ".join(f"{k} {v}" for k, v in label_counts.items())
    print(
        f"wrote {args.out}: {reference.profile.count} explanations ({counts}), model "
        f"{reference.model_name} {reference.model_version}, {reference.method} attributions"
    )
    return 0


# --- drift ----------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100.0 * x:5.2f}%"


def _shift_lines(title: str, shifts: Sequence[Any]) -> list[str]:
    # Tokens are cut from what clients sent: nothing in them may act on the terminal
    # (escape sequences, bidirectional overrides), and a wide character takes two columns.
    from limelight_client.render import columns, pad, terminal_safe

    if not shifts:
        return [f"    {title}: -"]
    tokens = [terminal_safe(s.token) for s in shifts]
    width = max(columns(token) for token in tokens)
    lines = [f"    {title}:"]
    for s, token in zip(shifts, tokens, strict=True):
        change = s.current_share - s.reference_share
        lines.append(
            f"      {pad(token, width)}  {_pct(s.reference_share)} -> {_pct(s.current_share)}"
            f"  ({'+' if change >= 0 else '-'}{100.0 * abs(change):.2f} pp)"
        )
    return lines


def _sampling(report: Any) -> str:
    rate = getattr(report, "sample_rate", 1.0)
    return "" if rate >= 1.0 else f"   observing {100.0 * rate:.3g}% of requests"


NOT_COMPARED = "-"
"""Printed for a divergence with nothing in the window to compare (Prometheus exports NaN)."""


def _explanations(count: int) -> str:
    return f"{count:,} explanation{'' if count == 1 else 's'}"


def _reference_progress(report: Any) -> str:
    """``7 explanations``, or while the reference builds ``7 of 1,000 explanations; drift is
    compared once it has them`` (a sidecar that does not say its target gives the count only)."""
    target = getattr(report, "reference_target", 0)
    if report.reference_state != "building" or target <= 0:
        return _explanations(report.reference_count)
    return (
        f"{report.reference_count:,} of {_explanations(target)}; drift is compared once it has them"
    )


def _bits(entropy: float) -> str:
    """A mean entropy, or ``-`` where there is none (no explanation of positive mass)."""
    return f"{entropy:.2f}" if math.isfinite(entropy) else NOT_COMPARED


def _names(labels: Sequence[str]) -> str:
    from limelight_client.render import terminal_safe

    return ", ".join(terminal_safe(label) for label in labels)


def format_report(report: Any) -> str:
    """A readable table of a drift report (the SDK's or the server's ``DriftReport``).

    With nothing in the window (the reference still building, or a label no recent answer was
    predicted as) there is nothing to compare: the divergences print as ``-``, not 0. Below the
    table, why each label that is not compared is not."""
    compared = report.window_count > 0
    mix_known = compared and math.isfinite(report.label_mix_divergence)
    mix = f"{report.label_mix_divergence:.4f}" if mix_known else NOT_COMPARED
    current = _bits(report.current_entropy) if compared else NOT_COMPARED
    out = [
        f"reference: {report.reference_state} ({_reference_progress(report)})   "
        f"window: {_explanations(report.window_count)}   alert above JSD "
        f"{report.alert_threshold:.3f}{_sampling(report)}",
        f"label mix JSD {mix}   attribution entropy {_bits(report.reference_entropy)} -> "
        f"{current} bits",
        "",
    ]
    from limelight_client.render import columns, pad, terminal_safe

    if not report.labels:
        out.append("(no labels)")
    width = max([len("label"), *(columns(terminal_safe(d.label)) for d in report.labels)])
    out.append(f"{'label':<{width}}  {'JSD':>7}  {'alert':<5}  {'window':>6}")
    out.append("-" * (width + 26))
    # Why a label is not compared, once the reference is ready: none of it in the reference;
    # too few in the reference (which no longer grows: never, against this reference); too few
    # in the window (yet: the window fills, or the label is rare); or enough of both, but too
    # few of them with positive attribution mass to make up a distribution.
    unreferenced: list[str] = []
    few_in_reference: list[str] = []
    few_in_window: list[str] = []
    no_mass: list[str] = []
    least = getattr(report, "min_count", 0)  # 0: a sidecar that does not say
    lists = {
        "unreferenced": unreferenced,
        "few_in_reference": few_in_reference,
        "few_in_window": few_in_window,
        "no_mass": no_mass,
    }
    for d in report.labels:
        if d.window_count > 0 and math.isfinite(d.divergence):
            jsd, alert = f"{d.divergence:7.4f}", "ALERT" if d.alert else "ok"
        else:
            jsd, alert = f"{NOT_COMPARED:>7}", NOT_COMPARED
            # Not ready, or no recent answer predicted as it: nothing to say but the "0".
            lists.get(_why_not_compared(report, d), []).append(d.label)
        out.append(f"{pad(terminal_safe(d.label), width)}  {jsd}  {alert:<5}  {d.window_count:>6}")
    if unreferenced:
        out.append(
            f"no explanation in the reference was predicted as {_names(unreferenced)}: "
            "nothing to compare with (build the reference from texts of every label)"
        )
    if few_in_reference:
        out.append(
            f"never compared against this reference: {_names(few_in_reference)} (fewer than "
            f"{least:,} explanations in the reference, the least a label needs there and in "
            "the window; rebuild the reference from more texts of it with `limelight "
            "drift-reference build`, or from more requests: LIMELIGHT_DRIFT_BOOTSTRAP_N)"
        )
    if few_in_window:
        out.append(
            f"not compared yet: {_names(few_in_window)} (fewer than {least:,} explanations in "
            "the window, the least a label needs there and in the reference; fewer read as "
            "drift on unchanged traffic. A label that stays rarer than that in the window is "
            "compared only with a larger LIMELIGHT_DRIFT_WINDOW)"
        )
    if no_mass:
        out.append(
            f"not compared: {_names(no_mass)} (fewer than {least:,} of its explanations in the "
            "window or in the reference carry any positive attribution mass: with the evidence "
            "all negative there is no distribution to compare; look at the texts predicted as "
            "it)"
        )
    for d in report.labels:
        if not d.risers and not d.fallers:
            continue
        out.append("")
        out.append(
            f"  {terminal_safe(d.label)}: share of positive attribution mass, reference -> current"
        )
        out.extend(_shift_lines("risers", d.risers))
        out.extend(_shift_lines("fallers", d.fallers))
    return "\n".join(out)


def _why_not_compared(report: Any, d: Any) -> str:
    """Why label ``d`` of ``report`` has no divergence: ``not_ready`` (the reference builds,
    or drift is off), ``none_in_window``, ``unreferenced``, ``few_in_reference``,
    ``few_in_window`` or ``no_mass`` (see :func:`format_report`)."""
    least = getattr(report, "min_count", 0)  # 0: a sidecar that does not say
    in_reference = getattr(d, "reference_count", 0)
    if report.reference_state != "ready":
        return "not_ready"
    if not least or in_reference == 0:
        return "unreferenced" if d.window_count > 0 else "none_in_window"
    if in_reference < least:
        return "few_in_reference"
    if d.window_count == 0:
        return "none_in_window"
    return "few_in_window" if d.window_count < least else "no_mass"


def _panel_note(report: Any, d: Any) -> str:
    """A label panel's few words on why the label is not compared (the figure's
    :func:`format_report` notes)."""
    least = getattr(report, "min_count", 0)
    kind = _why_not_compared(report, d)
    if kind == "not_ready":
        target = getattr(report, "reference_target", 0)
        of = f" of {target:,}" if target > 0 else ""
        return {
            "building": f"reference building:\n{report.reference_count:,}{of} explanations",
            "disabled": "drift monitoring is off",
        }.get(report.reference_state, "not compared")
    return {
        "none_in_window": "no recent answer\npredicted this label",
        "unreferenced": "none in the reference\nwas predicted as this label",
        "few_in_reference": f"fewer than {least:,} in the\nreference: never compared",
        "few_in_window": f"not compared yet:\n{d.window_count:,} in the window,\n{least:,} needed",
        "no_mass": "too few explanations with\npositive attribution mass",
    }[kind]


def plot_report(report: Any, path: Path, top_k: int = 8) -> None:
    """PNG of :func:`drift_figure`."""
    import matplotlib.pyplot as plt

    fig = drift_figure(report, top_k)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def drift_figure(report: Any, top_k: int = 8) -> Any:
    """Divergence per label (with the threshold) and each label's top token shifts.

    As in :func:`format_report`, a label with nothing in the window has no divergence: its
    bar is left out and its panel says why, rather than drawing a divergence of 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(report.labels)
    n = max(len(labels), 1)
    fig, axes = plt.subplots(1, n + 1, figsize=(4.2 * (n + 1), 4.0), squeeze=False)
    ax = axes[0][0]
    names = [d.label for d in labels]
    compared = [d.window_count > 0 and math.isfinite(d.divergence) for d in labels]
    values = [d.divergence if ok else 0.0 for d, ok in zip(labels, compared, strict=True)]
    colours = ["tab:red" if d.alert else "tab:blue" for d in labels]
    ax.bar(names, values, color=colours)
    for i, ok in enumerate(compared):
        if not ok:
            ax.text(i, 0, "not\ncompared", ha="center", va="bottom", fontsize=8, color="gray")
    ax.axhline(report.alert_threshold, color="tab:red", linestyle="--", linewidth=1)
    ax.set_ylim(0, max([report.alert_threshold * 1.5, *values, 1e-3]) * 1.1)
    ax.set_ylabel("Jensen-Shannon divergence (bits)")
    ax.set_title(f"attribution drift ({report.reference_state})")
    for i, d in enumerate(labels):
        ax = axes[0][i + 1]
        shifts = sorted(
            [*d.risers, *d.fallers], key=lambda s: abs(s.current_share - s.reference_share)
        )[-top_k:]
        deltas = [100.0 * (s.current_share - s.reference_share) for s in shifts]
        ax.barh(
            [s.token for s in shifts],
            deltas,
            color=["tab:green" if x >= 0 else "tab:orange" for x in deltas],
        )
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_xlabel("share change (percentage points)")
        if not compared[i]:  # the reason, not empty axes (shifts, if any, say little)
            ax.clear()
            ax.set_title(f"{d.label}: JSD {NOT_COMPARED}, n={d.window_count}")
            ax.text(
                0.5, 0.5, _panel_note(report, d), ha="center", va="center", transform=ax.transAxes
            )
            ax.set_xticks([])
            ax.set_yticks([])
        else:
            ax.set_title(f"{d.label}: JSD {d.divergence:.3f}, n={d.window_count}")
    fig.tight_layout()
    return fig


def _fetch(args: argparse.Namespace) -> Any:
    from limelight.cli.common import client_from_args

    with client_from_args(args) as client:
        return client.drift(top_k=args.top_k)


def run_drift(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    stdout = stdout or sys.stdout
    from limelight_client.errors import LimelightError as ClientError

    try:
        report = _fetch(args)
    except ClientError as exc:  # carries the status code and the server's message
        line = client_error_line(exc, args.target, timeout=args.timeout)
        return fail(args, line, client_error_status(exc))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2), file=stdout)
    else:
        print(format_report(report), file=stdout)
    if args.plot is not None:
        plot_report(report, args.plot, top_k=args.top_k)
        # with --json, stdout holds the report alone
        print(f"wrote {args.plot}", file=sys.stderr if args.json else stdout)
    if args.fail_on_alert and any(d.alert for d in report.labels):
        return 3
    return 0

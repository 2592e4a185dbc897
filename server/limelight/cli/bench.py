"""`limelight bench`: latency and throughput of the inline path, the served path and job methods.

Everything is measured in one run on the same inputs and reported as ratios against a baseline
from that run: inline explain vs plain forward (torch, ONNX Runtime); the sidecar in its own
process under closed-loop load from another process vs the same work in-process (throughput,
latency at one client vs a plain forward, server CPU per request vs in-process CPU per text);
short requests with and without long ones in the mix; job methods vs one forward pass. Prints
Markdown tables and writes a PNG plot. ``--against`` loads a sidecar already running elsewhere
instead (``limelight.cli.bench_remote``).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

from limelight.cli.common import (
    add_credential_args,
    add_model_args,
    listed,
    one_of,
    real,
    settings_from_args,
    whole,
)
from limelight.errors import InvalidArgument
from limelight.signals import interrupt_on

SECTIONS = ("inline", "served", "mix", "jobs")


# Defaults that the report's `command:` line leaves out (it writes the others).
DEFAULT_BATCHES = (1, 8, 32)
LOAD_WARMUP_S = 2.0
LONG_CHARS = 20_000
DEFAULT_JOB_METHODS = "gradient,grad_x_input,integrated_gradients,decoded_gradcam,lrp,slalom"


class _DefaultsShown(argparse.HelpFormatter):
    """argparse's help with each option's default, "(default: 10.0)", where its help does not
    say it already and there is one to show (not None, not an off switch): what
    ArgumentDefaultsHelpFormatter does without its "(default: None)" and "(default: False)",
    and without repeating a default the help words itself ("$LIMELIGHT_TOKEN", not a token)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if (
            not action.option_strings
            or "default" in help
            or action.default in (None, False, argparse.SUPPRESS)
        ):
            return action.help
        return f"{help} (default: %(default)s)"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark the inline path, the served path under load and job methods",
        description="Measure the latency and throughput of inline explanations, the served "
        "path under load and job methods in one run, against baselines from that run; print "
        "Markdown tables and write them with a plot to --out.",
        formatter_class=_DefaultsShown,
    )
    add_model_args(p)
    p.add_argument(
        "--runtimes",
        type=listed(one_of("torch", "onnx")),
        default="torch,onnx",
        help="comma-separated: torch,onnx",
    )
    p.add_argument(
        "--batches",
        type=listed(whole(1)),
        default=",".join(map(str, DEFAULT_BATCHES)),
        help="in-process batch sizes",
    )
    p.add_argument(
        "--clients",
        type=listed(whole(1)),
        default="1,8,32",
        help="concurrent clients of the out-of-process load",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="sidecar processes sharing the port in the served section (serve --workers)",
    )
    p.add_argument(
        "--channels",
        type=whole(1),
        default=None,
        help="gRPC channels (connections) the load generator spreads its clients over "
        "(default: 1, or 8 with --workers above 1: one channel reaches one worker)",
    )
    p.add_argument(
        "--drift",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="served and mix sections: run the sidecar with its drift monitor on (as it ships; "
        "the reference bootstraps from the first answers) instead of off",
    )
    p.add_argument(
        "--truncation",
        choices=("truncate", "window"),
        default="truncate",
        help="served and mix sections: the sidecar's policy for texts over the token limit "
        "(`serve --truncation`): cut them (default), or explain all of each in overlapping "
        "windows",
    )
    p.add_argument(
        "--drift-sample-rate",
        type=float,
        default=1.0,
        help="with --drift: the share of answers the monitor observes (default 1: all)",
    )
    p.add_argument(
        "--spread",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="place the load generator's channels evenly over the workers (by the worker "
        "each names in GetModel); --no-spread keeps the kernel's random placement",
    )
    p.add_argument(
        "--rpc",
        choices=("unary", "stream", "batch", "http"),
        default="unary",
        help="how the load generator calls the sidecar in the served section: one Explain call "
        "per request, one ExplainStream per client (the high-throughput path), ExplainBatch "
        "calls of --texts-per-call texts, or KServe v1 :explain on the HTTP port, one "
        "keep-alive connection per client",
    )
    p.add_argument(
        "--token-layout",
        choices=("columns", "messages"),
        default="columns",
        help="how the served section's gRPC answers list their tokens: in columns (what the "
        "SDK asks for) or one Token message each (what a request that does not ask gets)",
    )
    p.add_argument(
        "--texts-per-call",
        type=whole(1),
        default=16,
        help="--rpc batch: texts in each ExplainBatch call (each counts as a request)",
    )
    p.add_argument(
        "--duration",
        type=real(0.0, above=True),
        default=10.0,
        help="seconds measured per load point",
    )
    p.add_argument(
        "--load-warmup",
        type=real(0.0),
        default=LOAD_WARMUP_S,
        help="seconds of load before measuring",
    )
    p.add_argument(
        "--mix",
        type=_mix,
        default="8+4",
        help="mixed-length load: SHORT+LONG concurrent clients, e.g. 8+4 ('' to skip)",
    )
    p.add_argument(
        "--long-chars",
        type=whole(1),
        default=LONG_CHARS,
        help="characters of each long text in --mix",
    )
    p.add_argument(
        "--sections",
        type=listed(one_of(*SECTIONS)),
        default=",".join(SECTIONS),
        help=f"what to measure, comma-separated: {','.join(SECTIONS)}",
    )
    p.add_argument(
        "--job-methods",
        default=DEFAULT_JOB_METHODS,
        help="job methods to time ('' to skip)",
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats, short load (a smoke run)")
    remote = p.add_argument_group(
        "a running sidecar",
        "--against HOST:PORT loads a sidecar that is already serving (another machine, a "
        "cluster) instead of starting one here: the served and mix sections, with the load "
        "generator in its own process on this machine; the flags that configure a local "
        "sidecar (--model, --runtimes, --workers, --drift, --truncation) do not apply",
    )
    remote.add_argument(
        "--against",
        metavar="HOST:PORT",
        help="the sidecar's gRPC address (with --rpc http: its HTTP port's host:port)",
    )
    remote.add_argument(
        "--texts",
        type=Path,
        metavar="FILE",
        help="with --against: short texts to send, one per line (default: test reviews of the "
        "demo data); --mix's long texts are made by joining them",
    )
    add_credential_args(remote)
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    p.set_defaults(func=run)


def _plot(inline_rows: list[Any], served: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    groups: dict[tuple[str, str], list[Any]] = {}
    for r in inline_rows:
        groups.setdefault((r.runtime, r.texts), []).append(r)
    for (runtime, texts), group in groups.items():
        left.plot(
            [r.batch for r in group],
            [r.explain_per_s for r in group],
            marker="o",
            label=f"{runtime} explain, {texts} texts",
        )
    left.set_xscale("log", base=2)
    left.set_xlabel("batch size")
    left.set_ylabel("explanations / s (in-process)")
    left.set_title("Inline explain throughput")
    if groups:
        left.legend(fontsize=8)
    for runtime in sorted({r["runtime"] for r in served}):
        group = [r for r in served if r["runtime"] == runtime]
        right.plot(
            [r["clients"] for r in group], [r["per_s"] for r in group], marker="o", label=runtime
        )
    right.set_xscale("log", base=2)
    right.set_xlabel("concurrent clients (separate process)")
    right.set_ylabel("requests / s")
    right.set_title("Served end to end, loopback")
    if served:
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


#: The columns of a mixed-length table that local and ``--against`` runs share.
MIX_COLUMNS = [
    "short p50 alone ms",
    "short p50 mixed ms",
    "mixed/alone",
    "short p99 mixed ms",
    "short req/s mixed",
    "long req/s mixed",
    "long p50 mixed ms",
]


def mix_title(short: int, long: int, chars: int) -> str:
    return (
        f"Mixed lengths: {short} short clients, then with {long} long clients "
        f"({chars} characters) added"
    )


def long_texts(reviews: list[str], chars: int, count: int) -> list[str]:
    """``count`` texts of about ``chars`` characters (reviews joined, cut at a word)."""
    texts, i = [], 0
    for _ in range(count):
        parts: list[str] = []
        while sum(len(p) + 1 for p in parts) < chars:
            parts.append(reviews[i % len(reviews)])
            i += 1
        texts.append(" ".join(parts)[:chars].rsplit(" ", 1)[0])
    return texts


def run(args: argparse.Namespace) -> int:
    from limelight.evaluation.benchmark import workdir

    if args.against:
        from limelight.cli.bench_remote import run_against

        return run_against(args)
    if args.texts is not None:  # a local run measures its own set of the demo's test reviews
        raise InvalidArgument("--texts goes with --against; a local run sends the test reviews")

    # A closed terminal (SIGHUP) or a `kill` (SIGTERM) ends the run as Ctrl-C does: through
    # the cleanup that stops the sidecar and the load generator this run started.
    interrupt_on((signal.SIGTERM, signal.SIGHUP))
    with workdir() as work:
        return _run(args, work)


def _run(args: argparse.Namespace, work: Path) -> int:
    from limelight.api.ports import free_port
    from limelight.api.server_process import start_server_process
    from limelight.app import load_served_model, prepare_lexicon
    from limelight.core.service import resolve_default_method
    from limelight.demo.datasets import rotten_tomatoes
    from limelight.evaluation import benchmark as b
    from limelight.methods.base import InlineMethod, MethodRegistry
    from limelight.models.explainer_head import inline_heads
    from limelight.runtimes.base import Runtime
    from limelight.runtimes.serving import torch_serving_runtime, with_lexicon
    from limelight.runtimes.torch_runtime import TorchRuntime

    if args.channels is None:
        args.channels = 8 if args.workers > 1 else 1
    sections = set(args.sections)
    settings = settings_from_args(args, jobs="off", drift_enabled=False)
    job_methods = [m for m in args.job_methods.split(",") if m]
    if "jobs" in sections:  # a misspelt name would stop the run at its end, minutes from now
        _check_job_methods(job_methods, settings)
    model = load_served_model(settings)
    prepare_lexicon(settings, model)  # as the server will at start-up, before it is measured
    reviews = [e.text for e in rotten_tomatoes("test")]
    short = sorted(reviews, key=len)[len(reviews) // 4 :][:64]
    long = [" ".join(reviews[i : i + 6]) for i in range(0, 6 * 64, 6)]
    batches = list(args.batches)
    repeats = 3 if args.quick else 15
    duration = min(args.duration, 3.0) if args.quick else args.duration
    warmup = min(args.load_warmup, 1.0) if args.quick else args.load_warmup
    runtimes: dict[str, Runtime] = {}
    names = list(args.runtimes)
    # What the server runs: the heads and lexicon table found beside the model, and its
    # default inline method.
    heads = inline_heads(model)
    # The same runtimes without the heads: what NormXLogit alone costs, the floor under any
    # head (measured only when there is a head to compare).
    bare: dict[str, Runtime] = {}
    if "torch" in names:
        runtimes["torch"] = with_lexicon(TorchRuntime(model, heads), model, settings.cache_dir)
        if heads and "inline" in sections:
            bare["torch"] = TorchRuntime(model, {})
    if "onnx" in names:
        onnx = b.plain_onnx_runtime(model, work, heads, settings.torch_threads)
        runtimes["onnx"] = with_lexicon(onnx, model, settings.cache_dir)
        if heads and "inline" in sections:
            bare["onnx"] = b.plain_onnx_runtime(model, work / "bare", {}, settings.torch_threads)
    default_inline = MethodRegistry.load(settings).get(
        resolve_default_method(
            settings.default_method, torch_serving_runtime(model, settings.cache_dir)
        )
    )
    if not isinstance(default_inline, InlineMethod):
        raise InvalidArgument(f"--default-method {default_inline.name} is not an inline method")
    args.out.mkdir(parents=True, exist_ok=True)
    report = [f"model: {model.name} ({model.architecture}, version {model.version})"]
    report.append(f"machine: {b.machine()}")
    report.append(f"command: limelight bench {' '.join(_argv(args))}")
    print("\n".join(report), flush=True)

    def emit(title: str, table: str, note: str = "") -> None:
        report.extend(["", f"## {title}", "", table] + (["", note] if note else []))
        print(f"\n## {title}\n\n{table}" + (f"\n\n{note}" if note else ""), flush=True)

    inline_rows: list[Any] = []
    if "inline" in sections:
        inline_rows = b.inline_vs_forward(
            model,
            runtimes,
            {"short": short, "long": long},
            batches,
            repeats,
            default_inline,
            bare=bare,
        )
        header = ["runtime", "texts", "batch", "forward ms", "explain ms", "explain/forward"]
        header += ["normxlogit alone/forward"] if bare else []
        emit(
            f"Inline explain ({default_inline.name}) vs plain forward (same inputs, same run)",
            b.markdown_table(
                [*header, "expl/s"],
                [
                    [r.runtime, r.texts, r.batch, r.forward_ms, r.explain_ms, r.ratio]
                    + ([r.bare_ratio if r.bare_ratio is not None else "–"] if bare else [])
                    + [r.explain_per_s]
                    for r in inline_rows
                ],
            ),
            "Ratios are medians of alternating (forward, explain) pairs"
            + (
                "; 'normxlogit alone' is the inline pass without the heads, what every request "
                "costs before a head is added."
                if bare
                else "."
            ),
        )

    served: list[dict[str, Any]] = []
    model_dir = model.directory
    common: dict[str, Any] = {
        "model_dir": model_dir,
        "torch_threads": settings.torch_threads,
        "drift_enabled": args.drift,
        "drift_sample_rate": args.drift_sample_rate,
        "truncation": args.truncation,
    }
    if settings.device:
        common["device"] = settings.device
    if "served" in sections:
        clients = list(args.clients)
        rows = []
        for name, runtime in runtimes.items():
            forward_ms = statistics.median(
                b.single_forward_ms(model, runtime, text, repeats) for text in short[:16]
            )
            idle_forward_ms = statistics.median(
                b.single_forward_ms(model, runtime, text, repeats, b.IDLE_GAP_S)
                for text in short[:16]
            )
            base = b.in_process_baseline(model, runtime, short, 32, repeats, "short")
            overrides: dict[str, Any] = {**common, "runtime": name, "workers": args.workers}
            if name == "onnx":
                overrides["onnx_path"] = work / "inline.onnx"
            if args.rpc == "http":
                overrides["metrics_port"] = free_port()
            server = start_server_process(overrides)
            target = server.target
            if args.rpc == "http":
                target = f"127.0.0.1:{overrides['metrics_port']}"
            try:
                for n in clients:
                    load = b.run_load(
                        target,
                        {"short": short},
                        {"short": n},
                        duration,
                        warmup,
                        server.pid,
                        args.channels,
                        args.rpc,
                        args.spread,
                        args.texts_per_call,
                        args.token_layout,
                    )
                    row: dict[str, Any] = {
                        "runtime": name,
                        "clients": n,
                        "channels_per_worker": load.placement,
                        "p50": load.p50_ms("short"),
                        "p99": load.p99_ms("short"),
                        "per_s": load.per_s(),
                        "cpu": load.cpu_ms_per_request,
                        "errors": load.errors,
                        "forward_ms": forward_ms,
                        "idle_forward_ms": idle_forward_ms,
                    }
                    served.append(row)
                    rows.append(
                        [
                            name,
                            f"{n} ({load.placement})" if args.workers > 1 and load.placement else n,
                            row["p50"],
                            row["p99"],
                            row["per_s"],
                            row["per_s"] / base.per_s,
                            row["cpu"],
                            row["cpu"] / base.cpu_ms_per_text,
                            row["p50"] - forward_ms if n == 1 else "",
                            row["p50"] - idle_forward_ms if n == 1 else "",
                        ]
                    )
                    print(  # progress while the next load point runs; the table follows
                        f"served {name}, {rows[-1][1]} client(s): p50 {row['p50']:.3g} ms, "
                        f"p99 {row['p99']:.3g} ms, {row['per_s']:,.0f} req/s "
                        f"({row['per_s'] / base.per_s:.2f}x in-process), "
                        f"server CPU {row['cpu']:.3g} ms/req"
                        + (f", {load.errors} FAILED call(s)" if load.errors else ""),
                        flush=True,
                    )
            finally:
                server.stop()
            rows.append(
                [
                    f"{name} in-process",
                    "batch 32",
                    "",
                    "",
                    base.per_s,
                    1.0,
                    base.cpu_ms_per_text,
                    1.0,
                    f"forward {forward_ms:.3g} ms",
                    f"after idle {idle_forward_ms:.3g} ms",
                ]
            )
        emit(
            "Served out of process vs in-process (short texts, loopback)",
            b.markdown_table(
                [
                    "runtime",
                    "clients",
                    "p50 ms",
                    "p99 ms",
                    "req/s",
                    "vs in-process batch 32",
                    "server CPU ms/req",
                    "vs in-process CPU/text",
                    "p50 - plain forward ms",
                    "p50 - forward after idle ms",
                ],
                rows,
            ),
            f"The load generator is a separate process (closed loop, {args.rpc} calls, "
            + (
                "one HTTP connection per client"
                if args.rpc == "http"
                else f"{args.channels} gRPC channel(s)"
            )
            + f"); the sidecar ran {args.workers} worker "
            f"process(es) (with several: the channels per worker in brackets), drift monitor "
            f"{_drift_state(args)}. Server CPU is "
            "the sidecar's user+system time (every process) over "
            "the measured window. "
            "In-process: batch tokenizer + one forward + NormXLogit, batch 32. Plain forward: "
            "median over 16 short texts at batch 1, back to back; after idle: the same, each "
            f"after {b.IDLE_GAP_S * 1e3:g} ms asleep, as a one-client server's forward comes "
            "(the difference is the cost of being the first pass after other work).",
        )

    if "mix" in sections and args.mix:
        n_short, n_long = args.mix
        longs = long_texts(reviews, args.long_chars, 16)
        rows = []
        policies = {
            "length-aware (default)": {},
            "length-blind (one bucket, no token budget)": {
                "max_batch_tokens": 0,
                "batch_bucket_floor": 1_000_000,
            },
        }
        for label, policy in policies.items():
            server = start_server_process({**common, **policy})
            try:
                alone = b.run_load(
                    server.target,
                    {"short": short},
                    {"short": n_short},
                    duration,
                    warmup,
                    server.pid,
                )
                mixed = b.run_load(
                    server.target,
                    {"short": short, "long": longs},
                    {"short": n_short, "long": n_long},
                    duration,
                    warmup,
                    server.pid,
                )
            finally:
                server.stop()
            rows.append(
                [
                    label,
                    alone.p50_ms("short"),
                    mixed.p50_ms("short"),
                    mixed.p50_ms("short") / alone.p50_ms("short"),
                    mixed.p99_ms("short"),
                    mixed.per_s("short"),
                    mixed.per_s("long"),
                    mixed.p50_ms("long"),
                    round(mixed.tokens_per_answer("long")),
                    alone.tokens_per_s,
                    mixed.tokens_per_s,
                    mixed.tokens_per_s / alone.tokens_per_s,
                ]
            )
            print(
                f"mixed lengths, {label}: short p50 {alone.p50_ms('short'):.3g} ms alone, "
                f"{mixed.p50_ms('short'):.3g} ms with long texts; tokens/s "
                f"{mixed.tokens_per_s / alone.tokens_per_s:.2f}x",
                flush=True,
            )
        emit(
            mix_title(n_short, n_long, args.long_chars),
            b.markdown_table(
                [
                    "batching",
                    *MIX_COLUMNS,
                    "tokens per long answer",
                    "tokens/s alone",
                    "tokens/s mixed",
                    "tokens/s mixed/alone",
                ],
                rows,
            ),
            "torch runtime; "
            + (
                "long texts are explained whole, in overlapping windows (truncation=window)."
                if args.truncation == "window"
                else "long texts are truncated to the model's token limit."
            ),
        )

    if "jobs" in sections and job_methods:
        rows = b.job_method_ratios(model, settings, job_methods, short[:3], repeats)
        emit(
            "Job methods as multiples of one forward pass",
            b.markdown_table(["method", "x forward pass", "ms", "note"], rows),
        )

    (args.out / "bench.md").write_text("\n".join(report) + "\n")
    if inline_rows or served:
        _plot(inline_rows, served, args.out / "bench.png")
    print(f"\nwrote {args.out / 'bench.md'}")
    failed = sum(row["errors"] for row in served)
    if failed:  # a run where calls failed (a worker died, the sidecar stalled) measured that
        print(
            f"limelight bench: {failed} served call(s) failed during the measurement: its "
            "latency, throughput and CPU figures do not describe a healthy sidecar",
            file=sys.stderr,
        )
        return 1
    return 0


def _check_job_methods(names: list[str], settings: Any) -> None:
    from limelight.methods.base import JobMethod, MethodRegistry

    registry = MethodRegistry.load(settings)
    jobs = sorted(m.name for m in registry if isinstance(m, JobMethod))
    wrong = [n for n in names if n not in jobs]
    if wrong:
        raise InvalidArgument(
            f"--job-methods: {', '.join(map(repr, wrong))} not a job method (job methods: "
            f"{', '.join(jobs)})"
        )


def _mix(text: str) -> tuple[int, int] | None:
    """``--mix SHORT+LONG``: clients of each kind, both at least 1; '' skips the section."""
    if not text.strip():
        return None
    short, plus, long = text.partition("+")
    if not plus:
        raise argparse.ArgumentTypeError(f"expects SHORT+LONG clients, e.g. 8+4, got {text!r}")
    count = whole(1)
    return count(short), count(long)


def _argv(args: argparse.Namespace) -> list[str]:
    out = []
    if args.model_dir:
        out += ["--model", str(args.model_dir)]
    if args.demo_model:
        out += ["--demo", args.demo_model]
    if getattr(args, "torch_threads", None):
        out += ["--torch-threads", str(args.torch_threads)]
    sections = set(args.sections)
    for flag in ("runtimes", "clients", "mix", "sections", "workers", "channels", "rpc"):
        if flag == "mix" and "mix" not in sections:  # only the mix section reads it
            continue
        value = getattr(args, flag)
        if isinstance(value, tuple):  # the comma lists, and --mix as SHORT+LONG
            value = "+".join(map(str, value)) if flag == "mix" else ",".join(map(str, value))
        if value is None and flag != "mix":  # not given and not yet resolved: its default
            continue
        out += [f"--{flag}", "" if value is None else str(value)]
    if args.rpc == "batch":
        out += ["--texts-per-call", str(args.texts_per_call)]
    if args.rpc != "http":
        out += ["--token-layout", args.token_layout]
    out += ["--duration", f"{args.duration:g}"]
    out += changed_load_options(args)
    if "inline" in sections and tuple(args.batches) != DEFAULT_BATCHES:
        out += ["--batches", ",".join(map(str, args.batches))]
    if "jobs" in sections and args.job_methods != DEFAULT_JOB_METHODS:
        out += ["--job-methods", args.job_methods]
    if args.drift:
        out.append("--drift")
        if args.drift_sample_rate < 1.0:
            out += ["--drift-sample-rate", f"{args.drift_sample_rate:g}"]
    if args.truncation != "truncate":
        out += ["--truncation", args.truncation]
    if args.quick:
        out.append("--quick")
    return out


def changed_load_options(args: argparse.Namespace) -> list[str]:
    """The load generator's options that differ from their defaults, for a report's
    `command:` line (local runs and `--against` alike)."""
    out = []
    if args.load_warmup != LOAD_WARMUP_S:
        out += ["--load-warmup", f"{args.load_warmup:g}"]
    if "mix" in args.sections and args.long_chars != LONG_CHARS:
        out += ["--long-chars", str(args.long_chars)]
    if not args.spread:
        out.append("--no-spread")
    return out


def _drift_state(args: argparse.Namespace) -> str:
    if not args.drift:
        return "off"
    rate = args.drift_sample_rate
    return "on" if rate >= 1.0 else f"on (observing {100.0 * rate:.3g}% of answers)"

"""`limelight bench`: latency and throughput of the inline path and the job methods.

Everything is measured in one run on the same inputs and reported as ratios against a baseline
from that run: inline explain vs plain forward (torch, ONNX Runtime), gRPC end to end vs
in-process, job methods vs one forward pass. Prints Markdown tables and writes a PNG plot.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from limelight.cli.common import add_model_args, settings_from_args


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("bench", help="benchmark the inline path, gRPC and job methods")
    add_model_args(p)
    p.add_argument("--runtimes", default="torch,onnx", help="comma-separated: torch,onnx")
    p.add_argument("--batches", default="1,8,32", help="batch sizes")
    p.add_argument("--clients", default="1,8,32", help="concurrent gRPC clients")
    p.add_argument(
        "--job-methods",
        default="gradient,grad_x_input,integrated_gradients,decoded_gradcam,lrp,slalom",
        help="job methods to time ('' to skip)",
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    p.set_defaults(func=run)


def _plot(inline_rows: list, grpc_rows: list, out: Path) -> None:  # type: ignore[type-arg]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (runtime, texts), group in _groups(inline_rows).items():
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
    left.legend(fontsize=8)
    for runtime in sorted({r.runtime for r in grpc_rows}):
        group = [r for r in grpc_rows if r.runtime == runtime]
        right.plot([r.clients for r in group], [r.per_s for r in group], marker="o", label=runtime)
    right.set_xscale("log", base=2)
    right.set_xlabel("concurrent gRPC clients")
    right.set_ylabel("requests / s")
    right.set_title("gRPC end to end (micro-batched)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _groups(rows: list) -> dict:  # type: ignore[type-arg]
    groups: dict = {}  # type: ignore[type-arg]
    for r in rows:
        groups.setdefault((r.runtime, r.texts), []).append(r)
    return groups


def run(args: argparse.Namespace) -> int:
    from limelight.app import load_served_model
    from limelight.demo.datasets import rotten_tomatoes
    from limelight.evaluation import benchmark as b
    from limelight.runtimes.base import Runtime
    from limelight.runtimes.torch_runtime import TorchRuntime

    settings = settings_from_args(args, jobs="off", drift_enabled=False)
    model = load_served_model(settings)
    reviews = [e.text for e in rotten_tomatoes("test")]
    short = sorted(reviews, key=len)[len(reviews) // 4 :][:64]
    long = [" ".join(reviews[i : i + 6]) for i in range(0, 6 * 64, 6)]
    batches = [int(x) for x in args.batches.split(",") if x]
    repeats = 3 if args.quick else 15
    work = b.workdir()
    runtimes: dict[str, Runtime] = {}
    names = [r for r in args.runtimes.split(",") if r]
    if "torch" in names:
        runtimes["torch"] = TorchRuntime(model)
    if "onnx" in names:
        runtimes["onnx"] = b.plain_onnx_runtime(model, work)
    args.out.mkdir(parents=True, exist_ok=True)
    report = [f"model: {model.name} ({model.architecture}, version {model.version})"]
    report.append(f"machine: {b.machine()}")
    report.append(f"command: limelight bench {' '.join(_argv(args))}")
    print("\n".join(report), flush=True)

    inline_rows = b.inline_vs_forward(
        model, runtimes, {"short": short, "long": long}, batches, repeats
    )
    table = b.markdown_table(
        ["runtime", "texts", "batch", "forward ms", "explain ms", "explain/forward", "expl/s"],
        [
            [r.runtime, r.texts, r.batch, r.forward_ms, r.explain_ms, r.ratio, r.explain_per_s]
            for r in inline_rows
        ],
    )
    report += ["", "## Inline explain vs plain forward (same inputs, same run)", "", table]
    print("\n" + table, flush=True)

    best_in_process = {
        name: max(r.explain_per_s for r in inline_rows if r.runtime == name and r.texts == "short")
        for name in runtimes
    }
    grpc_rows = []
    per_client = 6 if args.quick else 24
    for name in runtimes:
        graph = work / "inline.onnx" if name == "onnx" else None
        for clients in [int(x) for x in args.clients.split(",") if x]:
            grpc_rows.append(
                b.grpc_end_to_end(
                    model.directory, short, clients, per_client, runtime=name, onnx_path=graph
                )
            )
    table = b.markdown_table(
        ["runtime", "clients", "p50 ms", "p99 ms", "req/s", "vs best in-process"],
        [
            [
                r.runtime,
                r.clients,
                r.p50_ms,
                r.p99_ms,
                r.per_s,
                r.per_s / best_in_process[r.runtime],
            ]
            for r in grpc_rows
        ],
    )
    report += ["", "## gRPC end to end on loopback (short texts)", "", table]
    print("\n" + table, flush=True)

    job_methods = [m for m in args.job_methods.split(",") if m]
    if job_methods:
        rows = b.job_method_ratios(model, settings, job_methods, short[:3], repeats)
        table = b.markdown_table(["method", "x forward pass", "ms", "note"], rows)
        report += ["", "## Job methods as multiples of one forward pass", "", table]
        print("\n" + table, flush=True)

    (args.out / "bench.md").write_text("\n".join(report) + "\n")
    _plot(inline_rows, grpc_rows, args.out / "bench.png")
    print(f"\nwrote {args.out / 'bench.md'} and {args.out / 'bench.png'}")
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    out = []
    if args.model_dir:
        out += ["--model", str(args.model_dir)]
    if args.demo_model:
        out += ["--demo", args.demo_model]
    if args.quick:
        out.append("--quick")
    return out

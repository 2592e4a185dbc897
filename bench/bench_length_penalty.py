"""Mixed-length load against the batcher's length penalty (out of process).

    .venv/bin/python bench/bench_length_penalty.py [--demo minilm|bert-tiny]
        [--penalties 0,0.25,0.5] [--mix 8+4] [--duration 10] [--torch-threads 1]

For each penalty: a sidecar in its own process; SHORT closed-loop clients of short reviews
alone, then with LONG clients of 20,000-character texts added (same server). Prints short p50
with and without the long clients, long throughput and latency, and tokens/s.
"""

from __future__ import annotations

import argparse

from limelight.api.server_process import start_server_process
from limelight.app import resolve_model_dir
from limelight.cli.bench import long_texts
from limelight.demo.datasets import rotten_tomatoes
from limelight.evaluation import benchmark as b
from limelight.settings import Settings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", default="minilm", choices=["minilm", "bert-tiny"])
    p.add_argument("--penalties", default="0,0.25,0.5")
    p.add_argument("--mix", default="8+4", help="SHORT+LONG clients")
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--torch-threads", type=int, default=1)
    args = p.parse_args()
    model_dir = resolve_model_dir(Settings(demo_model=args.demo), progress=True)
    reviews = [e.text for e in rotten_tomatoes("test")]
    short = sorted(reviews, key=len)[len(reviews) // 4 :][:64]
    longs = long_texts(reviews, 20_000, 16)
    n_short, n_long = (int(x) for x in args.mix.split("+"))
    rows = []
    for penalty in (float(x) for x in args.penalties.split(",")):
        server = start_server_process(
            {
                "model_dir": model_dir,
                "torch_threads": args.torch_threads,
                "batch_length_penalty": penalty,
            }
        )
        try:
            target, pid = server.target, server.pid
            alone = b.run_load(target, {"short": short}, {"short": n_short}, args.duration, 2, pid)
            mixed = b.run_load(
                target,
                {"short": short, "long": longs},
                {"short": n_short, "long": n_long},
                args.duration,
                2,
                pid,
            )
        finally:
            server.stop()
        rows.append(
            [
                penalty,
                alone.p50_ms("short"),
                mixed.p50_ms("short"),
                mixed.p50_ms("short") / alone.p50_ms("short"),
                mixed.p99_ms("short"),
                mixed.per_s("long"),
                mixed.p50_ms("long"),
                alone.tokens_per_s,
                mixed.tokens_per_s,
                mixed.tokens_per_s / alone.tokens_per_s,
            ]
        )
        print(rows[-1], flush=True)
    print(f"machine: {b.machine()}")
    print(
        b.markdown_table(
            [
                "penalty",
                "short p50 alone ms",
                "short p50 mixed ms",
                "mixed/alone",
                "short p99 mixed ms",
                "long req/s",
                "long p50 ms",
                "tokens/s alone",
                "tokens/s mixed",
                "mixed/alone",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()

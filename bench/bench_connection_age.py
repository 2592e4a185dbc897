"""What ``max_connection_age_s`` costs under load, and whether any call fails for it.

Starts the sidecar in its own process without and then with a connection age, and loads each
from this process (closed-loop grpc.aio clients on one connection, the same load generator as
``limelight bench --sections served``) with one-text unary calls, streams and ``ExplainBatch``
calls. Prints throughput and the number of texts whose call failed, per row.

    .venv/bin/python bench/bench_connection_age.py --demo bert-tiny --ages 0,0.5 --clients 32
"""

from __future__ import annotations

import argparse

from limelight.api.server_process import start_server_process
from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import rotten_tomatoes
from limelight.evaluation import benchmark as b
from limelight.settings import Settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", default="bert-tiny", help="demo model (default bert-tiny)")
    parser.add_argument("--runtime", default="onnx", choices=["torch", "onnx"])
    parser.add_argument(
        "--ages", default="0,0.5", help="connection ages in seconds, 0: none (default 0,0.5)"
    )
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=6.0, help="seconds measured per row")
    parser.add_argument("--rpcs", default="unary,stream,batch")
    args = parser.parse_args()

    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    reviews = [e.text for e in rotten_tomatoes("test")]
    texts = {"short": sorted(reviews, key=len)[len(reviews) // 4 :][:64]}
    print("| connection age s | rpc | texts/s | texts failed |")
    print("|---|---|---|---|")
    for age in (float(a) for a in args.ages.split(",")):
        settings: dict[str, object] = {
            "model_dir": model_dir,
            "runtime": args.runtime,
            "torch_threads": 1,
        }
        if age > 0:
            settings["max_connection_age_s"] = age
        server = start_server_process(settings)
        try:
            for rpc in args.rpcs.split(","):
                load = b.run_load(
                    server.target, texts, {"short": args.clients}, args.duration, 1.0,
                    server.pid, 1, rpc,
                )  # fmt: skip
                shown = f"{age:g}" if age > 0 else "none"
                print(f"| {shown} | {rpc} | {load.per_s():.0f} | {load.errors} |", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()

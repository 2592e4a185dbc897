"""The sidecar's per-token Python around the forward pass: tokens and the answer's layout.

    .venv/bin/python bench/bench_token_layout.py [--demo bert-tiny|minilm] [--rounds 5]

Explains `limelight bench`'s 64 short test reviews and 64 long ones (six reviews joined) once
with the demo model as served (the default inline method, in-process, no gRPC), then times in
rounds: the sidecar tokenising each text (``encode_batch`` of one text, an idle server's
request) against the fast tokenizer's own ``encode`` of it; and, alternating the two token
layouts (a Token message each, or columns), building each answer (``explanation_to_proto``,
which runs on the event loop), protobuf serialising it, and the SDK reading it back
(``Explanation.from_proto`` of the parsed bytes). Prints the median µs per text, the bytes on
the wire and each ratio against its baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

from limelight.api.convert import explanation_to_proto
from limelight.app import build_application, load_served_model
from limelight.core.service import _truncating_backend, encode_batch
from limelight.core.types import ExplainInput, Explanation
from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import rotten_tomatoes
from limelight.evaluation import benchmark as b
from limelight.metrics import Metrics
from limelight.models.loaded import load_model
from limelight.settings import Settings
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.types import Explanation as SdkExplanation

LAYOUTS = {"messages": pb.TOKEN_LAYOUT_MESSAGES, "columns": pb.TOKEN_LAYOUT_COLUMNS}


def explained(settings: Settings, texts: list[str]) -> list[Explanation]:
    model = load_served_model(settings)
    service = build_application(settings, Metrics(), model).service

    async def run() -> list[Explanation]:
        await service.start()
        try:
            return [await service.explain(ExplainInput(text=t)) for t in texts]
        finally:
            await service.close()

    return asyncio.run(run())


def build(explanation: Explanation, layout: int) -> object:
    return explanation_to_proto(explanation, layout)


def serialise(message: Any) -> object:
    return message.SerializeToString()


def sdk_read(wire: bytes) -> object:
    return SdkExplanation.from_proto(pb.ExplainResponse.FromString(wire))


def per_call_us(work: Callable[[Any], object], items: list[Any], repeats: int) -> float:
    """Median over the items of the mean time of ``repeats`` calls on each, µs."""
    times = []
    for item in items:
        start = time.perf_counter()
        for _ in range(repeats):
            work(item)
        times.append((time.perf_counter() - start) / repeats)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--demo", default="bert-tiny", choices=["bert-tiny", "minilm"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20, help="calls per answer and round")
    args = p.parse_args()
    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    settings = Settings(
        model_dir=model_dir, jobs="off", drift_enabled=False, warmup=False, metrics_port=0
    )
    reviews = [e.text for e in rotten_tomatoes("test")]
    sets = {  # the texts of `limelight bench`'s served and mixed sections
        "short": sorted(reviews, key=len)[len(reviews) // 4 :][:64],
        "long": [" ".join(reviews[i : i + 6]) for i in range(0, 6 * 64, 6)],
    }
    answers = {name: explained(settings, texts) for name, texts in sets.items()}
    model = load_model(model_dir)
    backend = _truncating_backend(model.tokenizer, model.max_tokens)
    tokenise: dict[tuple[str, str], list[float]] = {}
    times: dict[tuple[str, str, str], list[float]] = {}
    size: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for name, texts in sets.items():
            tokenise.setdefault((name, "backend"), []).append(
                per_call_us(functools.partial(backend.encode, add_special_tokens=True), texts, 5)
            )
            tokenise.setdefault((name, "sidecar"), []).append(
                per_call_us(lambda t: encode_batch(model, [(t, None)]), texts, 5)
            )
        for name, explanations in answers.items():
            for layout, value in LAYOUTS.items():
                protos = [explanation_to_proto(e, value) for e in explanations]
                wire = [m.SerializeToString() for m in protos]
                size[(name, layout)] = statistics.mean(len(w) for w in wire)
                steps: dict[str, tuple[Callable[[Any], object], list[Any]]] = {
                    "build": (functools.partial(build, layout=value), explanations),
                    "serialise": (serialise, protos),
                    "SDK read": (sdk_read, wire),
                }
                for step, (work, items) in steps.items():
                    us = per_call_us(work, items, args.repeats)
                    times.setdefault((name, layout, step), []).append(us)
    tokens = {n: statistics.median(len(e.tokens) for e in es) for n, es in answers.items()}
    method = answers["short"][0].attribution.method
    print(f"{args.demo}, the {method} answer of each text, {b.machine()}")
    print(f"{args.rounds} rounds x {args.repeats} calls per answer, median over the texts\n")
    print("| texts (median tokens) | step | messages µs | columns µs | columns ÷ messages |")
    print("|---|---|---|---|---|")
    for name in answers:
        alone = statistics.median(tokenise[(name, "backend")])
        ours = statistics.median(tokenise[(name, "sidecar")])
        print(
            f"| {name} ({tokens[name]:.0f}) | tokenise (either layout; the tokenizer's own "
            f"encode {alone:.1f} µs) | | {ours:.1f} | {ours / alone:.2f}× the tokenizer |"
        )
        for step in ("build", "serialise", "SDK read"):
            m = statistics.median(times[(name, "messages", step)])
            c = statistics.median(times[(name, "columns", step)])
            print(f"| {name} ({tokens[name]:.0f}) | {step} | {m:.1f} | {c:.1f} | {c / m:.2f}× |")
        m, c = size[(name, "messages")], size[(name, "columns")]
        print(f"| {name} ({tokens[name]:.0f}) | bytes | {m:.0f} | {c:.0f} | {c / m:.2f}× |")


if __name__ == "__main__":
    main()

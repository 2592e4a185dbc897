"""The drift monitor's own work per request, on saved attributions: in seconds or instructions.

    # once: BERT-tiny's NormXLogit attributions of 3,000 training reviews (torch)
    .venv/bin/python bench/bench_drift_observe.py save obs.json --model bert-tiny
    # then: the monitor alone (no torch imported), timed
    .venv/bin/python bench/bench_drift_observe.py run obs.json [--sample-rate 0.1]
    # or counted: instructions do not depend on the host's load
    valgrind --tool=callgrind .venv/bin/python bench/bench_drift_observe.py run obs.json --repeat 0
    valgrind --tool=callgrind .venv/bin/python bench/bench_drift_observe.py run obs.json --repeat 1
    # what the service spends on the event loop to have one answer observed
    .venv/bin/python bench/bench_drift_observe.py loop

The first 500 attributions bootstrap the reference (as a sidecar's first answers do); the rest
are the measured requests: for each, ``sampled()`` and, when sampled, ``observe``. The
difference of the two callgrind totals over the measured requests is the monitor's
instructions per request.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from limelight.drift import DriftMonitor
from limelight.settings import Settings

BOOTSTRAP = 500


def save(path: Path, model_name: str, n: int) -> None:
    # Imported here: `run` must not load torch (it would dominate an instruction count).
    from limelight.demo.build import ensure_demo_model
    from limelight.demo.datasets import rotten_tomatoes
    from limelight.drift.build import explain_texts
    from limelight.models.loaded import load_model

    settings = Settings()
    if model_name in ("minilm", "bert-tiny"):
        model_dir = ensure_demo_model(model_name, settings.cache_dir)
    else:
        model_dir = Path(model_name)
    model = load_model(model_dir)
    texts = [e.text for e in rotten_tomatoes("train")[:n]]
    observations = explain_texts(model, texts)
    rows = [[o.label, list(o.tokens), [float(x) for x in o.scores]] for o in observations]
    path.write_text(json.dumps({"model": model.name, "observations": rows}))
    tokens = sum(len(r[1]) for r in rows) / len(rows)
    print(f"saved {len(rows)} attributions of {model.name} ({tokens:.1f} tokens each) to {path}")


def run(path: Path, sample_rate: float, repeat: int) -> None:
    data = json.loads(path.read_text())
    rows = data["observations"]
    labels = sorted({r[0] for r in rows})
    monitor = DriftMonitor(Settings(drift_sample_rate=sample_rate), labels, None)
    for label, tokens, scores in rows[:BOOTSTRAP]:
        monitor.observe(label, tokens, scores)
    measured = rows[BOOTSTRAP:]
    started = time.perf_counter()
    for _ in range(repeat):
        for label, tokens, scores in measured:
            if monitor.sampled():
                monitor.observe(label, tokens, scores)
    seconds = time.perf_counter() - started
    requests = repeat * len(measured)
    per = f"{1e6 * seconds / requests:.1f} us per request" if requests else "nothing timed"
    print(
        f"{data['model']}: {requests} requests after a {BOOTSTRAP}-answer bootstrap, sample "
        f"rate {sample_rate:g}: {per} (reference {monitor.state})"
    )


def loop_cost(repeat: int) -> None:
    """The event-loop time of the service's drift step for one answer (``_observe``, which
    hands the answer to the drift feeder), for a short review and a 20,000-character document
    explained whole (BERT-tiny, ``truncation=window``); the feeder is flushed between calls,
    untimed."""
    import asyncio
    import statistics

    import numpy as np

    from limelight.app import build_application
    from limelight.cli.bench import long_texts
    from limelight.core.types import ExplainInput
    from limelight.demo.build import ensure_demo_model
    from limelight.demo.datasets import rotten_tomatoes
    from limelight.metrics import Metrics

    async def measure() -> None:
        model_dir = ensure_demo_model("bert-tiny", Settings().cache_dir)
        settings = Settings(
            model_dir=model_dir, jobs="off", metrics_port=0, truncation="window",
            drift_bootstrap_n=BOOTSTRAP,
        )  # fmt: skip
        service = build_application(settings, Metrics()).service
        await service.start()
        reviews = [e.text for e in rotten_tomatoes("test")]
        cases = [
            ("short review", reviews[0]),
            ("20,000 characters", long_texts(reviews, 20_000, 1)[0]),
        ]
        try:
            for name, text in cases:
                answer = await service.explain(ExplainInput(text=text))
                shape = (len(answer.tokens), len(answer.labels))
                matrix = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
                for _ in range(BOOTSTRAP):  # the reference fills: the window takes the rest
                    service._observe(answer, matrix)
                await service.drift_report(1)
                seconds = []
                for _ in range(repeat):
                    started = time.perf_counter()
                    service._observe(answer, matrix)
                    seconds.append(time.perf_counter() - started)
                    await service.drift_report(1)  # waits for the feeder
                median = 1e6 * statistics.median(seconds)
                print(f"{name} ({shape[0]} tokens): {median:.1f} us on the event loop per answer")
        finally:
            await service.close()

    asyncio.run(measure())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_save = sub.add_parser("save", help="compute and save NormXLogit attributions")
    p_save.add_argument("path", type=Path)
    p_save.add_argument("--model", default="bert-tiny", help="minilm, bert-tiny or a model dir")
    p_save.add_argument("--n", type=int, default=3000, help="training reviews")
    p_run = sub.add_parser("run", help="feed the saved attributions to a monitor")
    p_run.add_argument("path", type=Path)
    p_run.add_argument("--sample-rate", type=float, default=1.0)
    p_run.add_argument("--repeat", type=int, default=1, help="passes over the measured ones")
    p_loop = sub.add_parser("loop", help="the service's event-loop time per observed answer")
    p_loop.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args(argv)
    if args.command == "save":
        save(args.path, args.model, args.n)
    elif args.command == "loop":
        loop_cost(args.repeat)
    else:
        run(args.path, args.sample_rate, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())

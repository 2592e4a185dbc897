"""The drift monitor's own work per request, on saved attributions: in seconds or instructions.

    # once: BERT-tiny's NormXLogit attributions of 3,000 training reviews (torch)
    .venv/bin/python bench/bench_drift_observe.py save obs.json --model bert-tiny
    # then: the monitor alone (no torch imported), timed
    .venv/bin/python bench/bench_drift_observe.py run obs.json [--sample-rate 0.1]
    # or counted: instructions do not depend on the host's load
    valgrind --tool=callgrind .venv/bin/python bench/bench_drift_observe.py run obs.json --repeat 0
    valgrind --tool=callgrind .venv/bin/python bench/bench_drift_observe.py run obs.json --repeat 1

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
    args = parser.parse_args(argv)
    if args.command == "save":
        save(args.path, args.model, args.n)
    else:
        run(args.path, args.sample_rate, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())

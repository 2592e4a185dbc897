"""What a long document costs the sidecar beyond its windows' forward passes: cutting it into
windows, laying them out and stitching the scores back (``limelight.core.windows``).

    .venv/bin/python bench/bench_windows.py --demo bert-tiny --chars 20000
    # an older tree for comparison (the same calls, whatever their insides):
    PYTHONPATH=OLD/server:OLD/client .venv/bin/python bench/bench_windows.py --demo bert-tiny

The texts are test reviews of the demo dataset joined up to ``--chars`` characters (as the
``--mix`` load of ``limelight bench`` builds its long texts); the windows are the sidecar's
defaults (the model's token limit, a stride of 64). Prints the median over ``--repeat`` calls of
each step, in milliseconds per document, and which thread it runs on in the sidecar.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from limelight.cli.bench import long_texts
from limelight.core.windows import WindowLayout, encode_windows
from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import rotten_tomatoes
from limelight.evaluation.benchmark import median_seconds
from limelight.models.loaded import load_model
from limelight.settings import Settings


def stitch_twice(layout: WindowLayout, matrices: list[np.ndarray]) -> None:
    layout.stitch(matrices)
    layout.stitch(matrices)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", default="bert-tiny", choices=("bert-tiny", "minilm"))
    p.add_argument("--chars", type=int, default=20_000)
    p.add_argument("--texts", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()

    settings = Settings()
    model = load_model(ensure_demo_model(args.demo, settings.cache_dir))
    limit, stride = min(settings.max_tokens, model.max_tokens), settings.window_stride
    texts = long_texts([e.text for e in rotten_tomatoes("test")], args.chars, args.texts)
    rng = np.random.default_rng(0)
    steps: dict[str, list[float]] = {"encode": [], "layout": [], "stitch": []}
    windows_per_text, tokens_per_text = [], []
    for text in texts:
        windows = encode_windows(model, text, limit, stride)
        layout = WindowLayout.of(windows)
        # What the inline path stitches per answer: the class scores and NormXLogit's.
        matrices = [
            rng.standard_normal((len(w.input_ids), len(model.labels))).astype(np.float32)
            for w in windows
        ]
        calls: dict[str, Callable[[], Any]] = {
            "encode": partial(encode_windows, model, text, limit, stride),
            "layout": partial(WindowLayout.of, windows),
            "stitch": partial(stitch_twice, layout, matrices),
        }
        for step, call in calls.items():
            steps[step].append(1e3 * median_seconds(call, args.repeat, warmup=1))
        windows_per_text.append(len(windows))
        tokens_per_text.append(len(layout.tokens))
    print(
        f"{model.name}: {len(texts)} texts of {args.chars} characters, "
        f"{statistics.mean(windows_per_text):.1f} windows and "
        f"{statistics.mean(tokens_per_text):.0f} tokens each (limit {limit}, stride {stride})"
    )
    for step, values in steps.items():
        print(f"  {step:7s} {statistics.median(values):8.2f} ms per document")


if __name__ == "__main__":
    main()

"""The same reviews explained by NormXLogit, the classifier's context-free lexicon, the inline
head, Shapley values and greedy deletion: one heat-map row per method, written as a PNG.

    .venv/bin/python bench/figure_methods.py [--demo minilm] [--out docs/img/methods_minilm.png]

Each row is scaled to its own max |score| (red: towards the predicted class, blue: against).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

from limelight.demo.build import ensure_demo_model
from limelight.distill.train import predict_scores
from limelight.evaluation.perturbation import probabilities
from limelight.methods.base import JobContext
from limelight.methods.lexicon import Lexicon
from limelight.methods.search import greedy_deletion, shapley_values
from limelight.models.explainer_head import load_head
from limelight.models.loaded import load_model
from limelight.settings import Settings

REVIEWS = (
    "an unwatchable, overwrought misfire of a film",
    "a gorgeous, witty, seductive movie",
    "the plot is thin, but the performances are not bad at all",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", default="minilm", choices=["minilm", "bert-tiny"])
    parser.add_argument("--out", type=Path, default=Path("docs/img/methods_minilm.png"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = load_model(ensure_demo_model(args.demo, Settings().cache_dir, progress=False))
    head = load_head(model)
    lexicon, ctx = Lexicon(), JobContext(model=model, settings=Settings())
    rows: list[tuple[str, list[str], list[np.ndarray]]] = []
    for text in REVIEWS:
        enc = model.encode(text)
        target = int(probabilities(model, [enc])[0].argmax())
        with torch.inference_mode():
            ids = torch.tensor([enc.input_ids])
            out = model.adapter.run_base(ids, torch.ones_like(ids))
            logits = model.adapter.head(out.last_hidden_state)[0]
            normx = (out.hidden_states[0][0].norm(dim=-1)[:, None] * logits)[:, target].numpy()
        keep = [i for i, t in enumerate(enc.tokens) if not t.special]
        methods = {
            "normxlogit": normx,
            "lexicon": lexicon.run(ctx, enc, target, lexicon.defaults()).scores,
            "inline head": predict_scores(model, head, enc)[:, target],
            "shapley (16)": shapley_values(model, enc, target, permutations=16),
            "greedy deletion": greedy_deletion(model, enc, target),
        }
        label = model.labels[target]
        rows.append(
            (
                f"{text!r} → {label}",
                [enc.tokens[i].text for i in keep],
                [np.asarray(v)[keep] for v in methods.values()],
            )
        )
    names = ["normxlogit", "lexicon", "inline head", "shapley (16)", "greedy deletion"]
    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.9 * len(rows)))
    for ax, (title, tokens, values) in zip(np.atleast_1d(axes), rows, strict=True):
        grid = np.stack([v / (np.abs(v).max() or 1.0) for v in values])
        ax.imshow(grid, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
        ax.set_xticks(range(len(tokens)), tokens, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_title(title, fontsize=9, loc="left")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

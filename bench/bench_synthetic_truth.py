"""Recovery of known word weights: the inline head against NormXLogit and Shapley values.

    .venv/bin/python bench/bench_synthetic_truth.py [--n-train 1000] [--n-test 200]
    .venv/bin/python bench/bench_synthetic_truth.py --width 0 --attention-heads 0   # linear

A tiny BERT is trained on the synthetic linear-words task (ten words with fixed log-odds
weights, SLALOM paper's setting; see ``limelight.demo.synthetic``), so the truth is known.
A head is distilled on it exactly as for the demo models (Shapley labels from two antithetic
permutations, then the classifier in the loop). On held-out samples every method explains the
predicted class; each word's scores are averaged over its occurrences (sign-flipped when the
predicted class is 0, so that scores are towards class 1), and the ten averages are compared
with the true weights by Spearman correlation. Reported, not asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

from limelight.demo.synthetic import (
    SYNTHETIC_WEIGHTS,
    SYNTHETIC_WORDS,
    build_synthetic_model,
    sample_linear_dataset,
)
from limelight.distill.train import TrainConfig, distill, predict_scores
from limelight.methods.search import shapley_values
from limelight.models.loaded import load_model
from limelight.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-train", type=int, default=1000)
    parser.add_argument("--n-test", type=int, default=200)
    parser.add_argument("--loop-steps", type=int, default=300)
    parser.add_argument(
        "--loop-estimator", default="policy", choices=["policy", "straight_through"]
    )
    parser.add_argument("--width", type=int, default=64, help="the head's (0: a linear head)")
    parser.add_argument("--attention-heads", type=int, default=4, help="its context block's")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_synthetic_model(Path(tmp) / "model", seed=0, n_train=6000)
        model = load_model(model_dir)
        texts = sample_linear_dataset(args.n_train, seed=1).texts()
        head, card = distill(
            model,
            Settings(jobs="off"),
            texts,
            "shapley",
            {"permutations": 2},
            Path(tmp) / "labels.jsonl",
            config=TrainConfig(
                width=args.width,
                attention_heads=args.attention_heads,
                loop_steps=args.loop_steps,
                loop_estimator=args.loop_estimator,
            ),
        )
        test = sample_linear_dataset(args.n_test, seed=2).texts()
        per_word: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for text in test:
            encoded = model.encode(text)
            scores_head = predict_scores(model, head, encoded)
            with torch.inference_mode():
                ids = torch.tensor([encoded.input_ids])
                out = model.adapter.run_base(ids, torch.ones_like(ids))
                logits = model.adapter.head(out.last_hidden_state)[0]
                normx = (out.hidden_states[0][0].norm(dim=-1)[:, None] * logits).numpy()
                predicted = int(model.model(input_ids=ids).logits[0].argmax())
            sign = 1.0 if predicted == 1 else -1.0
            shap = shapley_values(model, encoded, predicted, permutations=16)
            methods = {
                "distilled head": scores_head[:, predicted],
                "normxlogit": normx[:, predicted],
                "shapley (16 permutations)": shap,
            }
            for i, tok in enumerate(encoded.tokens):
                if tok.special or tok.text not in SYNTHETIC_WORDS:
                    continue
                for name, values in methods.items():
                    per_word[name][tok.text].append(sign * float(values[i]))
        truth = dict(zip(SYNTHETIC_WORDS, SYNTHETIC_WEIGHTS, strict=True))
        print(
            f"synthetic linear-words model; {args.n_train} training texts, {args.n_test} held out"
        )
        print("| method | Spearman with the true weights |")
        print("|---|---|")
        for name, words in per_word.items():
            common = [w for w in SYNTHETIC_WORDS if words.get(w)]
            rho = spearmanr(
                [np.mean(words[w]) for w in common], [truth[w] for w in common]
            ).statistic
            print(f"| {name} | {rho:.3f} |")
        print(f"head card: {card.validation}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How much of the BERT-tiny head's faithfulness needs its context block: per-token heads.

    .venv/bin/python bench/bench_per_token_head.py probe --threads 2
    .venv/bin/python bench/bench_per_token_head.py build --out /tmp/bert-tiny-per-token

``probe`` fits linear maps by ridge regression (seconds), token by token, from features to the
demo head's cached training labels (signed greedy-deletion ranks, each text scaled by its
largest magnitude), one map per explained class, and scores them on the held-out sample of
`limelight eval --n 120 --seed 0` (deletion and sufficiency AOPC with ``[MASK]``, deletion with
the top tokens removed), paired against the lexicon lookup. Feature sets: the classifier's
hidden states of every layer, with and without the lexicon's columns, the last layer's alone
with them, and only what the serving pass already returns without hidden states (lexicon,
per-token logits, embedding norm).

``build`` copies the BERT-tiny demo model (its cached labels included) and builds its demo head
with the demo recipe except ``attention_heads=0``: no context block (``--attention-heads 1``:
a context block with one attention head instead of the demo's two). Then, on the copy:

    limelight eval --model OUT --n 120 --peer-budget 500 \\
        --methods distilled,shap,lime,integrated_gradients,normxlogit
    limelight bench --model OUT --sections inline --runtimes torch,onnx --batches 1,32 \\
        --torch-threads 1

docs/distillation-lab.md, "A per-token head", has the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from bench_head_width import HeldOut, cached_labels

from limelight.core.types import Encoded, FloatArray
from limelight.demo.build import demo_head_recipe, ensure_demo_model
from limelight.distill.build import build_head, report
from limelight.methods.base import JobContext
from limelight.methods.lexicon import lexicon_matrix
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings

FEATURE_SETS = ("hidden+lexicon", "hidden", "last+lexicon", "outputs")


class Features:
    """Per-token features of one text for one explained class, by feature set."""

    def __init__(self, model: LoadedModel, table: FloatArray) -> None:
        self.model = model
        self.table = table
        self.runtime = TorchRuntime(model, {})

    @torch.inference_mode()
    def __call__(self, enc: Encoded, target: int, kind: str) -> np.ndarray:
        lexicon = self.table[enc.input_ids].astype(np.float64)
        own, other = lexicon[:, target : target + 1], np.delete(lexicon, target, axis=1)
        lex = [own, own - other.mean(axis=1, keepdims=True)]
        if kind == "outputs":
            out = self.runtime.run_inline(InlineBatch.from_encoded([enc], self.model.pad_id))
            logits = out.token_logits[0].astype(np.float64)
            mine = logits[:, target : target + 1]
            rest = np.delete(logits, target, axis=1).mean(axis=1, keepdims=True)
            norm = np.log1p(out.embedding_norms[0].astype(np.float64))[:, None]
            parts = [*lex, mine, mine - rest, norm]
        else:
            ids = torch.tensor([enc.input_ids])
            hidden = self.model.model(
                input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True
            ).hidden_states
            states = [h[0].double().numpy() for h in hidden]
            if kind == "hidden":
                parts = states
            elif kind == "hidden+lexicon":
                parts = [*lex, *states]
            else:
                parts = [*lex, states[-1]]
        return np.concatenate(parts, axis=1)


class Ridge:
    """One standardised ridge map per explained class."""

    def __init__(self, penalty: float = 1e-3) -> None:
        self.penalty = penalty
        self.maps: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def fit(self, target: int, x: np.ndarray, y: np.ndarray) -> None:
        mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
        z = np.concatenate([(x - mean) / std, np.ones((len(x), 1))], axis=1)
        gram = z.T @ z + self.penalty * len(z) * np.eye(z.shape[1])
        self.maps[target] = (mean, std, np.linalg.solve(gram, z.T @ y))

    def __call__(self, target: int, x: np.ndarray) -> np.ndarray:
        mean, std, w = self.maps[target]
        z = np.concatenate([(x - mean) / std, np.ones((len(x), 1))], axis=1)
        return np.asarray(z @ w, dtype=np.float32)


def probe(model_dir: Path, n_texts: int) -> None:
    model = load_model(model_dir)
    table = lexicon_matrix(JobContext(model=model, settings=Settings(jobs="off")), 1024)
    features = Features(model, table)
    labels = cached_labels(model_dir, "greedy_deletion")[:n_texts]
    held = HeldOut(model, 120, 0)

    def lookup(enc: Encoded, target: int) -> FloatArray:
        return np.asarray(table[enc.input_ids, target], dtype=np.float32)

    base = held.score_explainer(lookup)
    print(f"{len(labels)} labelled training reviews; held-out sample of 120, seed 0")
    print(
        "| features | deletion | sufficiency | removed | Δ deletion | Δ sufficiency | Δ removed |"
    )
    print("|---|---|---|---|---|---|---|")
    print(f"| the lexicon lookup | {held.cells(base, base)} |")
    for kind in FEATURE_SETS:
        rows: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for example in labels:
            enc = model.encode(example.text)
            if len(enc.input_ids) != len(example.scores):
                continue
            scores = np.asarray(example.scores, dtype=np.float64)
            keep = ~np.asarray(enc.special_mask)
            xs, ys = rows.setdefault(example.target, ([], []))
            xs.append(features(enc, example.target, kind)[keep])
            ys.append(scores[keep] / (np.abs(scores).max() or 1.0))
        ridge = Ridge()
        for target, (xs, ys) in rows.items():
            ridge.fit(target, np.concatenate(xs), np.concatenate(ys))
        explain = _explainer(ridge, features, kind)
        print(f"| {kind} | {held.cells(held.score_explainer(explain), base)} |", flush=True)


def _explainer(ridge: Ridge, features: Features, kind: str) -> Callable[[Encoded, int], FloatArray]:
    def explain(enc: Encoded, target: int) -> FloatArray:
        return ridge(target, features(enc, target, kind))

    return explain


def build(model_dir: Path, out: Path, attention_heads: int = 0) -> None:
    if not out.exists():
        shutil.copytree(model_dir, out)
    shutil.rmtree(out / "limelight_distilled", ignore_errors=True)
    recipe = demo_head_recipe("bert-tiny")
    train = dataclasses.replace(recipe.train, attention_heads=attention_heads)
    recipe = dataclasses.replace(recipe, train=train)
    _, card, where = build_head(load_model(out), Settings(jobs="off"), recipe)
    print(report(card))
    print(f"wrote {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("mode", choices=["probe", "build"])
    parser.add_argument("--out", type=Path, help="build: the copy of the demo model")
    parser.add_argument("--n-texts", type=int, default=8000, help="probe: training reviews")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--attention-heads",
        type=int,
        default=0,
        help="build: the context block's attention heads (0: none, a per-token head; the demo: 2)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = ensure_demo_model("bert-tiny", Settings().cache_dir)
    if args.mode == "probe":
        probe(model_dir, args.n_texts)
    elif args.out is None:
        raise SystemExit("build needs --out")
    else:
        build(model_dir, args.out, args.attention_heads)


if __name__ == "__main__":
    main()

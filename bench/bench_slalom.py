"""SLALOM against LIME and SHAP's Partition explainer at the same model-evaluation budget.

Same model, same held-out Rotten Tomatoes reviews, same run. For each method: wall time per
explanation, the model evaluations it actually made, and the deletion AOPC (mask replacement,
``limelight.evaluation.perturbation.deletion_aopc``) of its token scores; random scores are the
floor. LIME and SHAP need the optional ``peers`` extra (``pip install -e '.[peers]'``).

    .venv/bin/python bench/bench_slalom.py --model bert-tiny --n 20 --budget 500 --write-docs

How the peers see the input (token level, like SLALOM):

* LIME (``lime`` 0.2.0.1, ``LimeTextExplainer(bow=False)``): one feature per non-special token
  position; a removed position becomes the model's mask token; ``num_samples`` = budget. LIME
  fits its weighted ridge to the class probability, as it does by default.
* SHAP Partition (``shap.maskers.Text`` over the model's own tokenizer, mask token, no
  collapsing; ``max_evals`` = budget): explains the class probability.
* SLALOM: ``num_samples`` = budget − 1 (plus one pass on the full input), other parameters at
  their defaults; the linearised score ranks tokens.

Every method runs the model with the same rows per forward pass (``--batch-size``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from limelight.core.types import Encoded, FloatArray
from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import rotten_tomatoes
from limelight.evaluation.benchmark import machine
from limelight.evaluation.perturbation import deletion_aopc, probabilities, random_deletion_aopc
from limelight.methods.base import JobContext
from limelight.methods.slalom import Slalom
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.base import InlineBatch
from limelight.settings import Settings

DOC = Path(__file__).resolve().parent.parent / "docs" / "methods" / "slalom.md"


@dataclass
class Result:
    seconds: list[float] = field(default_factory=list)
    evaluations: list[int] = field(default_factory=list)
    scores: list[FloatArray] = field(default_factory=list)


class Counter:
    """Runs the model on token-id rows in batches and counts the rows it evaluated."""

    def __init__(self, model: LoadedModel, batch_size: int = 64) -> None:
        self.model = model
        self.batch_size = batch_size
        self.rows = 0

    @torch.inference_mode()
    def probs(self, items: Sequence[Encoded]) -> np.ndarray:
        out = []
        for start in range(0, len(items), self.batch_size):
            chunk = list(items[start : start + self.batch_size])
            batch = InlineBatch.from_encoded(chunk, self.model.pad_id)
            ids = torch.from_numpy(batch.input_ids).to(self.model.device)
            mask = torch.from_numpy(batch.attention_mask).to(self.model.device)
            types = (
                torch.from_numpy(batch.token_type_ids).to(self.model.device)
                if batch.token_type_ids is not None
                else None
            )
            logits = self.model.model(**self.model.adapter.base_inputs(ids, mask, types)).logits
            out.append(torch.softmax(logits.float(), dim=-1).cpu().numpy())
        self.rows += len(items)
        return np.concatenate(out, axis=0)


def run_slalom(
    model: LoadedModel,
    enc: Encoded,
    target: int,
    budget: int,
    seed: int,
    batch: int,
    extra: dict[str, Any],
) -> Result:
    ctx = JobContext(model=model, settings=Settings())
    params = {"num_samples": budget - 1, "seed": seed, "query_batch_size": batch, **extra}
    start = time.perf_counter()
    out = Slalom().run(ctx, enc, target, params)
    seconds = time.perf_counter() - start
    return Result([seconds], [int(out.details["model_evaluations"])], [out.scores])


def run_lime(
    model: LoadedModel, enc: Encoded, target: int, budget: int, seed: int, batch: int
) -> Result:
    from lime.lime_text import LimeTextExplainer

    positions = [i for i, t in enumerate(enc.tokens) if not t.special]
    mask_id = model.mask_token_id if model.mask_token_id is not None else model.pad_id
    counter = Counter(model, batch)

    def classify(texts: list[str]) -> np.ndarray:
        items = []
        for text in texts:
            kept = {int(w) for w in text.split(" ") if w.isdigit()}
            ids = list(enc.input_ids)
            for k, pos in enumerate(positions):
                if k not in kept:
                    ids[pos] = int(mask_id)
            items.append(Encoded(ids, enc.token_type_ids, enc.tokens, False))
        return counter.probs(items)

    explainer = LimeTextExplainer(
        bow=False, split_expression=lambda s: s.split(" "), random_state=seed
    )
    text = " ".join(str(k) for k in range(len(positions)))
    start = time.perf_counter()
    explanation = explainer.explain_instance(
        text, classify, labels=(target,), num_features=len(positions), num_samples=budget
    )
    seconds = time.perf_counter() - start
    scores = np.zeros(len(enc), dtype=np.float32)
    for feature, weight in explanation.as_map()[target]:
        scores[positions[feature]] = weight
    return Result([seconds], [counter.rows], [scores])


def run_shap(
    model: LoadedModel, enc: Encoded, text: str, target: int, budget: int, batch: int
) -> Result:
    import shap

    counter = Counter(model, batch)

    def predict(texts: np.ndarray) -> np.ndarray:
        return counter.probs([model.encode(str(t)) for t in texts])

    masker = shap.maskers.Text(model.tokenizer, collapse_mask_token=False)
    explainer = shap.explainers.Partition(predict, masker, output_names=model.labels)
    start = time.perf_counter()
    explanation = explainer([text], max_evals=budget, batch_size=batch, silent=True)
    seconds = time.perf_counter() - start
    values = np.asarray(explanation.values[0])[:, target]
    if len(values) != len(enc):  # SHAP's tokens are the model's own, specials included
        raise RuntimeError(f"SHAP returned {len(values)} tokens for an input of {len(enc)}")
    return Result([seconds], [counter.rows], [values.astype(np.float32)])


def pick_reviews(n: int, min_words: int, max_words: int) -> list[str]:
    texts = [r.text for r in rotten_tomatoes("test")]
    chosen = [t for t in texts if min_words <= len(t.split()) <= max_words]
    return chosen[:n]


def table(results: dict[str, Result], aopc: dict[str, float]) -> str:
    lines = [
        "| method | seconds / explanation (mean ± sd) | model evaluations / explanation "
        "| deletion AOPC ↑ |",
        "|---|---|---|---|",
    ]
    for name, aopc_value in aopc.items():
        res = results.get(name)
        if res is None:
            lines.append(f"| {name} | – | – | {aopc_value:.4f} |")
            continue
        sec = np.asarray(res.seconds)
        lines.append(
            f"| {name} | {sec.mean():.3f} ± {sec.std():.3f} | {np.mean(res.evaluations):.0f} "
            f"| {aopc_value:.4f} |"
        )
    return "\n".join(lines)


def write_docs(block: str, key: str) -> None:
    """Replace the ``<!-- bench:KEY:begin -->`` … ``end`` block of the method's docs page."""
    begin, end = f"<!-- bench:{key}:begin -->", f"<!-- bench:{key}:end -->"
    text = DOC.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{DOC} has no {begin} … {end} block")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    DOC.write_text(f"{head}{begin}\n{block}\n{end}{tail}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["bert-tiny", "minilm"], default="bert-tiny")
    parser.add_argument("--model-dir", type=Path, help="explain this classifier instead")
    parser.add_argument("--n", type=int, default=20, help="held-out reviews to explain")
    parser.add_argument("--budget", type=int, default=500, help="model evaluations per method")
    parser.add_argument("--min-words", type=int, default=10)
    parser.add_argument("--max-words", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default="slalom,lime,shap")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per model forward")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--slalom-params", default="{}", help='extra SLALOM parameters, JSON: {"epochs": 500}'
    )
    parser.add_argument("--write-docs", action="store_true", help=f"update {DOC}")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    slalom_params: dict[str, Any] = json.loads(args.slalom_params)

    cache = Path(os.environ.get("LIMELIGHT_CACHE_DIR") or Settings().cache_dir)
    model_dir = args.model_dir or ensure_demo_model(args.model, cache, progress=False)
    model = load_model(model_dir, device=Settings().device)
    texts = pick_reviews(args.n, args.min_words, args.max_words)
    encoded = [model.encode(t) for t in texts]
    targets = [int(np.argmax(p)) for p in probabilities(model, encoded)]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]

    runners: dict[str, Callable[[int], Result]] = {
        "slalom": lambda i: run_slalom(
            model,
            encoded[i],
            targets[i],
            args.budget,
            args.seed + i,
            args.batch_size,
            slalom_params,
        ),
        "lime": lambda i: run_lime(
            model, encoded[i], targets[i], args.budget, args.seed + i, args.batch_size
        ),
        "shap": lambda i: run_shap(
            model, encoded[i], texts[i], targets[i], args.budget, args.batch_size
        ),
    }
    score = slalom_params.get("score", "linearized")
    names = {"slalom": f"SLALOM ({score})", "lime": "LIME", "shap": "SHAP Partition"}
    # Warm up every path once so that first-call overheads do not land in one method's time.
    for m in methods:
        runners[m](0)
    results: dict[str, Result] = {names[m]: Result() for m in methods}
    # Interleave the methods per review so that load drift on a shared machine hits all alike.
    for i in range(len(texts)):
        for m in methods:
            r = runners[m](i)
            res = results[names[m]]
            res.seconds += r.seconds
            res.evaluations += r.evaluations
            res.scores += r.scores
        print(f"review {i + 1}/{len(texts)} done", file=sys.stderr)

    aopc = {
        name: deletion_aopc(model, encoded, res.scores, targets) for name, res in results.items()
    }
    aopc["random"] = random_deletion_aopc(model, encoded, targets, seed=args.seed, repeats=5)
    command = "python bench/bench_slalom.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a != "--write-docs"
    )
    mean_tokens = np.mean([int((~e.special_mask).sum()) for e in encoded])
    block = "\n".join(
        [
            f"Command: `{command.strip()}`  ",
            f"Model: `{model.name}` ({model.architecture}, {model.num_layers} layers); "
            f"{len(texts)} held-out Rotten Tomatoes reviews of {args.min_words}–{args.max_words}"
            f" words ({mean_tokens:.1f} tokens on average); budget {args.budget} model "
            f"evaluations per explanation; {args.batch_size} rows per forward pass for every "
            "method.  ",
            f"Machine: {machine()}.",
            "",
            table(results, aopc),
        ]
    )
    print(block)
    if args.write_docs:
        write_docs(block, "custom" if args.model_dir else args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

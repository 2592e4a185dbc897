"""How much of a faithful ranking is lexical: the classifier's own context-free lexicon.

    .venv/bin/python bench/bench_lexicon.py --demo minilm --blend 0.1,0.25,0.5,1 \
        --feature-seeds 0,1 --threads 2
    .venv/bin/python bench/bench_lexicon.py --demo bert-tiny --blend 0.1,0.25,0.5,1 --threads 2

The lexicon gives every vocabulary entry its own effect on the classifier: the log-probability
of each class for the text made of that one token (``[CLS] v [SEP]``) minus that of the empty
text (``[CLS] [SEP]``), one batched pass over the vocabulary (about 15 s for MiniLM on two
cores). A token's lexicon score is its entry's for the explained class minus the entry's mean
over the classes: a table lookup that reads no context at all, so what the head gains over it
is what context (and the head's training) adds.

On held-out test reviews (the sample of `limelight eval --n N --seed S`) it prints deletion and
sufficiency AOPC with ``[MASK]`` and deletion with the top tokens removed for

- the served inline head (the baseline of the rows below it),
- the lexicon alone,
- ``--blend``: the head's scores plus α times the lexicon's, each divided by its root mean
  square over the text's tokens,
- ``--feature-seeds``: heads trained as the demo head's first stage (its cached labels, no loop)
  with the lexicon's columns among their inputs, each paired against the same training without
  them at the same seed.

docs/distillation-lab.md, "A context-free lexicon", has the figures.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from bench_head_width import HeldOut, cached_labels
from tqdm import tqdm

from limelight.core.types import Encoded, FloatArray
from limelight.demo.build import DEMO_HEADS, ensure_demo_model
from limelight.distill import train
from limelight.distill.train import TrainConfig, train_head
from limelight.models.explainer_head import ExplainerHead, inline_heads
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings

Explain = Callable[[Encoded, int], FloatArray]


@torch.inference_mode()
def lexicon(model: LoadedModel, batch_size: int = 1024) -> np.ndarray:
    """[V, C]: each vocabulary entry's class log-probabilities alone minus the empty text's."""
    tokenizer = model.tokenizer
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    if cls is None or sep is None:
        raise SystemExit("the lexicon needs a tokenizer with [CLS] and [SEP] tokens")

    def log_probs(ids: torch.Tensor) -> torch.Tensor:
        logits = model.model(input_ids=ids.to(model.device)).logits.float()
        return torch.log_softmax(logits, dim=-1).cpu()

    empty = log_probs(torch.tensor([[cls, sep]]))
    rows = []
    for start in tqdm(range(0, tokenizer.vocab_size, batch_size), desc="lexicon", unit="batch"):
        ids = torch.arange(start, min(tokenizer.vocab_size, start + batch_size))
        texts = torch.stack([torch.full_like(ids, cls), ids, torch.full_like(ids, sep)], dim=1)
        rows.append(log_probs(texts) - empty)
    return torch.cat(rows).numpy()


def lexicon_scores(table: np.ndarray, enc: Encoded, target: int) -> FloatArray:
    entries = table[np.asarray(enc.input_ids)]
    return np.asarray(entries[:, target] - entries.mean(axis=1), dtype=np.float32)


def per_text_rms(scores: FloatArray, keep: np.ndarray) -> FloatArray:
    return scores / (np.sqrt(np.mean(scores[keep] ** 2)) + 1e-9)


@contextmanager
def lexicon_inputs(table: np.ndarray) -> Iterator[None]:
    """Heads that ``train_head`` builds inside this block read the lexicon's columns of each
    token beside their usual inputs (the token ids reach the features through the batch
    tensors ``train`` builds for the same texts)."""
    columns = torch.from_numpy(table).float()
    current: dict[str, torch.Tensor] = {}
    plain_tensors, plain_head = train._tensors, train.ExplainerHead

    def tensors(model: LoadedModel, items: Sequence[Encoded]) -> tuple[torch.Tensor, ...]:
        out = plain_tensors(model, items)
        current["ids"] = out[0]
        return out  # type: ignore[return-value]

    class LexiconHead(ExplainerHead):
        def __init__(
            self, layers: list[int], hidden: int, labels: int, width: int, heads: int = 4
        ) -> None:
            super().__init__(layers, hidden, labels, width, heads)
            self.proj = torch.nn.Linear(self.proj.in_features + labels, width)

        def features(
            self,
            hidden_states: tuple[torch.Tensor, ...] | list[torch.Tensor],
            embedding_norms: torch.Tensor,
            token_logits: torch.Tensor,
        ) -> torch.Tensor:
            plain = super().features(hidden_states, embedding_norms, token_logits)
            entries = columns[current["ids"].cpu()].to(plain.device)
            return torch.cat([plain, entries], dim=-1)

    train._tensors, train.ExplainerHead = tensors, LexiconHead  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        train._tensors, train.ExplainerHead = plain_tensors, plain_head  # type: ignore[misc]


def head_explainer(model: LoadedModel, head: ExplainerHead) -> Explain:
    """A freshly trained head's scores for one text (features, then the head's score)."""

    def explain(enc: Encoded, target: int) -> FloatArray:
        features, _ = train._features_and_logits(model, head, [enc])
        with torch.inference_mode():
            scores = head.score(features[0][None], torch.ones(1, len(enc)))
        return np.asarray(scores[0, :, target].float())

    return explain


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--demo", choices=sorted(DEMO_HEADS), default="minilm")
    parser.add_argument("--n", type=int, default=120, help="held-out test reviews")
    parser.add_argument("--seed-data", type=int, default=0, help="seed of the review sample")
    parser.add_argument("--blend", default="", help="weights α of the lexicon added to the head")
    parser.add_argument("--feature-seeds", default="", help="training seeds of lexicon-fed heads")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    model = load_model(model_dir)
    table = lexicon(model)
    scorer = HeldOut(model, args.n, args.seed_data)
    runtime = TorchRuntime(model, inline_heads(model))

    def served(enc: Encoded, target: int) -> FloatArray:
        batch = InlineBatch.from_encoded([enc], model.pad_id)
        return np.asarray(runtime.run_inline(batch).extra["distilled"][0, :, target])

    def blend(alpha: float) -> Explain:
        def explain(enc: Encoded, target: int) -> FloatArray:
            keep = ~enc.special_mask
            head = per_text_rms(served(enc, target), keep)
            return head + alpha * per_text_rms(lexicon_scores(table, enc, target), keep)

        return explain

    print(f"{args.demo}: {args.n} held-out test reviews (seed {args.seed_data})")
    print(
        "| explainer | deletion | sufficiency | removed | Δ deletion | Δ sufficiency | Δ removed |"
    )
    print("|---|---|---|---|---|---|---|")
    base = scorer.score_explainer(served)
    print(f"| the served head | {HeldOut.cells(base, base)} |", flush=True)
    rows: list[tuple[str, Explain]] = [
        ("the lexicon alone", lambda enc, target: lexicon_scores(table, enc, target))
    ]
    alphas = [float(a) for a in filter(None, args.blend.split(","))]
    rows += [(f"head + {a} × lexicon", blend(a)) for a in alphas]
    for name, explain in rows:
        print(f"| {name} | {HeldOut.cells(scorer.score_explainer(explain), base)} |", flush=True)

    demo = DEMO_HEADS[args.demo]
    labels = cached_labels(model_dir, demo.teacher)
    for seed in (int(s) for s in filter(None, args.feature_seeds.split(","))):
        config = TrainConfig(
            width=demo.train.width,
            attention_heads=demo.train.attention_heads,
            epochs=demo.train.epochs,
            seed=seed,
        )
        plain, _ = train_head(model, labels, config)
        with lexicon_inputs(table):
            fed, _ = train_head(model, labels, config)
            first = scorer.score_explainer(head_explainer(model, plain))
            second = scorer.score_explainer(head_explainer(model, fed))
        print(f"| first stage, seed {seed} | {HeldOut.cells(first, first)} |")
        fed_cells = HeldOut.cells(second, first)
        print(f"| the same with the lexicon as input, seed {seed} | {fed_cells} |")


if __name__ == "__main__":
    main()

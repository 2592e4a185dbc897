"""Does the BERT-tiny head gain from more training texts than the training split's reviews?

    .venv/bin/python bench/bench_head_texts.py --extra validation,crops --seeds 0,1

The demo head learns from 8,000 of the training split's 8,530 reviews. This labels two sets of
extra texts with the demo head's own teacher (resumable, cached under ``--labels``) — the
validation split's reviews, and one crop per training review (a random run of 40–80 % of its
words, so a new context for the same words) — then trains heads exactly as the demo build
does on the demo's cached labels alone and with each extra set added, and scores them on
held-out test reviews (the sample of ``limelight eval --n N --seed S``). Δ is paired against
the demo's labels alone at the same training seed. Measured in docs/distillation-lab.md ("Texts
beyond the training split did not").
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np
import torch
from bench_head_width import HeldOut, cached_labels

from limelight.demo import datasets
from limelight.demo.build import DEMO_HEADS, ensure_demo_model
from limelight.distill.train import TeacherExample, TrainConfig, teacher_attributions, train_head
from limelight.models.loaded import LoadedModel, load_model
from limelight.settings import Settings


def extra_texts(name: str, first: int) -> list[str]:
    if name == "validation":
        return [e.text for e in datasets.rotten_tomatoes("validation")]
    if name != "crops":
        raise SystemExit(f"unknown extra set {name!r}: validation or crops")
    rng = random.Random(7)
    crops = []
    for text in (e.text for e in datasets.rotten_tomatoes("train")[:first]):
        words = text.split()
        if len(words) >= 6:
            k = max(3, round(len(words) * rng.uniform(0.4, 0.8)))
            start = rng.randrange(0, len(words) - k + 1)
            crops.append(" ".join(words[start : start + k]))
    return crops


def labelled(
    model: LoadedModel, settings: Settings, name: str, first: int, labels: Path
) -> list[TeacherExample]:
    head = DEMO_HEADS["bert-tiny"]
    texts = extra_texts(name, first)
    started = time.monotonic()
    examples = teacher_attributions(
        model,
        settings,
        head.teacher,
        dict(head.teacher_params),
        texts,
        labels / f"bert-tiny.{head.teacher}.{name}.jsonl",
    )
    print(f"{name}: {len(texts)} texts labelled in {time.monotonic() - started:.0f} s", flush=True)
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--extra", default="validation,crops")
    parser.add_argument("--seeds", default="0,1", help="training seeds")
    parser.add_argument("--n", type=int, default=120, help="held-out test reviews")
    parser.add_argument("--seed-data", type=int, default=0, help="seed of the review sample")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--labels", type=Path, help="label cache (default: under the cache dir)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = Settings()
    model_dir = ensure_demo_model("bert-tiny", settings.cache_dir)
    model = load_model(model_dir)
    demo = DEMO_HEADS["bert-tiny"]
    base = cached_labels(model_dir, demo.teacher)
    labels = args.labels or settings.cache_dir / "bench" / "head-texts"
    extras = {
        name: labelled(model, settings, name, demo.n_texts, labels)
        for name in args.extra.split(",")
    }
    variants = [["demo"], *[[name] for name in extras]]
    if len(extras) > 1:
        variants.append(list(extras))
    scorer = HeldOut(model, args.n, args.seed_data)
    print("| labels | texts | seed | deletion | sufficiency | removed | Δ deletion | "
          "Δ sufficiency | Δ removed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    first: dict[int, list[np.ndarray]] = {}
    for variant in variants:
        examples = list(base) + [e for name in variant if name != "demo" for e in extras[name]]
        for seed in (int(s) for s in args.seeds.split(",")):
            config = TrainConfig(
                width=demo.train.width,
                attention_heads=demo.train.attention_heads,
                epochs=demo.train.epochs,
                seed=seed,
            )
            head, _ = train_head(model, examples, config)
            per = scorer.score(head)
            cells = scorer.cells(per, first.setdefault(seed, per))
            print(f"| {' + '.join(variant)} | {len(examples):,} | {seed} | {cells} |", flush=True)


if __name__ == "__main__":
    main()

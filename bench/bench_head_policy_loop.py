"""A zeroth-order classifier-in-the-loop stage for the BERT-tiny head (experiment, not built).

    .venv/bin/python bench/bench_head_policy_loop.py --steps 2000 --temperature 0.25 --seeds 0,1

The loop stage of `train_head` passes the head the derivative of the class probability with
respect to each token's mask (straight-through), a first-order estimate of what masking a
token does; measured, it makes the head worse (docs/distillation.md, "What was tried"). This
replaces that estimate with the classifier's actual answers: the head's scores define a
distribution over token orders (Plackett–Luce, sampled with Gumbel noise at ``--temperature``);
each sampled order is scored by the frozen classifier's deletion curve — the class probability
with the order's top 10, 20, … 50 % of the tokens masked, as the metric reads it (``--reward
deletion``; ``deletion-sufficiency`` also subtracts the probability with only those tokens
kept) — and the head's own order is the baseline (self-critical policy gradient). It starts
from the demo head's training (stage 1 on the cached labels), trains ``--steps`` more steps,
and is scored on held-out test reviews, paired against stage 1 alone at the same seed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from bench_head_width import HeldOut, cached_labels

from limelight.demo.build import DEMO_HEADS, ensure_demo_model
from limelight.distill import train
from limelight.models.explainer_head import ExplainerHead
from limelight.models.loaded import LoadedModel, load_model
from limelight.settings import Settings

FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5)


@torch.no_grad()
def class_probability(
    model: LoadedModel,
    ids: torch.Tensor,
    attn: torch.Tensor,
    types: torch.Tensor | None,
    target: torch.Tensor,
) -> torch.Tensor:
    kwargs = {"input_ids": ids, "attention_mask": attn}
    if types is not None:
        kwargs["token_type_ids"] = types
    probs = torch.softmax(model.model(**kwargs).logits.float(), dim=-1)
    return probs[torch.arange(len(ids)), target]


def curve(
    model: LoadedModel,
    order: torch.Tensor,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    keep: torch.Tensor,
    target: torch.Tensor,
    sufficiency: bool,
) -> torch.Tensor:
    """Per text: the mean class probability with each order's top share masked (lower:
    better), less the mean with only that share kept when ``sufficiency``."""
    ids, attn, types = batch
    mask_id = int(model.mask_token_id if model.mask_token_id is not None else model.pad_id)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))
    n = keep.sum(1)
    total = torch.zeros(len(order))
    for fraction in FRACTIONS:
        top = (rank < torch.clamp((fraction * n).round().long(), min=1)[:, None]) & keep
        total += class_probability(model, ids.masked_fill(top, mask_id), attn, types, target)
        if sufficiency:
            kept = ids.masked_fill(~top & keep, mask_id)
            total -= class_probability(model, kept, attn, types, target)
    return total / len(FRACTIONS)


def policy_loop(
    model: LoadedModel,
    head: ExplainerHead,
    examples: list[train.TeacherExample],
    args: argparse.Namespace,
    seed: int,
) -> None:
    items = train._items(model, head, examples, "rms")
    lengths = [len(i.encoded) for i in items]
    rng = np.random.default_rng(seed + 1)
    generator = torch.Generator().manual_seed(seed)
    for p in model.model.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=1e-2)
    head.train()
    step, started = 0, time.monotonic()
    while step < args.steps:
        for chosen_ids in train._batches(len(items), 16, rng, lengths):
            if step >= args.steps:
                break
            chosen = [items[i] for i in chosen_ids]
            x, mask, _, keep, target = train._pad(chosen)
            s = head.score(x, mask)[torch.arange(len(chosen)), :, target]
            logits = s.masked_fill(~keep, float("-inf")) / args.temperature
            batch = train._tensors(model, [c.encoded for c in chosen])
            sufficiency = args.reward == "deletion-sufficiency"
            own = curve(model, logits.detach().argsort(1, descending=True), batch, keep, target,
                        sufficiency)  # fmt: skip
            half = torch.clamp((0.5 * keep.sum(1)).round().long(), min=1)
            loss = torch.zeros(())
            for _ in range(args.samples):
                u = torch.rand(logits.shape, generator=generator).clamp(1e-9, 1 - 1e-9)
                order = (logits.detach() - torch.log(-torch.log(u))).argsort(1, descending=True)
                advantage = own - curve(model, order, batch, keep, target, sufficiency)
                # log-probability of the order's first half under Plackett–Luce
                ordered = logits.gather(1, order)
                finite = torch.isfinite(ordered)
                remaining = torch.logcumsumexp(ordered.flip(1), 1).flip(1)
                terms = (ordered - remaining).masked_fill(~finite, 0.0)
                first_half = torch.arange(ordered.shape[1])[None, :] < half[:, None]
                log_prob = (terms * first_half).sum(1)
                loss = loss - (advantage * log_prob).mean() / args.samples
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 500 == 0:
                print(f"  step {step}: {time.monotonic() - started:.0f} s", flush=True)
    head.eval()
    for p in model.model.parameters():
        p.requires_grad_(True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--temperature", type=float, default=0.25)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=4, help="sampled orders per text")
    parser.add_argument(
        "--reward", default="deletion", choices=["deletion", "deletion-sufficiency"]
    )
    parser.add_argument("--seeds", default="0,1", help="training seeds")
    parser.add_argument("--n", type=int, default=120, help="held-out test reviews")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = ensure_demo_model("bert-tiny", Settings().cache_dir)
    model = load_model(model_dir)
    demo = DEMO_HEADS["bert-tiny"]
    examples = cached_labels(model_dir, demo.teacher)
    scorer = HeldOut(model, args.n, 0)
    print("| training | seed | deletion | sufficiency | removed | Δ deletion | Δ sufficiency | "
          "Δ removed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        config = train.TrainConfig(
            width=demo.width, attention_heads=demo.attention_heads, epochs=demo.epochs, seed=seed
        )
        torch.manual_seed(seed)
        head, _ = train.train_head(model, examples, config)
        base = scorer.score(head)
        print(f"| demo | {seed} | {scorer.cells(base, base)} |", flush=True)
        policy_loop(model, head, examples, args, seed)
        per = scorer.score(head)
        name = f"+ {args.steps} policy steps ({args.reward}, τ {args.temperature})"
        print(f"| {name} | {seed} | {scorer.cells(per, base)} |", flush=True)


if __name__ == "__main__":
    main()

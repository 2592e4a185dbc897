"""Perturbation curves: delete (or insert) the highest-scored tokens and watch the prediction.

AOPC (area over the perturbation curve) for deletion is the mean drop of the target class's
probability when the top-k% tokens are replaced, averaged over the fractions k. Special tokens
are never perturbed and never ranked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from limelight.core.types import Encoded, FloatArray
from limelight.models.loaded import LoadedModel
from limelight.runtimes.base import InlineBatch

DEFAULT_FRACTIONS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5)
Replacement = Literal["mask", "delete"]


def ranked_positions(encoded: Encoded, scores: FloatArray) -> list[int]:
    """Non-special positions, highest score first (stable for ties)."""
    candidates = [i for i, tok in enumerate(encoded.tokens) if not tok.special]
    return sorted(candidates, key=lambda i: (-float(scores[i]), i))


def perturb(
    model: LoadedModel, encoded: Encoded, positions: Sequence[int], replace: Replacement
) -> Encoded:
    """A copy of ``encoded`` with ``positions`` replaced by the mask token or removed."""
    drop = set(positions)
    if replace == "mask" and model.mask_token_id is None:
        replace = "delete"
    ids, types, tokens = [], [], []
    for i, tid in enumerate(encoded.input_ids):
        if i in drop:
            if replace == "delete":
                continue
            tid = int(model.mask_token_id)  # type: ignore[arg-type]
        ids.append(tid)
        tokens.append(encoded.tokens[i])
        if encoded.token_type_ids is not None:
            types.append(encoded.token_type_ids[i])
    return Encoded(ids, types if encoded.token_type_ids is not None else None, tokens, False)


@torch.inference_mode()
def probabilities(model: LoadedModel, items: Sequence[Encoded], batch_size: int = 32) -> FloatArray:
    """[len(items), C] class probabilities: softmax of the model's logits, or a sigmoid per
    label for multi-label models (each label's AOPC is then about its own probability)."""
    out = []
    for start in range(0, len(items), batch_size):
        batch = InlineBatch.from_encoded(list(items[start : start + batch_size]), model.pad_id)
        ids = torch.from_numpy(batch.input_ids).to(model.device)
        mask = torch.from_numpy(batch.attention_mask).to(model.device)
        types = (
            torch.from_numpy(batch.token_type_ids).to(model.device)
            if batch.token_type_ids is not None
            else None
        )
        # as the inline path computes them: no pad token needed, none mistaken for padding
        logits = model.adapter.logits(ids, mask, types).float()
        probs = torch.sigmoid(logits) if model.is_multi_label else torch.softmax(logits, dim=-1)
        out.append(probs.cpu().numpy())
    return np.concatenate(out, axis=0).astype(np.float32)


def deletion_curve(
    model: LoadedModel,
    encoded: Encoded,
    scores: FloatArray,
    target: int,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    replace: Replacement = "mask",
) -> FloatArray:
    """Drop of p(target) after removing the top ``fraction`` of tokens, one value per fraction."""
    order = ranked_positions(encoded, scores)
    variants = [encoded]
    for frac in fractions:
        k = max(1, round(frac * len(order))) if order else 0
        variants.append(perturb(model, encoded, order[:k], replace))
    probs = probabilities(model, variants)[:, target]
    return np.asarray(probs[0] - probs[1:], dtype=np.float32)


def deletion_aopc(
    model: LoadedModel,
    encoded: Sequence[Encoded],
    scores: Sequence[FloatArray],
    targets: Sequence[int],
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    replace: Replacement = "mask",
) -> float:
    """Mean deletion AOPC (comprehensiveness) over inputs; higher = more faithful ranking."""
    curves = [
        deletion_curve(model, e, s, t, fractions, replace)
        for e, s, t in zip(encoded, scores, targets, strict=True)
    ]
    return float(np.mean([c.mean() for c in curves]))


def random_deletion_aopc(
    model: LoadedModel,
    encoded: Sequence[Encoded],
    targets: Sequence[int],
    seed: int = 0,
    repeats: int = 3,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    replace: Replacement = "mask",
) -> float:
    """Deletion AOPC of uniformly random scores, averaged over ``repeats`` draws."""
    rng = np.random.default_rng(seed)
    return float(
        np.mean(
            [
                deletion_aopc(
                    model,
                    encoded,
                    [rng.random(len(e)).astype(np.float32) for e in encoded],
                    targets,
                    fractions,
                    replace,
                )
                for _ in range(repeats)
            ]
        )
    )

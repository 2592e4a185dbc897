"""Perturbation references that query the classifier many times: Shapley values and greedy
deletion.

Both treat the input's non-special tokens as players and measure the model on *coalitions*: a
token that is absent is replaced by the mask token (``replace="mask"``) or cut out of the
sequence (``replace="delete"``). They are what the deletion and sufficiency metrics measure, so
they are the references (and the teachers) of the distilled inline explainer.

- ``shapley``: Shapley values of the target class's log-odds, estimated by antithetic
  permutation sampling (each sampled permutation is paired with its reverse). Unbiased for any
  number of permutations; ``permutations=2`` is the cheap, noisy label used for amortisation
  (Covert et al., "Stochastic Amortization: A Unified Approach to Accelerate Feature and Data
  Attribution", arXiv 2401.15866), 16 or more is close to converged.
- ``greedy_deletion``: repeatedly remove the token whose removal lowers the target class's
  probability most; the first removed scores highest. A per-text search on the deletion metric
  itself, about n²/3 forward passes when it stops at half of the tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from limelight.core.types import Encoded, FloatArray
from limelight.errors import InvalidArgument
from limelight.methods.base import JobContext, JobMethod, MethodOutput, Param

REPLACEMENTS = ("mask", "delete")


def class_values(logits: torch.Tensor, target: int, multi_label: bool = False) -> torch.Tensor:
    """The value a coalition game pays: the target's log-odds against every other class
    (``logit_t - logsumexp(other logits)``); for a multi-label (sigmoid) head the label's own
    log-odds, its logit; the raw output of a regression head."""
    if logits.shape[-1] == 1:
        return logits[..., 0]
    if multi_label:
        return logits[..., target]
    others = torch.cat([logits[..., :target], logits[..., target + 1 :]], dim=-1)
    return logits[..., target] - torch.logsumexp(others, dim=-1)


@torch.inference_mode()
def batched_logits(
    model: Any,
    rows: Sequence[Sequence[int]],
    type_rows: Sequence[Sequence[int]] | None = None,
    batch_size: int = 64,
) -> torch.Tensor:
    """[len(rows), C] the model's logits of token-id rows of any lengths (right-padded per
    batch), as :meth:`HeadAdapter.logits` computes them.

    An empty row (every token cut out of a text its tokenizer adds no special tokens to, as
    GPT-2's adds none) is read as the pad token alone — for GPT-2 its end-of-text token, the
    text of nothing — since a model cannot run on no token at all."""
    out = []
    device = model.device
    pad = int(model.pad_id)
    for start in range(0, len(rows), batch_size):
        chunk = [list(r) if len(r) else [pad] for r in rows[start : start + batch_size]]
        width = max(len(r) for r in chunk)
        ids = torch.full((len(chunk), width), model.pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        types = torch.zeros((len(chunk), width), dtype=torch.long) if type_rows else None
        for i, row in enumerate(chunk):
            ids[i, : len(row)] = torch.as_tensor(row)
            mask[i, : len(row)] = 1
            if types is not None and type_rows is not None and len(type_rows[start + i]):
                types[i, : len(row)] = torch.as_tensor(type_rows[start + i])
        # The inline path's logits (the base, then the head at the mask's pooled position):
        # the classifier's own forward cannot pool a padded batch without a pad_token_id.
        logits = model.adapter.logits(
            ids.to(device), mask.to(device), None if types is None else types.to(device)
        )
        out.append(logits.float().cpu())
    return torch.cat(out)


class Coalitions:
    """Builds the model inputs for coalitions of one encoded text's non-special tokens."""

    def __init__(self, model: Any, encoded: Encoded, replace: str) -> None:
        self.model = model
        self.encoded = encoded
        self.players = [i for i, tok in enumerate(encoded.tokens) if not tok.special]
        mask_id = model.mask_token_id
        self.replace = "delete" if replace == "mask" and mask_id is None else replace
        self.mask_id = int(mask_id) if mask_id is not None else int(model.pad_id)

    def rows(self, present: np.ndarray) -> tuple[list[list[int]], list[list[int]] | None]:
        """Token-id rows (and segment rows) for a [k, players] boolean matrix of coalitions."""
        ids = np.asarray(self.encoded.input_ids, dtype=np.int64)
        types = self.encoded.token_type_ids
        t = np.asarray(types, dtype=np.int64) if types is not None else None
        keep_all = np.ones((present.shape[0], len(ids)), dtype=bool)
        keep_all[:, self.players] = present
        id_rows: list[list[int]] = []
        type_rows: list[list[int]] | None = [] if t is not None else None
        for keep in keep_all:
            if self.replace == "mask":
                id_rows.append(np.where(keep, ids, self.mask_id).tolist())
                if type_rows is not None and t is not None:
                    type_rows.append(t.tolist())
            else:
                id_rows.append(ids[keep].tolist())
                if type_rows is not None and t is not None:
                    type_rows.append(t[keep].tolist())
        return id_rows, type_rows

    def values(self, present: np.ndarray, target: int, batch_size: int) -> np.ndarray:
        """[k] target log-odds of each coalition."""
        id_rows, type_rows = self.rows(present)
        logits = batched_logits(self.model, id_rows, type_rows, batch_size)
        multi = bool(getattr(self.model, "is_multi_label", False))
        return class_values(logits, target, multi).numpy().astype(np.float64)


def shapley_values(
    model: Any,
    encoded: Encoded,
    target: int,
    permutations: int = 2,
    seed: int = 0,
    replace: str = "mask",
    batch_size: int = 64,
    ctx: JobContext | None = None,
) -> FloatArray:
    """[n] Shapley values of the target's log-odds (0 for special tokens), by antithetic
    permutation sampling: ``permutations`` must be even (each one is paired with its reverse)."""
    game = Coalitions(model, encoded, replace)
    m = len(game.players)
    scores = np.zeros(len(encoded), dtype=np.float32)
    if m == 0:
        return scores
    rng = np.random.default_rng([seed, m, target])
    orders = []
    for _ in range(max(1, permutations // 2)):
        order = rng.permutation(m)
        orders += [order, order[::-1]]
    # Rows of a permutation: the empty coalition, then one more player at a time.
    present = np.zeros((len(orders), m + 1, m), dtype=bool)
    for p, order in enumerate(orders):
        for step, player in enumerate(order):
            present[p, step + 1 :, player] = True
    flat = present.reshape(-1, m)
    values = np.empty(flat.shape[0])
    chunk = max(batch_size, m + 1)
    for start in range(0, flat.shape[0], chunk):
        values[start : start + chunk] = game.values(flat[start : start + chunk], target, batch_size)
        if ctx is not None:
            ctx.checkpoint(min(1.0, (start + chunk) / flat.shape[0]), "sampling coalitions")
    per_order = values.reshape(len(orders), m + 1)
    phi = np.zeros(m)
    for p, order in enumerate(orders):
        phi[order] += np.diff(per_order[p])
    scores[game.players] = phi / len(orders)
    return scores


def greedy_search(
    model: Any,
    encoded: Encoded,
    target: int,
    replace: str = "mask",
    max_fraction: float = 0.5,
    batch_size: int = 64,
    step: float = 0.0,
    signed: bool = False,
    ctx: JobContext | None = None,
    *,
    insert: bool = False,
) -> FloatArray:
    """[n] scores from greedy deletion (``insert`` False) or greedy insertion (True).

    Deletion starts from the whole text and repeatedly removes the token whose removal lowers
    the target most; insertion, the search on the sufficiency metric, starts from the text
    with every token absent and repeatedly adds the token whose addition raises the target
    most. A token's *effect* is what moving it changes in the search's direction (the drop
    when removed, the gain when added). The k-th token moved scores ``m - k``; tokens never
    moved (past ``max_fraction``) score below them, ordered by their effect in the last round.

    ``signed``: a token's sign is the sign of its effect when it was last measured. Positive
    tokens score their count down to 1 in the search's order, negative ones -1, -2, ... in
    the same order, so the ranking is the search's with the tokens that work against the
    target moved last — what a heat-map needs, where colour is read as direction.

    ``step`` = 0 moves one token per round (about n²/3 forward passes). ``step`` > 0 moves a
    share of the tokens per round — the ``step`` share with the largest single effects, in
    that order — so the rounds end at the fractions where a deletion or sufficiency curve is
    read (0.1 → 10 %, 20 %, …) at about n / step forward passes.
    """
    game = Coalitions(model, encoded, replace)
    m = len(game.players)
    scores = np.zeros(len(encoded), dtype=np.float32)
    if m == 0:
        return scores
    limit = max(1, int(np.ceil(max_fraction * m)))
    if step > 0:
        rounds = int(np.ceil(max_fraction / step - 1e-9))
        ends = sorted({min(limit, max(1, round((j + 1) * step * m))) for j in range(rounds)})
    else:
        ends = list(range(1, limit + 1))
    # ``waiting``: the tokens the search has not moved yet (present for deletion, absent
    # for insertion).
    waiting = np.ones(m, dtype=bool)
    rank = np.zeros(m)
    last_effect = np.zeros(m)
    current = game.values((waiting != insert)[None, :], target, batch_size)[0]
    moved = 0
    verb = "added" if insert else "removed"
    for done, end in enumerate(ends):
        candidates = np.flatnonzero(waiting)
        if candidates.size == 0:
            break
        trial = np.repeat(waiting[None, :], candidates.size, axis=0)
        trial[np.arange(candidates.size), candidates] = False
        values = game.values(trial != insert, target, batch_size)
        effect = values - current if insert else current - values
        last_effect[candidates] = effect
        chosen = np.argsort(-values if insert else values, kind="stable")[: end - moved]
        rank[candidates[chosen]] = m - moved - np.arange(chosen.size)
        waiting[candidates[chosen]] = False
        moved = end
        if chosen.size == 1:
            current = values[chosen[0]]
        else:  # the tokens moved together: measure where the search stands
            current = game.values((waiting != insert)[None, :], target, batch_size)[0]
        if ctx is not None:
            ctx.checkpoint((done + 1) / len(ends), f"{verb} {moved} of {limit} tokens")
    rest = np.flatnonzero(waiting)
    if rest.size:  # below every moved token, in the order of their last measured effect
        order = np.argsort(np.argsort(last_effect[rest]))
        rank[rest] = (order + 1) / (rest.size + 1)
    if signed:
        searched = np.argsort(-rank, kind="stable")
        towards = last_effect[searched] > 0
        rank[searched[towards]] = np.arange(int(towards.sum()), 0, -1)
        rank[searched[~towards]] = -np.arange(1, int((~towards).sum()) + 1)
    scores[game.players] = rank
    return scores


greedy_deletion = greedy_search
greedy_insertion = functools.partial(greedy_search, insert=True)


class ShapleyValues(JobMethod):
    name = "shapley"
    description = (
        "Shapley values of the target's log-odds by antithetic permutation sampling; absent "
        "tokens are masked or removed (about permutations x n forward passes)."
    )
    params: ClassVar[Mapping[str, Param]] = {
        "permutations": Param(
            int, 16, minimum=2, maximum=256, help="sampled permutations (even; pairs)"
        ),
        "replace": Param(str, "mask", choices=REPLACEMENTS, help="how an absent token is absent"),
        "seed": Param(int, 0, minimum=0, maximum=2**31 - 1, help="sampling seed"),
        "batch_size": Param(int, 64, minimum=1, maximum=512, help="coalitions per forward"),
    }

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        scores = shapley_values(
            ctx.model,
            encoded,
            target,
            permutations=int(params["permutations"]),
            seed=int(params["seed"]),
            replace=str(params["replace"]),
            # Within LIMELIGHT_JOB_MEMORY_MB, as every job method's passes.
            batch_size=min(
                int(params["batch_size"]), ctx.rows_per_pass(len(encoded), backward=False)
            ),
            ctx=ctx,
        )
        return MethodOutput(scores=scores, details={"value": "log-odds of the target class"})

    def validate_params(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        out = super().validate_params(given)
        if out["permutations"] % 2:  # antithetic pairs: an odd count would run one less
            raise InvalidArgument(
                "permutations must be even (sampled in antithetic pairs), "
                f"not {out['permutations']}"
            )
        return out


class GreedyDeletion(JobMethod):
    name = "greedy_deletion"
    description = (
        "Greedy search on the deletion metric: repeatedly remove the token whose removal lowers "
        "the target most; earlier removal scores higher (about n^2/3 forward passes, or n/step "
        "with a step share per round)."
    )
    insert = False
    params: ClassVar[Mapping[str, Param]] = {
        "replace": Param(str, "mask", choices=REPLACEMENTS, help="how a token is absent"),
        "max_fraction": Param(
            float, 0.5, minimum=0.01, maximum=1.0, help="stop after this share of tokens"
        ),
        "batch_size": Param(int, 64, minimum=1, maximum=512, help="candidates per forward"),
        "step": Param(
            float,
            0.0,
            minimum=0.0,
            maximum=0.5,
            help="share of tokens moved per round (0 = one token; 0.1 = rounds at 10 %, 20 %, …)",
        ),
        "signed": Param(
            bool,
            False,
            help="signed ranks: tokens that moved the target the wrong way negative, last",
        ),
    }

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        scores = greedy_search(
            ctx.model,
            encoded,
            target,
            insert=self.insert,
            replace=str(params["replace"]),
            max_fraction=float(params["max_fraction"]),
            batch_size=min(
                int(params["batch_size"]), ctx.rows_per_pass(len(encoded), backward=False)
            ),
            step=float(params["step"]),
            signed=bool(params["signed"]),
            ctx=ctx,
        )
        return MethodOutput(scores=scores)


class GreedyInsertion(GreedyDeletion):
    name = "greedy_insertion"
    description = (
        "Greedy search on the sufficiency metric: from the text with every token absent, "
        "repeatedly add the token whose addition raises the target most; earlier addition "
        "scores higher (about n^2/3 forward passes, or n/step with a step share per round)."
    )
    insert = True

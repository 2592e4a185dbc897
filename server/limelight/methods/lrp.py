"""Head-masked LRP for BERT-family encoders.

After Song et al., "Better Explain Transformers by Illuminating Important Information"
(arXiv 2401.09972), which builds on Chefer et al., "Transformer Interpretability Beyond
Attention Visualization" (arXiv 2012.09838). Method note: docs/methods/lrp.md.

The encoder is re-run layer by layer with the served model's own modules (embeddings, linear
layers, LayerNorms, activations; ``models/encoder.py``), so every activation the relevance rules
need is at hand and the attention probabilities exist whatever attention kernel (eager, sdpa,
flash) the model was loaded with. Nothing on the model is changed: the served forward pass and
its prediction are untouched, and a job can run while the same model serves inline traffic.

Relevance starts as 1 on the target logit (as Chefer et al. do) and is propagated explicitly:

* linear layers: the z⁺ rule in its α1β0 form (positive contributions x_i·w_ij only; the bias
  takes no relevance);
* LayerNorm, softmax, GELU/tanh/ReLU, dropout: relevance passes through unchanged;
* residual adds and the two attention matmuls (Q·Kᵀ and A·V): relevance is split between the two
  operands by gradient×input, then the two shares are rescaled so that their sum equals the
  relevance that came in (each share proportional to the magnitude of its gradient×input total).

So each layer conserves relevance; ``LRPTrace.layer_totals`` exposes the totals for the tests.

Head mask: relevance arriving at a masked head's context vector is not propagated through that
head; it stays on the residual stream at the same token position (so conservation still holds),
and masked heads are left out of the rollout average. The rollout is

    Ā_b = mean over heads h in H_b of (∇A_b^h ⊙ R_b^h)⁺,   C = Π_b rownorm(I + Ā_b),

with later layers multiplied on the left, and the token scores are the pooled position's row of
C with the pooled position itself set to 0.

The relevance that reaches the embedding output (``LRPTrace.input_relevance``) is not offered as
an attribution: with the z⁺ rule it is class-blind. Every rule above is linear in the relevance
that enters it and keeps only positive contributions, so the per-token totals at the input are
(to float precision) one fixed profile times a scalar, whatever the target class or the head's
weights: across classes, and after re-drawing the classifier head, their correlation is 1.000.
Only the gradient weighting of the rollout, ∇A ⊙ R, makes the scores class-specific (Chefer et
al. weight by the gradient for exactly this reason). The input relevance stays in the trace for
the conservation checks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import nn

from limelight.core.types import Encoded, FloatArray
from limelight.errors import FailedPrecondition, InvalidArgument
from limelight.methods.base import JobContext, JobMethod, MethodOutput, Param
from limelight.models.encoder import (
    EncoderBlock,
    LayerCache,
    encoder_forward,
    encoder_view,
    split_heads,
    unsupported_reason,
)
from limelight.models.head_mask import resolve_head_mask

if TYPE_CHECKING:
    from limelight.models.loaded import LoadedModel

_EPS = 1e-9


# --------------------------------------------------------------------------------------------
# Relevance rules


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    ok = den.abs() > _EPS
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def lrp_linear(x: torch.Tensor, weight: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """z⁺ / α1β0 rule for y = x Wᵀ + b: relevance of y → relevance of x (bias gets none)."""
    xp, xn = x.clamp(min=0), x.clamp(max=0)
    wp, wn = weight.clamp(min=0), weight.clamp(max=0)
    z = xp @ wp.T + xn @ wn.T  # positive part of every contribution x_i·w_ji
    s = _safe_div(relevance, z)
    return xp * (s @ wp) + xn * (s @ wn)


def _rebalance(
    ra: torch.Tensor, rb: torch.Tensor, total: torch.Tensor, dims: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescale two shares so they sum to ``total`` over ``dims``, each in proportion to the
    magnitude of its own sum."""
    sa, sb = ra.sum(dims, keepdim=True), rb.sum(dims, keepdim=True)
    mass = sa.abs() + sb.abs()
    half = torch.full_like(mass, 0.5)
    share_a = torch.where(mass > _EPS, sa.abs() / torch.where(mass > _EPS, mass, 1.0), half)
    return ra * _safe_div(share_a * total, sa), rb * _safe_div((1 - share_a) * total, sb)


def lrp_add(
    a: torch.Tensor, b: torch.Tensor, relevance: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the relevance of a + b between the operands (gradient×input, rebalanced per token)."""
    s = _safe_div(relevance, a + b)
    return _rebalance(a * s, b * s, relevance.sum(-1, keepdim=True), (-1,))


def lrp_matmul(
    a: torch.Tensor, b: torch.Tensor, relevance: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the relevance of a @ b (batched over heads) between a and b, rebalanced per head."""
    s = _safe_div(relevance, a @ b)
    ra = a * (s @ b.transpose(-1, -2))
    rb = b * (a.transpose(-1, -2) @ s)
    return _rebalance(ra, rb, relevance.sum((-2, -1), keepdim=True), (-2, -1))


# --------------------------------------------------------------------------------------------
# The whole propagation


@dataclass
class LRPTrace:
    """Everything one LRP run computed; the method returns a part of it."""

    logits: FloatArray
    """[C] logits of the re-run forward pass (equal to the model's)."""
    scores: FloatArray
    """[n] the token scores (rollout row or input relevance, per the ``rollout`` flag)."""
    input_relevance: FloatArray
    """[n] relevance at the embedding output, summed over hidden dimensions. Class-blind (see
    the module docstring): a conservation check, not an attribution."""
    layer_totals: list[float]
    """Total relevance at the head output (the start), at h_L, h_{L-1}, ..., h_0."""
    block_checks: list[tuple[float, float]] = field(default_factory=list)
    """Per layer, top to bottom: (relevance entering at its output, leaving at its input)."""
    attention_relevance: list[FloatArray] = field(default_factory=list)
    """Per layer [H, n, n]: relevance of the attention probabilities R_b."""
    rollout_layers: list[FloatArray] = field(default_factory=list)
    """Per layer [n, n]: Ā_b."""
    attention: list[FloatArray] = field(default_factory=list)
    """Per layer [H, n, n]: the attention probabilities A_b."""
    attention_grad: list[FloatArray] = field(default_factory=list)
    """Per layer [H, n, n]: ∇A_b, the gradient of the target logit."""


def _block_backward(
    block: EncoderBlock, c: LayerCache, r_out: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Relevance of a layer's output → (relevance of its input, R of attention probabilities)."""
    n, h = c.x.shape[0], block.num_heads
    # Output LayerNorm: pass-through; then the FFN residual.
    r_f, r_x1 = lrp_add(c.f, c.x1, r_out)
    r_g = lrp_linear(c.g, block.ffn_out.weight, r_f)  # activation: pass-through
    r_x1 = r_x1 + lrp_linear(c.x1, block.ffn_in.weight, r_g)
    # Attention LayerNorm: pass-through; then the attention residual.
    r_a, r_x = lrp_add(c.a, c.x, r_x1)
    r_ctx = split_heads(lrp_linear(c.ctx, block.attn_out.weight, r_a), h)  # [H, n, d]
    if not bool(keep.all()):
        # A masked head's relevance stays on the residual stream at its token position.
        dropped = r_ctx[~keep].sum(dim=(0, 2))  # [n]
        r_ctx = r_ctx * keep[:, None, None]
        weight = r_x1.abs()
        weight = _safe_div(weight, weight.sum(-1, keepdim=True))
        empty = weight.sum(-1) == 0
        weight[empty] = 1.0 / weight.shape[-1]
        r_x = r_x + dropped[:, None] * weight
    r_attn, r_v = lrp_matmul(c.attn, c.v, r_ctx)
    # Softmax: pass-through to the scores q·kᵀ.
    r_q, r_k = lrp_matmul(c.q, c.k.transpose(-1, -2), r_attn)
    r_k = r_k.transpose(-1, -2)

    def merge(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1).reshape(n, -1)

    r_x = r_x + lrp_linear(c.x, block.value.weight, merge(r_v))
    r_x = r_x + lrp_linear(c.x, block.query.weight, merge(r_q))
    r_x = r_x + lrp_linear(c.x, block.key.weight, merge(r_k))
    return r_x, r_attn


def run_lrp(
    model: Any,
    input_ids: Sequence[int],
    target: int,
    token_type_ids: Sequence[int] | None = None,
    heads: Mapping[int, Sequence[int]] | None = None,
    rollout: bool = True,
    pooled: int = 0,
    progress: Callable[[float, str], None] | None = None,
) -> LRPTrace:
    """Head-masked LRP for one unpadded sequence of a supported classifier.

    ``heads`` maps layer → important heads (None: every head). ``progress`` is called between
    layers and may raise to stop the run. ``rollout=False`` returns the input relevance as the
    scores: class-blind, kept for analysis and tests only (the job method does not offer it)."""
    view = encoder_view(model)
    num_layers = len(view.blocks)
    device = next(model.parameters()).device
    ids = torch.tensor(list(input_ids), dtype=torch.long, device=device)
    types = (
        torch.tensor(list(token_type_ids), dtype=torch.long, device=device)
        if token_type_ids is not None
        else None
    )
    note = progress or (lambda fraction, message: None)
    keeps = []
    for b, block in enumerate(view.blocks):
        keep = torch.ones(block.num_heads, dtype=torch.bool, device=device)
        if heads is not None:
            keep[:] = False
            for head in heads.get(b, ()):
                keep[int(head)] = True
        keeps.append(keep)

    with torch.enable_grad():
        fwd = encoder_forward(view, ids, types, pooled)
        logits = fwd.logits
        if not 0 <= target < logits.shape[-1]:
            raise InvalidArgument(
                f"target {target} is outside the model's {logits.shape[-1]} outputs"
            )
        grads = torch.autograd.grad(logits[target], [c.attn for c in fwd.caches])
    note(0.3, "forward and gradient done")

    with torch.no_grad():
        # Relevance 1 on the target logit, down through the head to the pooled token.
        r = torch.zeros_like(logits, dtype=torch.float32)
        r[target] = 1.0
        totals = [float(r.sum())]
        for (linear, _act), z in zip(reversed(view.head), reversed(fwd.head_inputs), strict=True):
            r = lrp_linear(z.float()[None], linear.weight.float(), r[None])[0]
        r_hidden = torch.zeros_like(fwd.hidden, dtype=torch.float32)
        r_hidden[pooled] = r
        totals.append(float(r_hidden.sum()))

        r_attns: list[torch.Tensor] = [torch.empty(0)] * num_layers
        checks = []
        for b in reversed(range(num_layers)):
            cache = _float_cache(fwd.caches[b])
            entering = float(r_hidden.sum())
            r_hidden, r_attns[b] = _block_backward(
                _float_block(view.blocks[b]), cache, r_hidden, keeps[b]
            )
            checks.append((entering, float(r_hidden.sum())))
            totals.append(float(r_hidden.sum()))
            note(0.3 + 0.6 * (num_layers - b) / num_layers, f"relevance through layer {b}")
        # Embedding LayerNorm: pass-through; one value per token.
        input_relevance = r_hidden.sum(-1)

        n = ids.shape[0]
        eye = torch.eye(n, device=device)
        joint = eye.clone()
        bars = []
        for b in range(num_layers):
            weighted = (grads[b].float() * r_attns[b]).clamp(min=0)
            kept = keeps[b]
            bar = weighted[kept].mean(0) if bool(kept.any()) else torch.zeros(n, n, device=device)
            bars.append(bar)
            step = eye + bar
            joint = (step / step.sum(-1, keepdim=True)) @ joint
        row = joint[pooled].clone()
        row[pooled] = 0.0

    scores = row if rollout else input_relevance
    return LRPTrace(
        logits=_np(logits.detach()),
        scores=_np(scores),
        input_relevance=_np(input_relevance),
        layer_totals=totals,
        block_checks=checks,
        attention_relevance=[_np(t) for t in r_attns],
        rollout_layers=[_np(t) for t in bars],
        attention=[_np(c.attn) for c in fwd.caches],
        attention_grad=[_np(g) for g in grads],
    )


def _np(t: torch.Tensor) -> FloatArray:
    return np.asarray(t.detach().float().cpu().numpy(), dtype=np.float32)


def _float_cache(c: LayerCache) -> LayerCache:
    return LayerCache(*(t.detach().float() for t in vars(c).values()))


@dataclass(frozen=True)
class _Weights:
    weight: torch.Tensor


def _float_block(block: EncoderBlock) -> EncoderBlock:
    """The same block with float32 weights for the relevance arithmetic (fp16 models)."""
    if block.query.weight.dtype == torch.float32:
        return block

    def w(linear: nn.Linear) -> Any:
        return _Weights(linear.weight.detach().float())

    return EncoderBlock(
        query=w(block.query),
        key=w(block.key),
        value=w(block.value),
        attn_out=w(block.attn_out),
        attn_norm=block.attn_norm,
        ffn_in=w(block.ffn_in),
        act=block.act,
        ffn_out=w(block.ffn_out),
        out_norm=block.out_norm,
        num_heads=block.num_heads,
    )


# --------------------------------------------------------------------------------------------
# The job method


#: Why ``rollout=false`` is refused; the InvalidArgument message and the parameter's help.
NO_ROLLOUT_WITHDRAWN = (
    "rollout=false (input-level LRP relevance) is not offered: with the z⁺ rule it is "
    "class-blind (the same token ranking for every class and for any classifier head); use "
    "grad_x_input or integrated_gradients for a signed input-level attribution"
)


class HeadMaskedLRP(JobMethod):
    """Head-masked LRP with attention rollout (Song et al., arXiv 2401.09972)."""

    name = "lrp"
    description = (
        "Layer-wise relevance propagation through the encoder, restricted to the heads a "
        "calibration found important (positional/syntactic), combined by attention rollout."
    )
    params: ClassVar[Mapping[str, Param]] = {
        "use_mask": Param(
            bool,
            True,
            help="Use the head mask file (limelight calibrate-heads) when one exists.",
        ),
        "rollout": Param(
            bool,
            True,
            help="Rollout of gradient-weighted attention relevance (always on; false is "
            "refused: input-level z⁺ relevance is class-blind).",
        ),
    }

    def validate_params(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        out = super().validate_params(given)
        if not out["rollout"]:
            raise InvalidArgument(NO_ROLLOUT_WITHDRAWN)
        return out

    def unavailable_reason(self, model: LoadedModel) -> str:
        return unsupported_reason(model.model)

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        reason = self.unavailable_reason(ctx.model)
        if reason:
            raise FailedPrecondition(reason)
        ctx.checkpoint(0.0, "loading head mask")
        mask_info: dict[str, Any] = {"used": False, "path": None, "heads": None}
        heads: dict[int, list[int]] | None = None
        if params["use_mask"]:
            mask, path = resolve_head_mask(ctx.model, ctx.settings)
            if mask is None:
                mask_info["reason"] = f"no head mask file at {path}; all heads used"
            elif not any(mask.important.values()):
                # An empty mask would zero the rollout; plain LRP is the useful answer.
                mask_info.update(
                    path=str(path),
                    reason="the head mask marks no head important (lower the calibration "
                    "thresholds); all heads used",
                )
            else:
                heads = mask.important
                mask_info.update(
                    used=True,
                    path=str(path),
                    heads={str(layer): list(hs) for layer, hs in sorted(heads.items())},
                    thresholds=dict(mask.thresholds),
                )
        else:
            mask_info["reason"] = "use_mask=false; all heads used"
        pooled = 0  # every supported encoder pools its first token
        trace = run_lrp(
            ctx.model.model,
            encoded.input_ids,
            target,
            token_type_ids=encoded.token_type_ids,
            heads=heads,
            rollout=True,
            pooled=pooled,
            progress=ctx.checkpoint,
        )
        ctx.checkpoint(1.0, "done")
        start = trace.layer_totals[0]
        drift = max(abs(a - b) for a, b in trace.block_checks) if trace.block_checks else 0.0
        return MethodOutput(
            scores=trace.scores,
            details={
                "head_mask": mask_info,
                "rollout": True,
                "pooled_position": pooled,
                "relevance_start": start,
                "relevance_at_input": trace.layer_totals[-1],
                "max_layer_conservation_error": drift,
            },
        )

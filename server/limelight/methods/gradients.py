"""Gradient baselines: gradient norm, gradient×input, integrated gradients.

All three differentiate the target's pre-softmax logit through the model's head adapter, so
every supported architecture works the same way. Where they take the gradient differs, for a
reason (see docs/methods/gradients.md):

- ``gradient`` and ``integrated_gradients`` use the word embeddings e_i (the token embeddings
  before position/segment embeddings and normalisation): Captum's ``LayerIntegratedGradients``
  convention on the word-embedding layer, which the tests compare against. IG multiplies by
  e_i − e'_i, so whatever is added to both the input and the baseline cancels.
- ``grad_x_input`` uses the embedding layer's output h0_i (word + position + segment
  embeddings, normalised: the first hidden state). At the word embeddings the product is
  degenerate for every model that normalises its embeddings: LayerNorm is invariant to the
  scale of its input, so its Jacobian annihilates x = e + p + s and Σ_k g_k e_k equals
  −Σ_k g_k (p + s)_k exactly: a score of the token's position and segment, not of the token.
  At h0 (Captum's ``LayerGradientXActivation`` on the embeddings module) no such identity holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import nn

from limelight.core.types import Encoded, FloatArray
from limelight.errors import FailedPrecondition, InvalidArgument
from limelight.methods.base import JobContext, JobMethod, MethodOutput, Param

if TYPE_CHECKING:
    from limelight.models.loaded import LoadedModel


# --- shared helpers --------------------------------------------------------------------------


def encoded_tensors(
    model: LoadedModel, encoded: Encoded
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[1, n] ids, attention mask and token types (None when the model takes none)."""
    device = model.device
    ids = torch.tensor([encoded.input_ids], dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    types = None
    if encoded.token_type_ids is not None and model.adapter.uses_token_type_ids:
        types = torch.tensor([encoded.token_type_ids], dtype=torch.long, device=device)
    return ids, mask, types


def target_logit(
    model: LoadedModel, last_hidden: torch.Tensor, mask: torch.Tensor, target: int
) -> torch.Tensor:
    """[B] pre-softmax logit of class ``target`` from final hidden states [B, n, K], pooled as
    the model pools (first or last token, masked mean, or mean of per-token logits)."""
    return model.adapter.pooled_logits(last_hidden, mask)[:, target]


def logit_from_embeddings(
    model: LoadedModel,
    embeds: torch.Tensor,
    mask: torch.Tensor,
    types: torch.Tensor | None,
    target: int,
) -> torch.Tensor:
    """[B] target logit for word-embedding outputs ``embeds`` [B, n, K]."""
    batch = embeds.shape[0]
    mask_b = mask.expand(batch, -1)
    types_b = types.expand(batch, -1) if types is not None else None
    out = model.adapter.run_base(None, mask_b, types_b, inputs_embeds=embeds)
    return target_logit(model, out.last_hidden_state, mask_b, target)


def word_embeddings_of(model: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.adapter.embed_words(ids).detach()


def no_embeddings_input_reason(model: LoadedModel) -> str:
    """Why the gradient methods cannot run on ``model`` (empty when they can): they feed the
    word embeddings to the base, which must then reproduce the logits of the token ids."""
    problem = model.adapter.inputs_embeds_problem
    if not problem:
        return ""
    return (
        f"the gradient methods differentiate the model fed its word embeddings, and for "
        f"{model.architecture!r} {problem}; use slalom, shapley or normxlogit"
    )


def embedding_gradient(
    model: LoadedModel, encoded: Encoded, target: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(gradient [n, K], word embeddings [n, K], target logit) for one input."""
    ids, mask, types = encoded_tensors(model, encoded)
    embeds = word_embeddings_of(model, ids).requires_grad_(True)
    with torch.enable_grad():
        logit = logit_from_embeddings(model, embeds, mask, types, target)
        (grad,) = torch.autograd.grad(logit.sum(), embeds)
    return grad[0].detach(), embeds[0].detach(), float(logit.detach().sum())


def embedding_output_gradient(
    model: LoadedModel, encoded: Encoded, target: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(gradient [n, K], embedding-layer output h0 [n, K], target logit) for one input.

    h0 is the base model's first hidden state: the input of the first transformer block
    (word + position + segment embeddings after the embedding LayerNorm for encoders; word +
    position embeddings for GPT-2; the word embeddings themselves for Llama-style decoders).
    Where the base returns a copy of h0 rather than the tensor its blocks read (Longformer
    pads to its attention window and slices every hidden state back), the gradient is taken at
    the output of the base's ``embeddings`` module instead, once that output is checked to equal
    h0 on the input's tokens; FailedPrecondition when no such tensor exists.
    """
    ids, mask, types = encoded_tensors(model, encoded)
    n = ids.shape[1]
    embeds = word_embeddings_of(model, ids).requires_grad_(True)
    outputs: list[torch.Tensor] = []
    embeddings = getattr(model.adapter.base, "embeddings", None)

    def keep(_module: nn.Module, _inputs: Any, out: Any) -> None:
        value = out[0] if isinstance(out, tuple) else out
        if isinstance(value, torch.Tensor):
            outputs.append(value)

    hook = embeddings.register_forward_hook(keep) if isinstance(embeddings, nn.Module) else None
    try:
        with torch.enable_grad():
            out = model.adapter.run_base(None, mask, types, inputs_embeds=embeds)
            h0 = out.hidden_states[0]
            logit = target_logit(model, out.last_hidden_state, mask, target)
            # The same values as h0 on the n tokens (the base may have padded after them).
            same = [
                o
                for o in outputs
                if o.requires_grad
                and o.shape[0] == h0.shape[0]
                and o.shape[1] >= n
                and torch.equal(o[:, :n], h0)
            ]
            grads = torch.autograd.grad(logit.sum(), [h0, *same], allow_unused=True)
    finally:
        if hook is not None:
            hook.remove()
    grad = next((g[:, :n] for g in grads if g is not None), None)
    if grad is None:
        raise FailedPrecondition(
            f"architecture {model.architecture!r}: its first hidden state is not a tensor its "
            "blocks compute with, so no gradient can be taken at it; use gradient or "
            "integrated_gradients"
        )
    return grad[0].detach(), h0[0].detach(), float(logit.detach().sum())


def _np(x: torch.Tensor) -> FloatArray:
    return np.asarray(x.detach().float().cpu().numpy(), dtype=np.float32)


# --- gradient norm and gradient×input ----------------------------------------------------------


class GradientNorm(JobMethod):
    """‖∂y^ĉ/∂e_i‖₂ for each token's word embedding e_i (unsigned saliency)."""

    name = "gradient"
    description = "L2 norm of the target logit's gradient w.r.t. each token's embedding."

    def unavailable_reason(self, model: LoadedModel) -> str:
        return no_embeddings_input_reason(model)

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        ctx.checkpoint(0.0, "forward and backward")
        grad, _, logit = embedding_gradient(ctx.model, encoded, target)
        ctx.checkpoint(1.0, "done")
        return MethodOutput(scores=_np(grad.float().norm(dim=-1)), details={"target_logit": logit})


class GradXInput(JobMethod):
    """Σ_k (∂y^ĉ/∂h0_i)_k · h0_{i,k}: gradient times the embedding layer's output h0 (the first
    hidden state), summed over features. Not at the word embeddings: see the module docstring."""

    name = "grad_x_input"
    description = (
        "Gradient × input at the embedding layer's output (the first hidden state), summed "
        "over hidden features (signed)."
    )

    def unavailable_reason(self, model: LoadedModel) -> str:
        return no_embeddings_input_reason(model)

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        ctx.checkpoint(0.0, "forward and backward")
        grad, h0, logit = embedding_output_gradient(ctx.model, encoded, target)
        ctx.checkpoint(1.0, "done")
        return MethodOutput(
            scores=_np((grad.float() * h0.float()).sum(dim=-1)),
            details={"target_logit": logit, "input": "embedding_output"},
        )


# --- integrated gradients --------------------------------------------------------------------


def path_points(steps: int, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """(alphas, weights) of a quadrature rule for the path integral over [0, 1].

    ``gausslegendre`` and ``riemann_middle`` are exactly Captum's. ``riemann_trapezoid`` is the
    textbook trapezoid rule (weights sum to 1); Captum's rule of that name weights every point
    by 1/n instead of 1/(n-1), i.e. its integral is (n-1)/n of this one.
    """
    if rule == "gausslegendre":
        nodes, weights = np.polynomial.legendre.leggauss(steps)
        return 0.5 * (nodes + 1.0), 0.5 * weights
    if rule == "riemann_middle":
        return (np.arange(steps) + 0.5) / steps, np.full(steps, 1.0 / steps)
    if rule == "riemann_trapezoid":
        if steps < 2:
            raise InvalidArgument("riemann_trapezoid needs steps >= 2")
        alphas = np.linspace(0.0, 1.0, steps)
        weights = np.full(steps, 1.0 / (steps - 1))
        weights[0] /= 2.0
        weights[-1] /= 2.0
        return alphas, weights
    raise InvalidArgument(f"unknown integration rule {rule!r}")


def baseline_embeddings(
    model: LoadedModel, encoded: Encoded, embeds: torch.Tensor, kind: str
) -> torch.Tensor:
    """[1, n, K] baseline: special tokens keep their embedding, every other token becomes
    the pad or mask token's embedding, or zeros."""
    special = torch.tensor(encoded.special_mask, device=embeds.device)[None, :, None]
    if kind == "zero":
        replaced = torch.zeros_like(embeds)
    else:
        token = model.pad_id if kind == "pad" else model.mask_token_id
        if token is None:
            raise FailedPrecondition(
                f"baseline {kind!r} needs a {kind} token and this model's tokenizer has none; "
                "use baseline 'pad' or 'zero'"
            )
        ids = torch.full(embeds.shape[:2], int(token), dtype=torch.long, device=embeds.device)
        replaced = word_embeddings_of(model, ids)
    return torch.where(special, embeds, replaced)


class IntegratedGradients(JobMethod):
    """Integrated gradients on the word embeddings (Sundararajan et al. 2017)."""

    name = "integrated_gradients"
    description = (
        "Integrated gradients from a pad/mask/zero baseline to the input's word embeddings, "
        "summed over hidden features (signed; special tokens keep their embedding in the "
        "baseline, so they score 0)."
    )
    params: ClassVar[Mapping[str, Param]] = {
        "steps": Param(int, 32, minimum=1, maximum=512, help="points on the path"),
        "baseline": Param(
            str,
            "pad",
            choices=("pad", "mask", "zero"),
            help="what non-special tokens start from: the pad or mask embedding, or zeros",
        ),
        "rule": Param(
            str,
            "gausslegendre",
            choices=("gausslegendre", "riemann_middle", "riemann_trapezoid"),
            help="quadrature rule (Captum's names; gausslegendre is Captum's default)",
        ),
        "batch_size": Param(
            int, 16, minimum=1, maximum=512, help="path points per forward/backward pass"
        ),
    }

    def unavailable_reason(self, model: LoadedModel) -> str:
        return no_embeddings_input_reason(model)

    def validate_params(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        out = super().validate_params(given)
        path_points(int(out["steps"]), str(out["rule"]))  # the rule's own limits, before queueing
        return out

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        model = ctx.model
        steps = int(params["steps"])
        # Bounded memory: at most as many path points per pass as job_memory_mb holds.
        batch_size = min(int(params["batch_size"]), ctx.rows_per_pass(len(encoded), backward=True))
        alphas, weights = path_points(steps, str(params["rule"]))
        ids, mask, types = encoded_tensors(model, encoded)
        embeds = word_embeddings_of(model, ids)  # [1, n, K]
        base = baseline_embeddings(model, encoded, embeds, str(params["baseline"]))
        delta = embeds - base
        total = torch.zeros_like(embeds[0], dtype=torch.float32)
        ctx.checkpoint(0.0, f"integrating over {steps} points")
        for start in range(0, steps, batch_size):
            a = torch.tensor(
                alphas[start : start + batch_size], dtype=embeds.dtype, device=embeds.device
            )
            w = torch.tensor(
                weights[start : start + batch_size], dtype=torch.float32, device=embeds.device
            )
            points = (base + a[:, None, None] * delta).requires_grad_(True)
            with torch.enable_grad():
                logits = logit_from_embeddings(model, points, mask, types, target)
                (grads,) = torch.autograd.grad(logits.sum(), points)
            total += (grads.float() * w[:, None, None]).sum(dim=0)
            done = min(start + batch_size, steps)
            ctx.checkpoint(done / steps, f"{done}/{steps} path points")
        scores = (total * delta[0].float()).sum(dim=-1)
        with torch.no_grad():
            ends = logit_from_embeddings(model, torch.cat([base, embeds]), mask, types, target)
        f_base, f_input = float(ends[0]), float(ends[1])
        return MethodOutput(
            scores=_np(scores),
            details={
                "target_logit": f_input,
                "baseline_logit": f_base,
                # Completeness: Σ scores should equal f(x) − f(baseline); large = more steps.
                "convergence_delta": float(scores.sum()) - (f_input - f_base),
            },
        )

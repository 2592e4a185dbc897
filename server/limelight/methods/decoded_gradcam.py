"""Decoded Grad-CAM.

From "Decoding Layer Saliency in Language Transformers" (Hou & Castanon, ICML 2023,
arXiv 2308.05219), which decodes Grad-CAM (Selvaraju et al., arXiv 1610.02391) through the
masked-LM head.
Method note: docs/methods/decoded_gradcam.md.

For a layer l: α = (∂y^ĉ/∂h_l) ⊙ h_l [n, K]; the masked-LM head decodes h_l to token
probabilities P = softmax(f_lm(h_l)) [n, V]; D [T, n] keeps the columns of P for the T unique
input tokens (D[t, j] = P[j, id(t)]); each column of D keeps only its τ largest entries (D̃);
then

    relu="sum"       (default, the paper's eq. 6):    s_t = ReLU(Σ_j D̃[t, j] · Σ_k α[j, k])
    relu="per_term"  (the paper's Algorithm 1):       s_t = Σ_j ReLU(D̃[t, j] · Σ_k α[j, k])

and every occurrence of token t gets s_t. Layer 0 is vanilla Grad-CAM on the embedding output
decoded the same way. Cost: one forward, one backward down to layer l, one LM-head projection.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from limelight.core.types import Encoded
from limelight.errors import FailedPrecondition, InvalidArgument
from limelight.methods.base import JobContext, JobMethod, MethodOutput, Param
from limelight.methods.gradients import encoded_tensors, target_logit
from limelight.models.lm_head import (
    LMHead,
    lm_head_source,
    lm_head_unavailable_reason,
    load_lm_head,
)

if TYPE_CHECKING:
    from limelight.models.loaded import LoadedModel
    from limelight.settings import Settings

AUTO_LAYER = -1


def default_layer(num_layers: int) -> int:
    """About 0.6·L, where the paper found the most class-discriminative layers."""
    return round(0.6 * num_layers)


def decoded_scores(
    alpha_sum: torch.Tensor, probs_unique: torch.Tensor, tau: int, relu: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised core of the method.

    alpha_sum: [n] Σ_k α[j, k]; probs_unique: [T, n] D. Returns (s [T], signed [T]) where
    ``signed`` is the score before the ReLU of the "sum" variant.
    """
    t = probs_unique.shape[0]
    k = min(tau, t)
    top = probs_unique.topk(k, dim=0).indices  # [k, n]
    kept = torch.zeros_like(probs_unique).scatter(0, top, probs_unique.gather(0, top))
    signed = kept @ alpha_sum
    if relu == "sum":
        return signed.clamp_min(0), signed
    return (kept * alpha_sum.clamp_min(0)[None, :]).sum(dim=1), signed


class DecodedGradCAM(JobMethod):
    """Layer Grad-CAM decoded to the input tokens with the base model's masked-LM head."""

    name = "decoded_gradcam"
    description = (
        "Grad-CAM at a transformer layer, decoded back to the input tokens with the base "
        "model's masked-LM head (Hou & Castanon 2023). Needs an LM head."
    )
    params: ClassVar[Mapping[str, Param]] = {
        "layer": Param(
            int,
            AUTO_LAYER,
            minimum=-1,
            maximum=1024,
            help="layer l in 0..L (0 = Grad-CAM on the embeddings); -1 = round(0.6·L)",
        ),
        "tau": Param(int, 5, minimum=1, maximum=100_000, help="keep the top-τ tokens per position"),
        "relu": Param(
            str,
            "sum",
            choices=("sum", "per_term"),
            help="sum: ReLU of the summed score (eq. 6); per_term: ReLU per term (Algorithm 1)",
        ),
    }

    def __init__(self, lm_head_dir: Path | None = None, fallback: Path | None = None) -> None:
        self.lm_head_dir = lm_head_dir
        self.fallback = fallback  # a demo base's own head, when nothing else gives one
        # Loaded heads by model fingerprint and source; the method object lives as long as the
        # registry, so a worker loads each head once.
        self._heads: dict[tuple[str, int, str], LMHead] = {}
        self._lock = threading.Lock()

    def configure(self, settings: Settings) -> None:
        """Take ``--lm-head`` and a demo base's own head from the settings (used by
        ``unavailable_reason``)."""
        self.lm_head_dir = settings.lm_head_dir
        self.fallback = settings.demo_lm_head_dir()

    def unavailable_reason(self, model: LoadedModel) -> str:
        if model.adapter.hidden_state_copies:
            return (
                f"Decoded Grad-CAM differentiates a layer's hidden states, and the "
                f"{model.architecture!r} base returns copies of them (sliced back from the "
                "padding to its attention window), so no gradient can be taken there; use "
                "grad_x_input, gradient or integrated_gradients"
            )
        source = lm_head_source(model, self.lm_head_dir, self.fallback)
        return lm_head_unavailable_reason(model, source)

    def resolve_layer(self, model: LoadedModel, layer: int) -> int:
        if layer == AUTO_LAYER:
            return default_layer(model.num_layers)
        if layer > model.num_layers:
            raise InvalidArgument(
                f"parameter 'layer' must be in 0..{model.num_layers} for this model "
                f"(or -1 for the default {default_layer(model.num_layers)})"
            )
        return layer

    def validate_for_model(self, model: LoadedModel, params: Mapping[str, Any]) -> None:
        """Model-dependent checks that belong before queueing."""
        self.resolve_layer(model, int(params.get("layer", AUTO_LAYER)))

    def lm_head(self, model: LoadedModel, settings: Settings) -> LMHead:
        source = lm_head_source(model, settings.lm_head_dir, settings.demo_lm_head_dir())
        key = (model.version, id(model.model), str(source))
        with self._lock:
            head = self._heads.get(key)
            if head is None:
                head = load_lm_head(model, source)
                self._heads[key] = head
            return head

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        model = ctx.model
        layer = self.resolve_layer(model, int(params["layer"]))
        tau = int(params["tau"])
        relu = str(params["relu"])
        ctx.checkpoint(0.0, "loading the LM head")
        head = self.lm_head(model, ctx.settings)
        ctx.checkpoint(0.2, f"forward and backward to layer {layer}")

        ids, mask, types = encoded_tensors(model, encoded)
        with torch.enable_grad():
            out = model.adapter.run_base(ids, mask, types)
            hidden = out.hidden_states[layer]
            if not hidden.requires_grad:
                raise FailedPrecondition(
                    "the model's weights are frozen (requires_grad=False); gradient methods "
                    "need a differentiable model"
                )
            logit = target_logit(model, out.last_hidden_state, mask, target)
            (grad,) = torch.autograd.grad(logit.sum(), hidden, allow_unused=True)
        if grad is None:
            raise FailedPrecondition(
                f"architecture {model.architecture!r}: hidden state {layer} is not a tensor its "
                "blocks compute with, so no gradient can be taken at it; use grad_x_input, "
                "gradient or integrated_gradients"
            )
        h = hidden.detach()[0]  # [n, K]
        alpha_sum = (grad[0] * h).sum(dim=-1).float()  # Σ_k α[j, k], [n]

        ctx.checkpoint(0.6, "decoding the layer with the LM head")
        with torch.no_grad():
            probs = torch.softmax(head(h).float(), dim=-1)  # [n, V]
        id_list = encoded.input_ids
        unique = list(dict.fromkeys(id_list))  # first-occurrence order
        index = torch.tensor(unique, dtype=torch.long, device=probs.device)
        d = probs[:, index].T.contiguous()  # [T, n]
        s_unique, signed_unique = decoded_scores(alpha_sum.to(d.device), d, tau, relu)

        row_of = {tid: r for r, tid in enumerate(unique)}
        rows = [row_of[tid] for tid in id_list]
        scores = s_unique[rows].cpu().numpy().astype(np.float32)
        signed = signed_unique[rows].cpu().numpy().astype(np.float32)
        # The decoded probability of each position's own token: how well h_l still "is" it.
        positions = torch.arange(len(id_list), device=probs.device)
        own_ids = torch.tensor(id_list, dtype=torch.long, device=probs.device)
        self_prob = probs[positions, own_ids].cpu().numpy()
        ctx.checkpoint(1.0, "done")
        return MethodOutput(
            scores=scores,
            extra_scores={
                "signed": signed,
                "layer_gradcam": alpha_sum.clamp_min(0).detach().cpu().numpy().astype(np.float32),
                "decoded_self_probability": self_prob.astype(np.float32),
            },
            details={
                "layer": layer,
                "tau": tau,
                "relu": relu,
                "unique_tokens": len(unique),
                "lm_head": head.source,
                "target_logit": float(logit.detach().sum()),
            },
        )

"""An encoder classifier as explicit modules, re-run layer by layer.

``encoder_view`` names the modules of a supported sequence classifier (embeddings, each
post-LayerNorm encoder layer's projections, LayerNorms and activation, the pooled head) under
architecture-neutral names; ``encoder_forward`` re-runs the encoder with those modules, keeping
every activation (queries, keys, values, attention probabilities, FFN hidden states) that an
attribution rule may need; ``encoder_attentions`` returns the attention probabilities alone.
Because the encoder is recomputed from its own modules, the attention probabilities exist
whatever attention kernel (eager, sdpa, flash) the model was loaded with, and nothing on the
served model changes. LRP (methods/lrp.py) and the head calibration use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from limelight.errors import FailedPrecondition

#: model_type values with an encoder view (MiniLM checkpoints are ``bert``).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "bert",
    "roberta",
    "xlm-roberta",
    "camembert",
    "distilbert",
)

Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class EncoderBlock:
    """The modules of one post-LayerNorm encoder layer, under architecture-neutral names."""

    query: nn.Linear
    key: nn.Linear
    value: nn.Linear
    attn_out: nn.Linear
    attn_norm: nn.Module
    ffn_in: nn.Linear
    act: Activation
    ffn_out: nn.Linear
    out_norm: nn.Module
    num_heads: int


@dataclass(frozen=True)
class EncoderView:
    """A read-only view of a sequence classifier as embeddings, blocks and a pooled head."""

    embed: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    blocks: list[EncoderBlock]
    head: list[tuple[nn.Linear, Activation | None]]
    """Head stages applied to the pooled token, in order: linear, then its activation."""


def unsupported_reason(model: Any) -> str:
    """Empty when ``model`` (a transformers classifier) has an encoder view; otherwise why not
    (worded for LRP, its main user)."""
    config = model.config
    arch = str(getattr(config, "model_type", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        return (
            "LRP propagates through BERT-family encoders only "
            f"({', '.join(SUPPORTED_ARCHITECTURES)}); this model is {arch!r}. "
            "Use gradient, grad_x_input or integrated_gradients instead."
        )
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return f"LRP supports encoder-only {arch} models (this config is a decoder)"
    pos = getattr(config, "position_embedding_type", "absolute")
    if pos not in (None, "absolute"):
        return f"LRP supports absolute position embeddings only (this model uses {pos!r})"
    if arch == "distilbert" and getattr(config, "activation", "gelu") not in ("gelu", "relu"):
        return f"unsupported DistilBERT activation {config.activation!r}"
    return ""


def encoder_view(model: Any) -> EncoderView:
    """Name the modules of a supported classifier; FailedPrecondition for anything else."""
    reason = unsupported_reason(model)
    if reason:
        raise FailedPrecondition(reason)
    arch = str(model.config.model_type)
    if arch == "distilbert":
        base = model.distilbert
        blocks = [
            EncoderBlock(
                query=layer.attention.q_lin,
                key=layer.attention.k_lin,
                value=layer.attention.v_lin,
                attn_out=layer.attention.out_lin,
                attn_norm=layer.sa_layer_norm,
                ffn_in=layer.ffn.lin1,
                act=layer.ffn.activation,
                ffn_out=layer.ffn.lin2,
                out_norm=layer.output_layer_norm,
                num_heads=int(model.config.n_heads),
            )
            for layer in base.transformer.layer
        ]
        head: list[tuple[nn.Linear, Activation | None]] = [
            (model.pre_classifier, torch.relu),
            (model.classifier, None),
        ]

        def embed(ids: torch.Tensor, types: torch.Tensor | None) -> torch.Tensor:
            return base.embeddings(input_ids=ids)  # type: ignore[no-any-return]

        return EncoderView(embed, blocks, head)

    base = model.bert if arch == "bert" else model.roberta
    blocks = [
        EncoderBlock(
            query=layer.attention.self.query,
            key=layer.attention.self.key,
            value=layer.attention.self.value,
            attn_out=layer.attention.output.dense,
            attn_norm=layer.attention.output.LayerNorm,
            ffn_in=layer.intermediate.dense,
            act=layer.intermediate.intermediate_act_fn,
            ffn_out=layer.output.dense,
            out_norm=layer.output.LayerNorm,
            num_heads=int(model.config.num_attention_heads),
        )
        for layer in base.encoder.layer
    ]
    if arch == "bert":
        pooler = base.pooler
        head = [(pooler.dense, torch.tanh)] if pooler is not None else []
        head.append((model.classifier, None))
    else:
        head = [(model.classifier.dense, torch.tanh), (model.classifier.out_proj, None)]

    def embed_bert(ids: torch.Tensor, types: torch.Tensor | None) -> torch.Tensor:
        if arch == "bert":
            return base.embeddings(input_ids=ids, token_type_ids=types)  # type: ignore[no-any-return]
        return base.embeddings(input_ids=ids)  # type: ignore[no-any-return]

    return EncoderView(embed_bert, blocks, head)


# --------------------------------------------------------------------------------------------
# Forward pass with the activations the rules need


@dataclass
class LayerCache:
    x: torch.Tensor  # [n, K] layer input
    q: torch.Tensor  # [H, n, d] scaled queries
    k: torch.Tensor  # [H, n, d]
    v: torch.Tensor  # [H, n, d]
    attn: torch.Tensor  # [H, n, n] attention probabilities
    ctx: torch.Tensor  # [n, H*d] merged context
    a: torch.Tensor  # [n, K] attention output projection
    x1: torch.Tensor  # [n, K] after the first residual + LayerNorm
    g: torch.Tensor  # [n, F] activated FFN hidden
    f: torch.Tensor  # [n, K] FFN output


def split_heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    n = t.shape[0]
    return t.view(n, num_heads, -1).transpose(0, 1)


def layer_forward(block: EncoderBlock, x: torch.Tensor) -> tuple[torch.Tensor, LayerCache]:
    h = block.num_heads
    q = split_heads(block.query(x), h)
    k = split_heads(block.key(x), h)
    v = split_heads(block.value(x), h)
    q = q * q.shape[-1] ** -0.5
    attn = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    ctx = (attn @ v).transpose(0, 1).reshape(x.shape[0], -1)
    a = block.attn_out(ctx)
    x1 = block.attn_norm(a + x)
    g = block.act(block.ffn_in(x1))
    f = block.ffn_out(g)
    out = block.out_norm(f + x1)
    return out, LayerCache(x, q, k, v, attn, ctx, a, x1, g, f)


@dataclass
class EncoderForward:
    h0: torch.Tensor  # [n, K]
    caches: list[LayerCache]
    hidden: torch.Tensor  # [n, K] final hidden states
    head_inputs: list[torch.Tensor]  # input of each head linear
    logits: torch.Tensor  # [C]


def encoder_forward(
    view: EncoderView, ids: torch.Tensor, types: torch.Tensor | None, pooled: int
) -> EncoderForward:
    h0 = view.embed(ids[None], None if types is None else types[None])[0]
    h0 = h0.detach().requires_grad_(True)  # the graph for ∇A, whatever the parameters' flags
    x = h0
    caches = []
    for block in view.blocks:
        x, cache = layer_forward(block, x)
        caches.append(cache)
    z = x[pooled]
    head_inputs = []
    for linear, act in view.head:
        head_inputs.append(z)
        z = linear(z)
        if act is not None:
            z = act(z)
    return EncoderForward(h0, caches, x, head_inputs, z)


def encoder_attentions(
    model: Any, input_ids: Sequence[int], token_type_ids: Sequence[int] | None = None
) -> list[torch.Tensor]:
    """Attention probabilities per layer, each [H, n, n], for one unpadded sequence.

    Computed with the model's own modules, so it works whatever attention kernel was loaded."""
    view = encoder_view(model)
    device = next(model.parameters()).device
    ids = torch.tensor(list(input_ids), dtype=torch.long, device=device)
    types = (
        torch.tensor(list(token_type_ids), dtype=torch.long, device=device)
        if token_type_ids is not None
        else None
    )
    with torch.no_grad():
        x = view.embed(ids[None], None if types is None else types[None])[0]
        out = []
        for block in view.blocks:
            x, cache = layer_forward(block, x)
            out.append(cache.attn.float().cpu())
    return out

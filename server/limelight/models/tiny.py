"""Tiny random-init sequence classifiers built offline from the installed transformers.

Used by the conformance table (``scripts/architectures.py``) and the tests: every architecture
is built from its default config shrunk to a few thousand parameters per layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: Common size settings; transformers' attribute maps translate them per family.
SMALL: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=128,
    num_labels=3,
)

#: Per-family settings where the common ones do not fit.
FAMILY: dict[str, dict[str, Any]] = {
    "albert": dict(embedding_size=16),
    "big_bird": dict(attention_type="original_full"),
    "deberta-v2": dict(relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"]),
    "distilbert": dict(dim=32, hidden_dim=64, n_layers=2, n_heads=2),
    "electra": dict(embedding_size=16),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=2, n_positions=128),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2),
    "gptj": dict(rotary_dim=8),
    "axk1": dict(head_dim=8),
    "deepseek_v3": dict(head_dim=8),
    "longformer": dict(attention_window=[8, 8]),
    "modernbert": dict(global_attn_every_n_layers=2, local_attention=16),
    "mobilebert": dict(
        embedding_size=16, intra_bottleneck_size=32, true_hidden_size=32, num_feedforward_networks=1
    ),
    "xlnet": dict(d_inner=64, d_head=16),
    "plbart": dict(decoder_attention_heads=2),
    **{t: dict(decoder_start_token_id=0, d_ff=64, d_kv=16) for t in ("t5", "mt5", "umt5")},
    "xmod": dict(default_language="en_XX"),
    "squeezebert": dict(
        embedding_size=32, q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2
    ),
}

#: Families whose tiny config cannot be built offline here, with what goes wrong.
NOT_BUILT: dict[str, str] = {
    "cohere_compass_text": "its default config does not build with a shrunk layer count",
    "zamba": "its default config does not validate with a shrunk layer count",
    "zamba2": "its default config does not validate with a shrunk layer count",
}

#: Shrunk when a config has them (mixture-of-experts, state-space and other extras).
#: Families whose multi-label (sigmoid) and regression heads are checked against transformers'
#: own outputs (tests/conformance/test_heads_x_architectures.py; listed in docs/architectures.md).
HEAD_KIND_FAMILIES: tuple[str, ...] = (
    "bert",
    "distilbert",
    "roberta",
    "deberta-v2",
    "electra",
    "modernbert",
    "gpt2",
    "llama",
    "xlnet",
    "fnet",
    "yoso",
    "bart",
)

_SHRINK: dict[str, Any] = dict(
    head_dim=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    sliding_window=64,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_headdim=8,
    mamba_dt_rank=8,
    linear_num_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    first_k_dense_replace=0,
    n_group=1,
    topk_group=1,
)
#: Config attributes that are derived (read-only) in some families.
_READ_ONLY: dict[str, set[str]] = {"falcon": {"head_dim"}}
#: Common settings a family's config refuses (XLNet has no position limit).
_NOT_SETTABLE: dict[str, set[str]] = {"xlnet": {"max_position_embeddings"}}


def tiny_config(model_type: str, vocab_size: int = 128, pad_token_id: int = 0, **extra: Any) -> Any:
    """A small config of ``model_type`` (pad/bos/eos ids inside the vocabulary)."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    values: dict[str, Any] = {**SMALL, **FAMILY.get(model_type, {})}
    for key in _NOT_SETTABLE.get(model_type, set()):
        values.pop(key, None)
    for key, value in _SHRINK.items():
        if hasattr(base, key) and key not in _READ_ONLY.get(model_type, set()):
            values.setdefault(key, value)
    values.update(vocab_size=vocab_size, pad_token_id=pad_token_id, **extra)
    config = AutoConfig.for_model(model_type, **values)
    if hasattr(config, "qk_head_dim") and hasattr(config, "qk_rope_head_dim"):
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    for name in ("bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id"):
        current = getattr(config, name, None)
        if isinstance(current, int) and current >= vocab_size:
            setattr(config, name, min(2, vocab_size - 1))
    for name in ("layer_types", "mlp_layer_types"):
        kinds = getattr(config, name, None)
        if isinstance(kinds, list) and len(kinds) != config.num_hidden_layers:
            setattr(config, name, (kinds * config.num_hidden_layers)[: config.num_hidden_layers])
    return config


def tiny_model(model_type: str, seed: int = 0, **config_values: Any) -> nn.Module:
    """A randomly initialised tiny sequence classifier of ``model_type``, in eval mode."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_config(model_type, **config_values)
    model = AutoModelForSequenceClassification.from_config(config)
    return model.eval()

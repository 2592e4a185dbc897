"""Lower precision for forward passes whose outputs are only read, never served.

Building a head or an LM head reads the frozen classifier many times (teacher labels, the
policy loop's rewards, the encoder under a fitted LM head). On devices with bfloat16
instructions those reads run about twice as fast under autocast, within about 0.01 of
float32's class probabilities; elsewhere bfloat16 is emulated and slower than float32, so a
request for it falls back. What is served (the inline pass, the head's features) always runs
in the model's own precision.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

log = logging.getLogger(__name__)

READ_PRECISIONS = ("float32", "bfloat16")


def bfloat16_is_native(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively (on a CPU: AVX512-BF16 or AMX
    instructions); elsewhere bfloat16 matrix products are emulated and slower than float32."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def read_precision(device: torch.device, requested: str) -> str:
    """The precision read-only forward passes on ``device`` use for ``requested``."""
    if requested not in READ_PRECISIONS:
        raise ValueError(f"unknown read precision {requested!r}: {', '.join(READ_PRECISIONS)}")
    if requested == "bfloat16" and not bfloat16_is_native(device):
        log.warning("no bfloat16 instructions on %s: reading in float32", device)
        return "float32"
    return requested


def reading(device: torch.device, precision: str) -> AbstractContextManager[Any]:
    """The context of a read-only forward pass in ``precision`` (from :func:`read_precision`)."""
    if precision == "float32":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)

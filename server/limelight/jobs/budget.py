"""What a job may cost, checked before it is queued: its timeout, its memory, its run time.

- Timeout: finite, >= 0, at most ``settings.job_timeout_max_s``.
- Memory: one input row of the job's length must fit ``settings.job_memory_mb`` (methods chunk
  their batches to the same budget while they run, ``JobContext.rows_per_pass``).
- Run time: a per-method estimate of the model work, in forward passes over one token
  ("token passes"), converted to seconds with the model's measured forward throughput; a job
  estimated to need far more than its timeout is refused rather than left to fail after
  holding a worker for the whole timeout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from limelight.core.jobs import ModelShape, rows_within
from limelight.errors import InvalidArgument

#: A backward pass costs about two forward passes.
_BACKWARD = 3.0

#: Refuse a job whose estimate exceeds its timeout by this factor (estimates are rough).
SLACK = 4.0

#: Methods that only run forward passes at the input's length (the rest also backpropagate).
FORWARD_ONLY = frozenset(
    {"slalom", "random", "shapley", "greedy_deletion", "greedy_insertion", "lexicon"}
)


def _slalom(params: Mapping[str, Any], tokens: int) -> float:
    samples = float(params.get("num_samples", 500))
    length = float(params.get("sample_length", 3)) + 2  # + special tokens
    return samples * length + tokens


def _slalom_fit_seconds(params: Mapping[str, Any], tokens: int) -> float:
    """SLALOM's surrogate fit runs in NumPy, not in the model: about 20 us per optimizer step
    and 15 ns per sample and token per epoch (2-core AMD EPYC; on the low side, so that only
    fits far beyond the timeout are refused)."""
    samples = int(params.get("num_samples", 500))
    epochs = float(params.get("epochs", 300))
    steps = epochs * math.ceil(samples / max(1, int(params.get("batch_size", 4096))))
    return steps * 2e-5 + epochs * samples * tokens * 1.5e-8


def _steps(params: Mapping[str, Any], tokens: int) -> float:
    return (float(params.get("steps", 32)) * _BACKWARD + 2) * tokens


def _shapley(params: Mapping[str, Any], tokens: int) -> float:
    # Each permutation walks every content token in: m + 1 coalitions of up to n tokens.
    content = max(1, tokens - 2)
    return float(params.get("permutations", 16)) * (content + 1) * tokens


def _greedy(params: Mapping[str, Any], tokens: int) -> float:
    # Each round tries every token still in play, one row each.
    content = max(1, tokens - 2)
    fraction = float(params.get("max_fraction", 0.5))
    step = float(params.get("step", 0.0))
    if step > 0:
        return math.ceil(fraction / step) * content * tokens
    rounds = min(content, math.ceil(fraction * content))
    return (rounds * content - rounds * (rounds - 1) / 2) * tokens


#: Token passes of a job, per method (methods not listed are not estimated).
ESTIMATES: dict[str, Callable[[Mapping[str, Any], int], float]] = {
    "integrated_gradients": _steps,
    "gradient": lambda params, tokens: _BACKWARD * tokens,
    "grad_x_input": lambda params, tokens: _BACKWARD * tokens,
    "decoded_gradcam": lambda params, tokens: _BACKWARD * tokens,
    "lrp": lambda params, tokens: 2 * _BACKWARD * tokens,
    "slalom": _slalom,
    "random": lambda params, tokens: 0.0,
    "shapley": _shapley,
    "greedy_deletion": _greedy,
    "greedy_insertion": _greedy,
}

#: Seconds a job spends outside the model, per method (on top of its token passes).
EXTRA_SECONDS: dict[str, Callable[[Mapping[str, Any], int], float]] = {
    "slalom": _slalom_fit_seconds,
}


def check_timeout(timeout_s: float, maximum_s: float) -> None:
    """A job's own timeout (0: the default): finite, >= 0 and at most ``maximum_s``."""
    if not math.isfinite(timeout_s) or timeout_s < 0:
        raise InvalidArgument("timeout_seconds must be a finite number >= 0 (0: the default)")
    if timeout_s > maximum_s:
        given = f"{timeout_s:g}"
        if given == f"{maximum_s:g}":  # just over: six digits would print it as the maximum
            given = repr(timeout_s)
        raise InvalidArgument(
            f"timeout_seconds {given} exceeds this server's maximum of {maximum_s:g} s"
        )


def check_memory(method: str, shape: ModelShape, tokens: int, memory_mb: float) -> None:
    """One row of ``tokens`` tokens must fit the job memory budget."""
    backward = method not in FORWARD_ONLY
    if rows_within(memory_mb, shape, tokens, backward) < 1:
        need = shape.row_bytes(tokens, backward) / (1024 * 1024)
        raise InvalidArgument(
            f"{method} on {tokens} tokens needs about {need:.0f} MB of working memory, more "
            f"than this server's job memory budget of {memory_mb:g} MB: shorten the text"
        )


def estimate_seconds(
    method: str, params: Mapping[str, Any], tokens: int, tokens_per_second: float
) -> float | None:
    """Estimated run time of a job, or None when the method has no estimate."""
    estimate = ESTIMATES.get(method)
    if estimate is None or tokens_per_second <= 0:
        return None
    extra = EXTRA_SECONDS.get(method)
    outside = extra(params, tokens) if extra is not None else 0.0
    return estimate(params, tokens) / tokens_per_second + outside


def check_cost(
    method: str,
    params: Mapping[str, Any],
    tokens: int,
    tokens_per_second: float,
    timeout_s: float,
    windows: Sequence[int] = (),
) -> None:
    """Refuse a job whose estimated run time is far beyond its timeout. ``windows``: under
    ``truncation=window``, the token count of each window the method runs on in turn
    (``tokens`` is then the whole text's), estimated one by one: a method's cost grows faster
    than its input, so the windows cost neither a single 512-token run nor the whole text's."""
    runs = list(windows) or [tokens]
    estimates = [estimate_seconds(method, params, n, tokens_per_second) for n in runs]
    if any(e is None for e in estimates):
        return
    seconds = sum(e for e in estimates if e is not None)
    if seconds <= SLACK * timeout_s:
        return
    if windows:
        size = (
            f"this {tokens}-token text, explained in {len(runs)} overlapping windows of up to "
            f"{max(runs)} tokens each,"
        )
        shorter = "a shorter text (fewer windows)"
    else:
        size = f"{tokens} tokens"
        shorter = "a shorter text"
    raise InvalidArgument(
        f"{method} with these parameters on {size} would take about {_seconds(seconds)} on this "
        f"server, far beyond the job's timeout of {timeout_s:g} s: use fewer steps, samples, "
        f"permutations or epochs, or {shorter}"
    )


def _seconds(seconds: float) -> str:
    """An estimate as a person reads it: "about 0 s" against a timeout of 1e-09 s read as
    nonsense."""
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.2g} s"

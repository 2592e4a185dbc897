"""SLALOM: a softmax-linked additive log-odds surrogate per input.

From Leemann et al., "Attention Mechanisms Don't Learn Additive Models: Rethinking Feature
Importance for Transformers" (arXiv 2405.13536). Method note: docs/methods/slalom.md.

The surrogate over the input's unique (non-special) tokens is

    F(t) = Σ_i exp(s(t_i)) · v(t_i) / Σ_j exp(s(t_j)),      normalised so that Σ_k s_k = 0,

with an *importance* s and a *value* v per unique token. Every occurrence of a token in a
sequence counts (a token present twice weighs exp(s) twice). F is fitted locally, as the
paper's SLALOM-eff does: sample N random short sequences made of the input's tokens, run the
model on each (wrapped in the same special tokens as the input), and minimise the mean squared
error between F and the model's output with Adam.

Fit defaults: full-batch Adam, 300 epochs at lr 0.05, which converges on the demo models (the
paper's 60 epochs of 128-sample minibatches at lr 5e-3 stop far short: on BERT-tiny their
held-out MSE is about half the output variance, worse than a linear model on the same samples).
``fit="paper"`` restores the paper's values. A share ``holdout`` of the samples is kept out of
the fit and the result reports the surrogate's error on it, next to the error of an ordinary
least-squares linear model on token counts fitted on the same samples (the paper's baseline).

Model output that F approximates (``target`` = the explained class c):

* two or more classes: the one-vs-rest log-odds ``logit_c − logsumexp(logits of the other
  classes)``. For a binary classifier this is exactly the paper's log-odds, oriented so that a
  positive value is evidence *for* the explained class (``logit₁ − logit₀`` when explaining
  class 1, ``logit₀ − logit₁`` when explaining class 0). For C > 2 it is the log-odds of
  "class c" against "any other class", i.e. log p_c / (1 − p_c): one SLALOM per explained
  class rather than the appendix C.1 model with one value map per class, so that each job
  fits exactly the quantity its scores are read against.
* multi-label heads (a sigmoid per label): the label's own log-odds, its logit.
* regression heads (one output): the raw output.

Text pairs: only the first segment's tokens are sampled and explained; the pair segment and
all special tokens are kept verbatim around every sample (``[CLS] sample [SEP] pair [SEP]``
for BERT) and get score 0.

Scores per token (every occurrence of a unique token gets its token's numbers):

* ``value`` v: the token's effect on its own (F of a sequence of only this token).
* ``importance`` s: its weight when mixed with other tokens (Σ s = 0 over unique tokens).
* ``linearized`` exp(s)·v: the paper's linearised SLALOM score (its §5.4 ranking score).
* ``removal`` α(v − F)/(1 − α) with α = exp(s)/Σ_j exp(s(t_j)) the softmax weight of one
  occurrence in the full input and F the surrogate's output on the full input: exactly how much
  F drops when that one occurrence is removed. A token that is the whole input gets its value.

The fitting core (:func:`fit_slalom`) works on count matrices and knows nothing about models,
so it can be tested against a black box that *is* a SLALOM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from limelight.core.types import Encoded, FloatArray
from limelight.errors import InvalidArgument
from limelight.methods.base import JobCancelled, JobContext, JobMethod, MethodOutput, Param

if TYPE_CHECKING:
    from limelight.models.loaded import LoadedModel

SCORE_KINDS: tuple[str, ...] = ("value", "importance", "linearized", "removal")

# Share of the progress bar spent querying the model; the rest is the fit.
_QUERY_SHARE = 0.5
# Adam's moment decay rates and epsilon (torch.optim.Adam's defaults).
_BETA1, _BETA2, _ADAM_EPS = 0.9, 0.999, 1e-8

#: Fit settings by name. ``converged``: full-batch Adam run to convergence (measured on the demo
#: models, docs/methods/slalom.md). ``paper``: the SLALOM paper's values, which under-fit.
FIT_PRESETS: dict[str, dict[str, Any]] = {
    "converged": {"epochs": 300, "lr": 0.05, "batch_size": 4096},
    "paper": {"epochs": 60, "lr": 5e-3, "batch_size": 128},
}
_FIT_KEYS = ("epochs", "lr", "batch_size")


@dataclass(frozen=True)
class SlalomFit:
    """Fitted SLALOM parameters over V unique tokens."""

    importance: FloatArray
    """[V] s, normalised to Σ s = 0."""
    value: FloatArray
    """[V] v."""
    mse: float
    """Mean squared error of the fitted surrogate on the samples it was fitted on."""


def _check_counts(counts: npt.ArrayLike) -> npt.NDArray[np.float64]:
    arr = np.asarray(counts, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise ValueError("counts must be a [samples, tokens] matrix with at least one token")
    if (arr < 0).any():
        raise ValueError("counts must be non-negative")
    if (arr.sum(axis=1) <= 0).any():
        raise ValueError("every sample must contain at least one token")
    return arr


def _log_counts(counts: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    # exp(s + log c) = c·exp(s): multiplicities enter the softmax; absent tokens get weight 0.
    with np.errstate(divide="ignore"):
        return np.where(counts > 0, np.log(np.where(counts > 0, counts, 1.0)), -np.inf)


def _weights(s: npt.NDArray[np.float64], log_c: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    logits = s[None, :] + log_c
    logits = logits - logits.max(axis=1, keepdims=True)
    w = np.exp(logits)
    return np.asarray(w / w.sum(axis=1, keepdims=True), dtype=np.float64)


def slalom_predict(
    importance: npt.ArrayLike, value: npt.ArrayLike, counts: npt.ArrayLike
) -> npt.NDArray[np.float64]:
    """F for each row of ``counts`` ([N, V] token multiplicities) in float64."""
    log_c = _log_counts(_check_counts(counts))
    s = np.asarray(importance, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    return np.asarray(_weights(s, log_c) @ v, dtype=np.float64)


def slalom_loss_grad(
    importance: npt.ArrayLike, value: npt.ArrayLike, counts: npt.ArrayLike, targets: npt.ArrayLike
) -> tuple[float, npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Mean squared error of F against ``targets`` and its gradients with respect to s and v.

    With w the softmax weights and r_n = 2 (F_n − y_n) / N:
    ∂L/∂v_k = Σ_n r_n w_nk and ∂L/∂s_k = Σ_n r_n w_nk (v_k − F_n).
    """
    s = np.asarray(importance, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    y = np.asarray(targets, dtype=np.float64)
    return _loss_grad(s, v, _log_counts(_check_counts(counts)), y)


def _loss_grad(
    s: npt.NDArray[np.float64],
    v: npt.NDArray[np.float64],
    log_c: npt.NDArray[np.float64],
    y: npt.NDArray[np.float64],
) -> tuple[float, npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    w = _weights(s, log_c)
    f = w @ v
    err = f - y
    r = 2.0 * err / len(y)
    grad_v = r @ w
    grad_s = v * grad_v - (r * f) @ w
    return float(np.mean(err**2)), grad_s, grad_v


def counts_from_indices(indices: npt.ArrayLike, num_tokens: int) -> npt.NDArray[np.float32]:
    """[N, L] token indices (−1 = empty slot) → [N, V] multiplicities."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim != 2:
        raise ValueError("indices must be a [samples, length] matrix")
    if (idx >= num_tokens).any():
        raise ValueError("token index out of range")
    counts = np.zeros((idx.shape[0], num_tokens), dtype=np.float32)
    rows, cols = np.nonzero(idx >= 0)
    np.add.at(counts, (rows, idx[rows, cols]), 1.0)
    return counts


def fit_slalom(
    counts: npt.ArrayLike,
    targets: npt.ArrayLike,
    *,
    epochs: int = 300,
    lr: float = 0.05,
    batch_size: int = 4096,
    seed: int = 0,
    on_epoch: Callable[[int], None] | None = None,
) -> SlalomFit:
    """Fit SLALOM's importance and value maps to (sample, output) pairs with Adam on the MSE.

    ``counts`` is [N, V]: how often each of the V unique tokens occurs in each sample (order
    does not matter to SLALOM). ``targets`` is [N], the black box's output per sample.
    Adam runs in float64 NumPy on the analytic gradient (:func:`slalom_loss_grad`): the
    problem is tiny, and small torch ops spend more time in dispatch and thread pools than in
    arithmetic. Minibatches are shuffled with a private generator seeded by ``seed``: the same
    inputs give the same fit. Values start at the mean target and importances at zero (a
    uniform-attention surrogate through the data's mean): Adam moves each parameter by about
    ``lr`` per step, so starting at the common offset leaves the step budget for the
    differences between tokens.
    ``on_epoch(k)`` is called after epoch k (1-based); it may raise to abort the fit.
    """
    c_np = _check_counts(counts)
    y = np.asarray(targets, dtype=np.float64).reshape(-1)
    if y.shape[0] != c_np.shape[0]:
        raise ValueError("counts and targets must have the same number of rows")
    if not np.isfinite(y).all():
        raise ValueError("targets must be finite")
    if epochs < 1 or batch_size < 1 or not lr > 0:
        raise ValueError("epochs and batch_size must be >= 1 and lr > 0")

    log_c = _log_counts(c_np)
    n, num_tokens = log_c.shape
    rng = np.random.default_rng(int(seed))
    # params[0] = s, params[1] = v; Adam state as in torch.optim.Adam's defaults.
    params = np.stack([np.zeros(num_tokens), np.full(num_tokens, float(y.mean()))])
    m1, m2 = np.zeros_like(params), np.zeros_like(params)
    step = 0
    for epoch in range(epochs):
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            rows = order[start : start + batch_size]
            _, grad_s, grad_v = _loss_grad(params[0], params[1], log_c[rows], y[rows])
            grad = np.stack([grad_s, grad_v])
            step += 1
            m1 = _BETA1 * m1 + (1.0 - _BETA1) * grad
            m2 = _BETA2 * m2 + (1.0 - _BETA2) * grad * grad
            denom = np.sqrt(m2 / (1.0 - _BETA2**step)) + _ADAM_EPS
            params -= lr / (1.0 - _BETA1**step) * m1 / denom
        if on_epoch is not None:
            on_epoch(epoch + 1)
    s_final = params[0] - params[0].mean()  # softmax is shift-invariant: Σ s = 0 is unique
    mse, _, _ = _loss_grad(s_final, params[1], log_c, y)
    return SlalomFit(
        importance=s_final.astype(np.float32), value=params[1].astype(np.float32), mse=mse
    )


def slalom_scores(fit: SlalomFit, input_counts: npt.ArrayLike) -> dict[str, FloatArray]:
    """The four per-token score maps ([V] each) for an input with multiplicities ``input_counts``.

    ``removal`` uses α = exp(s_k) / Σ_j c_j exp(s_j), the softmax weight of *one* occurrence of
    token k in the full input, and F = the surrogate's output on the full input.
    """
    c = np.asarray(input_counts, dtype=np.float64).reshape(1, -1)
    s = fit.importance.astype(np.float64)
    v = fit.value.astype(np.float64)
    full = float(slalom_predict(s, v, c)[0])
    shifted = s - s[c[0] > 0].max()
    alpha = np.exp(shifted) / float((c[0] * np.exp(shifted)).sum())
    rest = 1.0 - alpha
    removal = np.where(rest > 1e-12, alpha * (v - full) / np.where(rest > 1e-12, rest, 1.0), v)
    return {
        "value": v.astype(np.float32),
        "importance": s.astype(np.float32),
        "linearized": (np.exp(s) * v).astype(np.float32),
        "removal": removal.astype(np.float32),
    }


@dataclass(frozen=True)
class FitQuality:
    """How well a fitted surrogate describes the model on samples it was not fitted on."""

    heldout_samples: int
    heldout_mse: float
    """Mean squared error of the surrogate on the held-out samples."""
    heldout_r2: float
    """1 − heldout_mse / variance of the held-out outputs (1: perfect; ≤ 0: no better than
    their mean)."""
    linear_heldout_mse: float
    """The same error for an ordinary least-squares linear model on token counts (with an
    intercept) fitted on the same training samples: the additive baseline SLALOM should beat."""


def fit_quality(
    fit: SlalomFit,
    train_counts: npt.ArrayLike,
    train_targets: npt.ArrayLike,
    heldout_counts: npt.ArrayLike,
    heldout_targets: npt.ArrayLike,
) -> FitQuality:
    """Held-out errors of ``fit`` and of a linear model fitted on the same training samples."""
    c_train = np.asarray(train_counts, dtype=np.float64)
    c_test = np.asarray(heldout_counts, dtype=np.float64)
    y_train = np.asarray(train_targets, dtype=np.float64)
    y_test = np.asarray(heldout_targets, dtype=np.float64)
    predicted = slalom_predict(fit.importance, fit.value, c_test)
    mse = float(np.mean((predicted - y_test) ** 2))
    variance = float(np.var(y_test))
    r2 = 1.0 - mse / variance if variance > 0 else (1.0 if mse == 0 else 0.0)
    design = np.c_[np.ones(len(c_train)), c_train]
    beta = np.linalg.lstsq(design, y_train, rcond=None)[0]
    linear = np.c_[np.ones(len(c_test)), c_test] @ beta
    return FitQuality(
        heldout_samples=len(y_test),
        heldout_mse=mse,
        heldout_r2=float(r2),
        linear_heldout_mse=float(np.mean((linear - y_test) ** 2)),
    )


def target_output(logits: torch.Tensor, target: int, multi_label: bool = False) -> torch.Tensor:
    """[B, C] logits → [B] the quantity SLALOM models (see the module docstring)."""
    if logits.shape[-1] == 1:
        return logits[:, 0]
    if multi_label:  # a sigmoid per label: the label's log-odds is its logit
        return logits[:, target]
    others = torch.cat([logits[:, :target], logits[:, target + 1 :]], dim=-1)
    return logits[:, target] - torch.logsumexp(others, dim=-1)


@dataclass(frozen=True)
class _Frame:
    """The input split into fixed context and the explained segment."""

    positions: list[int]
    """Explained positions (first segment, non-special) in input order."""
    unique_ids: list[int]
    inverse: npt.NDArray[np.int64]
    """[len(positions)] index into ``unique_ids`` of each explained position."""
    prefix_ids: list[int]
    suffix_ids: list[int]
    prefix_types: list[int]
    suffix_types: list[int]
    segment_type: int


def _frame(encoded: Encoded) -> _Frame:
    explained = [i for i, tok in enumerate(encoded.tokens) if not tok.special]
    if not explained:
        raise InvalidArgument("the input has no tokens to explain (only special tokens)")
    first_segment = min(encoded.tokens[i].segment for i in explained)
    positions = [i for i in explained if encoded.tokens[i].segment == first_segment]
    lo, hi = positions[0], positions[-1]
    ids = encoded.input_ids
    types = encoded.token_type_ids or [0] * len(ids)
    unique: dict[int, int] = {}
    inverse = np.array([unique.setdefault(ids[i], len(unique)) for i in positions], np.int64)
    return _Frame(
        positions=positions,
        unique_ids=list(unique),
        inverse=inverse,
        prefix_ids=list(ids[:lo]),
        suffix_ids=list(ids[hi + 1 :]),
        prefix_types=list(types[:lo]),
        suffix_types=list(types[hi + 1 :]),
        segment_type=int(types[lo]),
    )


def _check_sample_fits(frame: _Frame, length: int, max_tokens: int) -> None:
    """A sample is the explained segment's ``length`` tokens between the input's fixed
    tokens (special tokens, and the other text of a pair): it must fit the model."""
    fixed = len(frame.prefix_ids) + len(frame.suffix_ids)
    if fixed + length > max_tokens:
        raise InvalidArgument(
            f"sample_length {length} makes samples of {fixed + length} tokens; the model "
            f"takes at most {max_tokens}: the {fixed} tokens every sample keeps (special "
            "tokens and, for a text pair, the other text) leave room for "
            f"{max(0, max_tokens - fixed)}; lower sample_length or shorten the pair"
        )


class Slalom(JobMethod):
    """SLALOM-eff: a value and an importance per token from a surrogate fitted on short samples."""

    name = "slalom"
    description = (
        "SLALOM surrogate (value, importance, linearised and removal scores per token) fitted "
        "on short random sequences of the input's tokens; N short forward passes + a tiny fit."
    )
    params: ClassVar[Mapping[str, Param]] = {
        "num_samples": Param(
            int, 500, 8, 100_000, help="random short sequences to query the model with"
        ),
        "sample_length": Param(int, 3, 1, 128, help="tokens per sampled sequence"),
        "fit": Param(
            str,
            "converged",
            choices=tuple(FIT_PRESETS),
            help="defaults of epochs, lr and batch_size: 'converged' (300 full-batch epochs at "
            "lr 0.05) or 'paper' (60 epochs of 128 at lr 5e-3, which under-fits); explicit "
            "values win",
        ),
        "epochs": Param(
            int, FIT_PRESETS["converged"]["epochs"], 1, 10_000, help="Adam epochs over the samples"
        ),
        "lr": Param(float, FIT_PRESETS["converged"]["lr"], 1e-6, 1.0, help="Adam learning rate"),
        "batch_size": Param(
            int,
            FIT_PRESETS["converged"]["batch_size"],
            1,
            100_000,
            help="samples per Adam step (at least the number of fitted samples: full batch)",
        ),
        "holdout": Param(
            float,
            0.2,
            0.0,
            0.5,
            help="share of the samples kept out of the fit to measure its quality (0: none)",
        ),
        "query_batch_size": Param(int, 64, 1, 4096, help="samples per model forward pass"),
        "seed": Param(int, 0, 0, 2**31 - 1, help="seed of sampling and minibatch order"),
        "score": Param(
            str, "linearized", choices=SCORE_KINDS, help="which score map is the primary one"
        ),
    }

    def validate_params(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        """Defaults, then the ``fit`` preset's values, then the explicitly given values."""
        out = super().validate_params(given)
        explicit = set(given or {})
        preset = FIT_PRESETS[str(out["fit"])]
        for key in _FIT_KEYS:
            if key not in explicit:
                out[key] = preset[key]
        return out

    def validate_for_input(
        self, model: LoadedModel, encoded: Encoded, params: Mapping[str, Any]
    ) -> None:
        _check_sample_fits(_frame(encoded), int(params["sample_length"]), model.max_tokens)

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        p = self.validate_params(params)
        model = ctx.model
        if not 0 <= target < max(model.num_labels, 1):
            raise InvalidArgument(f"target {target} out of range for {model.num_labels} labels")
        frame = _frame(encoded)
        num_tokens = len(frame.unique_ids)
        n, length = int(p["num_samples"]), int(p["sample_length"])
        _check_sample_fits(frame, length, model.max_tokens)

        rng = np.random.default_rng(int(p["seed"]))
        indices = rng.integers(0, num_tokens, size=(n, length))
        counts = counts_from_indices(indices, num_tokens)

        ctx.checkpoint(0.0, f"querying the model with {n} samples")
        targets = self._query(ctx, frame, indices, target, int(p["query_batch_size"]))
        full_output = float(
            self._forward(ctx, [encoded.input_ids], encoded.token_type_ids, target)[0]
        )

        epochs = int(p["epochs"])
        every = max(1, epochs // 20)

        def on_epoch(k: int) -> None:
            if k % every == 0 or k == epochs:
                fraction = _QUERY_SHARE + (1.0 - _QUERY_SHARE) * k / epochs
                ctx.checkpoint(fraction, f"fitting SLALOM: epoch {k}/{epochs}")
            elif ctx.should_stop():
                raise JobCancelled("job stopped during the SLALOM fit")

        held = int(n * float(p["holdout"]))
        train = n - held
        fit = fit_slalom(
            counts[:train],
            targets[:train],
            epochs=epochs,
            lr=float(p["lr"]),
            batch_size=int(p["batch_size"]),
            seed=int(p["seed"]),
            on_epoch=on_epoch,
        )
        input_counts = np.bincount(frame.inverse, minlength=num_tokens)
        per_token = slalom_scores(fit, input_counts)
        surrogate_full = float(slalom_predict(fit.importance, fit.value, input_counts[None])[0])

        extra: dict[str, FloatArray] = {}
        for kind, unique_scores in per_token.items():
            arr = np.zeros(len(encoded), dtype=np.float32)
            arr[frame.positions] = unique_scores[frame.inverse]
            extra[kind] = arr
        details: dict[str, Any] = {
            "mse": fit.mse,
            "samples": n,
            "fitted_samples": train,
            "sample_length": length,
            "fit": p["fit"],
            "epochs": epochs,
            "lr": float(p["lr"]),
            "batch_size": int(p["batch_size"]),
            "unique_tokens": num_tokens,
            "primary_score": p["score"],
            "output": (
                "raw output"
                if model.num_labels == 1
                else "label log-odds (logit)"
                if model.is_multi_label
                else "one-vs-rest log-odds"
            ),
            "model_output": full_output,
            "surrogate_output": surrogate_full,
            "model_evaluations": n + 1,
        }
        if held:
            quality = fit_quality(
                fit, counts[:train], targets[:train], counts[train:], targets[train:]
            )
            details.update(
                heldout_samples=quality.heldout_samples,
                heldout_mse=quality.heldout_mse,
                heldout_r2=quality.heldout_r2,
                linear_heldout_mse=quality.linear_heldout_mse,
            )
        finite = all(np.isfinite(values).all() for values in extra.values())
        if not (math.isfinite(fit.mse) and math.isfinite(surrogate_full) and finite):
            details["warning"] = "the fit diverged; lower lr"
        elif held and quality.heldout_mse > quality.linear_heldout_mse:
            details["warning"] = (
                "the surrogate fits held-out samples worse than a linear model; it has not "
                "converged (raise epochs or lr) or the model is far from a SLALOM"
            )
        return MethodOutput(
            scores=extra[str(p["score"])].copy(), extra_scores=extra, details=details
        )

    def _query(
        self,
        ctx: JobContext,
        frame: _Frame,
        indices: npt.NDArray[np.int64],
        target: int,
        batch_size: int,
    ) -> npt.NDArray[np.float64]:
        """The model's output on every sample, in batches, reporting progress."""
        uniq = np.asarray(frame.unique_ids, dtype=np.int64)
        n, length = indices.shape
        prefix = np.asarray(frame.prefix_ids, dtype=np.int64)
        suffix = np.asarray(frame.suffix_ids, dtype=np.int64)
        ids = np.concatenate(
            [np.tile(prefix, (n, 1)), uniq[indices], np.tile(suffix, (n, 1))], axis=1
        )
        types_row = frame.prefix_types + [frame.segment_type] * length + frame.suffix_types
        out = np.empty(n, dtype=np.float64)
        # Bounded memory: at most as many samples per pass as job_memory_mb holds.
        batch_size = min(batch_size, ctx.rows_per_pass(ids.shape[1], backward=False))
        for start in range(0, n, batch_size):
            stop = min(n, start + batch_size)
            out[start:stop] = self._forward(ctx, ids[start:stop], types_row, target)
            ctx.checkpoint(_QUERY_SHARE * stop / n, f"queried {stop}/{n} samples")
        return out

    @staticmethod
    def _forward(
        ctx: JobContext, ids: Any, types_row: list[int] | None, target: int
    ) -> npt.NDArray[np.float64]:
        """Model output (see :func:`target_output`) for equal-length rows of ids."""
        model = ctx.model
        with torch.inference_mode():
            input_ids = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=model.device)
            mask = torch.ones_like(input_ids)
            types = None
            if types_row is not None:
                row = torch.as_tensor(types_row, dtype=torch.long, device=model.device)
                types = row.unsqueeze(0).expand_as(input_ids)
            logits = model.adapter.logits(input_ids, mask, types).float()
            multi = bool(getattr(model, "is_multi_label", False))
            return target_output(logits, target, multi).double().cpu().numpy()

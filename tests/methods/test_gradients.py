"""Gradient baselines against direct autograd and Captum on the same real models."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from captum.attr import IntegratedGradients as CaptumIG
from captum.attr import LayerGradientXActivation, LayerIntegratedGradients

from limelight.core.types import Encoded
from limelight.errors import InvalidArgument
from limelight.methods.base import JobCancelled, JobContext, MethodRegistry
from limelight.methods.gradients import GradientNorm, GradXInput, IntegratedGradients
from limelight.models.loaded import LoadedModel

TEXT = "A great film, but the acting was not very good and the plot was boring."
PAIR = "Is it a good film?"
MODELS = ["random_bert", pytest.param("bert_tiny", marks=pytest.mark.slow)]


def tensors(model: LoadedModel, enc: Encoded) -> tuple[torch.Tensor, ...]:
    ids = torch.tensor([enc.input_ids])
    types = torch.tensor([enc.token_type_ids]) if enc.token_type_ids else torch.zeros_like(ids)
    return ids, torch.ones_like(ids), types


def hf_logits_from_ids(model: LoadedModel) -> Callable[..., torch.Tensor]:
    """Forward of the HF classifier itself (no Limelight adapter) for Captum."""

    def forward(ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        return model.model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits

    return forward


def hf_logits_from_embeds(model: LoadedModel) -> Callable[..., torch.Tensor]:
    def forward(embeds: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        return model.model(inputs_embeds=embeds, attention_mask=mask, token_type_ids=types).logits

    return forward


def run(method: Any, ctx: JobContext, enc: Encoded, target: int, **params: Any) -> Any:
    return method.run(ctx, enc, target, method.validate_params(params))


def assert_close_1e4(ours: np.ndarray, ref: np.ndarray) -> None:
    """Agreement to 1e-4, scaled down for tiny references (a random BERT's scores are ~1e-5)
    so that the comparison never passes trivially."""
    assert ours.shape == ref.shape
    scale = float(np.abs(ref).max())
    assert scale > 0.0 and np.ptp(ref) > 0.0
    np.testing.assert_allclose(ours, ref, atol=1e-4 * min(1.0, scale), rtol=1e-4)


@pytest.fixture(params=MODELS)
def model(request: pytest.FixtureRequest) -> LoadedModel:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


@pytest.mark.parametrize("pair", [None, PAIR])
def test_gradient_norm_matches_direct_autograd(
    model: LoadedModel, make_ctx: Callable[..., JobContext], pair: str | None
) -> None:
    enc = model.encode(TEXT, pair)
    ids, mask, types = tensors(model, enc)
    for target in range(model.num_labels):
        embeds = model.model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logit = hf_logits_from_embeds(model)(embeds, mask, types)[0, target]
        (grad,) = torch.autograd.grad(logit, embeds)
        expected = grad[0].norm(dim=-1).numpy()
        out = run(GradientNorm(), make_ctx(model), enc, target)
        assert out.scores.dtype == np.float32 and out.scores.shape == (len(enc),)
        np.testing.assert_allclose(out.scores, expected, rtol=1e-5, atol=1e-7)
        assert out.details["target_logit"] == pytest.approx(float(logit.detach()), abs=1e-5)


@pytest.mark.parametrize("pair", [None, PAIR])
def test_grad_x_input_matches_captum_at_the_embedding_output(
    model: LoadedModel, make_ctx: Callable[..., JobContext], pair: str | None
) -> None:
    """Gradient × input at h0, the embeddings module's output (word + position + segment,
    normalised): Captum's LayerGradientXActivation on that module."""
    enc = model.encode(TEXT, pair)
    ids, mask, types = tensors(model, enc)
    embeddings = model.model.bert.embeddings
    captum = LayerGradientXActivation(hf_logits_from_ids(model), embeddings)
    for target in range(model.num_labels):
        ref = captum.attribute(ids, target=target, additional_forward_args=(mask, types))
        out = run(GradXInput(), make_ctx(model), enc, target)
        assert_close_1e4(out.scores, ref[0].sum(dim=-1).detach().numpy())
        assert out.details["input"] == "embedding_output"


def test_grad_x_input_is_not_a_position_and_segment_score(
    model: LoadedModel, make_ctx: Callable[..., JobContext]
) -> None:
    """At the word embeddings e, grad × input is degenerate: the embedding LayerNorm is scale
    invariant, so g·e = −g·(position + segment) exactly. The method must not be that."""
    enc = model.encode(TEXT, PAIR)
    ids, mask, types = tensors(model, enc)
    embeddings = model.model.bert.embeddings
    words = embeddings.word_embeddings(ids).detach().requires_grad_(True)
    logit = hf_logits_from_embeds(model)(words, mask, types)[0, 0]
    (grad,) = torch.autograd.grad(logit, words)
    positions = embeddings.position_embeddings(torch.arange(ids.shape[1]))[None]
    segments = embeddings.token_type_embeddings(types)
    at_words = (grad * words).sum(dim=-1)[0].detach().numpy()
    from_position = -(grad * (positions + segments)).sum(dim=-1)[0].detach().numpy()
    # The identity that makes word-embedding grad × input useless (up to LayerNorm's epsilon):
    np.testing.assert_allclose(
        at_words, from_position, rtol=1e-2, atol=1e-3 * np.abs(at_words).max()
    )
    out = run(GradXInput(), make_ctx(model), enc, 0)
    assert not np.allclose(out.scores, from_position, rtol=0.1, atol=0.1 * np.abs(out.scores).max())


def captum_reference_ids(model: LoadedModel, enc: Encoded, baseline: str) -> torch.Tensor:
    token = model.pad_id if baseline == "pad" else model.mask_token_id
    assert token is not None
    return torch.tensor(
        [
            [
                tid if tok.special else token
                for tid, tok in zip(enc.input_ids, enc.tokens, strict=True)
            ]
        ]
    )


@pytest.mark.parametrize(
    ("baseline", "rule", "steps", "batch"),
    [
        ("pad", "gausslegendre", 32, 16),
        ("mask", "gausslegendre", 20, 7),
        ("pad", "riemann_middle", 25, 10),
        ("pad", "riemann_trapezoid", 25, 10),
    ],
)
def test_integrated_gradients_matches_captum_layer_ig(
    model: LoadedModel,
    make_ctx: Callable[..., JobContext],
    baseline: str,
    rule: str,
    steps: int,
    batch: int,
) -> None:
    enc = model.encode(TEXT, PAIR)
    ids, mask, types = tensors(model, enc)
    refs = captum_reference_ids(model, enc, baseline)
    lig = LayerIntegratedGradients(hf_logits_from_ids(model), model.model.get_input_embeddings())
    target = model.num_labels - 1
    ref, delta = lig.attribute(
        ids,
        baselines=refs,
        target=target,
        additional_forward_args=(mask, types),
        n_steps=steps,
        method=rule,
        internal_batch_size=batch,
        return_convergence_delta=True,
    )
    out = run(
        IntegratedGradients(),
        make_ctx(model),
        enc,
        target,
        steps=steps,
        baseline=baseline,
        rule=rule,
        batch_size=batch,
    )
    expected = ref[0].sum(dim=-1).detach().numpy()
    if rule == "riemann_trapezoid":
        # Captum weights every trapezoid point by 1/n; the textbook rule (ours) by 1/(n-1).
        expected = expected * steps / (steps - 1)
    else:
        # Captum's delta is Σ attributions − (f(x) − f(baseline)): ours means the same.
        assert out.details["convergence_delta"] == pytest.approx(float(delta[0]), abs=1e-4)
    assert_close_1e4(out.scores, expected)
    special = enc.special_mask
    assert np.all(out.scores[special] == 0.0)  # specials keep their embedding in the baseline


def test_integrated_gradients_zero_baseline_matches_captum_on_embeddings(
    bert_tiny: LoadedModel, make_ctx: Callable[..., JobContext]
) -> None:
    model = bert_tiny
    enc = model.encode(TEXT)
    ids, mask, types = tensors(model, enc)
    embeds = model.model.get_input_embeddings()(ids).detach()
    special = torch.tensor(enc.special_mask)[None, :, None]
    base = torch.where(special, embeds, torch.zeros_like(embeds))
    ig = CaptumIG(hf_logits_from_embeds(model))
    ref = ig.attribute(
        embeds, baselines=base, target=0, additional_forward_args=(mask, types), n_steps=24
    )
    out = run(IntegratedGradients(), make_ctx(model), enc, 0, steps=24, baseline="zero")
    assert_close_1e4(out.scores, ref[0].sum(dim=-1).detach().numpy())


@pytest.mark.parametrize("baseline", ["pad", "zero"])
def test_integrated_gradients_completeness(
    bert_tiny: LoadedModel, make_ctx: Callable[..., JobContext], baseline: str
) -> None:
    enc = bert_tiny.encode(TEXT)
    out = run(
        IntegratedGradients(), make_ctx(bert_tiny), enc, 1, steps=128, baseline=baseline,
        batch_size=64,
    )  # fmt: skip
    gap = out.details["target_logit"] - out.details["baseline_logit"]
    assert abs(gap) > 0.05  # the input and the baseline differ: completeness is not trivial
    assert float(out.scores.sum()) == pytest.approx(gap, abs=2e-3 + 1e-2 * abs(gap))
    assert out.details["convergence_delta"] == pytest.approx(
        float(out.scores.sum()) - gap, abs=1e-5
    )
    # The target logit agrees with the classifier's own output.
    ids, mask, types = tensors(bert_tiny, enc)
    logits = bert_tiny.model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    assert out.details["target_logit"] == pytest.approx(float(logits[0, 1].detach()), abs=1e-4)


def test_integrated_gradients_reports_progress_and_stops_when_cancelled(
    random_bert: LoadedModel, make_ctx: Callable[..., JobContext]
) -> None:
    enc = random_bert.encode(TEXT)
    ctx = make_ctx(random_bert)
    run(IntegratedGradients(), ctx, enc, 0, steps=10, batch_size=4)
    fractions = [f for f, _ in ctx.progress]  # type: ignore[attr-defined]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert len(fractions) == 1 + 3  # start + ceil(10 / 4) batches

    calls: list[float] = []
    stopping = JobContext(
        model=random_bert,
        settings=ctx.settings,
        report=lambda f, m: calls.append(f),
        should_stop=lambda: len(calls) >= 2,
    )
    with pytest.raises(JobCancelled):
        run(IntegratedGradients(), stopping, enc, 0, steps=10, batch_size=2)
    assert len(calls) == 2  # stopped after the first batch, not at the end


def test_parameters_are_validated() -> None:
    ig = IntegratedGradients()
    assert ig.validate_params({}) == {
        "steps": 32, "baseline": "pad", "rule": "gausslegendre", "batch_size": 16,
    }  # fmt: skip
    for bad in ({"steps": 0}, {"steps": 513}, {"baseline": "unk"}, {"rule": "riemann_left"},
                {"batch_size": 0}, {"alpha": 1}):  # fmt: skip
        with pytest.raises(InvalidArgument):
            ig.validate_params(bad)
    with pytest.raises(InvalidArgument):
        GradientNorm().validate_params({"steps": 3})


def test_trapezoid_needs_two_steps(
    random_bert: LoadedModel, make_ctx: Callable[..., JobContext]
) -> None:
    with pytest.raises(InvalidArgument):
        run(IntegratedGradients(), make_ctx(random_bert), random_bert.encode(TEXT), 0, steps=1,
            rule="riemann_trapezoid")  # fmt: skip


def test_registry_has_the_gradient_methods() -> None:
    registry = MethodRegistry.load()
    assert isinstance(registry.get("gradient"), GradientNorm)
    assert isinstance(registry.get("grad_x_input"), GradXInput)
    assert isinstance(registry.get("integrated_gradients"), IntegratedGradients)
    for name in ("gradient", "grad_x_input", "integrated_gradients"):
        assert registry.get(name).cost.value == "job"

"""Head-masked LRP: rules against hand computations, per-layer conservation on random configs of
every supported architecture and on the demo model, attention and gradients against the
transformers eager implementation, randomisation sanity, predictions untouched by the mask,
and deletion AOPC better than random on held-out reviews."""

from __future__ import annotations

import copy
import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from transformers import AutoConfig, AutoModelForSequenceClassification, GPT2Config

from limelight.demo.build import CARD_FILE, demo_model_dir
from limelight.demo.datasets import rotten_tomatoes
from limelight.errors import FailedPrecondition, InvalidArgument
from limelight.evaluation.perturbation import deletion_aopc
from limelight.methods.base import JobCancelled, JobContext
from limelight.methods.lrp import HeadMaskedLRP, lrp_add, lrp_linear, lrp_matmul, run_lrp
from limelight.models.loaded import LoadedModel, load_model
from limelight.settings import Settings

# Relevance starts at 1 on the target logit; float32 arithmetic keeps every layer's total
# within this absolute tolerance of the total that entered it.
CONSERVATION_TOL = 1e-4
TEXT = "the movie was a wonderful surprise, not boring at all, and the cast is superb"


def _tiny_config(arch: str) -> Any:
    if arch == "distilbert":
        kw = {"dim": 32, "n_layers": 3, "n_heads": 4, "hidden_dim": 64}
    else:
        kw = {
            "hidden_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "intermediate_size": 64,
        }
    if arch in ("roberta", "xlm-roberta"):
        kw["pad_token_id"] = 0
    return AutoConfig.for_model(
        arch, vocab_size=30522, max_position_embeddings=64, num_labels=3, **kw
    )


@pytest.fixture(scope="module", params=["bert", "roberta", "xlm-roberta", "distilbert"])
def tiny_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> LoadedModel:
    """A small random classifier of each supported architecture, with a real tokenizer."""
    arch = request.param
    out = tmp_path_factory.mktemp(f"tiny-{arch}")
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(_tiny_config(arch))
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return load_model(out)


def _model_logits(model: LoadedModel, text: str) -> np.ndarray:
    enc = model.encode(text)
    kwargs = model.adapter.base_inputs(
        torch.tensor([enc.input_ids]),
        torch.ones(1, len(enc), dtype=torch.long),
        torch.tensor([enc.token_type_ids]) if enc.token_type_ids is not None else None,
    )
    with torch.no_grad():
        return np.asarray(model.model(**kwargs).logits[0].float().numpy())


def _check_conservation(trace: Any) -> None:
    assert trace.layer_totals[0] == pytest.approx(1.0)
    steps = np.diff(np.array(trace.layer_totals))
    assert np.abs(steps).max() < CONSERVATION_TOL, trace.layer_totals
    for entering, leaving in trace.block_checks:
        assert abs(entering - leaving) < CONSERVATION_TOL
    assert float(trace.input_relevance.sum()) == pytest.approx(1.0, abs=CONSERVATION_TOL * 5)


# --- the rules -------------------------------------------------------------------------------


def test_linear_rule_matches_hand_computation() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, dtype=torch.float64)
    w = torch.randn(4, 5, dtype=torch.float64)
    r_out = torch.randn(3, 4, dtype=torch.float64)
    expected = torch.zeros_like(x)
    for t in range(3):
        for j in range(4):
            contrib = [max(float(x[t, i] * w[j, i]), 0.0) for i in range(5)]
            total = sum(contrib)
            for i in range(5):
                expected[t, i] += contrib[i] / total * r_out[t, j]
    got = lrp_linear(x, w, r_out)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got.sum(), r_out.sum())


def test_add_and_matmul_rules_conserve_and_split_by_grad_x_input() -> None:
    torch.manual_seed(0)
    a, b = torch.rand(4, 6, dtype=torch.float64) + 0.1, torch.rand(4, 6, dtype=torch.float64)
    r = torch.rand(4, 6, dtype=torch.float64)
    ra, rb = lrp_add(a, b, r)
    torch.testing.assert_close(ra + rb, r)  # positive operands: the plain a/(a+b) split
    torch.testing.assert_close(ra, a / (a + b) * r)
    p = torch.softmax(torch.randn(2, 5, 5, dtype=torch.float64), -1)
    v = torch.randn(2, 5, 3, dtype=torch.float64)
    rel = torch.randn(2, 5, 3, dtype=torch.float64)
    rp, rv = lrp_matmul(p, v, rel)
    torch.testing.assert_close(rp.sum((-2, -1)) + rv.sum((-2, -1)), rel.sum((-2, -1)))
    # Each share keeps the pattern of its gradient×input term.
    s = rel / (p @ v)
    gx = p * (s @ v.transpose(-1, -2))
    ratio = rp / gx
    torch.testing.assert_close(ratio, ratio[:, :1, :1].expand_as(ratio))


# --- the whole propagation on random configs -------------------------------------------------


def test_forward_matches_model_and_relevance_is_conserved(tiny_model: LoadedModel) -> None:
    enc = tiny_model.encode(TEXT)
    trace = run_lrp(tiny_model.model, enc.input_ids, 2, enc.token_type_ids)
    np.testing.assert_allclose(trace.logits, _model_logits(tiny_model, TEXT), atol=1e-5)
    _check_conservation(trace)
    assert len(trace.block_checks) == 3
    assert trace.scores.shape == (len(enc),)
    assert trace.scores[0] == 0.0  # the pooled token's own entry
    assert np.isfinite(trace.scores).all()


def test_conservation_holds_with_a_mask_and_an_empty_layer(tiny_model: LoadedModel) -> None:
    enc = tiny_model.encode(TEXT)
    heads = {0: [1, 3], 1: [], 2: [0]}
    trace = run_lrp(tiny_model.model, enc.input_ids, 0, enc.token_type_ids, heads=heads)
    _check_conservation(trace)
    # Masked heads take no relevance and do not enter the rollout.
    for layer, kept in heads.items():
        for h in range(4):
            if h not in kept:
                assert np.abs(trace.attention_relevance[layer][h]).max() == 0.0
    assert np.abs(trace.rollout_layers[1]).max() == 0.0


def test_attention_and_gradients_match_transformers_eager(
    tiny_model: LoadedModel,
) -> None:
    """The re-run forward gives the attention probabilities and ∇A of the eager kernel."""
    enc = tiny_model.encode(TEXT)
    target = 1
    trace = run_lrp(tiny_model.model, enc.input_ids, target, enc.token_type_ids)
    eager = AutoModelForSequenceClassification.from_pretrained(
        tiny_model.directory, attn_implementation="eager"
    ).eval()
    kwargs: dict[str, Any] = {"input_ids": torch.tensor([enc.input_ids])}
    if enc.token_type_ids is not None:
        kwargs["token_type_ids"] = torch.tensor([enc.token_type_ids])
    out = eager(**kwargs, output_attentions=True)
    for att in out.attentions:
        att.retain_grad()
    out.logits[0, target].backward()
    for b, att in enumerate(out.attentions):
        np.testing.assert_allclose(trace.attention[b], att[0].detach().numpy(), atol=1e-6)
        np.testing.assert_allclose(trace.attention_grad[b], att.grad[0].numpy(), atol=1e-6)


def _weights_digest(model: LoadedModel) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def test_mask_leaves_the_prediction_and_the_model_untouched(tiny_model: LoadedModel) -> None:
    enc = tiny_model.encode(TEXT)
    before_logits, before_weights = _model_logits(tiny_model, TEXT), _weights_digest(tiny_model)
    masked = run_lrp(tiny_model.model, enc.input_ids, 0, enc.token_type_ids, heads={0: [0], 2: [1]})
    plain = run_lrp(tiny_model.model, enc.input_ids, 0, enc.token_type_ids)
    np.testing.assert_array_equal(masked.logits, plain.logits)
    np.testing.assert_array_equal(_model_logits(tiny_model, TEXT), before_logits)
    assert _weights_digest(tiny_model) == before_weights
    # Random weights give tiny rollout values; compare their shapes, not their scale.
    assert not np.allclose(masked.scores / masked.scores.max(), plain.scores / plain.scores.max())


# --- the job method --------------------------------------------------------------------------


def test_method_reports_no_mask_and_only_the_rollout(
    tiny_model: LoadedModel, make_ctx: Callable[..., JobContext], tmp_path: Path
) -> None:
    method = HeadMaskedLRP()
    ctx = make_ctx(tiny_model, head_mask_path=tmp_path / "absent.json")
    enc = tiny_model.encode(TEXT)
    out = method.run(ctx, enc, 1, method.validate_params({}))
    assert out.details["head_mask"]["used"] is False
    assert "no head mask file" in out.details["head_mask"]["reason"]
    assert out.details["rollout"] is True
    assert out.details["max_layer_conservation_error"] < CONSERVATION_TOL
    assert out.extra_scores == {}  # no class-blind input relevance on the side
    assert ctx.progress[-1] == (1.0, "done")  # type: ignore[attr-defined]
    fractions = [f for f, _ in ctx.progress]  # type: ignore[attr-defined]
    assert fractions == sorted(fractions) and len(fractions) > 4
    assert method.validate_params({"rollout": True})["rollout"] is True
    with pytest.raises(InvalidArgument, match="class-blind"):
        method.validate_params({"rollout": False})


def _redraw_head(model: Any, seed: int) -> Any:
    clone = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = clone.classifier.weight
        weight.copy_(torch.randn(weight.shape, generator=gen) * 0.02)
    return clone


def test_input_relevance_is_class_blind_and_the_rollout_is_not(random_bert: LoadedModel) -> None:
    """Why the method offers the rollout only: the z⁺ input relevance is one token profile times
    a scalar, for every class and for any classifier head; the gradient-weighted rollout is not."""
    enc = random_bert.encode(TEXT)

    def corr(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.corrcoef(a, b)[0, 1])

    per_class = [
        run_lrp(random_bert.model, enc.input_ids, c, enc.token_type_ids)
        for c in range(random_bert.num_labels)
    ]
    other_head = run_lrp(_redraw_head(random_bert.model, 7), enc.input_ids, 0, enc.token_type_ids)
    inputs = [t.input_relevance for t in per_class]
    assert min(corr(inputs[0], x) for x in inputs[1:]) > 0.999
    assert corr(inputs[0], other_head.input_relevance) > 0.999
    rollouts = [t.scores for t in per_class]
    assert min(corr(rollouts[0], x) for x in rollouts[1:]) < 0.95
    assert corr(rollouts[0], other_head.scores) < 0.95


def test_cancellation_stops_between_layers(random_bert: LoadedModel) -> None:
    calls: list[int] = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 2

    ctx = JobContext(model=random_bert, settings=Settings(), should_stop=stop)
    method = HeadMaskedLRP()
    with pytest.raises(JobCancelled):
        method.run(ctx, random_bert.encode(TEXT), 0, method.validate_params({}))


def test_other_architectures_are_a_failed_precondition(random_bert: LoadedModel) -> None:
    from transformers import GPT2ForSequenceClassification

    gpt2 = GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    fake = SimpleNamespace(model=gpt2)
    method = HeadMaskedLRP()
    reason = method.unavailable_reason(fake)  # type: ignore[arg-type]
    assert "gpt2" in reason and "BERT-family" in reason
    with pytest.raises(FailedPrecondition, match="BERT-family"):
        method.run(
            JobContext(model=fake, settings=Settings()),  # type: ignore[arg-type]
            random_bert.encode("x"),
            0,
            method.validate_params({}),
        )
    assert method.unavailable_reason(random_bert) == ""


# --- the demo model ---------------------------------------------------------------------------


def test_conservation_on_the_demo_model(bert_tiny: LoadedModel) -> None:
    for i, example in enumerate(rotten_tomatoes("test")[:5]):
        enc = bert_tiny.encode(example.text, max_tokens=96)
        trace = run_lrp(bert_tiny.model, enc.input_ids, i % 2, enc.token_type_ids)
        _check_conservation(trace)
        masked = run_lrp(
            bert_tiny.model, enc.input_ids, i % 2, enc.token_type_ids, heads={0: [0], 1: [1]}
        )
        _check_conservation(masked)


def _randomised(model: LoadedModel) -> Any:
    """A copy of the classifier with every weight re-drawn (the cascading randomisation test)."""
    clone = copy.deepcopy(model.model)
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for module in clone.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.02)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    bias.zero_()
    return clone


@pytest.mark.parametrize("rollout", [True, False])
def test_randomising_weights_changes_attributions(bert_tiny: LoadedModel, rollout: bool) -> None:
    random_model = _randomised(bert_tiny)
    rhos, self_rhos = [], []
    for example in rotten_tomatoes("test")[:12]:
        enc = bert_tiny.encode(example.text, max_tokens=64)
        keep = ~enc.special_mask
        if keep.sum() < 5:
            continue
        target = 1
        a = run_lrp(bert_tiny.model, enc.input_ids, target, enc.token_type_ids, rollout=rollout)
        again = run_lrp(bert_tiny.model, enc.input_ids, target, enc.token_type_ids, rollout=rollout)
        b = run_lrp(random_model, enc.input_ids, target, enc.token_type_ids, rollout=rollout)
        rhos.append(spearmanr(a.scores[keep], b.scores[keep]).statistic)
        self_rhos.append(spearmanr(a.scores[keep], again.scores[keep]).statistic)
    assert np.mean(self_rhos) == pytest.approx(1.0)
    assert np.mean(rhos) < 0.5, rhos


@pytest.fixture(scope="module")
def demo_for_aopc(request: pytest.FixtureRequest) -> tuple[str, LoadedModel]:
    """MiniLM when it is already built in the cache (its build takes minutes), else BERT-tiny."""
    cache = Settings().cache_dir
    minilm = demo_model_dir("minilm", cache)
    if (minilm / CARD_FILE).exists():
        return "minilm", load_model(minilm)
    return "bert-tiny", load_model(request.getfixturevalue("bert_tiny_dir"))


def test_lrp_deletion_aopc_beats_random(demo_for_aopc: tuple[str, LoadedModel]) -> None:
    name, model = demo_for_aopc
    method = HeadMaskedLRP()
    ctx = JobContext(model=model, settings=Settings(head_mask_path=Path("/nonexistent")))
    params = method.validate_params({})
    encoded, targets, lrp_scores = [], [], []
    for example in rotten_tomatoes("test")[:40]:
        enc = model.encode(example.text, max_tokens=64)
        if (~enc.special_mask).sum() < 4:
            continue
        logits = _model_logits(model, example.text)
        target = int(np.argmax(logits))  # explain the prediction
        encoded.append(enc)
        targets.append(target)
        lrp_scores.append(method.run(ctx, enc, target, params).scores)
    lrp = deletion_aopc(model, encoded, lrp_scores, targets)
    rng = np.random.default_rng(0)
    randoms = [
        deletion_aopc(
            model, encoded, [rng.random(len(e)).astype(np.float32) for e in encoded], targets
        )
        for _ in range(3)
    ]
    print(f"{name}: LRP deletion AOPC {lrp:.4f}, random {np.mean(randoms):.4f}")
    assert lrp > max(randoms), (name, lrp, randoms)

"""SLALOM: recovery, the paper's synthetic linear set, fit quality, faithfulness, plumbing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from torch import nn

from limelight.demo.datasets import rotten_tomatoes
from limelight.demo.synthetic import (
    LABELS,
    SYNTHETIC_WEIGHTS,
    SYNTHETIC_WORDS,
    build_synthetic_model,
    build_word_tokenizer,
    sample_linear_dataset,
    word_token_ids,
)
from limelight.errors import InvalidArgument
from limelight.evaluation.perturbation import deletion_aopc, probabilities
from limelight.methods.base import JobCancelled, JobContext, MethodRegistry
from limelight.methods.slalom import (
    FIT_PRESETS,
    SCORE_KINDS,
    Slalom,
    counts_from_indices,
    fit_slalom,
    slalom_loss_grad,
    slalom_predict,
    slalom_scores,
    target_output,
)
from limelight.models.adapters import HeadAdapter
from limelight.models.loaded import LoadedModel, load_model
from limelight.settings import Settings

# Fit settings that run the optimiser well past convergence on a few hundred samples (full-batch
# Adam, 1000 steps), for parameter recovery to 0.02. The method's defaults (300 full-batch steps)
# converge in output terms; the paper's (60 epochs of 4 minibatches at lr 5e-3: 240 steps that
# each move a parameter by about 5e-3) rank tokens but do not even fit the outputs; see
# docs/methods/slalom.md.
CONVERGED: dict[str, Any] = {"epochs": 1000, "lr": 0.05, "batch_size": 100_000}
PAPER: dict[str, Any] = FIT_PRESETS["paper"]


def ctx_for(model: LoadedModel, should_stop: Callable[[], bool] = lambda: False) -> JobContext:
    progress: list[tuple[float, str]] = []
    ctx = JobContext(
        model=model,
        settings=Settings(),
        report=lambda fraction, message: progress.append((fraction, message)),
        should_stop=should_stop,
    )
    ctx.progress = progress  # type: ignore[attr-defined]
    return ctx


def random_slalom(num_tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Importances (Σ = 0) and values of a random, clearly non-constant SLALOM."""
    rng = np.random.default_rng(seed)
    s = rng.normal(0.0, 1.0, num_tokens)
    v = rng.normal(0.0, 1.5, num_tokens)
    return s - s.mean(), v


# --- the pure fitting core ------------------------------------------------------------------


def test_recovers_a_slalom_black_box() -> None:
    """Proposition 5.2: fitting a black box that IS a SLALOM recovers its s (after Σs = 0) and v.

    Tolerance: 0.02 absolute on every parameter (they are O(1)) and held-out outputs within
    1e-4 MSE, from 600 samples of length 3 over 12 tokens.
    """
    num_tokens = 12
    s_true, v_true = random_slalom(num_tokens, seed=1)
    rng = np.random.default_rng(2)
    counts = counts_from_indices(rng.integers(0, num_tokens, (600, 3)), num_tokens)
    fit = fit_slalom(counts, slalom_predict(s_true, v_true, counts), seed=0, **CONVERGED)

    assert abs(float(fit.importance.sum())) < 1e-5
    np.testing.assert_allclose(fit.importance, s_true, atol=0.02)
    np.testing.assert_allclose(fit.value, v_true, atol=0.02)
    held_out = counts_from_indices(rng.integers(0, num_tokens, (1000, 6)), num_tokens)
    truth = slalom_predict(s_true, v_true, held_out)
    ours = slalom_predict(fit.importance, fit.value, held_out)
    assert float(np.mean((ours - truth) ** 2)) < 1e-4
    assert fit.mse < 1e-4


@pytest.mark.parametrize("seed", [1, 3])
def test_paper_defaults_fit_roughly_and_rank_values(seed: int) -> None:
    """With the paper's defaults (500 samples, 60 epochs, lr 5e-3) the fit explains most of the
    output variance and orders tokens by value, without recovering the parameters exactly."""
    s_true, v_true = random_slalom(12, seed=seed)
    rng = np.random.default_rng(4)
    counts = counts_from_indices(rng.integers(0, 12, (500, 3)), 12)
    targets = slalom_predict(s_true, v_true, counts)
    fit = fit_slalom(counts, targets, **PAPER)
    assert fit.mse < 0.25 * float(np.var(targets))
    assert spearmanr(fit.value, v_true)[0] > 0.8


def test_surrogate_and_scores_match_the_formulas() -> None:
    s = np.array([0.5, -0.2, -0.3])
    v = np.array([2.0, -1.0, 0.5])
    counts = np.array([[1, 0, 0], [1, 1, 0], [2, 1, 1]])
    e = np.exp(s)
    expected = [
        2.0,
        (e[0] * 2.0 - e[1]) / (e[0] + e[1]),
        (2 * e[0] * 2.0 - e[1] + e[2] * 0.5) / (2 * e[0] + e[1] + e[2]),
    ]
    np.testing.assert_allclose(slalom_predict(s, v, counts), expected, rtol=1e-12)

    from limelight.methods.slalom import SlalomFit

    fit = SlalomFit(s.astype(np.float32), v.astype(np.float32), 0.0)
    scores = slalom_scores(fit, counts[2])
    np.testing.assert_allclose(scores["linearized"], e * v, rtol=1e-6)
    # Removal score = exact drop of F when one occurrence of the token is removed.
    full = slalom_predict(s, v, counts[2:3])[0]
    for k in range(3):
        fewer = counts[2].copy()
        fewer[k] -= 1
        dropped = full - slalom_predict(s, v, fewer[None])[0]
        assert scores["removal"][k] == pytest.approx(dropped, rel=1e-5, abs=1e-6)


def test_analytic_gradient_matches_autograd() -> None:
    """The fit's hand-written gradient against torch autograd on the same loss."""
    rng = np.random.default_rng(8)
    s, v = rng.normal(size=7), rng.normal(size=7)
    counts = counts_from_indices(rng.integers(-1, 7, (40, 5)), 7)
    counts[counts.sum(axis=1) == 0, 0] = 1.0
    y = rng.normal(size=40)
    loss, grad_s, grad_v = slalom_loss_grad(s, v, counts, y)

    ts = torch.tensor(s, requires_grad=True)
    tv = torch.tensor(v, requires_grad=True)
    c = torch.tensor(counts, dtype=torch.float64)
    logits = torch.where(c > 0, ts + torch.log(c.clamp_min(1e-300)), float("-inf"))
    f = (torch.softmax(logits, dim=-1) * tv).sum(-1)
    ref = torch.mean((f - torch.tensor(y)) ** 2)
    ref.backward()  # type: ignore[no-untyped-call]
    assert loss == pytest.approx(ref.item(), rel=1e-12)
    assert ts.grad is not None and tv.grad is not None
    np.testing.assert_allclose(grad_s, ts.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad_v, tv.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_fit_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError):
        fit_slalom(np.zeros((3, 2)), np.zeros(3))  # samples without tokens
    with pytest.raises(ValueError):
        fit_slalom(np.ones((3, 2)), np.zeros(4))
    with pytest.raises(ValueError):
        fit_slalom(np.ones((3, 2)), np.array([0.0, np.nan, 1.0]))


def test_target_output_is_one_vs_rest_log_odds() -> None:
    logits = torch.tensor([[0.3, -1.2, 2.0], [1.0, 0.0, -0.5]])
    p = torch.softmax(logits.double(), dim=-1)
    for c in range(3):
        expected = torch.log(p[:, c]) - torch.log1p(-p[:, c])
        torch.testing.assert_close(target_output(logits, c).double(), expected, atol=1e-6, rtol=0)
    binary = torch.tensor([[0.5, 2.0]])
    assert target_output(binary, 1).item() == pytest.approx(1.5)
    assert target_output(binary, 0).item() == pytest.approx(-1.5)


# --- through the job method, with a black box that is a SLALOM ------------------------------


class SlalomClassifier(nn.Module):
    """A binary classifier whose log-odds logit₁ − logit₀ is exactly a SLALOM over token ids.

    Special tokens and padding get zero attention. Records every batch it sees.
    """

    s_table: torch.Tensor
    v_table: torch.Tensor

    def __init__(self, vocab_size: int, s: dict[int, float], v: dict[int, float]) -> None:
        super().__init__()
        s_table = torch.full((vocab_size,), float("-inf"), dtype=torch.float64)
        v_table = torch.zeros(vocab_size, dtype=torch.float64)
        for tid, value in s.items():
            s_table[tid] = value
            v_table[tid] = v[tid]
        self.register_buffer("s_table", s_table)
        self.register_buffer("v_table", v_table)
        self.config = SimpleNamespace(model_type="slalom", num_hidden_layers=0)
        self.seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> Any:
        self.seen.append((input_ids.clone(), None if token_type_ids is None else token_type_ids))
        scores = self.s_table[input_ids].masked_fill(attention_mask == 0, float("-inf"))
        f = (torch.softmax(scores, dim=-1) * self.v_table[input_ids]).sum(-1)
        return SimpleNamespace(logits=torch.stack([-f / 2, f / 2], dim=-1).float())


class PlainAdapter(HeadAdapter):
    """The generic HeadAdapter input plumbing around the SLALOM classifier."""

    uses_token_type_ids = True

    @property
    def base(self) -> nn.Module:
        return self.model

    def head(self, hidden: torch.Tensor) -> torch.Tensor:  # not used by SLALOM
        raise NotImplementedError

    def logits(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The black box's logits are its own output (it has no base and head to split)."""
        kwargs = self.base_inputs(input_ids, attention_mask, token_type_ids, inputs_embeds)
        return self.model(**kwargs).logits  # type: ignore[no-any-return]


@pytest.fixture
def slalom_model(tmp_path: Path) -> tuple[LoadedModel, dict[str, float], dict[str, float]]:
    tokenizer = build_word_tokenizer()
    s_true, v_true = random_slalom(len(SYNTHETIC_WORDS), seed=7)
    ids = word_token_ids(tokenizer)
    black_box = SlalomClassifier(
        len(tokenizer), dict(zip(ids, s_true, strict=True)), dict(zip(ids, v_true, strict=True))
    )
    model = LoadedModel(
        directory=tmp_path,
        name="slalom-black-box",
        version="0",
        model=black_box,
        tokenizer=tokenizer,
        adapter=PlainAdapter(black_box),
        labels=list(LABELS),
        max_tokens=64,
        pad_id=0,
        device=torch.device("cpu"),
    )
    return (
        model,
        dict(zip(SYNTHETIC_WORDS, s_true, strict=True)),
        dict(zip(SYNTHETIC_WORDS, v_true, strict=True)),
    )


def test_job_recovers_the_black_box_per_token(slalom_model: Any) -> None:
    model, s_true, v_true = slalom_model
    # Only 6 of the 10 words, one of them twice: SLALOM sees only the input's tokens.
    words = ["good", "the", "worst", "movie", "ok", "the", "best"]
    enc = model.encode(" ".join(words))
    out = Slalom().run(ctx_for(model), enc, 1, {"num_samples": 600, **CONVERGED})

    present = sorted(set(words))
    s_ref = np.array([s_true[w] for w in present])
    s_ref -= s_ref.mean()  # Σ s = 0 over the input's unique tokens
    for tok, s_fit, v_fit in zip(
        enc.tokens, out.extra_scores["importance"], out.extra_scores["value"], strict=True
    ):
        if tok.special:
            assert s_fit == 0.0 and v_fit == 0.0
            continue
        assert v_fit == pytest.approx(v_true[tok.text], abs=0.02)
        assert s_fit == pytest.approx(s_ref[present.index(tok.text)], abs=0.02)
    # The surrogate reproduces the black box's output on the full input.
    assert out.details["surrogate_output"] == pytest.approx(out.details["model_output"], abs=0.01)
    np.testing.assert_array_equal(out.scores, out.extra_scores["linearized"])
    assert set(out.extra_scores) == set(SCORE_KINDS)


def test_default_fit_converges_and_reports_its_held_out_quality(slalom_model: Any) -> None:
    """With the defaults the surrogate of a SLALOM black box reproduces held-out samples almost
    exactly and beats the linear baseline; the paper's values fall clearly short."""
    model, _, _ = slalom_model
    enc = model.encode("good the worst movie ok the best we watch")
    out = Slalom().run(ctx_for(model), enc, 1, {})
    d = out.details
    assert d["fit"] == "converged"
    assert d["samples"] == 500 and d["fitted_samples"] == 400 and d["heldout_samples"] == 100
    assert d["heldout_r2"] > 0.99
    assert d["heldout_mse"] < 0.1 * d["linear_heldout_mse"]
    assert "warning" not in d
    paper = Slalom().run(ctx_for(model), enc, 1, {"fit": "paper"}).details
    assert (paper["epochs"], paper["lr"], paper["batch_size"]) == (60, 5e-3, 128)
    assert paper["heldout_mse"] > 10 * d["heldout_mse"]
    none = Slalom().run(ctx_for(model), enc, 1, {"holdout": 0.0}).details
    assert none["fitted_samples"] == 500 and "heldout_mse" not in none


def test_explaining_the_other_class_flips_the_values(slalom_model: Any) -> None:
    """Class 0's target is exactly minus class 1's, and Adam is sign-equivariant: the fits agree
    up to the sign of v (s unchanged) to float rounding, with the paper's defaults."""
    model, _, _ = slalom_model
    enc = model.encode("bad perfect we watch")
    pos = Slalom().run(ctx_for(model), enc, 1, {"num_samples": 200})
    neg = Slalom().run(ctx_for(model), enc, 0, {"num_samples": 200})
    assert np.ptp(pos.extra_scores["value"]) > 0.1
    np.testing.assert_allclose(neg.extra_scores["value"], -pos.extra_scores["value"], atol=1e-4)
    np.testing.assert_allclose(
        neg.extra_scores["importance"], pos.extra_scores["importance"], atol=1e-4
    )
    assert neg.details["model_output"] == pytest.approx(-pos.details["model_output"], abs=1e-5)


def test_samples_are_wrapped_in_the_inputs_special_tokens_and_keep_the_pair(
    slalom_model: Any,
) -> None:
    model, _, _ = slalom_model
    tok = model.tokenizer
    enc = model.encode("good bad the", "we watch movie")
    out = Slalom().run(
        ctx_for(model), enc, 1, {"num_samples": 50, "sample_length": 2, "query_batch_size": 16}
    )
    cls_id, sep_id = tok.cls_token_id, tok.sep_token_id
    pair_ids = tok.convert_tokens_to_ids(["we", "watch", "movie"])
    first_ids = set(tok.convert_tokens_to_ids(["good", "bad", "the"]))
    # Samples: [CLS] 2 sampled tokens [SEP] pair [SEP] = 8 tokens (the full input has 9).
    sample_batches = [(ids, types) for ids, types in model.model.seen if ids.shape[1] == 8]
    assert sum(ids.shape[0] for ids, _ in sample_batches) == 50
    assert max(ids.shape[0] for ids, _ in sample_batches) == 16  # batched queries
    for ids, types in sample_batches:
        for row, trow in zip(ids.tolist(), types.tolist(), strict=True):
            assert row[0] == cls_id and row[3] == sep_id and row[-1] == sep_id
            assert set(row[1:3]) <= first_ids
            assert row[4:7] == pair_ids
            assert trow == [0, 0, 0, 0, 1, 1, 1, 1]
    # Pair-segment tokens are context, not explained: score 0.
    for t, score in zip(enc.tokens, out.extra_scores["value"], strict=True):
        if t.special or t.segment == 1:
            assert score == 0.0
        else:
            assert score != 0.0


def test_multiclass_explains_one_vs_rest_log_odds(random_bert: LoadedModel) -> None:
    """3-class BERT, text pair: the fitted output is log p_c / (1 − p_c) of the model's own
    logits on the full input, computed here independently with the HF model."""
    enc = random_bert.encode("a fine film with a dull plot", "is it good?")
    out = Slalom().run(ctx_for(random_bert), enc, 2, {"num_samples": 64, "epochs": 5})
    with torch.inference_mode():
        logits = random_bert.model(
            input_ids=torch.tensor([enc.input_ids]),
            token_type_ids=torch.tensor([enc.token_type_ids]),
        ).logits[0]
    p = torch.softmax(logits.double(), dim=-1)
    expected = float(torch.log(p[2]) - torch.log1p(-p[2]))
    assert out.details["model_output"] == pytest.approx(expected, abs=1e-4)
    assert out.details["output"] == "one-vs-rest log-odds"
    pair = np.array([t.segment == 1 and not t.special for t in enc.tokens])
    assert pair.any() and (out.scores[pair] == 0).all()
    assert (out.scores[~pair & ~enc.special_mask] != 0).all()


# --- the paper's synthetic linear dataset (appendix E.1) ------------------------------------


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A 1-layer BERT trained in the test on the linear dataset (125 steps, ~5 s on one core)."""
    directory = tmp_path_factory.mktemp("synthetic")
    return load_model(build_synthetic_model(directory, seed=0, n_train=4000, epochs=2))


def log_odds(model: LoadedModel, texts: list[str]) -> np.ndarray:
    p = probabilities(model, [model.encode(t) for t in texts], batch_size=256).astype(np.float64)
    return np.log(p[:, 1]) - np.log(p[:, 0])


def test_the_synthetic_transformer_learned_the_task(synthetic_model: LoadedModel) -> None:
    data = sample_linear_dataset(1000, seed=99)
    predicted = log_odds(synthetic_model, data.texts())
    # Accuracy close to the Bayes rule's, log-odds correlated with the true linear ones.
    bayes = float(np.mean((data.log_odds > 0) == data.labels))
    assert float(np.mean((predicted > 0) == data.labels)) > bayes - 0.05
    assert np.corrcoef(predicted, data.log_odds)[0, 1] > 0.8


def test_slalom_values_rank_the_words_by_their_true_weights(synthetic_model: LoadedModel) -> None:
    order = np.random.default_rng(3).permutation(len(SYNTHETIC_WORDS))
    enc = synthetic_model.encode(" ".join(SYNTHETIC_WORDS[i] for i in order))
    out = Slalom().run(ctx_for(synthetic_model), enc, 1, {"score": "value"})  # default fit
    words = [t.text for t in enc.tokens if not t.special]
    values = out.scores[~enc.special_mask]
    weights = [SYNTHETIC_WEIGHTS[SYNTHETIC_WORDS.index(w)] for w in words]
    assert spearmanr(values, weights)[0] >= 0.8


def test_slalom_fits_the_transformer_better_than_a_linear_model(
    synthetic_model: LoadedModel,
) -> None:
    """The paper's table 6: on the linear data, SLALOM fits the transformer's log-odds with a
    lower MSE than an OLS linear model on word counts fitted on the same samples (held out)."""

    def counts(data: Any) -> np.ndarray:
        out = np.zeros((len(data.word_ids), len(SYNTHETIC_WORDS)))
        for row, ids in enumerate(data.word_ids):
            np.add.at(out[row], ids, 1.0)
        return out

    train, test = sample_linear_dataset(1000, seed=5), sample_linear_dataset(1000, seed=6)
    y_train, y_test = (
        log_odds(synthetic_model, train.texts()),
        log_odds(synthetic_model, test.texts()),
    )
    c_train, c_test = counts(train), counts(test)

    fit = fit_slalom(c_train, y_train, seed=0, **CONVERGED)
    slalom_mse = float(np.mean((slalom_predict(fit.importance, fit.value, c_test) - y_test) ** 2))

    design = np.c_[np.ones(len(c_train)), c_train]
    beta = np.linalg.lstsq(design, y_train, rcond=None)[0]
    linear_mse = float(np.mean((np.c_[np.ones(len(c_test)), c_test] @ beta - y_test) ** 2))

    assert slalom_mse < linear_mse


# --- the demo model: faithfulness ------------------------------------------------------------


def test_linearized_slalom_beats_random_on_deletion_aopc(bert_tiny: LoadedModel) -> None:
    """Deletion AOPC of linearised SLALOM > random scores on 16 fixed held-out reviews."""
    reviews = [r for r in rotten_tomatoes("test") if 12 <= len(r.text.split()) <= 30][:16]
    assert len(reviews) == 16
    model = bert_tiny
    encoded = [model.encode(r.text) for r in reviews]
    targets = [int(np.argmax(p)) for p in probabilities(model, encoded)]
    slalom = [
        Slalom().run(ctx_for(model), e, t, {"seed": i}).scores
        for i, (e, t) in enumerate(zip(encoded, targets, strict=True))
    ]
    rng = np.random.default_rng(0)
    random_aopc = np.mean(
        [
            deletion_aopc(
                model, encoded, [rng.random(len(e)).astype(np.float32) for e in encoded], targets
            )
            for _ in range(3)
        ]
    )
    slalom_aopc = deletion_aopc(model, encoded, slalom, targets)
    assert slalom_aopc > random_aopc


def test_default_fit_beats_the_linear_baseline_on_the_demo_model(bert_tiny: LoadedModel) -> None:
    """On real reviews the default fit converges: held-out R² high and below the linear
    model's error. The paper's values do not: worse than the linear model on the same samples."""
    reviews = [r for r in rotten_tomatoes("test") if 12 <= len(r.text.split()) <= 30][:4]
    for i, review in enumerate(reviews):
        enc = bert_tiny.encode(review.text)
        ours = Slalom().run(ctx_for(bert_tiny), enc, 1, {"seed": i}).details
        paper = Slalom().run(ctx_for(bert_tiny), enc, 1, {"seed": i, "fit": "paper"}).details
        assert ours["heldout_r2"] > 0.8, ours
        assert ours["heldout_mse"] < ours["linear_heldout_mse"], ours
        assert paper["heldout_mse"] > paper["linear_heldout_mse"], paper
        assert "worse than a linear model" in paper["warning"]


# --- method contract: registry, determinism, parameters, progress, cancellation ---------------


def test_registered_as_a_builtin_job_method() -> None:
    method = MethodRegistry.load().get("slalom")
    assert isinstance(method, Slalom)
    assert method.defaults()["num_samples"] == 500
    assert method.defaults()["epochs"] == 300


def test_fit_presets_and_explicit_values() -> None:
    method = Slalom()
    defaults = method.validate_params({})
    assert defaults["fit"] == "converged" and defaults["holdout"] == 0.2
    assert {k: defaults[k] for k in PAPER} == FIT_PRESETS["converged"]
    paper = method.validate_params({"fit": "paper"})
    assert {k: paper[k] for k in PAPER} == {"epochs": 60, "lr": 5e-3, "batch_size": 128}
    mixed = method.validate_params({"fit": "paper", "epochs": 90})
    assert (mixed["epochs"], mixed["lr"], mixed["batch_size"]) == (90, 5e-3, 128)
    assert method.validate_params(mixed) == mixed  # re-validating stored params changes nothing
    with pytest.raises(InvalidArgument):
        method.validate_params({"fit": "fast"})
    with pytest.raises(InvalidArgument):
        method.validate_params({"holdout": 0.9})


def test_deterministic_for_a_fixed_seed(synthetic_model: LoadedModel) -> None:
    enc = synthetic_model.encode("good movie but the worst ending we watch ok")
    params = {"num_samples": 200, "epochs": 20, "seed": 5}
    a = Slalom().run(ctx_for(synthetic_model), enc, 1, params)
    b = Slalom().run(ctx_for(synthetic_model), enc, 1, params)
    for kind in SCORE_KINDS:
        np.testing.assert_array_equal(a.extra_scores[kind], b.extra_scores[kind])
    assert a.details == b.details
    c = Slalom().run(ctx_for(synthetic_model), enc, 1, {**params, "seed": 6})
    assert not np.array_equal(a.extra_scores["value"], c.extra_scores["value"])


@pytest.mark.parametrize(
    "params",
    [
        {"num_samples": 0},
        {"num_samples": 10.5},
        {"sample_length": 0},
        {"epochs": -1},
        {"lr": 0.0},
        {"lr": "fast"},
        {"batch_size": 0},
        {"seed": -1},
        {"score": "shapley"},
        {"samples": 100},
    ],
)
def test_bad_parameters_are_invalid_arguments(
    params: dict[str, Any], synthetic_model: LoadedModel
) -> None:
    with pytest.raises(InvalidArgument):
        Slalom().validate_params(params)
    enc = synthetic_model.encode("good movie")
    with pytest.raises(InvalidArgument):
        Slalom().run(ctx_for(synthetic_model), enc, 1, params)


def test_rejects_inputs_it_cannot_explain(synthetic_model: LoadedModel) -> None:
    only_specials = synthetic_model.encode("")
    assert len(only_specials) == 2 and only_specials.special_mask.all()
    ctx = ctx_for(synthetic_model)
    with pytest.raises(InvalidArgument):
        Slalom().run(ctx, only_specials, 1, {})
    good = synthetic_model.encode("good")
    with pytest.raises(InvalidArgument):  # samples longer than the model's 64-token context
        Slalom().run(ctx, good, 1, {"sample_length": 63})
    with pytest.raises(InvalidArgument):  # a binary model has no class 2
        Slalom().run(ctx, good, 2, {})


def test_reports_progress_through_sampling_and_fitting(synthetic_model: LoadedModel) -> None:
    ctx = ctx_for(synthetic_model)
    Slalom().run(ctx, synthetic_model.encode("the best movie"), 1, {"num_samples": 256})
    fractions = [f for f, _ in ctx.progress]  # type: ignore[attr-defined]
    messages = " ".join(m for _, m in ctx.progress)  # type: ignore[attr-defined]
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)
    assert "queried" in messages and "epoch 300/300" in messages


def test_cancellation_stops_mid_fit(synthetic_model: LoadedModel) -> None:
    state = {"fitting": 0}

    def report(fraction: float, message: str) -> None:
        if message.startswith("fitting"):
            state["fitting"] += 1

    ctx = JobContext(
        model=synthetic_model,
        settings=Settings(),
        report=report,
        should_stop=lambda: state["fitting"] >= 2,
    )
    with pytest.raises(JobCancelled):
        Slalom().run(ctx, synthetic_model.encode("the best movie"), 1, {"epochs": 1000})
    assert state["fitting"] == 2  # stopped after the second fit checkpoint, not at the end

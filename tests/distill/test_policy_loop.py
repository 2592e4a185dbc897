"""The zeroth-order loop stage (``loop_estimator="policy"``): its two pieces against
independent computations — the sampled orders' log-probabilities against a brute-force
Plackett–Luce model, the reward against the evaluator's own deletion reading — and a head
trained with it served like any other. Whether it helps is measured, not asserted
(bench/bench_head_policy_loop.py)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from limelight.demo.synthetic import build_synthetic_model, sample_linear_dataset
from limelight.distill.build import HeadRecipe
from limelight.distill.train import (
    TeacherExample,
    TrainConfig,
    _tensors,
    loop_reward_terms,
    perturbation_curve,
    plackett_luce_log_prob,
    predict_scores,
    reward_curve,
    train_head,
)
from limelight.evaluation.runner import EvalConfig, EvalExample, Evaluator
from limelight.models.explainer_head import ExplainerHead
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.torch_runtime import TorchRuntime


def brute_force_prefix_probability(weights: list[float], prefix: tuple[int, ...]) -> float:
    """P(the first draws are ``prefix``) summed over every full order that starts with it."""
    total = 0.0
    for order in itertools.permutations(range(len(weights))):
        if order[: len(prefix)] != prefix:
            continue
        p, left = 1.0, list(order)
        for i in order:
            p *= math.exp(weights[i]) / sum(math.exp(weights[j]) for j in left)
            left.remove(i)
        total += p
    return total


def test_plackett_luce_log_prob_against_brute_force() -> None:
    logits = torch.tensor([[0.3, -1.2, 2.0, 0.5, float("-inf")]])  # the last: never drawn
    weights = logits[0, :4].tolist()
    for order in [(2, 0, 3, 1), (1, 3, 0, 2), (0, 1, 2, 3)]:
        full = torch.tensor([[*order, 4]])
        for first in range(5):
            expected = brute_force_prefix_probability(weights, order[:first]) if first else 1.0
            got = plackett_luce_log_prob(logits, full, torch.tensor([first])).exp().item()
            assert got == pytest.approx(min(expected, 1.0), rel=1e-5), (order, first)
    # Differentiable in the logits (the policy gradient flows through it).
    live = logits.clone().requires_grad_(True)
    plackett_luce_log_prob(live, torch.tensor([[2, 0, 3, 1, 4]]), torch.tensor([2])).backward()
    assert live.grad is not None and torch.isfinite(live.grad[0, :4]).all()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_synthetic_model(tmp_path_factory.mktemp("synthetic"), seed=0, n_train=2000)


@pytest.mark.parametrize(
    ("replace", "keep_top"), [("mask", False), ("delete", False), ("mask", True), ("delete", True)]
)
def test_the_reward_is_the_evaluators_curve(synthetic: Path, replace: str, keep_top: bool) -> None:
    """Deletion and sufficiency, each with the tokens masked or cut out of the text (the
    evaluator re-encodes the shorter text; the loop moves each row's tokens left in one
    batch)."""
    model = load_model(synthetic)
    texts = sample_linear_dataset(6, seed=3).texts()
    encoded = [model.encode(t) for t in texts]
    rng = np.random.default_rng(0)
    scores = [rng.normal(size=len(e)).astype(np.float32) for e in encoded]
    evaluator = Evaluator(model, EvalConfig(replace=replace, game_fractions=()))  # type: ignore[arg-type]
    original = evaluator.predict(encoded)
    targets = [int(p) for p in original.argmax(axis=1)]
    by_text = {id(e): s for e, s in zip(encoded, scores, strict=True)}

    def explain(enc: object, target: int) -> np.ndarray:
        return by_text[id(enc)]

    examples = [EvalExample(t) for t in texts]
    result = evaluator.evaluate_method("fixed", explain, examples, encoded, targets)
    width = max(len(e) for e in encoded)
    keep = torch.zeros((len(encoded), width), dtype=torch.bool)
    logits = torch.full((len(encoded), width), float("-inf"))
    for row, (e, s) in enumerate(zip(encoded, scores, strict=True)):
        keep[row, : len(e)] = torch.from_numpy(~e.special_mask)
        logits[row, : len(e)] = torch.from_numpy(s).masked_fill(keep[row, : len(e)] == 0, -1e9)
    logits = logits.masked_fill(~keep, float("-inf"))
    order = logits.argsort(1, descending=True)
    target = torch.tensor(targets)
    tensors = _tensors(model, encoded)
    curve = perturbation_curve(model, order, tensors, keep, target, replace, keep_top)
    p = original[np.arange(len(targets)), targets]
    # AOPC = the original probability less the mean of the curve.
    expected = result.aopc_sufficiency_per_input if keep_top else result.aopc_deletion_per_input
    np.testing.assert_allclose(p - curve.numpy(), np.asarray(expected), atol=1e-5)


Curves = tuple[
    LoadedModel, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    torch.Tensor, torch.Tensor,
]  # fmt: skip
"""``perturbation_curve``'s first arguments: model, order, tensors, keep, target."""


def random_orders(model: LoadedModel, n: int, seed: int, target: int) -> Curves:
    """The curves' arguments for ``n`` synthetic texts: each text's tokens (not its special
    ones) in a random order, explaining class ``target``."""
    encoded = [model.encode(t) for t in sample_linear_dataset(n, seed=seed).texts()]
    width = max(len(e) for e in encoded)
    keep = torch.zeros((n, width), dtype=torch.bool)
    for row, e in enumerate(encoded):
        keep[row, : len(e)] = torch.from_numpy(~e.special_mask)
    scores = torch.randn((n, width), generator=torch.Generator().manual_seed(seed))
    order = scores.masked_fill(~keep, float("-inf")).argsort(1, descending=True)
    return model, order, _tensors(model, encoded), keep, torch.full((n,), target)


@pytest.mark.parametrize(
    ("reward", "deleted", "kept"),
    [
        ("mask", {"mask": 1.0}, 0.0),
        ("mask+delete", {"mask": 0.5, "delete": 0.5}, 0.0),
        ("3mask+delete+0.25keep", {"mask": 0.75, "delete": 0.25}, 0.25),
        ("keep", {}, 1.0),
    ],
)
def test_a_weighted_reward_is_its_curves_combined(
    synthetic: Path, reward: str, deleted: dict[str, float], kept: float
) -> None:
    """The deletion terms' weights count relative to each other, ``keep``'s against their
    mean: the reward is each curve read on its own and combined by hand."""
    args = random_orders(load_model(synthetic), 5, seed=5, target=1)
    expected = torch.zeros(5)
    for perturbation, weight in deleted.items():
        expected += weight * perturbation_curve(*args, perturbation)
    if kept:
        expected -= kept * perturbation_curve(*args, "mask", keep_top=True)
    got = reward_curve(*args, TrainConfig(loop_reward=reward))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_a_curve_read_at_some_points_averages_those_points(synthetic: Path) -> None:
    """``loop_points``: the loop reads a random subset of the five fractions per text; a
    subset's reading is the mean of its points read one by one, and all five the full curve."""
    args = random_orders(load_model(synthetic), 4, seed=6, target=0)
    single = torch.stack(
        [perturbation_curve(*args, "delete", points=torch.full((4, 1), i)) for i in range(5)], 1
    )
    torch.testing.assert_close(single.mean(1), perturbation_curve(*args, "delete"))
    points = torch.tensor([[0, 3], [4, 1], [2, 2], [1, 0]])
    expected = single.gather(1, points).mean(1)
    torch.testing.assert_close(perturbation_curve(*args, "delete", points=points), expected)


@pytest.mark.parametrize(
    "reward", ["", "other", "mask+mask", "0keep", "-1keep", "mask+", "1e3mask"]
)
def test_a_reward_that_does_not_parse_is_refused(reward: str) -> None:
    with pytest.raises(ValueError, match="unknown loop reward"):
        loop_reward_terms(reward)


def test_a_head_trained_with_the_policy_loop_is_served(synthetic: Path) -> None:
    model = load_model(synthetic)
    texts = sample_linear_dataset(40, seed=1).texts()
    rng = np.random.default_rng(1)
    examples = []
    for text in texts:
        n = len(model.encode(text))
        examples.append(TeacherExample(text, 1, rng.normal(size=n).tolist()))
    config = TrainConfig(
        epochs=2, width=16, attention_heads=2, loop_steps=3, loop_batch_size=8,
        loop_estimator="policy", loop_samples=2,
    )  # fmt: skip
    before, _ = train_head(model, examples, TrainConfig(**{**config.__dict__, "loop_steps": 0}))
    head, info = train_head(model, examples, config)
    assert info["loop_steps"] == 3
    changed = [
        not torch.equal(a, b)
        for a, b in zip(head.state_dict().values(), before.state_dict().values(), strict=True)
    ]
    assert any(changed)  # the loop moved the head
    batch = InlineBatch.from_encoded([model.encode(texts[0])], model.pad_id)
    scores = TorchRuntime(model, {"distilled": head}).run_inline(batch).extra["distilled"]
    assert np.isfinite(np.asarray(scores)).all()

    # The loop's settings are part of a recipe only when it has a loop (they change only
    # such a head): without one the digest ignores them, with one it does not.
    def digest(**train: object) -> str:
        return HeadRecipe(train=TrainConfig(**train)).digest()  # type: ignore[arg-type]

    assert digest(loop_temperature=0.1) == digest() == digest(loop_estimator="straight_through")
    assert digest(loop_steps=5) != digest(loop_steps=5, loop_temperature=0.1)
    with pytest.raises(ValueError, match="estimator"):
        train_head(model, examples, TrainConfig(loop_steps=1, loop_estimator="other"))
    with pytest.raises(ValueError, match="reward"):
        train_head(model, examples, TrainConfig(loop_steps=1, loop_reward="other"))
    with pytest.raises(ValueError, match="loop_points"):
        train_head(model, examples, TrainConfig(loop_steps=1, loop_points=0))
    # Reading all five points is how every loop read them before the option (same digest).
    assert digest(loop_steps=5) == digest(loop_steps=5, loop_points=5)
    assert digest(loop_steps=5) != digest(loop_steps=5, loop_points=1)
    assert digest(loop_points=1) == digest()


def test_the_loop_reads_texts_without_labels(synthetic: Path) -> None:
    """``loop_texts``: the policy loop trains on texts that have no labels (explaining the
    predicted class); the amortisation stage never sees them, and the removal reward runs."""
    model = load_model(synthetic)
    texts = sample_linear_dataset(30, seed=4).texts()
    rng = np.random.default_rng(2)
    examples = [
        TeacherExample(t, 1, rng.normal(size=len(model.encode(t))).tolist()) for t in texts[:10]
    ]
    config = TrainConfig(
        epochs=1, width=16, attention_heads=2, loop_steps=2, loop_batch_size=20,
        loop_samples=1, loop_reward="mask+delete+0.5keep", loop_points=2,
    )  # fmt: skip
    plain, _ = train_head(model, examples, config)
    more, _ = train_head(model, examples, config, loop_texts=texts[10:])
    differs = [
        not torch.equal(a, b)
        for a, b in zip(plain.state_dict().values(), more.state_dict().values(), strict=True)
    ]
    assert any(differs)  # the extra texts were in the loop's batches
    stage1, _ = train_head(model, examples, TrainConfig(**{**config.__dict__, "loop_steps": 0}))
    alone, _ = train_head(
        model, examples, TrainConfig(**{**config.__dict__, "loop_steps": 0}), loop_texts=texts
    )
    for a, b in zip(stage1.state_dict().values(), alone.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # no loop: the texts are not read
    with pytest.raises(ValueError, match="policy loop"):
        train_head(
            model,
            examples,
            TrainConfig(**{**config.__dict__, "loop_estimator": "straight_through"}),
            loop_texts=texts[10:],
        )


def test_the_shift_anchor_holds_each_texts_mean_score(synthetic: Path) -> None:
    """The sampled orders cannot see a shift of a text's scores, so the loop moves them
    freely; ``loop_shift_weight`` holds each text's mean score near stage 1's."""
    model = load_model(synthetic)
    texts = sample_linear_dataset(40, seed=1).texts()
    rng = np.random.default_rng(1)
    examples = [TeacherExample(t, 1, rng.normal(size=len(model.encode(t))).tolist()) for t in texts]
    config = TrainConfig(epochs=2, width=16, attention_heads=2, loop_batch_size=8, loop_samples=2)
    stage1, _ = train_head(model, examples, config)

    def means(head: ExplainerHead) -> np.ndarray:
        encoded = [model.encode(t) for t in texts]
        return np.array(
            [predict_scores(model, head, e)[~e.special_mask, 1].mean() for e in encoded]
        )

    drift = {}
    for weight in (0.0, 10.0):
        looped = replace(config, loop_steps=30, loop_shift_weight=weight)
        head, info = train_head(model, examples, looped)
        assert info["loop_shift_weight"] == weight
        drift[weight] = np.abs(means(head) - means(stage1)).mean()
    assert drift[10.0] < drift[0.0] / 2, drift


def test_the_loop_can_leave_an_average_of_its_weights(synthetic: Path) -> None:
    """``loop_average``: the head the loop leaves is the exponential moving average of the
    weights after each of its steps (recomputed here from those weights), not the last."""
    model = load_model(synthetic)
    texts = sample_linear_dataset(24, seed=5).texts()
    rng = np.random.default_rng(3)
    examples = [TeacherExample(t, 1, rng.normal(size=len(model.encode(t))).tolist()) for t in texts]
    config = TrainConfig(
        epochs=1, width=16, attention_heads=2, loop_steps=4, loop_batch_size=8, loop_samples=2,
        loop_average=0.6,
    )  # fmt: skip
    seen: list[dict[str, torch.Tensor]] = []
    holder: list[ExplainerHead] = []

    def progress(stage: str, step: int, total: int) -> None:
        # Called after each loop step's update (and never again once the average is applied).
        if stage == "classifier in the loop":
            seen.append({k: v.detach().clone() for k, v in holder[0].state_dict().items()})

    original = ExplainerHead.__init__

    def remember(self: ExplainerHead, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        holder.append(self)

    stage1, _ = train_head(model, examples, replace(config, loop_steps=0))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ExplainerHead, "__init__", remember)
        head, info = train_head(model, examples, config, progress=progress)
    assert info["loop_average"] == 0.6 and len(seen) == 4
    for name, start in stage1.state_dict().items():
        if not start.is_floating_point():
            continue
        expected = start.clone()
        for weights in seen:
            expected = 0.6 * expected + 0.4 * weights[name]
        torch.testing.assert_close(head.state_dict()[name], expected)
        if name.endswith("weight"):
            assert not torch.equal(head.state_dict()[name], seen[-1][name])
    with pytest.raises(ValueError, match="decay"):
        train_head(model, examples, replace(config, loop_average=1.0))

    def digest(**train: object) -> str:
        return HeadRecipe(train=TrainConfig(**train)).digest()  # type: ignore[arg-type]

    # Heads built before the option are the 0.0 ones (same digest); a loop with it is another.
    assert digest(loop_steps=5) == digest(loop_steps=5, loop_average=0.0)
    assert digest(loop_steps=5) != digest(loop_steps=5, loop_average=0.99)

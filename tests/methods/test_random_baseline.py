"""The random baseline: reproducible per seed and input, different across seeds and inputs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from limelight.errors import InvalidArgument
from limelight.methods.base import JobContext, MethodRegistry
from limelight.methods.random_baseline import RandomBaseline
from limelight.models.loaded import LoadedModel


def scores(ctx: JobContext, text: str, seed: int, target: int = 0) -> np.ndarray:
    method = RandomBaseline()
    enc = ctx.model.encode(text)
    out = method.run(ctx, enc, target, method.validate_params({"seed": seed}))
    assert out.scores.shape == (len(enc),) and out.scores.dtype == np.float32
    return out.scores


def test_deterministic_per_seed(
    random_bert: LoadedModel, make_ctx: Callable[..., JobContext]
) -> None:
    ctx = make_ctx(random_bert)
    a = scores(ctx, "a good film", 7)
    np.testing.assert_array_equal(a, scores(make_ctx(random_bert), "a good film", 7))
    assert not np.array_equal(a, scores(ctx, "a good film", 8))
    assert np.all((a >= 0) & (a < 1))


def test_same_seed_gives_inputs_of_equal_length_different_rankings(
    random_bert: LoadedModel, make_ctx: Callable[..., JobContext]
) -> None:
    ctx = make_ctx(random_bert)
    a, b = scores(ctx, "a good film", 3), scores(ctx, "a bad movie", 3)
    assert a.shape == b.shape and not np.array_equal(a, b)


def test_uniform_over_many_tokens(
    random_bert: LoadedModel, make_ctx: Callable[..., JobContext]
) -> None:
    s = scores(make_ctx(random_bert), " ".join(["good bad plot acting"] * 100), 0)
    assert abs(float(s.mean()) - 0.5) < 0.05
    assert len(np.unique(s)) == len(s)


def test_seed_is_validated() -> None:
    method = MethodRegistry.load().get("random")
    assert isinstance(method, RandomBaseline)
    assert method.validate_params({}) == {"seed": 0}
    for bad in ({"seed": -1}, {"seed": "x"}, {"seed": 1.5}):
        with pytest.raises(InvalidArgument):
            method.validate_params(bad)

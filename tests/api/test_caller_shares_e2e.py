"""``LIMELIGHT_MAX_PENDING_PER_CALLER`` through gRPC: the share is the bearer token's (the
servicer passes who is calling to the service), and without auth every caller is one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from limelight_client import Client
from limelight_client.errors import LimelightError
from tests.conftest import RunningSidecar


def test_a_call_larger_than_a_callers_share_is_refused_for_that_caller_only(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice-token\nbob-token\n")
    side = start_sidecar(
        model_dir=bert_tiny_dir, jobs="off", auth_tokens_file=tokens, max_pending_per_caller=2
    )
    texts = ["a witty film", "dull", "a slow, lovely film"]
    with Client(side.target, token="alice-token", timeout=60) as alice:
        with pytest.raises(LimelightError, match="3 inputs, more than the 2") as refused:
            alice.explain_batch(texts)
        code = refused.value.code
        assert code is not None and code.name == "INVALID_ARGUMENT"
        assert len(alice.explain_batch(texts[:2])) == 2
        # a stream is paced by the share, not refused
        assert len(list(alice.explain_many(texts * 4))) == 12
    with Client(side.target, token="bob-token", timeout=60) as bob:
        assert len(bob.explain_batch(texts[:2])) == 2


def test_without_auth_every_caller_shares_one(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    side = start_sidecar(model_dir=bert_tiny_dir, jobs="off", max_pending_per_caller=2)
    with Client(side.target, timeout=60) as client:
        with pytest.raises(LimelightError, match="more than the 2 one caller"):
            client.explain_batch(["a", "b", "c"])
        assert client.explain("a witty film").label

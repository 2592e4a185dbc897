"""``LIMELIGHT_MAX_PENDING_PER_CALLER`` through gRPC: the share is the bearer token's (the
servicer passes who is calling to the service), and without auth every caller is one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from limelight_client import Client
from limelight_client.errors import LimelightError
from tests.api.test_oip_grpc import text_input
from tests.api.test_oip_http import call
from tests.conftest import RunningSidecar, two_token_sidecar

TEXTS = ["a witty film", "dull", "a slow, lovely film"]


@pytest.fixture
def side(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> RunningSidecar:
    """A sidecar with two bearer tokens (alice's, bob's) and a share of 2 inputs per caller."""
    return two_token_sidecar(
        start_sidecar, tmp_path, model_dir=bert_tiny_dir, jobs="off", max_pending_per_caller=2
    )


def test_a_call_larger_than_a_callers_share_is_refused_for_that_caller_only(
    side: RunningSidecar,
) -> None:
    texts = TEXTS
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


def test_the_http_protocols_hold_the_callers_share_too(
    side: RunningSidecar, bert_tiny_dir: Path
) -> None:
    """OIP v2 (HTTP and gRPC) and KServe v1 take the same share as Explain, by the same token."""
    base = f"http://127.0.0.1:{side.server.metrics_port}"
    name = bert_tiny_dir.name
    texts = TEXTS
    v2 = {"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": texts}]}
    v1 = {"instances": texts}
    for who in ("alice-token", "bob-token"):
        auth = {"Authorization": f"Bearer {who}"}
        for url, body in (
            (f"{base}/v2/models/{name}/infer", v2),
            (f"{base}/v1/models/{name}:predict", v1),
        ):
            status, answer = call(url, body, auth)
            assert status == 400 and "3 inputs, more than the 2" in answer["error"]
        triton = tgrpc.InferenceServerClient(url=side.target)
        with pytest.raises(InferenceServerException, match="3 inputs, more than the 2"):
            triton.infer(name, [text_input(texts)], headers={"authorization": f"Bearer {who}"})
        triton.close()
        v2_two = {"inputs": [{**v2["inputs"][0], "shape": [2], "data": texts[:2]}]}
        status, answer = call(f"{base}/v2/models/{name}/infer", v2_two, auth)
        assert status == 200 and answer["outputs"]

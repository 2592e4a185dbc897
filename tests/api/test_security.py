"""TLS, mutual TLS and bearer-token auth on the gRPC port (and the same tokens on the HTTP
port); health stays open for probes."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from limelight.api.auth import TokenStore, bearer_allowed, load_tokens
from limelight.settings import Settings
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar, two_token_sidecar
from tests.pki import make_pki
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA, a server certificate for localhost and a client certificate."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def _secure_stub(target: str, pki: Path, client_cert: bool) -> explainer_pb2_grpc.ExplainerStub:
    creds = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes() if client_cert else None,
        certificate_chain=(pki / "client.pem").read_bytes() if client_cert else None,
    )
    port = target.rsplit(":", 1)[1]
    return explainer_pb2_grpc.ExplainerStub(grpc.secure_channel(f"localhost:{port}", creds))


def test_tls_and_mutual_tls(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, pki: Path
) -> None:
    tls = start_sidecar(
        model_dir=bert_tiny_dir, jobs="off", tls_cert=pki / "server.pem", tls_key=pki / "server.key"
    )
    ok = _secure_stub(tls.target, pki, client_cert=False).Explain(
        pb.ExplainRequest(text="secure and sound"), timeout=30
    )
    assert ok.explanation.scores
    plain = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(tls.target))
    with pytest.raises(grpc.RpcError) as err:
        plain.Explain(pb.ExplainRequest(text="x"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    mtls = start_sidecar(
        model_dir=bert_tiny_dir,
        jobs="off",
        tls_cert=pki / "server.pem",
        tls_key=pki / "server.key",
        tls_client_ca=pki / "ca.pem",
    )
    with pytest.raises(grpc.RpcError):
        _secure_stub(mtls.target, pki, client_cert=False).Explain(
            pb.ExplainRequest(text="who are you"), timeout=5
        )
    answer = _secure_stub(mtls.target, pki, client_cert=True).Explain(
        pb.ExplainRequest(text="it is me"), timeout=30
    )
    assert answer.label in ("rotten", "fresh")


def _with_tokens(
    start_sidecar: Callable[..., RunningSidecar], model_dir: Path, tokens: Path, lines: str
) -> RunningSidecar:
    """A sidecar (no jobs) whose bearer tokens file ``tokens`` holds ``lines``."""
    tokens.write_text(lines)
    return start_sidecar(model_dir=model_dir, jobs="off", auth_tokens_file=tokens)


def test_bearer_tokens(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    side = _with_tokens(
        start_sidecar, bert_tiny_dir, tokens, "# one per line\nalpha-token\nbeta-token\n"
    )
    channel = grpc.insecure_channel(side.target)
    stub = explainer_pb2_grpc.ExplainerStub(channel)
    request = pb.ExplainRequest(text="let me in")
    for metadata in [None, (("authorization", "Bearer wrong"),), (("authorization", "beta"),)]:
        with pytest.raises(grpc.RpcError) as err:
            stub.Explain(request, timeout=10, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:  # streaming RPCs are protected too
        list(stub.ExplainStream(iter([request]), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for token in ("alpha-token", "beta-token"):
        good = stub.Explain(request, timeout=30, metadata=(("authorization", f"Bearer {token}"),))
        assert good.explanation.scores
    # Probes need no token.
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_unknown_methods_are_unimplemented_with_auth_on(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    side = start_sidecar(model_dir=bert_tiny_dir, jobs="off", auth_token="gamma-token")
    channel = grpc.insecure_channel(side.target)
    for metadata in [None, (("authorization", "Bearer gamma-token"),)]:
        for method in ("/limelight.v1.Explainer/Nope", "/limelight.v1.Elsewhere/Explain"):
            call = channel.unary_unary(method)
            with pytest.raises(grpc.RpcError) as err:
                call(b"", timeout=10, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, (method, metadata)
            details = err.value.details() or ""
            assert "Traceback" not in details and "Error" not in details


def test_jobs_belong_to_the_token_that_submitted_them(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    side = two_token_sidecar(start_sidecar, tmp_path, model_dir=bert_tiny_dir)
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(side.target))
    alice = (("authorization", "Bearer alice-token"),)
    bob = (("authorization", "Bearer bob-token"),)
    submit = pb.SubmitJobRequest(text="a private review", method="random", idempotency_key="k")
    job = stub.SubmitJob(submit, timeout=30, metadata=alice)
    for call in (
        lambda: stub.GetJob(pb.GetJobRequest(id=job.id), timeout=30, metadata=bob),
        lambda: stub.CancelJob(pb.CancelJobRequest(id=job.id), timeout=30, metadata=bob),
        lambda: list(stub.WatchJob(pb.GetJobRequest(id=job.id), timeout=30, metadata=bob)),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert not stub.ListJobs(pb.ListJobsRequest(), timeout=30, metadata=bob).jobs
    assert [j.id for j in stub.ListJobs(pb.ListJobsRequest(), timeout=30, metadata=alice).jobs] == [
        job.id
    ]
    assert stub.GetJob(pb.GetJobRequest(id=job.id), timeout=30, metadata=alice).id == job.id
    # Bob's key "k" is his own; Alice's "k" is bound to her first request.
    assert stub.SubmitJob(submit, timeout=30, metadata=bob).id != job.id
    assert stub.SubmitJob(submit, timeout=30, metadata=alice).id == job.id
    other = pb.SubmitJobRequest(text="another review", method="random", idempotency_key="k")
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitJob(other, timeout=30, metadata=alice)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_each_token_has_its_own_share_of_the_job_queue(
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    tmp_path: Path,
    redis_url: str,
) -> None:
    # A Redis queue of its own that no worker consumes: what is submitted stays queued.
    side = two_token_sidecar(
        start_sidecar,
        tmp_path,
        model_dir=bert_tiny_dir,
        jobs=redis_url,
        jobs_queue=f"shares-{uuid.uuid4().hex[:8]}",
        job_queue_max_per_owner=2,
    )
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(side.target))
    alice = (("authorization", "Bearer alice-token"),)
    bob = (("authorization", "Bearer bob-token"),)

    def submit(text: str, who: tuple[tuple[str, str], ...]) -> pb.Job:
        request = pb.SubmitJobRequest(text=text, method="random")
        return stub.SubmitJob(request, timeout=30, metadata=who)

    first = submit("one review", alice)
    submit("two reviews", alice)
    with pytest.raises(grpc.RpcError) as err:
        submit("three reviews", alice)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit 2 per caller" in (err.value.details() or "")
    assert submit("bob's review", bob).id  # Alice's full share does not hold Bob up
    stub.CancelJob(pb.CancelJobRequest(id=first.id), timeout=30, metadata=alice)
    assert submit("three reviews", alice).id  # a slot of hers came free


def test_tls_start_up_says_what_is_wrong_and_exposes_the_expiry(
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    pki: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from limelight.api.tls_check import TlsConfigError, check_server_tls

    # The client's key is not the server certificate's key.
    with pytest.raises(TlsConfigError, match="not the private key"):
        start_sidecar(
            model_dir=bert_tiny_dir,
            jobs="off",
            tls_cert=pki / "server.pem",
            tls_key=pki / "client.key",
        )
    with pytest.raises(TlsConfigError, match="not a PEM certificate"):
        start_sidecar(
            model_dir=bert_tiny_dir, jobs="off", tls_cert=pki / "ca.key", tls_key=pki / "ca.key"
        )
    side = start_sidecar(
        model_dir=bert_tiny_dir, jobs="off", tls_cert=pki / "server.pem", tls_key=pki / "server.key"
    )
    expires = side.server.metrics.registry.get_sample_value(
        "limelight_tls_certificate_expiry_timestamp_seconds", {"cert": str(pki / "server.pem")}
    )
    assert expires == check_server_tls(pki / "server.pem", pki / "server.key")
    # Past that moment the same files start with a warning that names the problem.
    with caplog.at_level("WARNING", logger="limelight.api.tls_check"):
        check_server_tls(pki / "server.pem", pki / "server.key", now=expires + 1)
    assert any("EXPIRED" in r.getMessage() for r in caplog.records)


def _grpc_accepts(side: RunningSidecar, authorization: str | None) -> bool:
    """Whether the gRPC port takes a call with this ``authorization`` (None: none sent)."""
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(side.target))
    metadata = () if authorization is None else (("authorization", authorization),)
    try:
        stub.GetModel(pb.GetModelRequest(), timeout=10, metadata=metadata)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
        return False
    return True


def _http_accepts(
    side: RunningSidecar, authorization: str | None, path: str = "/v1/models"
) -> bool:
    """Whether the HTTP port takes a request with this ``authorization`` (None: none sent)."""
    headers = {} if authorization is None else {"Authorization": authorization}
    url = f"http://127.0.0.1:{side.server.metrics_port}{path}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10):
            return True
    except urllib.error.HTTPError as exc:
        assert exc.code == 401, path
        return False


def _until_accepted(side: RunningSidecar, authorization: str) -> None:
    """Wait until both ports take ``authorization`` (a rotation is picked up within the
    store's check interval; the deadline is a hang guard)."""
    deadline = time.monotonic() + 120
    while not (_grpc_accepts(side, authorization) and _http_accepts(side, authorization)):
        assert time.monotonic() < deadline, "the rotated token was never accepted"
        time.sleep(0.05)


def test_rotated_tokens_file_is_picked_up_without_a_restart(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    side = _with_tokens(start_sidecar, bert_tiny_dir, tokens, "old-token\n")
    old, new = "Bearer old-token", "Bearer new-token"
    for accepts in (_grpc_accepts, _http_accepts):  # the HTTP port checks the same tokens
        assert accepts(side, old) and not accepts(side, new)
    replacement = tmp_path / "tokens.new"
    replacement.write_text("new-token\n")
    replacement.replace(tokens)  # an atomic swap, as a secret volume update does
    _until_accepted(side, new)
    assert not _grpc_accepts(side, old) and not _http_accepts(side, old)


def test_a_tokens_file_without_tokens_yet_lets_no_one_in_on_either_port(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    # Auth is on because a file is configured, not because it holds tokens: a file still being
    # provisioned must not open the HTTP port (nor accept an empty token anywhere).
    tokens = tmp_path / "tokens"
    side = _with_tokens(
        start_sidecar,
        bert_tiny_dir,
        tokens,
        "# filled in by the secret's rotation\n  # indented comment\n\n",
    )
    for authorization in (None, "Bearer", "Bearer # indented comment"):
        assert not _grpc_accepts(side, authorization)
        for path in ("/v1/models", "/viewer/api/model"):
            assert not _http_accepts(side, authorization, path)
    tokens.write_text("first-token\n")
    _until_accepted(side, "Bearer first-token")


def test_a_blank_token_setting_is_refused() -> None:
    from pydantic import ValidationError

    for blank in ("", "   "):
        with pytest.raises(ValidationError, match="blank"):
            Settings(auth_token=blank)
    assert not bearer_allowed([b"t"], "Bearer") and not bearer_allowed([b"t"], "Bearer  ")
    assert bearer_allowed([b"t"], "Bearer t") and not bearer_allowed([b"t"], "Bearer \udcff")


def test_plaintext_health_port_for_probes_beside_a_tls_port(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, pki: Path
) -> None:
    from limelight.api.ports import free_port

    side = start_sidecar(
        model_dir=bert_tiny_dir,
        jobs="off",
        tls_cert=pki / "server.pem",
        tls_key=pki / "server.key",
        health_port=free_port(),
    )
    probe = grpc.insecure_channel(f"127.0.0.1:{side.server.health_port}")
    status = health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    # Nothing but health is served in plaintext.
    with pytest.raises(grpc.RpcError) as err:
        explainer_pb2_grpc.ExplainerStub(probe).Explain(pb.ExplainRequest(text="x"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.asyncio
async def test_refused_client_streams_read_unauthenticated_from_an_aio_client(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    from collections import Counter

    side = start_sidecar(model_dir=bert_tiny_dir, jobs="off", auth_token="delta-token")
    requests = [pb.ExplainRequest(text="let me in")] * 3

    async def refused() -> Counter[str]:
        codes: Counter[str] = Counter()
        async with grpc.aio.insecure_channel(side.target) as channel:
            stub = explainer_pb2_grpc.ExplainerStub(channel)
            for _ in range(100):
                try:
                    async for _reply in stub.ExplainStream(iter(requests), timeout=30):
                        pass
                except grpc.RpcError as exc:
                    codes[exc.code().name] += 1
        return codes

    # Refused while the client was still sending, the call used to end INTERNAL ("Internal
    # error from Core") for most calls instead of UNAUTHENTICATED.
    assert await refused() == Counter({"UNAUTHENTICATED": 100})


def test_a_tokens_file_edit_with_a_line_that_is_not_utf8_is_read(
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Tokens are bytes: a Latin-1 line is a token like any other (sent as those bytes in an
    HTTP header), and the other tokens of the same edit are accepted. Such a line once failed
    every request (gRPC UNKNOWN, HTTP 500) with a traceback, the new tokens never taken."""
    tokens = tmp_path / "tokens"
    side = _with_tokens(start_sidecar, bert_tiny_dir, tokens, "old-token\n")
    replacement = tmp_path / "tokens.new"
    replacement.write_bytes(b"old-token\ncaf\xe9-token\nnew-token\n")
    with caplog.at_level("INFO", logger="limelight.api.auth"):
        replacement.replace(tokens)
        _until_accepted(side, "Bearer new-token")
    assert _http_accepts(side, "Bearer caf\xe9-token")  # http.client sends it as Latin-1
    # The same text in UTF-8 is other bytes: not that token.
    assert not _http_accepts(side, "Bearer caf\u00e9-token".encode().decode("latin-1"))
    assert _grpc_accepts(side, "Bearer old-token")
    assert "Traceback" not in caplog.text and "UnicodeDecodeError" not in caplog.text
    assert f"bearer tokens reloaded from {tokens}: 3 accepted" in caplog.text


def test_a_tokens_file_that_is_not_utf8_or_starts_with_a_bom_at_start(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """A non-UTF-8 line once stopped the start with a UnicodeDecodeError that named no file;
    a UTF-8 byte order mark (an editor's) made the first token silently unusable."""
    tokens = tmp_path / "tokens"
    tokens.write_bytes(b"\xef\xbb\xbffirst-token\r\ncaf\xe9-token\r\nlast-token\r\n")
    side = start_sidecar(model_dir=bert_tiny_dir, jobs="off", auth_tokens_file=tokens)
    for token in ("first-token", "last-token"):
        assert _grpc_accepts(side, f"Bearer {token}") and _http_accepts(side, f"Bearer {token}")
    assert _http_accepts(side, "Bearer caf\xe9-token")
    assert not _http_accepts(side, "Bearer \ufefffirst-token".encode().decode("latin-1"))


def _store(tmp_path: Path, lines: list[str], check_s: float = 1.0) -> TokenStore:
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{line}\n" for line in lines))
    return TokenStore(Settings(auth_tokens_file=tokens), check_s=check_s)


def test_a_token_is_looked_up_not_compared_with_every_token(tmp_path: Path) -> None:
    """A million tokens once cost every request ~40 ms (one compare_digest per token): the
    presented token's digest is looked up among the accepted tokens' digests instead."""

    class NotWalked(TokenStore):
        def __iter__(self) -> Iterator[bytes]:
            raise AssertionError("went through every token")

        def current(self) -> list[bytes]:
            raise AssertionError("went through every token")

    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"svc-{i:06d}\n" for i in range(20_000)))
    store = NotWalked(Settings(auth_tokens_file=tokens))
    assert bearer_allowed(store, "Bearer svc-019999") and bearer_allowed(store, "Bearer svc-000000")
    assert not bearer_allowed(store, "Bearer svc-020000") and not bearer_allowed(store, "Bearer")
    assert bearer_allowed([b"a", b"b"], "Bearer b") and not bearer_allowed([b"a"], "Bearer ab")


def test_a_changed_tokens_file_is_read_off_the_callers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller is the event loop of both ports: a large file read there stalled them all."""
    from limelight.api import auth

    readers: list[threading.Thread] = []
    load = auth.load_tokens

    def recorded(settings: Settings) -> list[bytes]:
        readers.append(threading.current_thread())
        return load(settings)

    monkeypatch.setattr(auth, "load_tokens", recorded)
    store = _store(tmp_path, ["old-token"], check_s=0)
    replacement = tmp_path / "tokens.new"
    replacement.write_text("new-token\n")
    replacement.replace(tmp_path / "tokens")
    wait_until(lambda: b"new-token" in store.current())
    assert len(readers) == 2 and readers[1] is not threading.current_thread()


def test_a_tokens_file_over_the_size_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """At start an error that names the file; later the previous tokens stay, with one
    warning that names it."""
    from limelight.api import auth

    monkeypatch.setattr(auth, "MAX_TOKENS_FILE_BYTES", 64)
    tokens = tmp_path / "tokens"
    tokens.write_text("x" * 65)
    with pytest.raises(ValueError, match=f"tokens file {tokens} .* larger than"):
        TokenStore(Settings(auth_tokens_file=tokens))
    store = _store(tmp_path, ["old-token"], check_s=0)
    with caplog.at_level("WARNING", logger="limelight.api.auth"):
        tokens.write_text("new-token\n" + "x" * 64)
        wait_until(lambda: store.current() and "not reloaded" in caplog.text)
        for _ in range(20):
            assert store.current() == [b"old-token"]
    assert caplog.text.count(f"bearer tokens not reloaded from {tokens}") == 1


def test_a_byte_order_mark_is_not_part_of_the_first_token(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("\ufefffirst-token\nsecond-token\n", encoding="utf-8")
    assert load_tokens(Settings(auth_tokens_file=tokens)) == [b"first-token", b"second-token"]

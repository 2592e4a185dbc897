"""A head or lexicon table written beside the model after the sidecar started is served from
the next batch on, without a restart; requests during the swap are all answered; a bad one is
logged and the server keeps what it served."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from limelight.api.ports import free_port
from limelight.api.server import LIVENESS_SERVICE
from limelight.cli.main import main
from limelight.models.explainer_head import HEAD_DIRNAME
from limelight.models.lexicon_table import LEXICON_DIRNAME
from limelight.reload import content_digest, fingerprint
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar
from tests.waiting import wait_until

TEXT = "a gorgeous, witty, seductive movie that never lets up"


def stub(target: str) -> explainer_pb2_grpc.ExplainerStub:
    return explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(target))


def bare_copy(model_dir: Path, out: Path) -> Path:
    """The model without its distilled head (nor its labels)."""
    return Path(shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns(f"{HEAD_DIRNAME}*")))


def wait_for_method(target: str, method: str, patience_s: float = 120.0) -> pb.ExplainResponse:
    """The first default explanation made with ``method`` (polling; fails after a generous
    ``patience_s`` so that a broken reload fails the test instead of hanging it)."""
    give_up = time.monotonic() + patience_s
    while True:
        r = stub(target).Explain(pb.ExplainRequest(text=TEXT), timeout=30)
        if r.explanation.method == method or time.monotonic() > give_up:
            return r
        time.sleep(0.05)


def watching(model: Path, reference_file: Path) -> dict[str, Any]:
    """A sidecar's settings that serve ``model``'s default method with ``reference_file`` as
    its drift reference and look at the files beside the model every 50 ms."""
    return {
        "model_dir": model,
        "default_method": "auto",
        "drift_reference": reference_file,
        "reload_interval_s": 0.05,
        "jobs": "off",
    }


def drift_reference(model: Path, out: Path, method: str) -> Path:
    """A drift reference of 20 validation reviews, as `limelight drift-reference build` writes
    it for the sidecar's default ``method``."""
    built = main(
        [
            "drift-reference", "build", "--model", str(model), "--out", str(out),
            "--data", "rotten_tomatoes:validation", "--n", "20", "--no-progress",
            "--default-method", method,
        ]
    )  # fmt: skip
    assert built == 0
    return out


def test_a_table_and_then_a_head_written_after_the_start_are_served_without_a_restart(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    model = bare_copy(bert_tiny_dir, tmp_path / "model")
    reference = start_sidecar(model_dir=bert_tiny_dir, default_method="auto")
    served = start_sidecar(
        model_dir=model, default_method="auto", reload_interval_s=0.05, jobs="off"
    )
    s = stub(served.target)
    assert s.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation.method == "normxlogit"
    with pytest.raises(grpc.RpcError) as refused:
        s.Explain(pb.ExplainRequest(text=TEXT, method="distilled"), timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "limelight distill" in (refused.value.details() or "")

    # `limelight lexicon` as a user runs it beside a serving sidecar.
    subprocess.run(
        [sys.executable, "-m", "limelight.cli.main", "lexicon", "--model", str(model)],
        check=True,
        capture_output=True,
    )
    assert wait_for_method(served.target, "lexicon_lookup").explanation.method == "lexicon_lookup"

    # Then a distilled head, copied in file by file while requests keep coming: each is
    # answered, by the method served when it was admitted.
    methods: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def traffic() -> None:
        client = stub(served.target)
        while not stop.is_set():
            try:
                r = client.Explain(pb.ExplainRequest(text=TEXT), timeout=30)
                methods.append(r.explanation.method)
            except grpc.RpcError as exc:
                errors.append(exc)

    clients = [threading.Thread(target=traffic) for _ in range(4)]
    for c in clients:
        c.start()
    try:
        shutil.copytree(bert_tiny_dir / HEAD_DIRNAME, model / HEAD_DIRNAME)
        after = wait_for_method(served.target, "distilled")
        # The traffic reaches the new head too (or fails: reported below).
        wait_until(lambda: "distilled" in methods or errors)
    finally:
        stop.set()
        for c in clients:
            c.join()
    assert not errors
    assert after.explanation.method == "distilled"
    assert set(methods) <= {"lexicon_lookup", "distilled"} and "distilled" in methods
    # What a server started on the model with its head serves, number for number.
    fresh = stub(reference.target).Explain(pb.ExplainRequest(text=TEXT), timeout=30)
    assert fresh.explanation.method == "distilled"
    assert list(after.explanation.scores) == pytest.approx(
        list(fresh.explanation.scores), rel=1e-5, abs=1e-6
    )
    assert len(after.explanation.extra_scores["normxlogit"].values) == len(after.explanation.tokens)
    with urllib.request.urlopen(served.metrics_url, timeout=10) as response:
        body = response.read().decode()
    assert 'default_method="distilled"' in body
    drift = served.server.app.service.drift  # a monitor of the head's scores, not the table's
    assert drift is not None and drift.method == "distilled"
    assert served.server.reloader.reloads >= 2


def test_a_head_taken_away_while_served_is_a_warning(
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The served head deleted (or its folder pruned, moved): the sidecar falls back to the
    next method, and says so where an operator looks, not only at INFO."""
    model = Path(shutil.copytree(bert_tiny_dir, tmp_path / "model"))
    served = start_sidecar(model_dir=model, default_method="auto", reload_interval_s=0.05)
    assert wait_for_method(served.target, "distilled").explanation.method == "distilled"
    shutil.rmtree(model / HEAD_DIRNAME)
    assert wait_for_method(served.target, "normxlogit").explanation.method == "normxlogit"
    (warning,) = [
        r.getMessage()
        for r in caplog.records
        if r.name == "limelight.reload" and r.levelname == "WARNING"
    ]
    assert f"beside {model} is gone" in warning
    assert "the default inline method is normxlogit (was distilled)" in warning


def onnx_sidecar(
    start_sidecar: Callable[..., RunningSidecar], model: Path, tmp_path: Path
) -> RunningSidecar:
    """A sidecar on ``model`` with ONNX Runtime, which exports its own graph into the cache
    (none is left beside the model), reloading what is written beside it every 50 ms."""
    for graph in model.glob("*.onnx*"):
        graph.unlink()
    served: RunningSidecar = start_sidecar(
        model_dir=model,
        runtime="onnx",
        cache_dir=tmp_path / "cache",
        default_method="auto",
        reload_interval_s=0.05,
        jobs="off",
    )
    return served


def test_a_default_method_that_cannot_be_served_is_not_ready_until_it_can(
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`--default-method distilled` on a model without a head: the sidecar said SERVING and
    ready, then failed every request that named no method. It now stays out of rotation, says
    why, serves requests that name another method, and is ready once the head is there."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    model = bare_copy(bert_tiny_dir, tmp_path / "model")
    served = start_sidecar(
        model_dir=model, default_method="distilled", reload_interval_s=0.05, jobs="off"
    )
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(served.target))

    def status() -> tuple[int, int]:
        checked = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
        ready_url = served.metrics_url.replace("/metrics", "/v2/health/ready")
        try:
            with urllib.request.urlopen(ready_url, timeout=10) as response:
                return checked, response.status
        except urllib.error.HTTPError as refused:
            return checked, refused.code

    assert status() == (health_pb2.HealthCheckResponse.NOT_SERVING, 503)
    # Out of rotation, not dead: a liveness probe must not restart it for that.
    alive = health.Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE), timeout=10)
    assert alive.status == health_pb2.HealthCheckResponse.SERVING
    (warning,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("not ready")]
    assert "distilled cannot be served (no distilled head beside the model" in warning
    s = stub(served.target)
    with pytest.raises(grpc.RpcError) as refused:
        s.Explain(pb.ExplainRequest(text=TEXT), timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    named = s.Explain(pb.ExplainRequest(text=TEXT, method="normxlogit"), timeout=30)
    assert named.explanation.method == "normxlogit"
    with urllib.request.urlopen(served.metrics_url, timeout=10) as response:
        assert "limelight_ready 0.0" in response.read().decode()

    shutil.copytree(bert_tiny_dir / HEAD_DIRNAME, model / HEAD_DIRNAME)
    wait_until(lambda: status() == (health_pb2.HealthCheckResponse.SERVING, 200))
    assert s.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation.method == "distilled"
    with urllib.request.urlopen(served.metrics_url, timeout=10) as response:
        assert "limelight_ready 1.0" in response.read().decode()


def test_with_onnx_runtime_a_new_head_is_exported_and_served_without_a_restart(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """No graph anywhere at the start, as on a fresh clone with `--runtime onnx`: the sidecar
    exports one itself, and again when a head appears beside the model."""
    model = bare_copy(bert_tiny_dir, tmp_path / "model")
    reference = start_sidecar(model_dir=bert_tiny_dir, default_method="auto", jobs="off")
    served = onnx_sidecar(start_sidecar, model, tmp_path)
    s = stub(served.target)
    assert s.GetModel(pb.GetModelRequest(), timeout=10).runtime == "onnx"
    assert s.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation.method == "normxlogit"
    shutil.copytree(bert_tiny_dir / HEAD_DIRNAME, model / HEAD_DIRNAME)
    after = wait_for_method(served.target, "distilled")
    assert after.explanation.method == "distilled"
    fresh = stub(reference.target).Explain(pb.ExplainRequest(text=TEXT), timeout=30)
    assert list(after.explanation.scores) == pytest.approx(
        list(fresh.explanation.scores), rel=1e-4, abs=1e-4
    )
    assert not list(model.glob("*.onnx*"))  # exported into the cache, not beside the model
    reloads = served.server.reloader.reloads
    time.sleep(0.5)  # the sidecar's own export is not taken for a new graph to load
    assert served.server.reloader.reloads == reloads == 1


def test_a_graph_given_with_onnx_path_is_served_as_it_is_until_exported_again(
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The sidecar never exports over a graph it was given: a new head beside the model is not
    served (and no reload is logged as if it were) until the user exports that graph again."""
    model = bare_copy(bert_tiny_dir, tmp_path / "model")
    pinned = tmp_path / "graphs" / "pinned.onnx"
    assert main(["export-onnx", "--model", str(model), "--out", str(pinned)]) == 0
    served = start_sidecar(
        model_dir=model,
        runtime="onnx",
        onnx_path=pinned,
        default_method="auto",
        reload_interval_s=0.05,
        jobs="off",
    )
    s = stub(served.target)
    shutil.copytree(bert_tiny_dir / HEAD_DIRNAME, model / HEAD_DIRNAME)
    with caplog.at_level("WARNING", logger="limelight.reload"):
        said = wait_until(
            lambda: [r.getMessage() for r in caplog.records if "export it again" in r.getMessage()]
        )
    assert str(pinned) in said[0] and "keeps serving" in said[0]
    assert s.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation.method == "normxlogit"
    assert served.server.reloader.reloads == 0
    assert main(["export-onnx", "--model", str(model), "--out", str(pinned)]) == 0
    assert wait_for_method(served.target, "distilled").explanation.method == "distilled"
    assert served.server.reloader.reloads == 1


def test_a_head_made_for_another_model_is_not_served_and_says_why(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    model = bare_copy(bert_tiny_dir, tmp_path / "model")
    served = start_sidecar(
        model_dir=model, default_method="auto", reload_interval_s=0.05, jobs="off"
    )
    foreign = tmp_path / "foreign"
    shutil.copytree(bert_tiny_dir / HEAD_DIRNAME, foreign)
    card = json.loads((foreign / "card.json").read_text())
    card["model_version"] = "0" * len(card["model_version"])
    (foreign / "card.json").write_text(json.dumps(card))
    foreign.rename(model / HEAD_DIRNAME)
    reloader = served.server.reloader
    give_up = time.monotonic() + 60
    while reloader.reloads == 0 and time.monotonic() < give_up:
        time.sleep(0.05)
    assert reloader.reloads == 1  # the files were read again ...
    s = stub(served.target)
    r = s.Explain(pb.ExplainRequest(text=TEXT), timeout=30)
    assert r.explanation.method == "normxlogit"  # ... and nothing new is served
    with pytest.raises(grpc.RpcError) as refused:
        s.Explain(pb.ExplainRequest(text=TEXT, method="distilled"), timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "version" in (refused.value.details() or "")


def test_a_served_head_replaced_by_another_models_is_kept_and_so_is_its_drift_reference(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """The served head's card rewritten for another model: the build leaves the head out, and
    swapping that in downgraded the default method to NormXLogit and threw away the drift
    reference. The sidecar keeps what it serves; and once the card is put back as it was, that
    is no change to what is served — the monitor keeps its reference."""
    model = Path(shutil.copytree(bert_tiny_dir, tmp_path / "model"))
    served = start_sidecar(model_dir=model, default_method="auto", reload_interval_s=0.05)
    reloader, service = served.server.reloader, served.server.app.service
    monitor = service.drift
    assert monitor is not None and monitor.method == "distilled"
    card_file = model / HEAD_DIRNAME / "card.json"
    original = card_file.read_text()
    card = json.loads(original)
    card["model_version"] = "0" * len(card["model_version"])

    def replace_card(text: str) -> None:
        staged = tmp_path / "card.json"
        staged.write_text(text)
        staged.rename(card_file)  # whole, as a Secret or `mv` puts it
        give_up = time.monotonic() + 60
        while reloader._seen.stats != fingerprint(reloader._paths):
            assert time.monotonic() < give_up, "the reloader never looked"
            time.sleep(0.05)

    replace_card(json.dumps(card))
    assert reloader.reloads == 0
    s = stub(served.target)
    assert s.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation.method == "distilled"
    assert service.drift is monitor
    replace_card(original)
    assert reloader.reloads == 0 and service.drift is monitor
    assert s.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation.method == "distilled"


def test_a_head_that_the_drift_reference_does_not_fit_is_served_by_name_only(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """A drift reference of NormXLogit's attributions cannot monitor the head's: the default
    and its monitor stay, and the head is served to requests that name it."""
    model = bare_copy(bert_tiny_dir, tmp_path / "model")
    reference_file = drift_reference(model, tmp_path / "reference.json", "normxlogit")
    reference = start_sidecar(model_dir=bert_tiny_dir, default_method="auto", jobs="off")
    served = start_sidecar(**watching(model, reference_file))
    shutil.copytree(bert_tiny_dir / HEAD_DIRNAME, model / HEAD_DIRNAME)
    reloader = served.server.reloader
    give_up = time.monotonic() + 60
    while reloader.reloads == 0 and time.monotonic() < give_up:
        time.sleep(0.05)
    assert reloader.reloads == 1
    s = stub(served.target)
    assert s.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation.method == "normxlogit"
    named = s.Explain(pb.ExplainRequest(text=TEXT, method="distilled"), timeout=30)
    fresh = stub(reference.target).Explain(pb.ExplainRequest(text=TEXT), timeout=30)
    assert fresh.explanation.method == named.explanation.method == "distilled"
    assert list(named.explanation.scores) == pytest.approx(
        list(fresh.explanation.scores), rel=1e-5, abs=1e-6
    )
    drift = served.server.app.service.drift
    assert drift is not None and drift.method == "normxlogit"


def test_a_new_head_is_not_judged_by_the_reference_file_of_the_head_it_replaced(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """The reference file holds the old head's attributions: re-read for the new head, it
    read unchanged traffic as drift (an alert). The new head's monitor builds its reference
    from the first requests instead. A reference file gone meanwhile no longer keeps the new
    head from being served."""
    from limelight.models.tensor_files import load_tensors, save_tensors

    model = Path(shutil.copytree(bert_tiny_dir, tmp_path / "model"))
    reference_file = drift_reference(model, tmp_path / "reference.json", "auto")
    served = start_sidecar(**watching(model, reference_file))
    reloader, service = served.server.reloader, served.server.app.service
    assert service.drift is not None and service.drift.state == "ready"
    weights = model / HEAD_DIRNAME / "head.safetensors"

    def new_head(scale: float, reloads: int) -> None:
        staged = tmp_path / f"head-{reloads}.safetensors"
        save_tensors({k: v * scale for k, v in load_tensors(weights).items()}, staged)
        staged.replace(weights)  # whole, as a copy job moves it in
        give_up = time.monotonic() + 60
        while reloader.reloads < reloads and time.monotonic() < give_up:
            time.sleep(0.05)
        assert reloader.reloads == reloads

    new_head(1.5, 1)
    drift = service.drift
    assert drift is not None and drift.method == "distilled" and drift.state == "building"
    reference_file.unlink()
    new_head(0.5, 2)
    assert service.default_method.name == "distilled"
    assert service.drift is not drift and service.drift.state == "building"  # type: ignore[union-attr]


def test_the_fingerprint_changes_when_a_file_is_written_replaced_or_removed(
    tmp_path: Path,
) -> None:
    head = tmp_path / "head"
    graph = tmp_path / "graph.onnx"
    paths = [head, graph]
    empty = fingerprint(paths)  # neither exists yet
    head.mkdir()
    (head / "head.safetensors").write_bytes(b"x" * 10)
    one = fingerprint(paths)
    assert one != empty
    (head / "card.json").write_text("{}")
    two = fingerprint(paths)
    assert two != one and fingerprint(paths) == two  # stable while nothing changes
    (head / "head.safetensors").write_bytes(b"y" * 11)
    three = fingerprint(paths)
    assert three != two
    graph.write_bytes(b"g")
    assert fingerprint(paths) != three
    graph.unlink()
    assert fingerprint(paths) == three


def test_the_content_digest_moves_with_the_bytes_only(tmp_path: Path) -> None:
    head = tmp_path / "head"
    head.mkdir()
    weights = head / "head.safetensors"
    weights.write_bytes(b"x" * 10)
    paths = [head, tmp_path / "graph.onnx"]
    first = content_digest(paths)
    os.utime(weights, ns=(1, 1))
    weights.write_bytes(b"x" * 10)
    assert content_digest(paths) == first  # touched and rewritten, the same bytes
    weights.write_bytes(b"x" * 9 + b"y")
    assert content_digest(paths) != first  # the same size, other bytes
    weights.write_bytes(b"x" * 10)
    (head / "card.json").write_text("{}")
    with_card = content_digest(paths)
    assert with_card != first  # a file more
    (head / "card.json").rename(head / "other.json")
    assert content_digest(paths) != with_card  # the same bytes under another name


def test_files_touched_or_rewritten_unchanged_are_not_reloaded(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """A head written again with the same bytes (a periodic job, a copy that keeps the bytes)
    is not a new head: no runtime is rebuilt and the drift monitor keeps its reference. New
    bytes are reloaded as before, with a new monitor when they are the served head's, and the
    same monitor when they are another file's."""
    model = Path(shutil.copytree(bert_tiny_dir, tmp_path / "model"))
    served = start_sidecar(model_dir=model, default_method="auto", reload_interval_s=0.05)
    reloader = served.server.reloader
    service = served.server.app.service
    monitor = service.drift
    assert monitor is not None and monitor.method == "distilled"
    head = model / HEAD_DIRNAME
    paths = reloader._paths

    def looked_at_the_files() -> None:
        give_up = time.monotonic() + 60
        while reloader._seen.stats != fingerprint(paths) and time.monotonic() < give_up:
            time.sleep(0.05)
        assert reloader._seen.stats == fingerprint(paths)

    for path in head.iterdir():
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched
    looked_at_the_files()
    weights = next(p for p in head.iterdir() if p.suffix == ".safetensors")
    # Written again, the same bytes, moved into place whole: written in place, a look could
    # catch the file empty mid-write, a change of its own (CI caught one, and two reloads).
    again = tmp_path / "again.safetensors"
    again.write_bytes(weights.read_bytes())
    again.replace(weights)
    looked_at_the_files()
    assert reloader.reloads == 0 and service.drift is monitor
    # New bytes, each file moved into place whole: a file seen half-written would be a
    # change of its own (and a reload of its own).
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "notes.txt").write_text("a new file beside the head")
    (staged / "notes.txt").rename(head / "notes.txt")

    def reloaded(count: int) -> None:
        give_up = time.monotonic() + 60
        while reloader.reloads < count and time.monotonic() < give_up:
            time.sleep(0.05)
        assert reloader.reloads == count

    reloaded(1)
    renewed = service.drift
    assert renewed is not monitor and renewed is not None and renewed.method == "distilled"
    # New bytes beside the model, but not the head's: the head's monitor keeps its reference.
    (staged / "notes.txt").write_text("not the head")
    tables = model / LEXICON_DIRNAME
    if tables.exists():
        (staged / "notes.txt").rename(tables / "limelight-test-notes.txt")
    else:  # the folder appears whole, with its file
        (staged / "tables").mkdir()
        (staged / "notes.txt").rename(staged / "tables" / "notes.txt")
        (staged / "tables").rename(tables)
    reloaded(2)
    assert service.default_method.name == "distilled" and service.drift is renewed


def serve_process(
    model: Path, log: Path, *flags: str, ready: str = "SERVING"
) -> tuple[subprocess.Popen[bytes], str]:
    """``limelight serve`` as a user starts it, with polling off; returns once ``ready`` is
    logged."""
    port = free_port()
    argv = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(model)]
    argv += ["--port", str(port), "--metrics-port", "0", "--jobs", "off"]
    argv += ["--reload-interval-s", "0", "--grace-period-s", "5", "--default-method", "auto"]
    argv += flags
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    wait_for_log(process, log, ready)
    return process, f"127.0.0.1:{port}"


def wait_for_log(process: subprocess.Popen[bytes], log: Path, pattern: str, count: int = 1) -> None:
    """Until ``pattern`` has appeared ``count`` times in the log; fails if the process ends."""
    while len(re.findall(pattern, log.read_text())) < count:
        assert process.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)


def stop_process(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()


def test_sighup_serves_a_new_head_at_once_with_polling_off(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    model = bare_copy(bert_tiny_dir, tmp_path / "model")
    log = tmp_path / "serve.log"
    process, target = serve_process(model, log)
    try:
        s = stub(target)
        assert (
            s.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation.method == "normxlogit"
        )
        shutil.copytree(bert_tiny_dir / HEAD_DIRNAME, model / HEAD_DIRNAME)
        # Polling is off: the head stays unserved until asked for ...
        assert (
            s.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation.method == "normxlogit"
        )
        process.send_signal(signal.SIGHUP)  # ... and is served once asked, with no restart
        assert wait_for_method(target, "distilled").explanation.method == "distilled"
        wait_for_log(process, log, "reloaded the inline outputs")
        # Asked again with nothing new: said so, and nothing changes.
        process.send_signal(signal.SIGHUP)
        wait_for_log(process, log, "SIGHUP: nothing new served")
        assert s.Explain(pb.ExplainRequest(text=TEXT), timeout=30).explanation.method == "distilled"
        assert log.read_text().count("reloaded the inline outputs") == 1
    finally:
        assert stop_process(process) == 0, log.read_text()[-3000:]


def test_sighup_to_the_supervisor_reaches_every_worker(bert_tiny_dir: Path, tmp_path: Path) -> None:
    model = bare_copy(bert_tiny_dir, tmp_path / "model")
    log = tmp_path / "serve.log"
    process, target = serve_process(model, log, "--workers", "2", ready="with 2 worker processes")
    # One connection on each worker (the kernel places each new connection on one of them).
    on: dict[str, grpc.Channel] = {}
    options = [("grpc.use_local_subchannel_pool", 1)]
    try:
        for _ in range(64):
            channel = grpc.insecure_channel(target, options=options)
            instance = (
                explainer_pb2_grpc.ExplainerStub(channel)
                .GetModel(pb.GetModelRequest(), timeout=30)
                .instance
            )
            if instance in on:
                channel.close()
            else:
                on[instance] = channel
            if len(on) == 2:
                break
        assert len(on) == 2
        shutil.copytree(bert_tiny_dir / HEAD_DIRNAME, model / HEAD_DIRNAME)
        process.send_signal(signal.SIGHUP)
        wait_for_log(process, log, "reloaded the inline outputs", count=2)
        for channel in on.values():
            r = explainer_pb2_grpc.ExplainerStub(channel).Explain(
                pb.ExplainRequest(text=TEXT), timeout=30
            )
            assert r.explanation.method == "distilled"
    finally:
        for channel in on.values():
            channel.close()
        assert stop_process(process) == 0, log.read_text()[-3000:]


def _catches_sighup(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
    return False


def _started_and_catches_sighup(pid: int, marker: bytes) -> bool:
    """A child that runs its own program (``marker`` in its command line) and catches SIGHUP
    itself. Between fork and exec a child still runs its parent's image and handlers (a SIGHUP
    then is lost at exec), so its own command line must be in place first."""
    try:
        started = marker in Path(f"/proc/{pid}/cmdline").read_bytes()
        return started and _catches_sighup(pid)
    except FileNotFoundError:  # gone meanwhile
        return False


def _torch_loaded(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_sighup_while_the_process_starts_does_not_end_it(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """SIGHUP's default action ends a process: ``limelight serve`` catches it from its first
    steps, long before torch is imported and the server's own handler is in place, and honours
    it once serving."""
    model = bare_copy(bert_tiny_dir, tmp_path / "model")
    shutil.copytree(bert_tiny_dir / HEAD_DIRNAME, model / HEAD_DIRNAME)
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(model)]
    port = free_port()
    argv += ["--port", str(port), "--metrics-port", "0", "--jobs", "off"]
    argv += ["--reload-interval-s", "0", "--default-method", "auto"]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        while not _started_and_catches_sighup(process.pid, b"limelight.cli.main"):
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.005)
        assert not _torch_loaded(process.pid)  # caught well before the server's imports
        process.send_signal(signal.SIGHUP)
        wait_for_log(process, log, "SERVING")
        wait_for_log(process, log, "SIGHUP: nothing new served")
        r = stub(f"127.0.0.1:{port}").Explain(pb.ExplainRequest(text=TEXT), timeout=30)
        assert r.explanation.method == "distilled"
    finally:
        assert stop_process(process) == 0, log.read_text()[-3000:]


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def _worker_catches_sighup(pid: int) -> bool:
    return _started_and_catches_sighup(pid, b"worker_main")


def test_a_sighup_sent_to_a_worker_while_it_starts_does_not_end_it(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """With ``--workers`` each worker catches SIGHUP from its first steps too (the supervisor
    passes SIGHUP only to workers that serve, but anyone may signal a worker directly)."""
    model = bare_copy(bert_tiny_dir, tmp_path / "model")
    shutil.copytree(bert_tiny_dir / HEAD_DIRNAME, model / HEAD_DIRNAME)
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(model)]
    port = free_port()
    argv += ["--port", str(port), "--metrics-port", "0", "--jobs", "off", "--workers", "2"]
    argv += ["--reload-interval-s", "0", "--default-method", "auto"]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        worker = None
        while worker is None:  # the first worker, caught SIGHUP but not yet importing torch
            assert process.poll() is None, log.read_text()[-3000:]
            worker = next((w for w in _children(process.pid) if _worker_catches_sighup(w)), None)
            time.sleep(0.005)
        assert not _torch_loaded(worker)
        os.kill(worker, signal.SIGHUP)
        wait_for_log(process, log, "with 2 worker processes")
        wait_for_log(process, log, "SIGHUP: nothing new served")
        assert worker in _children(process.pid)  # the same process: not ended and restarted
        assert "exited" not in log.read_text()
        r = stub(f"127.0.0.1:{port}").Explain(pb.ExplainRequest(text=TEXT), timeout=30)
        assert r.explanation.method == "distilled"
    finally:
        assert stop_process(process) == 0, log.read_text()[-3000:]


# --- a build that failed, a default named in the settings, a graph served as exported ---------


def scaled_head(source: Path, scale: float, weights: Path) -> None:
    """The weights of the head in ``source`` times ``scale``, moved into place at ``weights``
    whole (as a copy job does)."""
    from limelight.models.tensor_files import load_tensors, save_tensors

    staged = weights.parent.parent / ".staged-head.safetensors"  # not in a watched folder
    tensors = load_tensors(source / HEAD_DIRNAME / "head.safetensors")
    save_tensors({k: v * scale for k, v in tensors.items()}, staged)
    staged.replace(weights)


def unreadable(monkeypatch: pytest.MonkeyPatch, path: Path) -> Callable[[], None]:
    """``path`` cannot be opened, as a file written 0600 by another user (root reads any file:
    a test cannot drop that with ``chmod``); returns what makes it readable again, leaving its
    ``stat`` as it is."""
    blocked = [True]
    real_open = Path.open

    def guarded(self: Path, *args: Any, **kwargs: Any) -> Any:
        if blocked[0] and self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", guarded)
    return lambda: blocked.__setitem__(0, False)


def scores(target: str, method: str = "") -> list[float]:
    r = stub(target).Explain(pb.ExplainRequest(text=TEXT, method=method), timeout=30)
    assert r.explanation.method == (method or "distilled")
    return list(r.explanation.scores)


def test_an_unreadable_file_counts_in_the_digest_and_a_chmod_moves_the_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head file the sidecar may not read was left out of the digest (as if absent), and a
    ``chmod`` moved nothing the reloader looked at: the head made readable was never served."""
    head = tmp_path / "head"
    head.mkdir()
    (head / "card.json").write_text("{}")
    weights = head / "head.safetensors"
    weights.write_bytes(b"x" * 10)
    readable = content_digest([head])
    before = fingerprint([head])
    os.chmod(weights, 0o600)
    assert fingerprint([head]) != before  # a status change: looked at again
    readable_again = unreadable(monkeypatch, weights)
    blocked = content_digest([head])
    weights.rename(tmp_path / "aside")
    absent = content_digest([head])
    (tmp_path / "aside").rename(weights)
    assert len({readable, blocked, absent}) == 3
    readable_again()
    assert content_digest([head]) == readable


@pytest.fixture
def model(bert_tiny_dir: Path, tmp_path: Path) -> Path:
    """A copy of the BERT-tiny demo model, its head included, to change under a sidecar."""
    return Path(shutil.copytree(bert_tiny_dir, tmp_path / "model"))


@pytest.fixture
def write_unreadable_head(
    model: Path, bert_tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[[], tuple[Path, Callable[[], None]]]:
    """Writes a new head (the demo's, scaled) beside ``model`` that the sidecar cannot read
    yet: returns its weights, and what makes them readable."""

    def write() -> tuple[Path, Callable[[], None]]:
        weights = model / HEAD_DIRNAME / "head.safetensors"
        readable_again = unreadable(monkeypatch, weights)
        scaled_head(bert_tiny_dir, -1.0, weights)
        return weights, readable_again

    return write


def test_a_head_that_could_not_be_read_is_served_once_it_can_be(
    start_sidecar: Callable[..., RunningSidecar],
    model: Path,
    write_unreadable_head: Callable[[], tuple[Path, Callable[[], None]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A new head written unreadable (0600, another user's) fails to build, and the old head
    stays served; made readable (``chmod``), it is served from the next look on."""
    served = start_sidecar(model_dir=model, default_method="auto", reload_interval_s=0.05)
    old = scores(served.target)
    weights, readable_again = write_unreadable_head()
    wait_until(lambda: any("could not be built" in r.getMessage() for r in caplog.records))
    assert scores(served.target) == old and served.server.reloader.reloads == 0
    readable_again()
    os.chmod(weights, 0o644)
    wait_until(lambda: served.server.reloader.reloads == 1, timeout=30)
    new = scores(served.target)
    assert new != pytest.approx(old, abs=1e-6)


def test_a_build_that_failed_is_tried_again_on_sighup(
    start_sidecar: Callable[..., RunningSidecar],
    model: Path,
    write_unreadable_head: Callable[[], tuple[Path, Callable[[], None]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What fixes a failed build need not move a watched file (a directory's permissions, a
    cache made writable): a SIGHUP builds again, where it found "nothing new"."""
    import asyncio

    # Polling, but not within the test: the SIGHUPs below are the only looks.
    served = start_sidecar(model_dir=model, default_method="auto", reload_interval_s=3600)
    server, reloader = served.server, served.server.reloader
    loop = server._reloading.get_loop()

    def sighup() -> bool:
        return bool(asyncio.run_coroutine_threadsafe(server._reload_now(reloader), loop).result(60))

    old = scores(served.target)
    _, readable_again = write_unreadable_head()
    assert not sighup()
    assert any("could not be built" in r.getMessage() for r in caplog.records)
    assert not sighup()  # the same failure: said again, in one line
    (again,) = [r for r in caplog.records if "still cannot be built" in r.getMessage()]
    assert again.exc_info is None
    assert scores(served.target) == old
    readable_again()  # no stat moved
    assert sighup()
    assert scores(served.target) != pytest.approx(old, abs=1e-6)
    assert not sighup()  # nothing left to retry


def test_a_default_named_in_the_settings_keeps_its_head_and_the_rest_is_reloaded(
    start_sidecar: Callable[..., RunningSidecar],
    model: Path,
    bert_tiny_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`--default-method distilled` and the head deleted: the head loaded before stays served
    (one warning, no traceback), and a lexicon table written afterwards is served too (every
    later reload was refused, and GetModel said there was no table); the head's monitor keeps
    its reference."""
    served = start_sidecar(
        model_dir=model,
        default_method="distilled",
        cache_dir=tmp_path / "cache",
        reload_interval_s=0.05,
        jobs="off",
    )
    reloader, service = served.server.reloader, served.server.app.service
    monitor = service.drift
    old = scores(served.target)
    (model / HEAD_DIRNAME).rename(tmp_path / "aside")  # whole: never seen half-removed
    (held,) = wait_until(lambda: [r for r in caplog.records if r.name == "limelight.reload"])
    assert held.levelname == "WARNING" and held.exc_info is None
    assert "no distilled head beside the model" in held.getMessage()
    assert "stays served" in held.getMessage()
    assert reloader.reloads == 0 and scores(served.target) == old

    # `limelight lexicon` on another copy of the model, its table moved in whole.
    staging = bare_copy(bert_tiny_dir, tmp_path / "staging")
    assert main(["lexicon", "--model", str(staging), "--no-progress"]) == 0
    (staging / LEXICON_DIRNAME).rename(model / LEXICON_DIRNAME)
    wait_until(lambda: "lexicon" in service.runtime.head_names)
    assert scores(served.target, "lexicon_lookup")
    assert scores(served.target) == pytest.approx(old, rel=1e-6, abs=1e-7)
    assert service.ready and service.drift is monitor
    model_info = stub(served.target).GetModel(pb.GetModelRequest(), timeout=10)
    info = {m.name: m for m in model_info.methods}
    assert info["lexicon_lookup"].unavailable_reason == ""
    assert info["distilled"].unavailable_reason == ""  # served, from the head loaded before
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_graph_served_as_exported_is_not_reloaded_for_a_new_head(
    start_sidecar: Callable[..., RunningSidecar],
    model: Path,
    bert_tiny_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`LIMELIGHT_ONNX_EXPORT=false` and the graph beside the model: a new head written beside
    it is not in the graph, so nothing served changes. The reloader rebuilt all the same, said
    "reloaded" and started a new drift monitor; it now says why the head is not served, until
    the graph is exported again."""
    assert main(["export-onnx", "--model", str(model)]) == 0
    served = start_sidecar(
        model_dir=model,
        runtime="onnx",
        onnx_export=False,
        cache_dir=tmp_path / "cache",
        default_method="auto",
        reload_interval_s=0.05,
        jobs="off",
    )
    reloader, service = served.server.reloader, served.server.app.service
    monitor = service.drift
    old = scores(served.target)
    weights = model / HEAD_DIRNAME / "head.safetensors"
    scaled_head(bert_tiny_dir, -1.0, weights)
    said = wait_until(
        lambda: [r.getMessage() for r in caplog.records if "export it again" in r.getMessage()],
        timeout=30,
    )
    assert str(model / "limelight.onnx") in said[0] and "keeps serving" in said[0]
    assert reloader.reloads == 0 and service.drift is monitor
    assert scores(served.target) == old
    assert main(["export-onnx", "--model", str(model)]) == 0
    wait_until(lambda: reloader.reloads == 1)
    assert scores(served.target) != pytest.approx(old, abs=1e-6)
    assert service.drift is not monitor


def test_the_table_the_start_builds_is_not_reloaded(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """`--lexicon-build` writes the table into a watched folder of the cache while the sidecar
    starts: the first look took it for a new table, and rebuilt the runtime and the monitor."""
    model = bare_copy(bert_tiny_dir, tmp_path / "model")
    served = start_sidecar(
        model_dir=model,
        default_method="auto",
        lexicon_build=True,
        cache_dir=tmp_path / "cache",
        reload_interval_s=0.05,
        jobs="off",
    )
    reloader, service = served.server.reloader, served.server.app.service
    assert service.default_method.name == "lexicon_lookup"
    monitor = service.drift
    give_up = time.monotonic() + 1.0  # twenty looks
    while time.monotonic() < give_up:
        assert reloader._seen.stats == fingerprint(reloader._paths)
        time.sleep(0.05)
    assert reloader.reloads == 0 and service.drift is monitor


def test_a_head_the_build_did_not_see_whole_is_refused_with_its_reason(
    start_sidecar: Callable[..., RunningSidecar],
    model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A head changing under a build (churn) is left out of it though its card is there: the
    error sent the reader to "the warning above", which no one had logged."""
    import limelight.reload
    from limelight.runtimes.torch_runtime import TorchRuntime

    served = start_sidecar(
        model_dir=model, default_method="auto", cache_dir=tmp_path / "cache", reload_interval_s=0.05
    )
    # The build reads the folder as a copy leaves it for a moment: no card yet.
    monkeypatch.setattr(limelight.reload, "build_runtime", lambda s, m: TorchRuntime(m, {}))
    (model / HEAD_DIRNAME / "notes.txt").write_text("new bytes beside the head")
    said = wait_until(
        lambda: [r for r in caplog.records if "could not be served" in r.getMessage()]
    )
    message = said[0].getMessage()
    assert "see the warning above" not in message
    assert "not whole when the runtime was built" in message
    assert served.server.reloader.reloads == 0


def test_a_served_head_cut_short_is_a_failed_build_said_in_one_line(
    start_sidecar: Callable[..., RunningSidecar],
    model: Path,
    bert_tiny_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A copy of the head not done yet (its weights cut short) was logged at ERROR with a
    traceback of some thirty lines, the reason in the last: it is one line naming the file,
    the old head stays served, and the head is served once whole."""
    served = start_sidecar(model_dir=model, default_method="auto", reload_interval_s=0.05)
    registry = served.server.app.metrics.registry

    def reloads(outcome: str) -> float:
        return (
            registry.get_sample_value("limelight_inline_reloads_total", {"outcome": outcome}) or 0.0
        )

    def head_files() -> str:
        (info,) = [m for m in registry.collect() if m.name == "limelight_model"]
        return str(info.samples[0].labels["method_files"])

    served_files = head_files()
    assert served_files and reloads("failed") == reloads("reloaded") == 0
    old = scores(served.target)
    weights = model / HEAD_DIRNAME / "head.safetensors"
    whole = weights.read_bytes()
    staged = model.parent / ".cut-short.safetensors"  # moved in whole: never seen half-cut
    staged.write_bytes(whole[:100])
    staged.replace(weights)
    (failed,) = wait_until(
        lambda: [r for r in caplog.records if "could not be built" in r.getMessage()]
    )
    assert failed.levelname == "ERROR" and failed.exc_info is None
    assert str(weights) in failed.getMessage() and "limelight distill" in failed.getMessage()
    assert scores(served.target) == old and served.server.reloader.reloads == 0
    assert reloads("failed") >= 1 and head_files() == served_files  # on /metrics too
    scaled_head(bert_tiny_dir, -1.0, weights)
    wait_until(lambda: served.server.reloader.reloads == 1)
    assert scores(served.target) != pytest.approx(old, abs=1e-6)
    # Which head computes the answers is on limelight_model_info: another head, another digest.
    assert reloads("reloaded") == 1 and head_files() not in ("", served_files)


def test_an_unexpected_build_failure_keeps_its_traceback(
    start_sidecar: Callable[..., RunningSidecar], model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Files half-written, unreadable or damaged are one line; anything else is a bug, whose
    traceback is what whoever fixes it needs."""
    reloader = start_sidecar(model_dir=model, reload_interval_s=0).server.reloader
    for error in (
        PermissionError(13, "Permission denied", str(model / HEAD_DIRNAME / "card.json")),
        ValueError("a table cut short"),
        RuntimeError("a bug"),
    ):
        reloader._failed(error, "distilled")
    expected, expected_too, bug = [r for r in caplog.records if r.name == "limelight.reload"]
    assert expected.exc_info is None and "Permission denied" in expected.getMessage()
    assert expected_too.exc_info is None and "a table cut short" in expected_too.getMessage()
    assert bug.exc_info is not None


def test_a_graph_beside_the_model_that_is_not_served_changes_nothing_served(
    start_sidecar: Callable[..., RunningSidecar],
    model: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With ONNX Runtime serving its own export from the cache, garbage written to
    <model>/limelight.onnx (then removed) rebuilt the runtime twice, logged two reloads and
    restarted the drift monitor, though the graph served never changed."""
    served = onnx_sidecar(start_sidecar, model, tmp_path)
    reloader, service = served.server.reloader, served.server.app.service
    monitor, old = service.drift, scores(served.target)
    beside = model / "limelight.onnx"
    beside.write_bytes(os.urandom(5000))

    def not_served() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "it is not served" in r.getMessage()]

    wait_until(lambda: reloader.reloads or not_served())
    assert reloader.reloads == 0 and service.drift is monitor
    (warning,) = not_served()
    assert warning.levelname == "WARNING" and str(beside) in warning.getMessage()
    assert scores(served.target) == old
    with caplog.at_level(logging.INFO, logger="limelight.reload"):
        beside.unlink()  # back to what is served: nothing to reload
        wait_until(lambda: reloader.reloads or "nothing to reload" in caplog.text)
    assert reloader.reloads == 0 and service.drift is monitor
    assert len(not_served()) == 1

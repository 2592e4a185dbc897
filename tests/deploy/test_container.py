"""The container image, built and run for real (docs/deploy.md).

One test: build the image with buildah from an offline base (debootstrap Debian bookworm) and the
wheelhouse, run it with podman the way Kubernetes runs it (read-only root FS, no capabilities,
non-root, writable tmpfs only at /tmp and /var/lib/limelight) serving the BERT-tiny demo model from
a read-only volume, and answer an Explain call over gRPC with the SDK. The answer is compared with
the same model run here by transformers; the live /metrics exposition is checked against the
dashboard; SIGTERM must stop the server cleanly within its grace period.

Needs root, apt-get (to install podman, buildah, runc, debootstrap when missing) and a Debian
mirror the first time (the base image is cached in podman's storage afterwards). Opt out with
LIMELIGHT_SKIP_CONTAINER_TEST=1. Phase timings are written to build/container-test-timings.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from limelight.api.ports import free_port
from tests.deploy.deploy_support import (
    OVERLAYS,
    REPO,
    dashboard,
    dashboard_exprs,
    exported_metric_names,
    live_metric_names,
    promql_metric_names,
    render,
)

pytestmark = pytest.mark.container

BASE_IMAGE = "localhost/limelight-base:bookworm"
IMAGE = "localhost/limelight:container-test"
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
GRACE_PERIOD_S = 10
TEXT = "A gripping, beautifully shot film with a wonderful cast."


def _run(cmd: list[str], timeout: float, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload, no-any-return]


def _tail(text: str, n: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _wheelhouse_fresh(folder: Path) -> bool:
    lock = folder / "requirements.lock"
    inputs = [REPO / "pyproject.toml", REPO / "client" / "pyproject.toml"]
    return lock.exists() and all(lock.stat().st_mtime >= p.stat().st_mtime for p in inputs)


@pytest.fixture(scope="module")
def container_host() -> Iterator[None]:
    """podman/buildah/runc/debootstrap, containers.conf limits and the offline base image."""
    if os.environ.get("LIMELIGHT_SKIP_CONTAINER_TEST") == "1":
        pytest.skip("LIMELIGHT_SKIP_CONTAINER_TEST=1")
    if os.geteuid() != 0:
        pytest.skip("the container test runs rootful podman/buildah and apt-get: needs root")
    tools = ("podman", "buildah", "runc", "debootstrap")
    if not all(shutil.which(t) for t in tools) and not shutil.which("apt-get"):
        pytest.skip(f"{', '.join(t for t in tools if not shutil.which(t))} missing and no apt-get")
    setup = _run(["bash", str(REPO / "scripts" / "podman_setup.sh"), BASE_IMAGE], timeout=1800)
    if setup.returncode != 0:
        output = _tail(setup.stdout + setup.stderr)
        pytest.skip(
            "cannot prepare podman/buildah or the debootstrap base image here "
            f"(scripts/podman_setup.sh exit {setup.returncode}):\n{output}"
        )
    yield


def test_image_builds_runs_and_explains(
    container_host: None, bert_tiny_dir: Path, tmp_path: Path
) -> None:
    timings: dict[str, float] = {}
    t_all = time.monotonic()

    # 1. Wheelhouse (host side, reused while the pinned requirements are unchanged).
    t0 = time.monotonic()
    wheelhouse = REPO / "build" / "wheelhouse"
    if not _wheelhouse_fresh(wheelhouse):
        done = _run(["bash", str(REPO / "scripts" / "build_wheelhouse.sh"), str(wheelhouse)], 1800)
        assert done.returncode == 0, _tail(done.stdout + done.stderr)
    timings["wheelhouse_s"] = time.monotonic() - t0

    # 2. Build from the offline base; --layers reuses the dependency layer across runs.
    previous = _run([*PODMAN, "image", "inspect", "-f", "{{.Id}}", IMAGE], 120).stdout.strip()
    t0 = time.monotonic()
    build = _run(
        [
            "buildah", "bud", "--isolation", "chroot", "--layers",
            "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
            "-t", IMAGE, "-f", "Dockerfile", ".",
        ],
        timeout=3600,
        cwd=REPO,
    )  # fmt: skip
    timings["build_s"] = time.monotonic() - t0
    assert build.returncode == 0, _tail(build.stdout + build.stderr, 80)
    inspect = json.loads(_run([*PODMAN, "image", "inspect", IMAGE], 120).stdout)[0]
    config = inspect["Config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["limelight"] and config["Cmd"] == ["serve"]
    assert {"50051/tcp", "9464/tcp"} <= set(config["ExposedPorts"])
    timings["image_size_mb"] = inspect["Size"] / 1e6
    if previous and previous != inspect["Id"]:
        # The last run's image is dangling now; its layers stay cached for --layers.
        _run([*PODMAN, "rmi", previous], 300)

    # 3. The model volume: a world-readable copy (the cache dir may be private to root).
    model = tmp_path / "classifier"
    shutil.copytree(bert_tiny_dir, model)
    for path in [model, *model.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)

    # 4. Run it like the Kubernetes manifests do.
    port, metrics_port = free_port(), free_port()
    name = f"limelight-ctest-{os.getpid()}"
    t0 = time.monotonic()
    started = _run(
        [
            *PODMAN, "run", "-d", "--name", name, "--network", "host",
            "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--tmpfs", "/tmp:rw,mode=1777",
            "--tmpfs", "/var/lib/limelight:rw,U,mode=0750",
            "-v", f"{model}:/models/classifier:ro",
            "-e", "LIMELIGHT_HOST=127.0.0.1",
            "-e", f"LIMELIGHT_PORT={port}",
            "-e", f"LIMELIGHT_METRICS_PORT={metrics_port}",
            "-e", f"LIMELIGHT_GRACE_PERIOD_S={GRACE_PERIOD_S}",
            "-e", "LIMELIGHT_TORCH_THREADS=1",
            IMAGE,
        ],
        timeout=300,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 600
        status = None
        while time.monotonic() < deadline:
            running = _run([*PODMAN, "inspect", "-f", "{{.State.Running}}", name], 60).stdout
            if running.strip() != "true":
                logs = _run([*PODMAN, "logs", name], 60)
                pytest.fail(f"container exited before SERVING:\n{_tail(logs.stdout + logs.stderr)}")
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            except grpc.RpcError:
                status = None
            if status == health_pb2.HealthCheckResponse.SERVING:
                break
            time.sleep(1)
        assert status == health_pb2.HealthCheckResponse.SERVING, "never became SERVING"
        timings["start_to_serving_s"] = time.monotonic() - t0

        # 5. Explain over gRPC with the SDK; compare with transformers run here.
        from limelight_client import Client

        t0 = time.monotonic()
        with Client(f"127.0.0.1:{port}", timeout=60) as client:
            exp = client.explain(TEXT)
            info = client.model()
        timings["explain_s"] = time.monotonic() - t0
        tokenizer = AutoTokenizer.from_pretrained(bert_tiny_dir)
        reference = AutoModelForSequenceClassification.from_pretrained(bert_tiny_dir).eval()
        with torch.no_grad():
            probs = torch.softmax(reference(**tokenizer(TEXT, return_tensors="pt")).logits, -1)[0]
        labels = [reference.config.id2label[i] for i in range(probs.numel())]
        assert exp.labels == labels
        assert exp.label == labels[int(probs.argmax())]
        for i, label in enumerate(labels):
            assert exp.probabilities[label] == pytest.approx(float(probs[i]), abs=1e-4)
        ids = tokenizer(TEXT)["input_ids"]
        assert len(exp.tokens) == len(ids) == len(exp.scores)
        assert any(abs(s) > 0 for s in exp.scores)
        # The demo build put the inline explainer head beside the model: the image serves it
        # by default, with NormXLogit alongside.
        assert exp.method == "distilled"
        assert len(exp.score_array("normxlogit")) == len(ids)
        assert info.name and info.version

        # 6. The live exposition: only known metric names, the call counted, promtool happy.
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30)
        exposition = body.read().decode()
        live = live_metric_names(exposition)
        exported = exported_metric_names()
        limelight_live = {n for n in live if n.startswith("limelight_")}
        assert limelight_live - exported == set(), "served metrics the collectors don't declare"
        assert 'limelight_request_duration_seconds_count{code="OK",rpc="Explain"} 1.0' in exposition
        assert "limelight_ready 1.0" in exposition
        used = set().union(
            *(promql_metric_names(e) for e in dashboard_exprs(dashboard(render(OVERLAYS["base"]))))
        )
        # Names with observations by now must be live; the rest are declared (checked above).
        for name_ in ("limelight_request_duration_seconds_bucket", "limelight_predictions_total",
                      "limelight_ready", "limelight_model_info"):  # fmt: skip
            assert name_ in used and name_ in live, name_
        if promtool := shutil.which("promtool"):
            check = _run([promtool, "check", "metrics"], 60, input=exposition)
            assert check.returncode == 0, check.stdout + check.stderr

        # 7. SIGTERM: clean exit within the grace period.
        t0 = time.monotonic()
        stop = _run([*PODMAN, "stop", "-t", str(GRACE_PERIOD_S + 20), name], GRACE_PERIOD_S + 120)
        timings["stop_s"] = time.monotonic() - t0
        assert stop.returncode == 0, stop.stderr
        exit_code = _run([*PODMAN, "inspect", "-f", "{{.State.ExitCode}}", name], 60).stdout
        logs = _run([*PODMAN, "logs", name], 60)
        # podman stop sends SIGKILL (exit 137) if the server outlives the grace period.
        assert exit_code.strip() == "0", _tail(logs.stdout + logs.stderr)
    finally:
        _run([*PODMAN, "rm", "-f", "-t", "0", name], 120)
        timings["total_s"] = time.monotonic() - t_all
        out = REPO / "build" / "container-test-timings.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({k: round(v, 1) for k, v in timings.items()}, indent=2) + "\n")
        print(f"container test timings: {timings}")

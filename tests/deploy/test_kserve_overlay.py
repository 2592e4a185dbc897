"""k8s/overlays/kserve: renders with kustomize, matches the kserve package's typed models, and
wires the runtime's ports, probes and settings to what the sidecar really serves."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from limelight.api import http_server
from limelight.metrics import Metrics
from limelight.settings import Settings
from tests.deploy.deploy_support import K8S, find, kustomize_command, render

KSERVE = K8S / "overlays" / "kserve"
CHECKER = Path(__file__).with_name("kserve_typed_check.py")

pytestmark = pytest.mark.skipif(
    kustomize_command() is None,
    reason="needs `kubectl` (built-in kustomize) or `kustomize` on PATH to render k8s/",
)


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render(KSERVE)


def typed_problems(objects: list[dict[str, Any]]) -> list[str]:
    run = subprocess.run(
        [sys.executable, str(CHECKER)],
        input=json.dumps(objects),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    problems: list[str] = json.loads(run.stdout)
    return problems


@pytest.mark.skipif(importlib.util.find_spec("kserve") is None, reason="kserve not installed")
def test_objects_match_kserve_typed_models(objects: list[dict[str, Any]]) -> None:
    assert {(o["kind"], o["metadata"]["name"]) for o in objects} == {
        ("ServingRuntime", "limelight"),
        ("InferenceService", "limelight-classifier"),
    }
    assert typed_problems(objects) == []
    # The check can fail: a typo'd field and a wrong type are reported.
    broken = copy.deepcopy(objects)
    isvc = find(broken, "InferenceService", "limelight-classifier")
    isvc["spec"]["predictor"]["model"]["storageURI"] = "s3://x"
    runtime = find(broken, "ServingRuntime", "limelight")
    runtime["spec"]["multiModel"] = "no"
    problems = typed_problems(broken)
    assert any("storageURI" in p for p in problems)
    assert any("multiModel" in p for p in problems)


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def test_runtime_serves_the_isvc_over_the_routes_the_sidecar_has(
    objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = find(objects, "ServingRuntime", "limelight")["spec"]
    isvc = find(objects, "InferenceService", "limelight-classifier")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == "limelight"
    formats = {(f["name"], f.get("version")) for f in runtime["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"]["version"]) in formats
    assert model["protocolVersion"] in runtime["protocolVersions"]
    assert {"v1", "v2", "grpc-v2"} <= set(runtime["protocolVersions"])
    (container,) = runtime["containers"]
    assert container["name"] == "kserve-container"
    env = _env(container) | _env(model)
    # The clients address the model by the InferenceService's name.
    assert env["LIMELIGHT_MODEL_NAME"] == isvc["metadata"]["name"]
    assert env["LIMELIGHT_MODEL_DIR"] == "/mnt/models"  # where KServe's storage initializer puts it
    for key in [k for k in os.environ if k.startswith("LIMELIGHT_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.host == "0.0.0.0"
    (port,) = container["ports"]
    assert port["containerPort"] == settings.metrics_port == 8080 and port["name"] == "http1"
    assert settings.port == 8081  # KServe's gRPC port convention
    assert runtime["annotations"]["prometheus.kserve.io/port"] == str(settings.metrics_port)
    assert runtime["annotations"]["prometheus.kserve.io/path"] == "/metrics"
    # Probes hit OIP health routes the HTTP server really has, on its port.
    app = http_server.HttpServer(settings, Metrics(), lambda: None).application()
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] == settings.metrics_port, probe
        assert ("GET", get["path"]) in routes, probe
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert (
        container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"]
        >= 300
    )
    # Hardened like the base sidecar; writable paths are mounted.
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    for path in (settings.cache_dir, settings.resolved_jobs_db(), Path("/tmp")):
        assert any(Path(path).is_relative_to(m) for m in mounts), path
    volumes = {v["name"] for v in runtime["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= volumes
    assert isvc["metadata"]["annotations"]["serving.kserve.io/enable-prometheus-scraping"] == "true"

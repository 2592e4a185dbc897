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
from tests.deploy.deploy_support import (
    K8S,
    OVERLAYS,
    drain_timing_problems,
    find,
    kustomize_command,
    pod_selectors,
    render,
    selects,
)

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


def kserve_service_ports(container: dict[str, Any]) -> dict[int, int]:
    """Service port -> container port of the predictor Service KServe creates in RawDeployment
    mode (service_reconciler.go, createDefaultSvc): the first declared container port behind
    port 80, every further one behind a Service port of its own number; only those."""
    ports = [p["containerPort"] for p in container.get("ports", [])]
    if not ports:
        return {80: 8080}
    return {80: ports[0]} | {port: port for port in ports[1:]}


def test_kserve_service_ports_model() -> None:
    """The model above: a runtime declaring only http1 leaves gRPC without a Service port."""
    only_http = {"ports": [{"name": "http1", "containerPort": 8080}]}
    assert kserve_service_ports(only_http) == {80: 8080}
    both = {"ports": [{"containerPort": 8080}, {"containerPort": 8081}]}
    assert kserve_service_ports(both) == {80: 8080, 8081: 8081}


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
    # KServe's conventions: http1 on 8080 first, then the gRPC port h2c on 8081.
    assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [
        ("http1", settings.metrics_port),
        ("h2c", settings.port),
    ]
    assert (settings.metrics_port, settings.port) == (8080, 8081)
    # The predictor Service KServe builds from them reaches both servers: REST on the URL's
    # port 80, gRPC (grpc-v2, limelight.v1) on its own port.
    service_ports = kserve_service_ports(container)
    assert service_ports[80] == settings.metrics_port
    assert settings.port in service_ports.values()
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


def test_predictor_drains_like_the_base_sidecar(objects: list[dict[str, Any]]) -> None:
    """Scale-in and rollouts shed no requests: the preStop sleep keeps the pod serving while
    endpoints drop it and every connection ages out to another replica, and the drain fits in
    the predictor's grace period (the base sidecar's rule, docs/deploy.md)."""
    runtime = find(objects, "ServingRuntime", "limelight")["spec"]
    (container,) = runtime["containers"]
    predictor = find(objects, "InferenceService", "limelight-classifier")["spec"]["predictor"]
    env = _env(container) | _env(predictor["model"])
    assert (
        drain_timing_problems(
            pre_stop_s=container["lifecycle"]["preStop"]["sleep"]["seconds"],
            termination_grace_s=predictor["terminationGracePeriodSeconds"],
            grace_period_s=float(env["LIMELIGHT_GRACE_PERIOD_S"]),
            connection_age_s=float(env["LIMELIGHT_MAX_CONNECTION_AGE_S"]),
        )
        == []
    )


def kserve_pod_labels(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The labels KServe gives the predictor's pods: the InferenceService's, the predictor's
    and the runtime's own, and KServe's."""
    isvc = find(objects, "InferenceService", "limelight-classifier")
    runtime = find(objects, "ServingRuntime", "limelight")["spec"]
    name = isvc["metadata"]["name"]
    return (
        dict(isvc["metadata"].get("labels", {}))
        | isvc["spec"]["predictor"].get("labels", {})
        | runtime.get("labels", {})
        | {
            "serving.kserve.io/inferenceservice": name,
            "component": "predictor",
            "app": f"isvc.{name}-predictor",
        }
    )


def test_base_selectors_leave_the_predictor_pods_alone(objects: list[dict[str, Any]]) -> None:
    """Applied in the same namespace as the base (or an overlay of it), the predictor's pods are
    selected by none of its Services, PodDisruptionBudgets, NetworkPolicies or Deployments: the
    Service would send sidecar clients to them on ports they do not serve, the PDB would count
    them, a Deployment's topology spread would weigh them."""
    labels = kserve_pod_labels(objects)
    for overlay, path in OVERLAYS.items():
        others = render(path)
        found = list(pod_selectors(others))
        # The check can fail: each of the overlay's own Deployments has its pods selected.
        for deployment in [o for o in others if o["kind"] == "Deployment"]:
            own = deployment["spec"]["template"]["metadata"]["labels"]
            assert any(selects(selector, own) for _, selector in found)
        for where, selector in found:
            assert not selects(selector, labels), f"{overlay}: {where} selects KServe's pods"
        # ...and would select the predictor's pods if they carried the sidecars' component.
        collide = labels | {"app.kubernetes.io/component": "explainer"}
        assert any(selects(selector, collide) for _, selector in found), overlay

"""Kubernetes manifests: every overlay renders, validates against the Kubernetes JSON schemas,
keeps the security and probe contract, and its alerts and dashboard read real metrics."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from limelight.api.server import LIVENESS_SERVICE
from limelight.settings import Settings, unknown_variables
from tests.deploy.crd_schemas import CRD_SCHEMAS
from tests.deploy.deploy_support import (
    KUBERNETES_VERSION,
    KUBERNETES_VERSIONS,
    OVERLAYS,
    REPO,
    dashboard,
    dashboard_exprs,
    drain_timing_problems,
    exported_metric_families,
    exported_metric_names,
    find,
    kustomize_command,
    pod_templates,
    promql_metric_names,
    render,
    rule_exprs,
    rule_groups,
    selects,
)

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(
    kustomize_command() is None,
    reason="needs `kubectl` (built-in kustomize) or `kustomize` on PATH to render k8s/",
)


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(OVERLAYS[request.param])


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(path) for name, path in OVERLAYS.items()}


def _config(objects: list[dict[str, Any]]) -> dict[str, str]:
    return dict(find(objects, "ConfigMap", "limelight-config")["data"])


def _container(objects: list[dict[str, Any]], deployment: str, name: str) -> dict[str, Any]:
    spec = find(objects, "Deployment", deployment)["spec"]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == name]
    return dict(container)


def _settings(config: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings as the pod sees them: the ConfigMap's keys as the only LIMELIGHT_* variables."""
    for key in [k for k in os.environ if k.startswith("LIMELIGHT_")]:
        monkeypatch.delenv(key)
    for key, value in config.items():
        monkeypatch.setenv(key, value)
    return Settings()


def _validate(obj: dict[str, Any], version: str) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        jsonschema.Draft202012Validator(CRD_SCHEMAS[key]).validate(obj)
    else:
        kubernetes_validate.validate(obj, version, strict=True)


# --- rendering and schemas ----------------------------------------------------------------------


def test_overlays_render_unique_namespaced_objects(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    name, objects = overlay
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys)), f"{name}: duplicate objects"
    assert {o["metadata"].get("namespace") for o in objects} == {"limelight"}
    kinds = {o["kind"] for o in objects}
    assert {
        "Deployment",
        "Service",
        "ConfigMap",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ServiceMonitor",
        "PrometheusRule",
    } <= kinds
    if name == "redis-workers":
        # KEDA owns the worker pool's HPA; a second HPA on the same Deployment would fight it.
        assert "ScaledObject" in kinds and "HorizontalPodAutoscaler" not in kinds


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_matches_the_kubernetes_schema(
    overlay: tuple[str, list[dict[str, Any]]], version: str
) -> None:
    """Strict schemas (unknown fields rejected); CRD kinds against crd_schemas.py."""
    _, objects = overlay
    for obj in objects:
        _validate(obj, version)


def test_schema_validation_rejects_broken_objects(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The validators above can fail: a typo'd field, a wrong type, a bad CRD field."""
    objects = rendered["base"]
    deployment = copy.deepcopy(find(objects, "Deployment", "limelight"))
    deployment["spec"]["template"]["spec"]["containers"][1]["readinesProbe"] = {"grpc": {}}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment, KUBERNETES_VERSION)
    deployment = copy.deepcopy(find(objects, "Deployment", "limelight"))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment, KUBERNETES_VERSION)
    service = copy.deepcopy(find(objects, "Service", "limelight"))
    service["spec"]["ports"][0]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(service, KUBERNETES_VERSION)
    monitor = copy.deepcopy(find(objects, "ServiceMonitor", "limelight"))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        _validate(monitor, KUBERNETES_VERSION)
    rule = copy.deepcopy(find(objects, "PrometheusRule", "limelight"))
    rule["spec"]["groups"][1]["rules"][0]["for"] = "15 minutes"
    with pytest.raises(jsonschema.ValidationError):
        _validate(rule, KUBERNETES_VERSION)


# --- pod contract ---------------------------------------------------------------------------------


def test_pods_are_locked_down(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """Non-root, read-only root FS, no capabilities, no privilege escalation, seccomp, limits."""
    _, objects = overlay
    templates = list(pod_templates(objects))
    assert templates
    for where, spec in templates:
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True, where
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert spec["automountServiceAccountToken"] is False, where
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            label = f"{where}/{c['name']}"
            assert sc["runAsNonRoot"] is True, label
            assert sc["readOnlyRootFilesystem"] is True, label
            assert sc["allowPrivilegeEscalation"] is False, label
            assert sc["capabilities"] == {"drop": ["ALL"]}, label
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), label
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), label


def test_every_limelight_variable_names_a_setting(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    """The settings ignore a LIMELIGHT_* variable that names no setting (the sidecar warns at
    its start, in a log nobody reads during a rollout): a misspelt key in a ConfigMap or a
    container's env would silently leave its setting at the default."""
    _, objects = overlay
    names = {key: "" for key in _config(objects)}
    for _, spec in pod_templates(objects):
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            names.update({e["name"]: "" for e in c.get("env", [])})
    assert any(name.startswith("LIMELIGHT_") for name in names)
    assert list(unknown_variables(names)) == []


def test_limelight_containers_write_only_to_mounted_volumes(
    overlay: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a read-only root FS every path Limelight writes must be a writable mount, and the
    model is mounted read-only where LIMELIGHT_MODEL_DIR points."""
    _, objects = overlay
    config = _config(objects)
    settings = _settings(config, monkeypatch)
    for where, spec in pod_templates(objects):
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            if not c["image"].startswith("registry.example.com/limelight/"):
                continue
            # A literal value must agree with the ConfigMap (one from a Secret is checked by the
            # overlay's own test).
            env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
            assert env.get("LIMELIGHT_JOBS", settings.jobs) == settings.jobs
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            model = mounts[str(settings.model_dir)]
            assert model.get("readOnly") is True, where
            assert "persistentVolumeClaim" in volumes[model["name"]]

            def writable(path: Path, mounts: dict[str, dict[str, Any]] = mounts) -> bool:
                return any(
                    path.is_relative_to(mp) and not m.get("readOnly", False)
                    for mp, m in mounts.items()
                )

            for path in (settings.cache_dir, settings.resolved_jobs_db(), Path("/tmp")):
                assert writable(path), f"{where}/{c['name']}: {path} is not on a writable volume"


def test_sidecar_uses_native_grpc_probes_and_drains_within_grace(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, objects = overlay
    config = _config(objects)
    sidecar = _container(objects, "limelight", "limelight")
    port = int(config["LIMELIGHT_PORT"])
    # Probes use the plaintext health-only port: kubelet's gRPC probes cannot speak TLS.
    health = int(config["LIMELIGHT_HEALTH_PORT"])
    assert health != port
    # Readiness asks for overall health: NOT_SERVING while loading, while the default method
    # cannot be served, and while draining.
    assert sidecar["readinessProbe"]["grpc"] == {"port": health}
    # Start-up and liveness ask for the service that stays SERVING while the pod is only out of
    # rotation: asking for "" would restart, after the start-up budget, a pod whose default
    # method cannot be served yet (no head beside the model), which a restart cannot mend.
    for probe in ("startupProbe", "livenessProbe"):
        assert sidecar[probe]["grpc"] == {"port": health, "service": LIVENESS_SERVICE}, probe
    # Start-up must tolerate a slow model load; liveness may not kill a warming pod.
    startup = sidecar["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {
        "grpc": port,
        "metrics": int(config["LIMELIGHT_METRICS_PORT"]),
        "health": health,
    }
    assert config["LIMELIGHT_HOST"] == "0.0.0.0"
    spec = find(objects, "Deployment", "limelight")["spec"]["template"]["spec"]
    # Connections age out, so the Service spreads clients over new and remaining pods, and every
    # connection to a terminating pod is renewed (elsewhere) during its preStop sleep, before the
    # drain refuses work; the drain then fits in the rest of the grace period.
    assert (
        drain_timing_problems(
            pre_stop_s=sidecar["lifecycle"]["preStop"]["sleep"]["seconds"],
            termination_grace_s=spec["terminationGracePeriodSeconds"],
            grace_period_s=float(config["LIMELIGHT_GRACE_PERIOD_S"]),
            connection_age_s=float(config["LIMELIGHT_MAX_CONNECTION_AGE_S"]),
        )
        == []
    )


def test_drain_timing_check_can_fail() -> None:
    assert drain_timing_problems(15, 40, 20, 10) == []
    assert len(drain_timing_problems(15, 40, 20, 30)) == 1  # the age outlasts the sleep
    assert len(drain_timing_problems(15, 30, 20, 10)) == 1  # the drain outlasts the grace
    assert len(drain_timing_problems(15, 40, 20, 0)) == 1  # connections never age out


def test_service_network_policy_and_pdb_select_the_pod(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, objects = overlay
    deployment = find(objects, "Deployment", "limelight")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    containers = deployment["spec"]["template"]["spec"]["containers"]
    named_ports = {p["name"] for c in containers for p in c.get("ports", [])}

    def selects(selector: dict[str, str]) -> bool:
        return all(pod_labels.get(k) == v for k, v in selector.items())

    service = find(objects, "Service", "limelight")
    assert selects(service["spec"]["selector"])
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"grpc", "metrics"}
    assert selects(
        find(objects, "PodDisruptionBudget", "limelight")["spec"]["selector"]["matchLabels"]
    )
    assert deployment["spec"]["replicas"] > 1  # a PDB with minAvailable 1 needs a spare
    policy = find(objects, "NetworkPolicy", "limelight")["spec"]
    assert selects(policy["podSelector"]["matchLabels"])
    assert policy["policyTypes"] == ["Ingress"]
    policy_ports = {p["port"] for rule in policy["ingress"] for p in rule["ports"]}
    assert policy_ports <= named_ports
    metrics_rule = [
        r for r in policy["ingress"] if {"port": "metrics", "protocol": "TCP"} in r["ports"]
    ]
    assert metrics_rule[0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    monitor = find(objects, "ServiceMonitor", "limelight")["spec"]
    assert all(
        service["metadata"]["labels"].get(k) == v
        for k, v in monitor["selector"]["matchLabels"].items()
    )
    assert monitor["endpoints"][0]["port"] == "metrics"


def test_the_classifier_port_has_a_service_the_network_policy_admits(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    """The classifier keeps serving its clients from inside the Limelight pod: a Service of its
    own selects the pod on the classifier container's port, the NetworkPolicy admits Limelight's
    clients to that port, and the ServiceMonitor does not scrape it as Limelight."""
    _, objects = overlay
    deployment = find(objects, "Deployment", "limelight")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    classifier = _container(objects, "limelight", "classifier")
    classifier_ports = {p["name"]: p["containerPort"] for p in classifier["ports"]}
    service = find(objects, "Service", "classifier")
    assert selects(service["spec"]["selector"], pod_labels)
    targets = {p["targetPort"] for p in service["spec"]["ports"]}
    assert targets and targets <= set(classifier_ports)
    assert {p["port"] for p in service["spec"]["ports"]} == {classifier_ports[t] for t in targets}
    # Not through Limelight's own Service (its ports are the sidecar's).
    limelight = find(objects, "Service", "limelight")
    assert not {p["targetPort"] for p in limelight["spec"]["ports"]} & set(classifier_ports)
    policy = find(objects, "NetworkPolicy", "limelight")["spec"]
    assert selects(policy["podSelector"], pod_labels)
    (client_rule,) = [
        r for r in policy["ingress"] if {"port": "grpc", "protocol": "TCP"} in r["ports"]
    ]
    for target in targets:
        assert {"port": target, "protocol": "TCP"} in client_rule["ports"], target
    monitor = find(objects, "ServiceMonitor", "limelight")["spec"]["selector"]
    assert not selects(monitor, service["metadata"]["labels"])


def test_autoscaled_deployments_leave_the_replica_count_to_the_autoscaler(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    """A Deployment that KEDA's HPA scales states no `replicas`: each `kubectl apply` would set
    it again, resizing the pool behind the autoscaler's back."""
    _, objects = overlay
    targets = [
        o["spec"]["scaleTargetRef"]["name"]
        for o in objects
        if o["kind"] in {"ScaledObject", "HorizontalPodAutoscaler"}
    ]
    for name in targets:
        assert "replicas" not in find(objects, "Deployment", name)["spec"], name


def _redis_bytes(value: str) -> int:
    """Redis's memory units: k/m/g are powers of 1000, kb/mb/gb of 1024."""
    units = {"": 1, "k": 10**3, "kb": 2**10, "m": 10**6, "mb": 2**20, "g": 10**9, "gb": 2**30}
    match = re.fullmatch(r"(\d+)([kmg]b?)?", value.lower())
    assert match, value
    return int(match.group(1)) * units[match.group(2) or ""]


def _kubernetes_bytes(quantity: str) -> int:
    units = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 10**3, "M": 10**6, "G": 10**9}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|k|M|G)?", quantity)
    assert match, quantity
    return int(match.group(1)) * units[match.group(2) or ""]


def test_redis_refuses_writes_before_it_reaches_its_memory_limit(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """With noeviction and a maxmemory, a full Redis answers writes with OOM, which Limelight
    turns into RESOURCE_EXHAUSTED for new jobs and keeps every queued one. Without a maxmemory
    (0: unlimited) it grows until the kubelet kills it at the container's limit; at the limit,
    the append-only file's rewrite (a fork whose pages are copied as Redis writes) would not
    fit."""
    redis = _container(rendered["redis-workers"], "limelight-redis", "redis")
    args = redis["args"]
    options = {args[i]: args[i + 1] for i in range(0, len(args), 2)}
    assert all(key.startswith("--") for key in options), args
    assert options["--maxmemory-policy"] == "noeviction"
    assert options["--appendonly"] == "yes"
    maxmemory = _redis_bytes(options["--maxmemory"])
    limit = _kubernetes_bytes(redis["resources"]["limits"]["memory"])
    assert 0.5 * limit <= maxmemory <= 0.8 * limit, (maxmemory, limit)
    assert _redis_bytes("384mb") == 384 * 2**20 and _redis_bytes("1g") == 10**9
    assert _kubernetes_bytes("512Mi") == 512 * 2**20


def redis_policy_selector(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(find(objects, "NetworkPolicy", "limelight-redis")["spec"]["podSelector"])


def test_redis_workers_overlay_wires_queue_workers_and_keda(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["redis-workers"]
    config = _config(objects)
    redis_service = find(objects, "Service", "limelight-redis")
    assert config["LIMELIGHT_JOBS"] == (
        f"redis://{redis_service['metadata']['name']}:{redis_service['spec']['ports'][0]['port']}/0"
    )
    assert config["LIMELIGHT_JOB_WORKERS"] == "0"
    worker = _container(objects, "limelight-worker", "worker")
    assert worker["args"] == ["worker", "--metrics-port", config["LIMELIGHT_METRICS_PORT"]]
    assert worker["image"] == _container(objects, "limelight", "limelight")["image"]
    assert {"name": "LIMELIGHT_JOB_WORKERS", "value": "1"} in worker["env"]
    scaled = find(objects, "ScaledObject", "limelight-worker")["spec"]
    assert scaled["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "limelight-worker",
    }
    assert scaled["minReplicaCount"] >= 1
    assert scaled["maxReplicaCount"] > scaled["minReplicaCount"]
    # The queue triggers read the stream and consumer group the Redis backend really uses.
    from limelight.jobs.redis_backend import GROUP, Keys

    redis_address = (
        f"{redis_service['metadata']['name']}.{redis_service['metadata']['namespace']}"
        f".svc.cluster.local:{redis_service['spec']['ports'][0]['port']}"
    )
    queue = [t for t in scaled["triggers"] if t["type"] == "redis-streams"]
    assert {
        ("lagCount" in t["metadata"], "pendingEntriesCount" in t["metadata"]) for t in queue
    } == {
        (True, False),
        (False, True),
    }
    assert config["LIMELIGHT_JOBS_QUEUE"] == Settings.model_fields["jobs_queue"].default
    for trigger in queue:
        meta = trigger["metadata"]
        assert meta["stream"] == Keys(config["LIMELIGHT_JOBS_QUEUE"]).stream
        assert meta["consumerGroup"] == GROUP
        assert meta["address"] == redis_address and meta["databaseIndex"] == "0"
    # Written out, not KEDA's default: KEDA 2.17.0 refuses the fallback otherwise.
    assert [t.get("metricType") for t in queue] == ["AverageValue"] * 2
    (cpu,) = [t for t in scaled["triggers"] if t["type"] == "cpu"]
    assert cpu["metricType"] == "Utilization"
    assert "cpu" in worker["resources"]["requests"]  # utilisation needs a request
    # KEDA's operator (its own namespace) may reach Redis to read the stream.
    keda_policy = find(objects, "NetworkPolicy", "limelight-redis-keda")["spec"]
    assert keda_policy["podSelector"] == redis_policy_selector(objects)
    assert keda_policy["ingress"][0]["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "keda"}
    }
    # Only Limelight pods may reach Redis.
    redis_policy = find(objects, "NetworkPolicy", "limelight-redis")["spec"]
    assert redis_policy["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "limelight"}}}
    ]
    # The base ServiceMonitor also scrapes the workers' headless Service.
    monitor = find(objects, "ServiceMonitor", "limelight")["spec"]["selector"]["matchLabels"]
    worker_service = find(objects, "Service", "limelight-worker")
    assert all(worker_service["metadata"]["labels"].get(k) == v for k, v in monitor.items())
    # Redis is not scraped as if it were Limelight.
    assert redis_service["metadata"]["labels"]["app.kubernetes.io/name"] != "limelight"


def test_a_keda_fallback_needs_an_explicit_average_value_trigger(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """KEDA 2.17.0's admission webhook refuses a ScaledObject with a fallback unless a trigger
    other than cpu or memory says ``metricType: AverageValue`` (kedacore/keda#6696): the
    schema holds the manifests to it, and can fail."""
    for name in ("redis-workers", "managed-redis"):
        scaled = find(rendered[name], "ScaledObject", "limelight-worker")
        assert "fallback" in scaled["spec"]
        _validate(scaled, KUBERNETES_VERSION)
        implicit = copy.deepcopy(scaled)
        for trigger in implicit["spec"]["triggers"]:
            if trigger["type"] != "cpu":
                del trigger["metricType"]
        with pytest.raises(jsonschema.ValidationError, match="contain"):
            _validate(implicit, KUBERNETES_VERSION)
        del implicit["spec"]["fallback"]
        _validate(implicit, KUBERNETES_VERSION)


def test_alerts_tell_sidecars_from_workers_by_the_labels_the_monitor_copies(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The ServiceMonitor copies the Services' name and component labels onto their series (as
    app_kubernetes_io_name, app_kubernetes_io_component): the target-down alert finds every
    Limelight target by the one, LimelightNotReady leaves workers out by the other."""
    objects = rendered["redis-workers"]
    monitor = find(objects, "ServiceMonitor", "limelight")["spec"]
    assert monitor["targetLabels"] == ["app.kubernetes.io/name", "app.kubernetes.io/component"]
    selected = [
        o
        for o in objects
        if o["kind"] == "Service"
        and all(
            o["metadata"]["labels"].get(k) == v
            for k, v in monitor["selector"]["matchLabels"].items()
        )
    ]
    components = {
        o["metadata"]["name"]: o["metadata"]["labels"]["app.kubernetes.io/component"]
        for o in selected
    }
    assert components == {"limelight": "explainer", "limelight-worker": "worker"}
    assert {o["metadata"]["labels"]["app.kubernetes.io/name"] for o in selected} == {"limelight"}
    rules = {
        r["alert"]: r["expr"]
        for g in rule_groups(objects)["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    assert 'up{app_kubernetes_io_name="limelight"}' in rules["LimelightTargetDown"]
    assert 'limelight_ready{app_kubernetes_io_component!="worker"}' in rules["LimelightNotReady"]


def test_the_queue_is_named_once_and_keda_reads_its_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second model on the same Redis names its queue in the ConfigMap only: the sidecars,
    the workers and KEDA's two stream triggers all follow it (kustomize replacements)."""
    from limelight.jobs.redis_backend import Keys

    tree = tmp_path / "k8s"
    shutil.copytree(REPO / "k8s", tree)
    patch = tree / "overlays" / "redis-workers" / "configmap-patch.yaml"
    text = patch.read_text()
    assert text.count("LIMELIGHT_JOBS_QUEUE: limelight\n") == 1
    patch.write_text(
        text.replace("LIMELIGHT_JOBS_QUEUE: limelight\n", "LIMELIGHT_JOBS_QUEUE: reviews\n")
    )
    for overlay in ("redis-workers", "managed-redis"):
        objects = render(tree / "overlays" / overlay)
        config = _config(objects)
        assert _settings(config, monkeypatch).jobs_queue == "reviews"
        scaled = find(objects, "ScaledObject", "limelight-worker")["spec"]
        streams = [
            t["metadata"]["stream"] for t in scaled["triggers"] if t["type"] == "redis-streams"
        ]
        assert streams == [Keys("reviews").stream] * 2, overlay


def documented_secret(guide: Path) -> tuple[set[str], str]:
    """The keys of the guide's `kubectl create secret generic limelight-redis` command, and the
    queue URL it stores."""
    text = guide.read_text("utf-8")
    command = text[text.index("create secret generic limelight-redis") :]
    command = command[: command.index("```")]
    keys = set(re.findall(r"--from-(?:literal|file)=([\w.]+)=", command))
    (url,) = re.findall(r"--from-literal=url='([^']+)'", command)
    return keys, url


def test_managed_redis_overlay_reads_the_queue_and_keda_credentials_from_one_secret(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["managed-redis"]
    # The in-cluster Redis (every object named after it but KEDA's credentials), and its
    # address in the ConfigMap, are gone.
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {n for n in names if n[1].startswith("limelight-redis")} == {
        ("TriggerAuthentication", "limelight-redis")
    }
    assert "LIMELIGHT_JOBS" not in _config(objects)
    secret = "limelight-redis"
    documented_keys, documented_url = documented_secret(REPO / "docs" / "deploy.md")
    used_keys = {"url"}
    for deployment, name in (("limelight", "limelight"), ("limelight-worker", "worker")):
        container = _container(objects, deployment, name)
        env = {e["name"]: e for e in container["env"]}
        assert env["LIMELIGHT_JOBS"]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "url"}
        spec = find(objects, "Deployment", deployment)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (mount,) = [
            m
            for m in container["volumeMounts"]
            if volumes[m["name"]].get("secret", {}).get("secretName") == secret
        ]
        assert mount["readOnly"] is True
        items = {i["key"]: i["path"] for i in volumes[mount["name"]]["secret"]["items"]}
        used_keys |= set(items)
        # The CA where the documented address's ssl_ca_certs looks for it, the password where
        # LIMELIGHT_JOBS_PASSWORD_FILE does.
        assert f"ssl_ca_certs={mount['mountPath']}/{items['ca.crt']}" in documented_url
        password_file = env["LIMELIGHT_JOBS_PASSWORD_FILE"]["value"]
        assert password_file == f"{mount['mountPath']}/{items['password']}"
    assert documented_url.startswith("rediss://")
    # The password is in the file only (the sidecar refuses it in both places).
    assert urlsplit(documented_url).password is None
    auth = find(objects, "TriggerAuthentication", secret)["spec"]["secretTargetRef"]
    assert {ref["name"] for ref in auth} == {secret}
    params = {ref["parameter"]: ref["key"] for ref in auth}
    assert {"username", "password", "ca"} <= set(params)
    assert "tls" not in params  # KEDA refuses TLS set both here and in the trigger
    used_keys |= set(params.values())
    assert used_keys <= documented_keys, "the guide's Secret lacks a key the manifests read"
    scaled = find(objects, "ScaledObject", "limelight-worker")["spec"]
    queue = [t for t in scaled["triggers"] if t["type"] == "redis-streams"]
    assert len(queue) == 2
    for trigger in queue:
        assert trigger["authenticationRef"] == {"name": secret}
        assert trigger["metadata"]["enableTLS"] == "true"
        assert ".svc.cluster.local" not in trigger["metadata"]["address"]


def test_gpu_overlay_requests_a_gpu_and_the_onnx_cuda_path(
    rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = rendered["gpu"]
    config = _config(objects)
    assert config["LIMELIGHT_DEVICE"] == "cuda"
    assert config["LIMELIGHT_RUNTIME"] == "onnx"
    sidecar = _container(objects, "limelight", "limelight")
    assert sidecar["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert sidecar["image"].endswith(":0.1.0-gpu")
    spec = find(objects, "Deployment", "limelight")["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    # The patch must not have dropped the base's hardening or probes.
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    assert sidecar["livenessProbe"]["grpc"] == {"port": 8086, "service": LIVENESS_SERVICE}
    # Settings accepts the overlay's values.
    settings = _settings(config, monkeypatch)
    assert (settings.device, settings.runtime) == ("cuda", "onnx")
    base = _container(rendered["base"], "limelight", "limelight")
    assert "nvidia.com/gpu" not in base["resources"]["limits"]


# --- alerts and dashboard -------------------------------------------------------------------------


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH: `make sysdeps` (apt-get install prometheus)")
    return promtool


def _rules_dir(tmp_path: Path, objects: list[dict[str, Any]]) -> Path:
    (tmp_path / "limelight-rules.yaml").write_text(yaml.safe_dump(rule_groups(objects)))
    shutil.copy(HERE / "promtool_rules_test.yaml", tmp_path / "promtool_rules_test.yaml")
    return tmp_path


def test_promtool_checks_the_alert_rules(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    promtool = _promtool()
    folder = _rules_dir(tmp_path, rendered["base"])
    result = subprocess.run(
        [promtool, "check", "rules", "limelight-rules.yaml"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = {
        r["alert"]
        for g in rule_groups(rendered["base"])["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    assert {
        "LimelightAttributionDrift",
        "LimelightExplainLatencyHigh",
        "LimelightJobBacklog",
        "LimelightJobsWithoutWorkers",
        "LimelightNotReady",
        "LimelightTargetDown",
    } <= alerts
    drift = [
        r
        for g in rule_groups(rendered["base"])["groups"]
        for r in g["rules"]
        if r.get("alert") == "LimelightAttributionDrift"
    ]
    assert drift[0]["for"] == "15m"


def test_promtool_unit_tests_fire_each_alert(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """promtool_rules_test.yaml feeds synthetic series: each alert fires when it should
    (after its `for`), and not below threshold."""
    promtool = _promtool()
    folder = _rules_dir(tmp_path, rendered["base"])
    result = subprocess.run(
        [promtool, "test", "rules", "promtool_rules_test.yaml"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_unit_tests_cover_every_alert(rendered: dict[str, list[dict[str, Any]]]) -> None:
    alerts = {
        r["alert"]
        for g in rule_groups(rendered["base"])["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    cases = yaml.safe_load((HERE / "promtool_rules_test.yaml").read_text())["tests"]
    tested = {t["alertname"] for case in cases for t in case.get("alert_rule_test", [])}
    assert alerts == tested


def test_rules_and_dashboard_read_only_exported_metrics(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    exported = exported_metric_names()
    dash = dashboard(rendered["base"])
    dash_exprs = dashboard_exprs(dash)
    assert len(dash_exprs) >= 15
    used_by_dashboard = set().union(*(promql_metric_names(e) for e in dash_exprs))
    used_by_rules = set().union(
        *(promql_metric_names(e) for e in rule_exprs(rule_groups(rendered["base"])))
    )
    assert used_by_dashboard - exported == set(), "dashboard queries unknown metrics"
    assert used_by_rules - exported == set(), "alert rules query unknown metrics"
    # The dashboard shows every metric family the sidecar exports (a new one needs a panel).
    not_shown = {
        family
        for family in exported_metric_families()
        if not any(u == family or u.startswith(family + "_") for u in used_by_dashboard)
    }
    assert not_shown == set(), "metric families without a dashboard panel"


def test_metric_name_extraction_sees_misspelt_metrics() -> None:
    """The check above can fail: a misspelt name is reported, recording rules are not names."""
    exported = exported_metric_names()
    expr = (
        "sum(rate(limelight_request_duration_second_count[5m])) + limelight:request_errors:ratio_5m"
    )
    assert promql_metric_names(expr) - exported == {"limelight_request_duration_second_count"}


def test_dashboard_configmap_is_picked_up_by_grafana(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    dash = dashboard(rendered["base"])
    assert dash["uid"] == "limelight-overview"
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "namespace"}
    ids = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            ids.append(p["id"])
            walk(p.get("panels", []))

    walk(dash["panels"])
    assert len(ids) == len(set(ids))

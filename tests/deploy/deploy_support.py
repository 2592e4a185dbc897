"""Helpers for the deployment tests: render kustomize overlays, list exported metric names,
pull PromQL out of the dashboard and the PrometheusRule."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from limelight.metrics import Metrics
from limelight_client._lanes import LANE_MAX_AGE_S

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
OVERLAYS: dict[str, Path] = {
    "base": K8S / "base",
    "redis-workers": K8S / "overlays" / "redis-workers",
    "managed-redis": K8S / "overlays" / "managed-redis",
    "gpu": K8S / "overlays" / "gpu",
}
KUBERNETES_VERSION = "1.32.0"
"""The Kubernetes version the manifests are validated against (and the oldest: 1.30.0)."""
KUBERNETES_VERSIONS = ("1.30.0", KUBERNETES_VERSION, "1.37.0")

_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "gauge": ("",),
    "unknown": ("",),
}


def exported_metric_names(registry: CollectorRegistry | None = None) -> set[str]:
    """Every sample name the sidecar can expose, from ``limelight.metrics.Metrics``.

    Labelled collectors have no samples until a child exists, so names come from each family's
    type (``_bucket``/``_sum``/``_count`` for histograms, ``_total`` for counters, ...) plus any
    samples already present.
    """
    registry = registry if registry is not None else CollectorRegistry()
    Metrics(registry)
    names: set[str] = set()
    for family in registry.collect():
        for suffix in _SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
        names.update(sample.name for sample in family.samples)
    return names


def exported_metric_families() -> set[str]:
    """Names of the metric families of ``limelight.metrics.Metrics`` (counters without
    ``_total``, info metrics without ``_info``, as prometheus_client names families)."""
    registry = CollectorRegistry()
    Metrics(registry)
    return {family.name for family in registry.collect()}


def live_metric_names(exposition: str) -> set[str]:
    """Sample names in a Prometheus text exposition (what a scrape really returns)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for f in text_string_to_metric_families(exposition) for s in f.samples}


def kustomize_command() -> list[str] | None:
    """``kubectl kustomize`` (kubectl embeds kustomize) or a standalone ``kustomize build``."""
    if kubectl := shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    return None


def render(path: Path) -> list[dict[str, Any]]:
    """Render one kustomization directory into its list of objects."""
    command = kustomize_command()
    if command is None:
        raise RuntimeError("neither kubectl nor kustomize is on PATH")
    out = subprocess.run(
        [*command, str(path)], check=True, capture_output=True, text=True, timeout=300
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(objects: Iterable[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of ``kind`` named ``name``."""
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} objects"
    return hits[0]


def pod_templates(objects: Iterable[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(``Kind/name``, pod spec) of every workload."""
    for o in objects:
        if o["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
            yield f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"]


def drain_timing_problems(
    pre_stop_s: float, termination_grace_s: float, grace_period_s: float, connection_age_s: float
) -> list[str]:
    """What is wrong with a pod's shutdown timing (docs/deploy.md, "Probes and shutdown").

    The preStop sleep must outlast the endpoints' update and every client connection's age
    (plus gRPC's 10 % jitter, a second for the endpoints, and the SDK's streamed single calls,
    kept for up to ``LANE_MAX_AGE_S`` on the connection they were opened on), so that by SIGTERM
    no client is left on the pod; the drain (``LIMELIGHT_GRACE_PERIOD_S``) must then fit in what
    is left of ``terminationGracePeriodSeconds``."""
    problems = []
    if connection_age_s <= 0:
        problems.append("LIMELIGHT_MAX_CONNECTION_AGE_S is off: clients stay on a draining pod")
    if 1.1 * connection_age_s + 1 + LANE_MAX_AGE_S > pre_stop_s:
        problems.append(
            f"preStop sleep {pre_stop_s} s < 1.1 x connection age {connection_age_s} s + 1 s"
            f" + {LANE_MAX_AGE_S} s (streamed single calls)"
        )
    if termination_grace_s <= pre_stop_s + grace_period_s:
        problems.append(
            f"terminationGracePeriodSeconds {termination_grace_s} <= preStop sleep {pre_stop_s}"
            f" + LIMELIGHT_GRACE_PERIOD_S {grace_period_s}"
        )
    return problems


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (a Service's plain map, or a LabelSelector with ``matchLabels``
    and ``matchExpressions``) selects an object with ``labels``."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not ok:
            return False
    return True


def pod_selectors(objects: Iterable[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, selector) of every selector that picks pods by their labels: Services,
    PodDisruptionBudgets, NetworkPolicies (the pods they protect), workloads and their topology
    spread constraints. Not a NetworkPolicy's ``from`` peers: those admit, they do not select."""
    for o in objects:
        where = f"{o['kind']}/{o['metadata']['name']}"
        spec = o.get("spec", {})
        if o["kind"] in {"Service", "PodDisruptionBudget"} and spec.get("selector"):
            yield where, spec["selector"]
        elif o["kind"] == "NetworkPolicy":
            yield where, spec["podSelector"]
        elif o["kind"] in {"Deployment", "StatefulSet", "DaemonSet"}:
            yield where, spec["selector"]
            for i, constraint in enumerate(
                spec["template"]["spec"].get("topologySpreadConstraints", [])
            ):
                yield f"{where} topologySpreadConstraints[{i}]", constraint["labelSelector"]


def dashboard(objects: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The Grafana dashboard JSON carried by the labelled ConfigMap."""
    maps = [
        o
        for o in objects
        if o["kind"] == "ConfigMap"
        and o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]
    assert len(maps) == 1, f"expected one dashboard ConfigMap, got {len(maps)}"
    (content,) = maps[0]["data"].values()
    return dict(json.loads(content))


def dashboard_exprs(dash: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard (panels, nested rows, template queries)."""
    exprs: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(dash.get("panels", []))
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if var.get("type") == "query" and isinstance(query, str):
            exprs.append(query)
    return exprs


_METRIC = re.compile(r"(?<![\w:])(limelight_[a-zA-Z0-9_]+)")


def promql_metric_names(expr: str) -> set[str]:
    """``limelight_*`` series names an expression reads (recording rules use ``limelight:``)."""
    return set(_METRIC.findall(expr))


def rule_groups(objects: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The PrometheusRule's spec as a Prometheus rule file (``groups: [...]``)."""
    rules = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert len(rules) == 1, f"expected one PrometheusRule, got {len(rules)}"
    return {"groups": rules[0]["spec"]["groups"]}


def rule_exprs(groups: dict[str, Any]) -> list[str]:
    return [rule["expr"] for group in groups["groups"] for rule in group["rules"]]

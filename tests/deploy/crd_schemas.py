"""Structural JSON schemas for the custom kinds the manifests use: the two Prometheus Operator
kinds, and KEDA's ScaledObject and TriggerAuthentication (keda.sh/v1alpha1, from KEDA's reference).

No Python package ships the monitoring.coreos.com CRD schemas for offline use, so these cover
the fields of ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1) that Limelight's
manifests set, written from the operator's API reference: types, required fields, allowed
values, and no unknown keys at the levels we use. They are narrower than the real CRDs on
purpose: a field outside this subset fails here and has to be checked and added deliberately.
"""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
    r"(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": _NAME,
        "namespace": _NAME,
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
    "additionalProperties": False,
}
_LABEL_SELECTOR = {
    "type": "object",
    "properties": {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
                "additionalProperties": False,
            },
        },
    },
    "additionalProperties": False,
}


def _resource(
    kind: str, spec: dict[str, Any], api_version: str = "monitoring.coreos.com/v1"
) -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        "additionalProperties": False,
    }


SERVICE_MONITOR = _resource(
    "ServiceMonitor",
    {
        "type": "object",
        "required": ["selector", "endpoints"],
        "properties": {
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": {
                "type": "object",
                "properties": {
                    "any": {"type": "boolean"},
                    "matchNames": {"type": "array", "items": {"type": "string"}},
                },
                "additionalProperties": False,
            },
            "jobLabel": {"type": "string"},
            "targetLabels": {"type": "array", "items": {"type": "string", "minLength": 1}},
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "port": {"type": "string"},
                        "targetPort": {"type": ["string", "integer"]},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": _DURATION,
                        "scrapeTimeout": _DURATION,
                        "honorLabels": {"type": "boolean"},
                    },
                    "additionalProperties": False,
                },
            },
        },
        "additionalProperties": False,
    },
)

PROMETHEUS_RULE = _resource(
    "PrometheusRule",
    {
        "type": "object",
        "properties": {
            "groups": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name", "rules"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "interval": _DURATION,
                        "limit": {"type": "integer"},
                        "rules": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["expr"],
                                "properties": {
                                    "record": {"type": "string"},
                                    "alert": {"type": "string"},
                                    "expr": {"type": ["string", "integer"]},
                                    "for": _DURATION,
                                    "keep_firing_for": _DURATION,
                                    "labels": _STRING_MAP,
                                    "annotations": _STRING_MAP,
                                },
                                "oneOf": [
                                    {"required": ["record"], "not": {"required": ["alert"]}},
                                    {"required": ["alert"], "not": {"required": ["record"]}},
                                ],
                                "additionalProperties": False,
                            },
                        },
                    },
                    "additionalProperties": False,
                },
            },
        },
        "additionalProperties": False,
    },
)

_INT = {"type": "integer", "minimum": 0}
_SCALING_RULES = {
    "type": "object",
    "properties": {
        "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "value", "periodSeconds"],
                "properties": {
                    "type": {"enum": ["Pods", "Percent"]},
                    "value": {"type": "integer", "minimum": 1},
                    "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800},
                },
                "additionalProperties": False,
            },
        },
    },
    "additionalProperties": False,
}

# KEDA's ScaledObject (keda.sh/v1alpha1), the fields of KEDA's reference that the manifests use.
SCALED_OBJECT = _resource(
    "ScaledObject",
    {
        "type": "object",
        "required": ["scaleTargetRef", "triggers"],
        "properties": {
            "scaleTargetRef": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "name": _NAME,
                    "envSourceContainerName": {"type": "string"},
                },
                "additionalProperties": False,
            },
            "pollingInterval": _INT,
            "cooldownPeriod": _INT,
            "initialCooldownPeriod": _INT,
            "idleReplicaCount": _INT,
            "minReplicaCount": _INT,
            "maxReplicaCount": _INT,
            "fallback": {
                "type": "object",
                "required": ["failureThreshold", "replicas"],
                "properties": {"failureThreshold": _INT, "replicas": _INT},
                "additionalProperties": False,
            },
            "advanced": {
                "type": "object",
                "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "behavior": {
                                "type": "object",
                                "properties": {
                                    "scaleUp": _SCALING_RULES,
                                    "scaleDown": _SCALING_RULES,
                                },
                                "additionalProperties": False,
                            },
                        },
                        "additionalProperties": False,
                    },
                },
                "additionalProperties": False,
            },
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["type", "metadata"],
                    "properties": {
                        "type": {"type": "string", "minLength": 1},
                        "name": {"type": "string"},
                        "metadata": _STRING_MAP,
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "useCachedMetrics": {"type": "boolean"},
                        "authenticationRef": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {
                                "name": {"type": "string"},
                                "kind": {
                                    "enum": [
                                        "TriggerAuthentication",
                                        "ClusterTriggerAuthentication",
                                    ]
                                },
                            },
                            "additionalProperties": False,
                        },
                    },
                    "additionalProperties": False,
                },
            },
        },
        "additionalProperties": False,
        # KEDA's admission webhook: a fallback needs a trigger other than cpu or memory whose
        # metric is an AverageValue. KEDA 2.17.0 reads an omitted metricType as no type
        # (kedacore/keda#6696, fixed in 2.17.1), so the manifests write it out.
        "if": {"required": ["fallback"]},
        "then": {
            "properties": {
                "triggers": {
                    "contains": {
                        "type": "object",
                        "required": ["type", "metricType"],
                        "properties": {
                            "type": {"not": {"enum": ["cpu", "memory"]}},
                            "metricType": {"const": "AverageValue"},
                        },
                    },
                },
            },
        },
    },
    api_version="keda.sh/v1alpha1",
)

# KEDA's TriggerAuthentication (keda.sh/v1alpha1): parameters from Secrets, as the manifests use.
TRIGGER_AUTHENTICATION = _resource(
    "TriggerAuthentication",
    {
        "type": "object",
        "properties": {
            "secretTargetRef": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["parameter", "name", "key"],
                    "properties": {
                        "parameter": {"type": "string", "minLength": 1},
                        "name": _NAME,
                        "key": {"type": "string", "minLength": 1},
                    },
                    "additionalProperties": False,
                },
            },
        },
        "additionalProperties": False,
    },
    api_version="keda.sh/v1alpha1",
)

CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE,
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
    ("keda.sh/v1alpha1", "TriggerAuthentication"): TRIGGER_AUTHENTICATION,
}

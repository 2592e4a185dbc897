"""Check rendered KServe objects against the ``kserve`` package's typed models.

Reads a JSON list of objects on stdin and prints a JSON list of problems: every key must be a
field of the typed model (``attribute_map``), recursively through kserve's and the Kubernetes
client's models, and every value must have the field's type. Run as a child process by
``test_kserve_overlay.py``: importing kserve registers protobuf names that tritonclient also
registers, so it stays out of the test process.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import kserve
import kubernetes.client

MODELS = {
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
    ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService",
}
_SCALARS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
    "object": (object,),
    "datetime": (str,),
    "date": (str,),
}


def _model(name: str) -> Any:
    for module in (kserve, kubernetes.client):
        if hasattr(module, name):
            return getattr(module, name)
    raise LookupError(f"no typed model {name}")


def check(value: Any, type_name: str, where: str, problems: list[str]) -> None:
    if type_name in _SCALARS:
        expected = _SCALARS[type_name]
        # bool is an int subclass: True is not an acceptable int here.
        wrong_bool = isinstance(value, bool) and bool not in expected and object not in expected
        if wrong_bool or not isinstance(value, expected):
            problems.append(f"{where}: {value!r} is not {type_name}")
        return
    if match := re.fullmatch(r"(?:list|List)\[(.+)\]", type_name):
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list")
            return
        for i, item in enumerate(value):
            check(item, match.group(1), f"{where}[{i}]", problems)
        return
    if match := re.fullmatch(r"(?:dict\((\w+), (.+)\)|Dict\[(\w+), (.+)\])", type_name):
        if not isinstance(value, dict):
            problems.append(f"{where}: expected a map")
            return
        for key, item in value.items():
            check(item, match.group(2) or match.group(4), f"{where}.{key}", problems)
        return
    model = _model(type_name)
    if not isinstance(value, dict):
        problems.append(f"{where}: expected an object ({type_name})")
        return
    fields = {json_key: attr for attr, json_key in model.attribute_map.items()}
    for key, item in value.items():
        if key not in fields:
            problems.append(f"{where}.{key}: not a field of {type_name}")
            continue
        check(item, model.openapi_types[fields[key]], f"{where}.{key}", problems)


def main() -> int:
    problems: list[str] = []
    for obj in json.load(sys.stdin):
        key = (obj.get("apiVersion"), obj.get("kind"))
        name = obj.get("metadata", {}).get("name", "?")
        if key not in MODELS:
            problems.append(f"{key[1]}/{name}: no kserve typed model for {key}")
            continue
        check(obj, MODELS[key], f"{key[1]}/{name}", problems)
    print(json.dumps(problems))
    return 0


if __name__ == "__main__":
    sys.exit(main())

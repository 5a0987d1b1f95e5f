"""The ``InferenceEndpointConfig`` CustomResourceDefinition, generated from the config model.

The CRD's ``openAPIV3Schema`` is ``dpd.config.load.json_schema()`` made *structural*, the form
Kubernetes requires: every ``$ref`` inlined (no ``$defs``), ``anyOf [X, null]`` turned into
``X`` with ``nullable: true``, ``exclusiveMinimum: N`` into ``minimum: N`` +
``exclusiveMinimum: true`` (OpenAPI v3.0), ``const`` into a one-value ``enum``, a
string-or-integer into ``x-kubernetes-int-or-string``, free-form maps into
``x-kubernetes-preserve-unknown-fields``. So local and cluster validation read the same model
and cannot drift.

NOTE: pydantic forbids unknown fields (``additionalProperties: false``). A structural schema
cannot say that; Kubernetes would silently *prune* a misspelt field. Each object therefore
keeps unknown fields (``x-kubernetes-preserve-unknown-fields``), and the operator's validating
webhook (``dpd.k8s.webhook``) rejects them with the very message ``dpd validate`` prints.
Cross-field rules the schema cannot express are repeated as CEL ``x-kubernetes-validations``
so a cluster without the webhook still refuses them.
"""

from __future__ import annotations

import copy
from typing import Any

from dpd.config.load import json_schema
from dpd.config.model import API_VERSION, KIND

GROUP, VERSION = API_VERSION.split("/")
PLURAL = "inferenceendpointconfigs"
SINGULAR = "inferenceendpointconfig"
SHORT_NAMES = ["iec", "dpd"]

# Keywords a structural schema may carry (OpenAPI v3.0 subset Kubernetes accepts).
_KEPT = {
    "type", "description", "properties", "items", "required", "enum", "default", "pattern",
    "minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength", "minItems", "maxItems",
    "additionalProperties", "nullable", "format",
}

# Cross-field rules of the model (its validators) the schema alone cannot state. Keyed by the
# path of the object they sit on; the messages are the model's own.
CEL_RULES: dict[tuple[str, ...], list[dict[str, str]]] = {
    ("pdSpec",): [
        {
            "rule": "!has(self.decodingSpec) || !has(self.decodingSpec.replicas) || self.decodingSpec.replicas >= 1",
            "message": "decodingSpec.replicas must be at least 1: every request is decoded",
        }
    ],
}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = copy.deepcopy(node)
    while "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**copy.deepcopy(target), **node}
    return node


def structural(schema: dict[str, Any], defs: dict[str, Any] | None = None, path: tuple[str, ...] = ()) -> dict[str, Any]:
    """``schema`` (pydantic's JSON schema) as a Kubernetes structural schema; pure."""
    defs = schema.get("$defs", {}) if defs is None else defs
    node = _resolve(schema, defs)
    is_nullable = False
    if "anyOf" in node:
        branches = node.pop("anyOf")
        non_null = [_resolve(b, defs) for b in branches if b.get("type") != "null"]
        is_nullable = len(non_null) < len(branches)
        types = sorted(b.get("type", "?") for b in non_null)
        if types == ["integer", "string"]:
            node["x-kubernetes-int-or-string"] = True
        elif len(non_null) == 1:
            node = {**non_null[0], **node}
        else:
            raise ValueError(f"{'.'.join(path) or '(root)'}: cannot express anyOf {types} structurally")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-"):
            out[key] = value
        elif key == "const":
            out["enum"] = [value]
        elif key == "exclusiveMinimum" and not isinstance(value, bool):
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "properties":
            out["properties"] = {name: structural(sub, defs, (*path, name)) for name, sub in value.items()}
        elif key == "items":
            out["items"] = structural(value, defs, path)
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out["additionalProperties"] = structural(value, defs, path)
        elif key == "default":
            if value is not None:
                out["default"] = value
        elif key in _KEPT:
            out[key] = value
    if is_nullable:
        out["nullable"] = True
    if out.get("type") == "object" and "additionalProperties" not in out:
        # Objects with properties keep unknown fields so the webhook can name them (the
        # module's NOTE); free-form maps (``dict[str, Any]``) keep everything.
        out["x-kubernetes-preserve-unknown-fields"] = True
    rules = CEL_RULES.get(path[-1:]) if path else None
    if rules:
        out["x-kubernetes-validations"] = copy.deepcopy(rules)
    return out


def spec_schema() -> dict[str, Any]:
    """The structural schema of ``spec`` (an ``EndpointSpec``)."""
    full = json_schema()
    return structural(full["$defs"]["EndpointSpec"], full["$defs"])


STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "x-kubernetes-preserve-unknown-fields": True,
    "description": "Written by the operator: observedGeneration, pools (replicas and readyReplicas per pool), conditions.",
}


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition manifest (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": SHORT_NAMES, "listKind": f"{KIND}List"},
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Model", "type": "string", "jsonPath": ".spec.modelName"},
                        {"name": "Threshold", "type": "integer", "jsonPath": ".spec.pdSpec.routingThreshold"},
                        {"name": "Prefill", "type": "string", "jsonPath": ".status.pools.prefill.summary"},
                        {"name": "Decode", "type": "string", "jsonPath": ".status.pools.decode.summary"},
                        {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type=='Ready')].status"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A disaggregated prefill/decode endpoint; the file `dpd serve` runs locally.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": STATUS_SCHEMA,
                            },
                        }
                    },
                }
            ],
        },
    }

"""The CRD: its schema is the config model's, structural, and judges configs as dpd validate does."""

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from dpd.config import ConfigError, load_config, parse_config
from dpd.k8s.crd import CEL_RULES, crd, spec_schema, structural
from dpd.k8s.webhook import admission_problems
from tests.unit.k8s_schema import errors

EXAMPLES = sorted(Path("examples").glob("*.yaml"))
K8S_VERSION = "1.33.0"
OPENAPI = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node, path="spec"):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from walk(node[key], f"{path}[{key}]")


def test_crd_is_a_valid_kubernetes_object():
    kubernetes_validate.validate(crd(), K8S_VERSION, strict=True)


def test_schema_is_structural():
    """Kubernetes' rules for structural schemas, checked on every node."""
    for path, node in walk(spec_schema()):
        assert not {"$ref", "$defs", "anyOf", "oneOf", "allOf", "const", "title"} & set(node), path
        is_free = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        assert "type" in node or is_free, f"{path}: no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


@pytest.mark.parametrize(
    "pydantic_schema, expected",
    [
        ({"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}, {"type": "string", "nullable": True}),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, {"x-kubernetes-int-or-string": True}),
        ({"type": "number", "exclusiveMinimum": 0}, {"type": "number", "minimum": 0, "exclusiveMinimum": True}),
        ({"const": "NixlConnector", "type": "string", "title": "C"}, {"enum": ["NixlConnector"], "type": "string"}),
        ({"type": "object", "additionalProperties": True}, {"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
        (
            {"type": "object", "additionalProperties": False, "properties": {"a": {"type": "integer", "default": 1}}},
            {"type": "object", "properties": {"a": {"type": "integer", "default": 1}}, "x-kubernetes-preserve-unknown-fields": True},
        ),
        (
            {"$defs": {"D": {"type": "object", "additionalProperties": {"type": "string"}}}, "$ref": "#/$defs/D"},
            {"type": "object", "additionalProperties": {"type": "string"}},
        ),
    ],
)
def test_structural_transformation(pydantic_schema, expected):
    assert structural(pydantic_schema) == expected


def test_nullable_ref_is_inlined():
    schema = {"$defs": {"Disk": {"type": "object", "properties": {"path": {"type": "string"}}}},
              "anyOf": [{"$ref": "#/$defs/Disk"}, {"type": "null"}], "default": None}
    out = structural(schema)
    assert out["nullable"] is True and out["properties"] == {"path": {"type": "string"}}


def test_cel_rules_sit_where_the_model_validates():
    schema = spec_schema()
    assert schema["properties"]["pdSpec"]["x-kubernetes-validations"] == CEL_RULES[("pdSpec",)]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_accepted_by_schema_and_webhook(example):
    document = yaml.safe_load(example.read_text())
    assert errors(OPENAPI, document) == []
    assert admission_problems(document) == []


def mutate(path, value):
    document = yaml.safe_load(Path("examples/minimal.yaml").read_text())
    node = document
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return document


# (field, bad value, the schema's complaint at that path)
INVALID = [
    ("spec.pdSpec.prefillSpec.replicas", -1, "spec.pdSpec.prefillSpec.replicas: -1 is less than the minimum of 0"),
    ("spec.pdSpec.prefillSpec.kvCacheGiB", 0, "less than or equal to the minimum of 0"),
    ("spec.pdSpec.router.picker", "random", "'random' is not one of ['least-outstanding', 'power-of-two', 'round-robin']"),
    ("spec.pdSpec.routingThreshold", "many", "'many' is not of type 'integer'"),
    ("spec.pdSpec.kvTransferSpec.backends", ["TCP"], "'TCP' is not one of"),
    ("spec.pdSpec.kvTransferSpec.connector", "LMCache", "'LMCache' is not one of ['NixlConnector']"),
    ("spec.maxModelLen", 8, "8 is less than the minimum of 16"),
    ("spec.pdSpec.prefillSpec.resources", {"requests": {"cpu": 1.5}}, "1.5 is not an integer or a string"),
]


@pytest.mark.parametrize("path, value, schema_message", INVALID, ids=[c[0] + "=" + repr(c[1]) for c in INVALID])
def test_invalid_configs_are_rejected_by_schema_and_webhook_like_dpd_validate(path, value, schema_message, tmp_path):
    document = mutate(path, value)
    schema_errors = errors(OPENAPI, document)
    assert any(schema_message in e for e in schema_errors), schema_errors
    # The webhook's messages are exactly `dpd validate`'s for the same file.
    file = tmp_path / "bad.yaml"
    file.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError) as exc:
        load_config(file)
    assert admission_problems(document) == exc.value.problems
    assert any(p.startswith(path) for p in exc.value.problems), exc.value.problems


@pytest.mark.parametrize(
    "path, value, expected",
    [
        ("spec.pdSpec.prefilSpec", {"replicas": 2},
         ["spec.pdSpec.prefilSpec: unknown field (check spelling; see `dpd validate --schema`)"]),
        ("spec.pdSpec.decodingSpec.replicas", 0,
         ["spec.pdSpec: Value error, decodingSpec.replicas must be at least 1: every request is decoded"]),
        ("spec.modelSourceConfig", {"modelSourceType": "hub"},
         ["spec.modelSourceConfig: Value error, modelLocation is required when modelSourceType is 'hub'"]),
    ],
)
def test_what_only_the_webhook_catches(path, value, expected):
    """Typos survive the schema (it keeps unknown fields so they are not pruned silently) and
    cross-field rules need code or CEL: the webhook answers with dpd validate's messages."""
    document = mutate(path, value)
    assert admission_problems(document) == expected
    with pytest.raises(ConfigError) as exc:
        parse_config(document)
    assert exc.value.problems == expected


def test_webhook_ignores_api_server_bookkeeping():
    document = yaml.safe_load(Path("examples/gpu-rdma.yaml").read_text())
    body = copy.deepcopy(document)
    body["metadata"].update(uid="u-1", resourceVersion="42", generation=3, managedFields=[{"manager": "kubectl"}])
    body["status"] = {"conditions": []}
    assert admission_problems(body) == []


def test_webhook_reports_autoscaling_mistakes_with_paths():
    document = mutate("spec.pdSpec.autoScalingSpec", {"decodingAutoScaling": {"maxReplicaCount": 4, "metric": "gpu_util"}})
    assert admission_problems(document) == [
        "spec.pdSpec.autoScalingSpec.decodingAutoScaling.metric: must be one of num_requests_running, kv_cache_usage, got 'gpu_util'"
    ]

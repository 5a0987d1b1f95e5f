"""Config loading and validation: every error names its field path and the allowed values."""

import pytest
from pydantic import ValidationError

from dpd.config import ConfigError, load_config, parse_config
from dpd.config.model import DEFAULT_ROUTING_THRESHOLD_TOKENS

EXAMPLES = ["examples/default.yaml", "examples/two-pools.yaml"]


def test_embedded_default_is_one_prefill_one_decode():
    config = load_config()
    pd = config.spec.pdSpec
    assert (pd.prefillSpec.replicas, pd.decodingSpec.replicas) == (1, 1)
    assert DEFAULT_ROUTING_THRESHOLD_TOKENS == 2048  # an omitted routingThreshold
    assert (pd.routingPolicy, pd.routingThreshold) == ("adaptive", 512)  # the adaptive policy's floor
    assert config.spec.modelSourceConfig.modelSourceType == "bundled"


def test_the_default_example_is_the_embedded_default():
    """README: examples/ holds the default `dpd serve` runs without a file."""
    assert load_config("examples/default.yaml") == load_config()


@pytest.mark.parametrize("path", EXAMPLES)
def test_examples_are_valid(path):
    assert load_config(path).kind == "InferenceEndpointConfig"


def test_reference_resource_fields_are_accepted():
    config = parse_config(
        {
            "apiVersion": "inference.sagemaker.aws.amazon.com/v1",
            "kind": "InferenceEndpointConfig",
            "metadata": {"name": "x", "namespace": "ns"},
            "spec": {
                "modelName": "m",
                "instanceType": "ml.p5.48xlarge",
                "pdSpec": {
                    "prefillSpec": {"replicas": 2, "args": ["--enforce-eager"], "nodeSelector": {"a": "b"}},
                    "decodingSpec": {"replicas": 3},
                    "routingThreshold": 0,
                    "autoScalingSpec": {"prefillAutoScaling": {"minReplicaCount": 1}},
                },
            },
        }
    )
    assert config.spec.pdSpec.prefillSpec.replicas == 2
    assert config.spec.pdSpec.routingThreshold == 0


@pytest.mark.parametrize(
    "spec, expected",
    [
        ({"pdSpec": {"prefillSpec": {"replicas": -1}}}, "spec.pdSpec.prefillSpec.replicas: Input should be greater than or equal to 0"),
        ({"pdSpec": {"decodingSpec": {"replicas": 0}}}, "decodingSpec.replicas must be at least 1"),
        ({"pdSpec": {"routingThreshold": -5}}, "spec.pdSpec.routingThreshold: Input should be greater than or equal to 0"),
        ({"pdSpec": {"routingThreshold": "high"}}, "spec.pdSpec.routingThreshold: Input should be a valid integer"),
        ({"pdSpec": {"router": {"picker": "random"}}},
         "spec.pdSpec.router.picker: Input should be 'least-outstanding', 'power-of-two' or 'round-robin'"),
        ({"pdSpec": {"kvTransferSpec": {"connector": "P2pNccl"}}},
         "spec.pdSpec.kvTransferSpec.connector: Input should be 'NixlConnector'"),
        ({"pdSpec": {"kvTransferSpec": {"bufferDevice": "tpu"}}},
         "spec.pdSpec.kvTransferSpec.bufferDevice: Input should be 'auto', 'cpu' or 'cuda'"),
        ({"pdSpec": {"kvTransferSpec": {"backends": []}}},
         "spec.pdSpec.kvTransferSpec.backends: Value error, at least one backend is required"),
        ({"pdSpec": {"kvCacheOffloadingSpec": {"disk": {"path": "rel/dir", "sizeGiB": 1}}}},
         "spec.pdSpec.kvCacheOffloadingSpec.disk.path: Value error, must be an absolute path"),
        ({"pdSpec": {"kvCacheOffloadingSpec": {"cpuGiB": -1}}},
         "spec.pdSpec.kvCacheOffloadingSpec.cpuGiB: Input should be greater than or equal to 0"),
        ({"pdSpec": {"prefillSpec": {"args": ["--port", "1"]}}}, "spec.pdSpec.prefillSpec.args: Value error, --port is set by dpd"),
        ({"pdSpec": {"prefilSpec": {}}}, "spec.pdSpec.prefilSpec: unknown field"),
        ({"modelSourceConfig": {"modelSourceType": "local"}}, "modelLocation is required when modelSourceType is 'local'"),
        ({"maxModelLen": 4}, "spec.maxModelLen: Input should be greater than or equal to 16"),
        ({"pdSpec": {"router": {"port": 70000}}}, "spec.pdSpec.router.port: Input should be less than or equal to 65535"),
        ({"pdSpec": {"router": {"decodeFirstTokenTimeoutS": 30}}},  # issue 16, finding 8
         "router.decodeFirstTokenTimeoutS (30s) must be shorter than kvTransferSpec.kvLeaseDurationS (30s)"),
        # issue 15: SLO classes partition prompt lengths
        ({"pdSpec": {"router": {"slo": {"classes": [{"name": "a", "maxPromptTokens": 9}, {"name": "a"}]}}}},
         "slo.classes: names must be unique"),
        ({"pdSpec": {"router": {"slo": {"classes": [{"name": "a", "maxPromptTokens": 9}, {"name": "b", "maxPromptTokens": 99}]}}}},
         "the last holds every longer prompt and sets none"),
        ({"pdSpec": {"router": {"slo": {"classes": [{"name": "a", "maxPromptTokens": 9}, {"name": "b", "maxPromptTokens": 5},
                                                    {"name": "c"}]}}}},
         "slo.classes: maxPromptTokens must increase"),
        ({"pdSpec": {"router": {"slo": {"tpotS": 0}}}}, "spec.pdSpec.router.slo.tpotS: Input should be greater than 0"),
        ({"pdSpec": {"router": {"slo": {"classes": [{"name": "Chat Class"}]}}}},
         "spec.pdSpec.router.slo.classes[0].name: String should match pattern"),
    ],
)
def test_invalid_configs_name_the_field(spec, expected):
    with pytest.raises(ConfigError) as info:
        parse_config({"kind": "InferenceEndpointConfig", "spec": spec})
    assert any(expected in p for p in info.value.problems), info.value.problems


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        parse_config({"spec": {"maxModelLen": 1, "pdSpec": {"routingThreshold": -1, "router": {"port": 0}}}})
    assert len(info.value.problems) == 3


@pytest.mark.parametrize(
    "data, expected",
    [
        ([1, 2], "(root): expected a mapping"),
        ({"kind": "Deployment"}, "kind: Input should be 'InferenceEndpointConfig'"),
        ({"apiVersion": "v2"}, "apiVersion: Input should be"),
        ({"metadata": {"name": "Bad_Name"}}, "metadata.name: String should match pattern"),
    ],
)
def test_invalid_top_level(data, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert any(expected in p for p in info.value.problems), info.value.problems


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed")
    with pytest.raises(ConfigError, match=r"\(yaml\)"):
        load_config(bad)


def test_config_is_immutable():
    config = load_config()
    with pytest.raises(ValidationError):
        config.spec.pdSpec.routingThreshold = 5  # type: ignore[misc]

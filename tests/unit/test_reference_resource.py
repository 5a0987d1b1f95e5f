"""An existing HyperPod InferenceEndpointConfig loads as is (issue 18): every field of the
reference CRD's schema (fixtures written by hand from it) validates and renders; each field
either does what it means or is reported once, by path, as accepted and not applied; a typo
still fails with its field path."""

from pathlib import Path

import pytest
import yaml

from dpd.config import ConfigError, parse_config
from dpd.config.reference import not_applied
from dpd.k8s.render import render
from dpd.models.bundled import ModelError, resolve_model

FIXTURES = Path("tests/unit/fixtures/hyperpod")
ALL = sorted(FIXTURES.glob("*.yaml"))

# The reference schema's fields (inference operator v3.2, InferenceEndpointConfig v1), by hand.
REFERENCE_FIELDS = [
    "InitialReplicaCount", "autoScalingSpec", "dataCapture", "dnsConfig", "endpointName", "instanceType",
    "instanceTypes", "intelligentRoutingSpec", "invocationEndpoint", "kubernetes", "kvCacheSpec", "loadBalancer",
    "maxDeployTimeInSeconds", "metrics", "modelName", "modelSourceConfig", "modelVersion", "nodeAffinity", "pdSpec",
    "replicas", "tags", "tlsConfig", "worker",
    "worker.args", "worker.command", "worker.environmentVariables", "worker.image", "worker.modelInvocationPort",
    "worker.modelVolumeMount", "worker.probes", "worker.requestLimits", "worker.resources", "worker.workingDir",
    "worker.requestLimits.maxConcurrentRequests", "worker.requestLimits.maxQueueSize",
    "worker.requestLimits.overflowStatusCode",
    "modelSourceConfig.modelSourceType", "modelSourceConfig.modelLocation", "modelSourceConfig.prefetchEnabled",
    "modelSourceConfig.s3Storage", "modelSourceConfig.fsxStorage", "modelSourceConfig.huggingFaceModel",
    "modelSourceConfig.huggingFaceModel.tokenSecretRef", "modelSourceConfig.huggingFaceModel.commitSHA",
    "tlsConfig.customCertificateConfig", "tlsConfig.tlsCertificateOutputS3Uri",
    "metrics.enabled", "metrics.metricsScrapeIntervalSeconds", "metrics.modelMetrics",
    "kvCacheSpec.enableL1Cache", "kvCacheSpec.enableL2Cache", "kvCacheSpec.l2CacheSpec", "kvCacheSpec.cacheConfigFile",
    "intelligentRoutingSpec.enabled", "intelligentRoutingSpec.routingStrategy", "intelligentRoutingSpec.autoScalingSpec",
    "loadBalancer.healthCheckPath", "loadBalancer.routingAlgorithm",
    "pdSpec.prefillSpec", "pdSpec.decodingSpec", "pdSpec.routingThreshold", "pdSpec.topologySpec", "pdSpec.autoScalingSpec",
    "pdSpec.prefillSpec.args", "pdSpec.prefillSpec.nodeSelector", "pdSpec.prefillSpec.replicas", "pdSpec.prefillSpec.resources",
    "pdSpec.topologySpec.availabilityZone", "pdSpec.topologySpec.placementGroup", "pdSpec.topologySpec.sameAZ",
    "pdSpec.autoScalingSpec.prefillAutoScaling", "pdSpec.autoScalingSpec.decodingAutoScaling",
]


def document(path):
    return yaml.safe_load(Path(path).read_text())


def has(doc, dotted):
    node = doc["spec"]
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def workers(objects, pool):
    return next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith(f"-{pool}"))


def container(objects, pool):
    return workers(objects, pool)["spec"]["template"]["spec"]["containers"][0]


def test_the_fixtures_cover_every_reference_field():
    docs = [document(p) for p in ALL]
    missing = [f for f in REFERENCE_FIELDS if not any(has(d, f) for d in docs)]
    assert not missing
    assert {d["spec"]["modelSourceConfig"]["modelSourceType"] for d in docs} >= {"s3", "fsx", "huggingface", "kubernetesVolume"}


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_every_fixture_validates_and_renders(path):
    doc = document(path)
    assert doc["apiVersion"] == "inference.sagemaker.aws.amazon.com/v1"
    config = parse_config(doc, str(path))
    objects = render(doc)
    assert {"Deployment", "Service"} <= {o["kind"] for o in objects}
    lines = not_applied(config)
    assert len(lines) == len(set(lines))  # each reported once
    assert all(": accepted, not applied: " in line and line.startswith("spec.") for line in lines)


def test_applied_fields_are_not_reported_and_ignored_ones_are():
    paths = {line.split(":")[0] for line in not_applied(parse_config(document(FIXTURES / "full-s3.yaml")))}
    for applied in ("spec.worker.image", "spec.worker.args", "spec.worker.environmentVariables", "spec.worker.resources",
                    "spec.worker.probes", "spec.worker.requestLimits", "spec.modelSourceConfig", "spec.instanceType",
                    "spec.metrics.enabled", "spec.loadBalancer.routingAlgorithm", "spec.intelligentRoutingSpec.routingStrategy",
                    "spec.kvCacheSpec.enableL1Cache", "spec.pdSpec.topologySpec.availabilityZone"):
        assert applied not in paths
    for ignored in ("spec.dataCapture", "spec.endpointName", "spec.worker.command", "spec.tlsConfig.customCertificateConfig",
                    "spec.kvCacheSpec.l2CacheSpec", "spec.pdSpec.topologySpec.placementGroup",
                    "spec.pdSpec.autoScalingSpec.prefillAutoScaling.prometheusTrigger"):
        assert ignored in paths


@pytest.mark.parametrize("path, value, where", [
    ("workr", {}, "spec.workr"),
    ("worker.requestLimit", {"maxConcurrentRequests": 4}, "spec.worker.requestLimit"),
    ("modelSourceConfig.s3Storage.bucket", "x", "spec.modelSourceConfig.s3Storage.bucket"),
    ("kvCacheSpec.enableL3Cache", True, "spec.kvCacheSpec.enableL3Cache"),
    ("pdSpec.prefillSpec.replica", 2, "spec.pdSpec.prefillSpec.replica"),
    ("intelligentRoutingSpec.routingStrategy", "random", "spec.intelligentRoutingSpec.routingStrategy"),
])
def test_a_typo_still_fails_with_its_field_path(path, value, where):
    doc = document(FIXTURES / "full-s3.yaml")
    node = doc["spec"]
    *parents, leaf = path.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    with pytest.raises(ConfigError) as error:
        parse_config(doc)
    assert any(p.startswith(where) for p in error.value.problems), error.value.problems


def test_s3_source_is_fetched_by_an_init_container():
    objects = render(document(FIXTURES / "full-s3.yaml"))
    pod = workers(objects, "prefill")["spec"]["template"]["spec"]
    fetch = next(c for c in pod["initContainers"] if c["name"] == "fetch-model")
    assert fetch["command"][:3] == ["aws", "s3", "sync"]
    assert "s3://my-model-bucket/llama-3-1-8b-instruct" in fetch["command"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/model"


def test_worker_section_reaches_the_pods():
    objects = render(document(FIXTURES / "full-s3.yaml"))
    c = container(objects, "decode")
    assert c["image"] == "public.ecr.aws/deep-learning-containers/vllm:0.32.0-gpu"
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_LOGGING_LEVEL"]["value"] == "INFO"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert c["args"][c["args"].index("--max-num-seqs") + 1] == "128"
    assert c["readinessProbe"]["periodSeconds"] == 10 and c["startupProbe"]["failureThreshold"] == 120
    selector = workers(objects, "decode")["spec"]["template"]["spec"]["nodeSelector"]
    assert selector["node.kubernetes.io/instance-type"] == "ml.g5.12xlarge"
    assert selector["topology.kubernetes.io/zone"] == "us-west-2a"
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["interval"] == "30s"


def test_request_limits_and_routing_become_dpds_own():
    router = parse_config(document(FIXTURES / "full-s3.yaml")).spec.pdSpec.router
    assert router.picker == "round-robin"  # intelligentRoutingSpec.routingStrategy: roundrobin
    assert (router.admission.prefill.maxInFlight, router.admission.decode.maxInFlight) == (32, 64)  # 32 per worker
    assert router.admission.decode.maxQueue == 64 and router.overflowStatusCode == 503
    assert parse_config(document(FIXTURES / "fsx.yaml")).spec.pdSpec.router.picker == "round-robin"  # loadBalancer
    assert parse_config(document(FIXTURES / "huggingface.yaml")).spec.pdSpec.router.picker == "least-outstanding"


def test_an_explicit_dpd_setting_wins_over_the_reference_one():
    doc = document(FIXTURES / "full-s3.yaml")
    doc["spec"]["pdSpec"]["router"] = {"picker": "power-of-two", "admission": {"decode": {"maxInFlight": 5}}}
    router = parse_config(doc).spec.pdSpec.router
    assert router.picker == "power-of-two" and router.admission.decode.maxInFlight == 5 and router.admission.prefill is None


def test_huggingface_source_token_and_revision():
    objects = render(document(FIXTURES / "huggingface.yaml"))
    c = container(objects, "prefill")
    assert c["args"][c["args"].index("--model") + 1] == "Qwen/Qwen3-8B"
    assert c["args"][c["args"].index("--revision") + 1] == "9c925d64d72725edaf899c6cb9c377fd0709d9c5"
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-secret", "key": "token"}


def test_fsx_source_is_a_static_persistent_volume():
    objects = render(document(FIXTURES / "fsx.yaml"))
    pv = next(o for o in objects if o["kind"] == "PersistentVolume")
    assert pv["spec"]["csi"]["driver"] == "fsx.csi.aws.com" and pv["spec"]["csi"]["volumeHandle"] == "fs-0123456789abcdef0"
    pvc = next(o for o in objects if o["kind"] == "PersistentVolumeClaim")
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"] and pvc["metadata"]["namespace"] == "models"
    c = container(objects, "decode")
    assert c["args"][c["args"].index("--model") + 1] == "/models/fsx/llama-3.1-70b-instruct"


def test_kubernetes_volume_source_mounts_the_named_volume():
    objects = render(document(FIXTURES / "kubernetes-volume.yaml"))
    pod = workers(objects, "decode")["spec"]["template"]["spec"]
    assert {"name": "model-weights", "persistentVolumeClaim": {"claimName": "mistral-weights"}} in pod["volumes"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/opt/ml/model/mistral-7b-instruct"


@pytest.mark.parametrize("name, message", [("full-s3", "does not fetch from S3"), ("fsx", "cluster volume"),
                                           ("kubernetes-volume", "cluster volume")])
def test_cluster_sources_are_a_clear_error_locally(name, message):
    config = parse_config(document(FIXTURES / f"{name}.yaml"))
    with pytest.raises(ModelError, match=message):
        resolve_model(config.spec.modelSourceConfig)


def test_tls_secret_is_mounted_and_probed_over_https():
    doc = document(FIXTURES / "full-s3.yaml")
    doc["spec"]["tlsConfig"] = {"secretName": "llm-tls"}
    objects = render(doc)
    router = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-router"))
    pod = router["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "llm-tls"}} in pod["volumes"]
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"

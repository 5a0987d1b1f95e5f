"""dpd render: every object validates against Kubernetes' schemas; goldens; what each object says.

Goldens live in tests/unit/golden/; regenerate them with ``DPD_UPDATE_GOLDEN=1``.
"""

import hashlib
import json
import os
import random
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from dpd.cli import main
from dpd.config import load_config
from dpd.k8s.autoscaling import RenderError, adapter_rules, parse_autoscaling, quantity
from dpd.k8s.render import config_hash, render, render_config, split_secrets, to_yaml
from dpd.k8s.webhook import admission_problems
from dpd.launch.plan import kv_transfer_config, plan_workers
from tests.unit.k8s_schema import errors

EXAMPLES = sorted(Path("examples").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden"
K8S_VERSION = "1.33.0"
DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
# prometheus-operator's ServiceMonitor CRD is not in kubernetes-validate. This is the subset of
# its monitoring.coreos.com/v1 schema for the fields dpd writes (required ones, types, enums).
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"enum": ["monitoring.coreos.com/v1"]},
        "kind": {"enum": ["ServiceMonitor"]},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object", "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
                },
                "endpoints": {"type": "array", "minItems": 1, "items": {"type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"},
                    "interval": DURATION,
                }}},
            },
        },
    },
}


# PrometheusRule (monitoring.coreos.com/v1): the subset of its schema for the fields dpd writes.
PROMETHEUS_RULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"enum": ["monitoring.coreos.com/v1"]},
        "kind": {"enum": ["PrometheusRule"]},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "additionalProperties": False, "properties": {"groups": {
            "type": "array", "items": {"type": "object", "required": ["name", "rules"], "additionalProperties": False, "properties": {
                "name": {"type": "string", "minLength": 1},
                "rules": {"type": "array", "items": {
                    "type": "object", "required": ["expr"], "additionalProperties": False, "properties": {
                        "alert": {"type": "string"}, "record": {"type": "string"},
                        "expr": {"type": "string", "minLength": 1},
                        "for": DURATION,
                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                    }}},
            }}}}},
    },
}
OPERATOR_SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR_SCHEMA, "PrometheusRule": PROMETHEUS_RULE_SCHEMA}


def validate(obj):
    """Against Kubernetes' own schema, or prometheus-operator's subset for its kinds."""
    if obj["kind"] in OPERATOR_SCHEMAS:
        assert errors(OPERATOR_SCHEMAS[obj["kind"]], obj) == []
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def rendered(example):
    return render(yaml.safe_load(Path(example).read_text()))


def golden_view(objects):
    """The objects as the goldens keep them: the dashboard's JSON (some 34 kB, the same in every
    render but for its uid, title and job) as its size and digest; test_observe.py checks it."""
    view = []
    for obj in objects:
        if obj["kind"] == "ConfigMap" and obj["metadata"]["labels"].get("grafana_dashboard") == "1":
            digests = {k: f"<dashboard JSON: {len(v)} bytes, sha256 {hashlib.sha256(v.encode()).hexdigest()[:16]}>"
                       for k, v in obj["data"].items()}
            obj = {**obj, "data": digests}
        view.append(obj)
    return view


def by_kind(objects, kind, name_suffix=""):
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, [o["metadata"]["name"] for o in found]
    return found[0]


def container(objects, pool):
    return by_kind(objects, "Deployment", f"-{pool}")["spec"]["template"]["spec"]["containers"][0]


def env(c):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_object_validates_against_kubernetes_schemas(example):
    objects = rendered(example)
    for obj in objects:
        validate(obj)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor", "ConfigMap", "Role",
            "PrometheusRule"} <= kinds


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_golden(example):
    text = to_yaml(golden_view(rendered(example)))
    golden = GOLDEN / f"render-{example.stem}.yaml"
    if os.environ.get("DPD_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"{golden} missing: run with DPD_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"render of {example} changed; if intended, regenerate with DPD_UPDATE_GOLDEN=1"


def shuffled(value, rng):
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: shuffled(v, rng) for k, v in items}
    return [shuffled(v, rng) for v in value] if isinstance(value, list) else value


def test_render_is_deterministic_whatever_the_key_order():
    document = yaml.safe_load(Path("examples/gpu-rdma.yaml").read_text())
    first = to_yaml(render(document))
    for seed in range(3):
        assert to_yaml(render(shuffled(document, random.Random(seed)))) == first


@pytest.mark.parametrize("pool, role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_workers_run_vllm_with_the_nixl_connector_and_their_role(pool, role):
    config = load_config("examples/minimal.yaml")
    c = container(rendered("examples/minimal.yaml"), pool)
    args = c["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    # The very connector config the local launcher gives the same pool.
    assert kv == kv_transfer_config(config, role, "cpu")
    assert kv["kv_connector"] == "NixlConnector" and kv["kv_role"] == role
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "nixl": 5600}
    assert env(c)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env(c)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert {"readinessProbe", "livenessProbe", "startupProbe"} <= set(c)


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_workers_drain_on_termination(pool):
    """A scaled-down or evicted worker finishes its in-flight requests: the preStop pause lets the
    router drop the terminating pod first, vLLM then drains on SIGTERM for the drain timeout, and
    the kubelet's grace period covers both."""
    document = yaml.safe_load(Path("examples/minimal.yaml").read_text())
    document["spec"]["pdSpec"].setdefault("router", {})["drainTimeoutS"] = 44.5
    template = by_kind(render(document), "Deployment", f"-{pool}")["spec"]["template"]["spec"]
    c = template["containers"][0]
    assert c["args"][c["args"].index("--shutdown-timeout") + 1] == "45"
    pause = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pause > 0 and template["terminationGracePeriodSeconds"] > pause + 45


def test_minimal_example_also_runs_locally():
    """The same file `dpd render` takes is one `dpd serve` runs: its local plan is sound."""
    config = load_config("examples/minimal.yaml")
    plans = plan_workers(config, "/models/smol", cores=[0, 1], python="py")
    assert [(p.name, p.kv_role) for p in plans] == [("prefill-0", "kv_producer"), ("decode-0", "kv_consumer")]
    assert len({p.side_channel_port for p in plans}) == 2
    assert main(["validate", "examples/minimal.yaml"]) == 0


def test_gpu_rdma_pods_request_devices_and_lock_memory():
    objects = rendered("examples/gpu-rdma.yaml")
    for pool in ("prefill", "decode"):
        c = container(objects, pool)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert env(c)["UCX_TLS"] == "rc,cuda_copy,cuda_ipc"
        assert "VLLM_CPU_KVCACHE_SPACE" not in env(c)
        pod = by_kind(objects, "Deployment", f"-{pool}")["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert "podAntiAffinity" in pod["affinity"]


def test_efa_example_uses_libfabric_and_requires_spreading():
    objects = rendered("examples/gpu-efa.yaml")
    c = container(objects, "decode")
    kv = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]
    assert env(c)["FI_PROVIDER"] == "efa"
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "8"
    assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32"
    pod = by_kind(objects, "Deployment", "-decode")["spec"]["template"]["spec"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in pod["affinity"]["podAntiAffinity"]


def test_each_pool_autoscales_on_its_own_metric_and_leaves_replicas_to_the_hpa():
    objects = rendered("examples/gpu-rdma.yaml")
    prefill, decode = by_kind(objects, "HorizontalPodAutoscaler", "-prefill"), by_kind(objects, "HorizontalPodAutoscaler", "-decode")
    assert prefill["spec"]["metrics"][0]["pods"]["metric"]["name"] == "dpd_vllm_num_requests_waiting"
    assert decode["spec"]["metrics"][0]["pods"]["metric"]["name"] == "dpd_vllm_kv_cache_usage"
    assert decode["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "800m"
    assert (prefill["spec"]["minReplicas"], prefill["spec"]["maxReplicas"]) == (2, 8)
    assert decode["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600
    assert "replicas" not in by_kind(objects, "Deployment", "-prefill")["spec"]
    served = {r["name"]["as"] for r in adapter_rules()["rules"]}
    assert {prefill["spec"]["metrics"][0]["pods"]["metric"]["name"], decode["spec"]["metrics"][0]["pods"]["metric"]["name"]} <= served
    # Without autoScalingSpec the pool's replicas are the Deployment's.
    assert by_kind(rendered("examples/minimal.yaml"), "Deployment", "-decode")["spec"]["replicas"] == 1


def test_workers_are_reachable_only_from_the_router_and_each_other():
    policy = by_kind(rendered("examples/minimal.yaml"), "NetworkPolicy", "-workers")["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    peers, metrics = policy["ingress"]
    assert peers["from"][0]["podSelector"]["matchExpressions"][0]["values"] == [
        "router", "prefill", "decode", "prefill-dedicated", "decode-dedicated"
    ]
    assert peers["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/instance": "smollm2-minimal"}
    assert metrics["ports"] == [{"port": "http", "protocol": "TCP"}]  # Prometheus: HTTP only, no NIXL


def test_secrets_leave_the_configmap_for_a_secret():
    objects = render_config(load_config("examples/minimal.yaml"), {"spec": {"pdSpec": {"router": {"adminKeySha256": "ab" * 32}}},
                                                                    "metadata": {"name": "smollm2-minimal"}})
    config_text = by_kind(objects, "ConfigMap", "-config")["data"]["config.yaml"]
    assert "ab" * 32 not in config_text
    assert yaml.safe_load(by_kind(objects, "Secret", "-secrets")["stringData"]["secrets.yaml"]) == {"adminKeySha256": "ab" * 32}
    router = by_kind(objects, "Deployment", "-router")["spec"]["template"]["spec"]
    assert {"name": "secrets", "secret": {"secretName": "smollm2-minimal-secrets"}} in router["volumes"]
    for obj in objects:
        validate(obj)
    assert not [o for o in rendered("examples/minimal.yaml") if o["kind"] == "Secret"]


def test_tenants_are_read_defensively_into_the_secret():
    document = {"spec": {"tenants": [{"name": "a", "apiKeySha256": ["ab" * 32]}], "pdSpec": {"router": {"adminKeySha256": "cd" * 32}}}}
    public, secrets = split_secrets(document)
    assert secrets == {"tenants": [{"name": "a", "apiKeySha256": ["ab" * 32]}], "adminKeySha256": "cd" * 32}
    assert "tenants" not in public["spec"] and public["spec"]["pdSpec"]["router"] == {}


def test_router_restarts_only_for_what_it_reads_at_start():
    public, _ = split_secrets(yaml.safe_load(Path("examples/minimal.yaml").read_text()))
    base = config_hash(public, {})
    public["spec"]["pdSpec"]["routingThreshold"] = 1
    public["spec"]["pdSpec"]["prefillSpec"]["replicas"] = 5
    assert config_hash(public, {}) == base
    public["spec"]["pdSpec"]["router"] = {"picker": "power-of-two"}
    assert config_hash(public, {}) != base
    public_minimal = split_secrets(yaml.safe_load(Path("examples/minimal.yaml").read_text()))[0]
    assert config_hash(public_minimal, {"adminKeySha256": "abababababababababababababababababababababababababababababababab"}) != base
    # what the router also reads once at start: the policy, tenants, the reference's routing and limits
    for path, value in ((("pdSpec", "routingPolicy"), "threshold"), (("tenants",), [{"name": "a"}]),
                        (("loadBalancer",), {"routingAlgorithm": "round_robin"}),
                        (("worker",), {"requestLimits": {"maxConcurrentRequests": 4}}),
                        (("pdSpec", "kvTransferSpec"), {"kvLeaseDurationS": 60})):
        changed = split_secrets(yaml.safe_load(Path("examples/minimal.yaml").read_text()))[0]
        node = changed["spec"]
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
        assert config_hash(changed, {}) != config_hash(public_minimal, {}), path


@pytest.mark.parametrize(
    "spec, problem",
    [
        ({"prefillAutoScaling": {"minReplicaCount": 1}},
         "spec.pdSpec.autoScalingSpec.prefillAutoScaling.maxReplicaCount: required field is missing"),
        ({"prefillAutoScaling": {"minReplicaCount": 4, "maxReplicaCount": 2}},
         "spec.pdSpec.autoScalingSpec.prefillAutoScaling.maxReplicaCount: must be >= minReplicaCount (4), got 2"),
        ({"decodeAutoScaling": {}},
         "spec.pdSpec.autoScalingSpec.decodeAutoScaling: unknown field; allowed: prefillAutoScaling, decodingAutoScaling"),
        ({"decodingAutoScaling": {"maxReplicaCount": 2, "targetValue": -1}},
         "spec.pdSpec.autoScalingSpec.decodingAutoScaling.targetValue: must be a number > 0, got -1"),
        ({"decodingAutoScaling": {"maxReplicaCount": 2, "metric": "num_requests_waiting"}},
         "spec.pdSpec.autoScalingSpec.decodingAutoScaling.metric: "
         "must be one of num_requests_running, kv_cache_usage, got 'num_requests_waiting'"),
    ],
)
def test_autoscaling_mistakes_name_the_field(spec, problem):
    config = load_config("examples/minimal.yaml")
    with pytest.raises(RenderError) as exc:
        parse_autoscaling(spec, {"prefill": config.spec.pdSpec.prefillSpec, "decode": config.spec.pdSpec.decodingSpec})
    assert problem in exc.value.problems


@pytest.mark.parametrize("value, expected", [(4, "4"), (0.8, "800m"), (20000.0, "20000"), (0.05, "50m")])
def test_quantity(value, expected):
    assert quantity(value) == expected


def test_cli_render_to_directory_and_crd(tmp_path, capsys):
    assert main(["render", "examples/gpu-efa.yaml", "-o", str(tmp_path)]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files[0] == "00-serviceaccount-llama-70b-efa-router.yaml" and "prometheus-adapter-rules.yaml" in files
    assert len(files) == len(rendered("examples/gpu-efa.yaml")) + 1
    capsys.readouterr()
    assert main(["crd"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["kind"] == "CustomResourceDefinition"
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: {pdSpec: {routingThreshold: -1}}\n")
    assert main(["render", str(bad)]) == 2


def test_the_image_holds_the_shim_where_worker_pods_look_for_it():
    """Worker pods put IMAGE_WORKER_SITE on PYTHONPATH; the Dockerfile puts the repo there."""
    from dpd.k8s.workers import IMAGE_WORKER_SITE

    workdir = next(line.split()[1] for line in Path("Dockerfile").read_text().splitlines() if line.startswith("WORKDIR"))
    assert IMAGE_WORKER_SITE.startswith(workdir + "/")
    assert (Path(IMAGE_WORKER_SITE[len(workdir) + 1:]) / "sitecustomize.py").is_file()


def with_tenants(example="examples/two-pools.yaml", name=None):
    """``example`` with tenant a owning prefill-1 and decode-1, and tenant b owning nothing."""
    document = yaml.safe_load(Path(example).read_text())
    if name:
        document["metadata"]["name"] = name
    pd = document["spec"]["pdSpec"]
    pd["prefillSpec"]["replicas"], pd["decodingSpec"]["replicas"] = 2, 3
    document["spec"]["tenants"] = [
        {"name": "a", "apiKeySha256": ["ab" * 32], "dedicatedWorkers": ["prefill-1", "decode-1"]},
        {"name": "b", "apiKeySha256": ["cd" * 32]},
    ]
    return document


def matches(selector, pod_labels):
    return all(pod_labels.get(k) == v for k, v in selector.items())


def test_a_tenants_dedicated_workers_are_a_deployment_and_service_of_their_own():
    """The cluster form of `dedicatedWorkers`: per pool, the tenant's count in its own Deployment
    behind its own Service (how the router's discovery tells whose pods are whose); the shared
    Deployment keeps the rest; no selector of one group matches another group's pods."""
    objects = render(with_tenants())
    for obj in objects:
        validate(obj)
    base = with_tenants()["metadata"]["name"]
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    assert {n: d["spec"].get("replicas") for n, d in deployments.items() if "router" not in n} == {
        f"{base}-prefill": 1, f"{base}-prefill-a": 1, f"{base}-decode": 2, f"{base}-decode-a": 1}
    pods = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deployments.items()}
    services = {o["metadata"]["name"]: o["spec"]["selector"] for o in objects if o["kind"] == "Service" and "selector" in o["spec"]}
    budgets = {o["metadata"]["name"]: o["spec"]["selector"]["matchLabels"] for o in objects if o["kind"] == "PodDisruptionBudget"}
    for group in (f"{base}-prefill", f"{base}-prefill-a", f"{base}-decode", f"{base}-decode-a"):
        for selectors in (services, budgets, {n: d["spec"]["selector"]["matchLabels"] for n, d in deployments.items()}):
            assert [n for n, labels in pods.items() if matches(selectors[group], labels)] == [group]
    assert pods[f"{base}-decode-a"]["dpd.dev/tenant"] == "a"
    # The workers' NetworkPolicy covers the dedicated pods too.
    policy = by_kind(objects, "NetworkPolicy", "-workers")["spec"]["podSelector"]["matchExpressions"][0]["values"]
    assert all(pods[g]["app.kubernetes.io/component"] in policy for g in pods if "router" not in g)


def test_only_the_shared_group_autoscales():
    document = with_tenants("examples/gpu-rdma.yaml")
    objects = render(document)
    targets = sorted(o["spec"]["scaleTargetRef"]["name"] for o in objects if o["kind"] == "HorizontalPodAutoscaler")
    assert targets == ["llama-8b-decode", "llama-8b-prefill"]
    assert by_kind(objects, "Deployment", "-decode-a")["spec"]["replicas"] == 1


def test_anti_affinity_spreads_a_pool_across_its_groups():
    objects = render(with_tenants())
    pods = {
        o["metadata"]["name"]: o["spec"]["template"]
        for o in objects if o["kind"] == "Deployment" and "router" not in o["metadata"]["name"]
    }
    for name, template in pods.items():
        pool = "prefill" if "-prefill" in name else "decode"
        affinity = template["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        spread = affinity["podAffinityTerm"]["labelSelector"]
        kept_apart = {n for n, t in pods.items() if selects(spread, t["metadata"]["labels"])}
        assert kept_apart == {n for n in pods if f"-{pool}" in n}, name


def selects(selector, pod_labels):
    expressions = selector.get("matchExpressions", [])
    assert all(e["operator"] == "In" for e in expressions)
    return matches(selector.get("matchLabels", {}), pod_labels) and all(pod_labels.get(e["key"]) in e["values"] for e in expressions)


def test_the_autoscalers_default_minimum_counts_shared_workers_only():
    document = with_tenants("examples/gpu-rdma.yaml")
    del document["spec"]["pdSpec"]["autoScalingSpec"]["decodingAutoScaling"]["minReplicaCount"]
    hpa = by_kind(render(document), "HorizontalPodAutoscaler", "-decode")
    assert hpa["spec"]["minReplicas"] == 3 - 1  # decode replicas 3, one of them tenant a's
    document["spec"]["tenants"][0]["dedicatedWorkers"] = ["prefill-0", "prefill-1"]
    with pytest.raises(RenderError, match="autoScalingSpec.prefillAutoScaling: every prefill worker is dedicated"):
        render(document)


def test_a_dedicated_pool_whose_service_name_is_too_long_is_refused_by_name():
    document = with_tenants(name="x" * 55)
    problem = ("tenants[a].dedicatedWorkers: the prefill Service '" + "x" * 55 + "-prefill-a' would be longer than 63 "
               "characters; shorten metadata.name or the tenant's name")
    with pytest.raises(RenderError) as raised:
        render(document)
    assert problem in raised.value.problems
    assert problem in admission_problems(document)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_router_rollouts_drain_streams(example):
    """The router pod pauses before SIGTERM (the Service stops sending first), then has the
    drain time plus a margin before the kubelet's SIGKILL (k8s/router_main drains for drainTimeoutS)."""
    objects = rendered(example)
    router = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-router"))
    pod = router["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    drain_s = load_config(example).spec.pdSpec.router.drainTimeoutS
    assert pod["terminationGracePeriodSeconds"] > int(container["lifecycle"]["preStop"]["exec"]["command"][1]) + drain_s


# -- Pod Security "restricted" (issue 16, finding 4) ----------------------------------------------
# The one exception, and why: RDMA (verbs) pins the KV buffers' memory, which needs IPC_LOCK.
RESTRICTED_EXCEPTIONS = {"IPC_LOCK": "RDMA workers: verbs locks (pins) registered memory"}


def restricted_problems(pod: dict) -> list[str]:
    """What keeps ``pod`` out of the Pod Security "restricted" profile (v1.30), beyond the named
    exceptions: the profile's checks on what dpd renders."""
    problems = []
    sc = pod.get("securityContext") or {}
    if (sc.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
        problems.append("pod: seccompProfile must be RuntimeDefault")
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= {"configMap", "emptyDir", "secret", "persistentVolumeClaim", "projected", "downwardAPI", "csi", "ephemeral"}:
            problems.append(f"volume {v['name']}: {kinds} not allowed")
    if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
        problems.append("pod: host namespaces")
    for c in [*pod.get("containers", []), *pod.get("initContainers", [])]:
        csc = c.get("securityContext") or {}
        if csc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{c['name']}: allowPrivilegeEscalation must be false")
        if not (csc.get("runAsNonRoot") or sc.get("runAsNonRoot")):
            problems.append(f"{c['name']}: runAsNonRoot")
        if (csc.get("runAsUser", sc.get("runAsUser")) or 0) == 0:
            problems.append(f"{c['name']}: runs as uid 0")
        caps = csc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{c['name']}: capabilities must drop ALL")
        for cap in caps.get("add") or []:
            if cap not in ("NET_BIND_SERVICE", *RESTRICTED_EXCEPTIONS):
                problems.append(f"{c['name']}: adds {cap}")
        if csc.get("privileged"):
            problems.append(f"{c['name']}: privileged")
    return problems


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_rendered_pod_meets_pod_security_restricted(example):
    objects = rendered(example)
    pods = [o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"]
    assert pods
    for pod in pods:
        problems = restricted_problems(pod)
        if any(v.get("hostPath") for v in pod.get("volumes") or []):
            # modelSourceType local: the model directory pre-staged on the node (read-only).
            problems = [p for p in problems if "hostPath" not in p]
        assert problems == [], problems
    workers = [o for o in objects if o["kind"] == "Deployment" and not o["metadata"]["name"].endswith("-router")]
    assert all(w["spec"]["template"]["spec"]["automountServiceAccountToken"] is False for w in workers)


def test_the_operator_pod_meets_pod_security_restricted():
    from dpd.k8s.install import operator_manifests

    (deployment,) = [o for o in operator_manifests("dpd-system") if o["kind"] == "Deployment"]
    assert restricted_problems(deployment["spec"]["template"]["spec"]) == []


# -- workers behind the router (issue 16, finding 1) ----------------------------------------------
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_workers_require_the_routers_key_and_talk_only_to_peers(example):
    objects = rendered(example)
    name = load_config(example).metadata.name
    key_ref = {"secretKeyRef": {"name": f"{name}-worker-key", "key": "key"}}
    for o in objects:
        if o["kind"] != "Deployment":
            continue
        (c,) = o["spec"]["template"]["spec"]["containers"]
        wanted = "DPD_WORKER_API_KEY" if o["metadata"]["name"].endswith("-router") else "VLLM_API_KEY"
        assert {e["name"]: e.get("valueFrom") for e in c["env"]}[wanted] == key_ref
        assert "api-key" not in json.dumps(c.get("args", []))  # never on a command line
    policy = by_kind(objects, "NetworkPolicy", "-workers")["spec"]
    prometheus = policy["ingress"][1]["from"][0]
    assert prometheus["namespaceSelector"] == {"matchLabels": {"dpd.dev/scrape": "true"}}  # not every namespace
    assert policy["egress"][0] == {"to": [{"podSelector": policy["ingress"][0]["from"][0]["podSelector"]}]}
    assert all("to" in rule or rule["ports"] == [{"port": 443, "protocol": "TCP"}] for rule in policy["egress"])


# -- monitoring: the dashboard for Grafana's sidecar, the alerts as a PrometheusRule (issue 15) --


def test_the_dashboard_ships_in_a_configmap_for_grafanas_sidecar():
    """One dashboard per endpoint: the sidecar's label, a file name and a uid of its own (a
    same-named endpoint elsewhere gets another), its router's job preselected — the job the
    ServiceMonitor gives the router Service's targets."""
    from dpd.k8s.monitoring import dashboard_uid, router_job
    from dpd.observe.dashboard import dashboard

    objects = rendered("examples/gpu-rdma.yaml")  # llama-8b in namespace inference
    config_map = by_kind(objects, "ConfigMap", "-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    (file_name, text), = config_map["data"].items()
    assert file_name == "dpd-inference-llama-8b.json"
    uid = dashboard_uid("llama-8b", "inference")
    assert json.loads(text) == dashboard(uid=uid, title="dpd: inference/llama-8b", job="llama-8b-router")
    assert len(uid) <= 40 and uid != dashboard_uid("llama-8b", "other") != dashboard_uid("llama-8b", None)
    router_service = by_kind(objects, "Service", "-router")
    assert router_service["metadata"]["name"] == router_job("llama-8b")
    assert router_service["metadata"]["labels"]["dpd.dev/metrics"] == "true"  # what the ServiceMonitor selects
    # kubectl apply keeps a copy in an annotation (256 kB for all of them).
    assert len(text) < 100_000


def test_the_alerts_ship_as_a_prometheus_rule_scoped_to_the_endpoint():
    from dpd.observe.alerts import alert_rules

    rule = by_kind(rendered("examples/gpu-rdma.yaml"), "PrometheusRule", "-alerts")
    assert rule["spec"]["groups"] == alert_rules(scope='job="llama-8b-router",namespace="inference"')
    expressions = [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]
    for expr in expressions:  # every series it reads is this endpoint's router's
        selectors = [part for part in expr.replace("(", " ").split() if part.startswith(("dpd_", "up{"))]
        assert selectors and all('{job="llama-8b-router",namespace="inference"' in s for s in selectors), expr
    without_namespace = by_kind(rendered("examples/minimal.yaml"), "PrometheusRule", "-alerts")  # no metadata.namespace
    assert any('dpd_worker_healthy{job="smollm2-minimal-router"}' in r["expr"]
               for group in without_namespace["spec"]["groups"] for r in group["rules"])


def test_metrics_disabled_renders_no_monitoring_objects():
    document = yaml.safe_load(Path("examples/minimal.yaml").read_text())
    document["spec"]["metrics"] = {"enabled": False}
    objects = render(document)
    assert not [o for o in objects if o["kind"] in ("ServiceMonitor", "PrometheusRule")]
    assert not [o for o in objects if o["metadata"]["name"].endswith("-dashboard")]


def test_a_router_port_on_the_clusters_metrics_port_is_refused_by_name():
    """Unset, router.metricsPort is 9090 on a cluster: a router on 9090 would give its Service two ports 9090."""
    document = yaml.safe_load(Path("examples/minimal.yaml").read_text())
    document["spec"].setdefault("pdSpec", {}).setdefault("router", {})["port"] = 9090
    with pytest.raises(RenderError, match="spec.pdSpec.router.port: 9090"):
        render(document)
    assert any("spec.pdSpec.router.port: 9090" in p for p in admission_problems(document))
    document["spec"]["pdSpec"]["router"]["metricsPort"] = 9091
    render(document)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_services_ports_are_distinct(example):
    for service in (o for o in render(yaml.safe_load(example.read_text())) if o["kind"] == "Service"):
        ports = [p["port"] for p in service["spec"]["ports"]]
        assert len(ports) == len(set(ports)), service["metadata"]["name"]


def test_the_routers_resources_are_its_own_when_set():
    document = yaml.safe_load(Path("examples/minimal.yaml").read_text())

    def router_resources(doc: dict) -> dict:
        router = by_kind(render(doc), "Deployment", "-router")
        return router["spec"]["template"]["spec"]["containers"][0]["resources"]

    assert router_resources(document) == {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
    wanted = {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "16Gi"}}
    document["spec"].setdefault("pdSpec", {}).setdefault("router", {})["resources"] = wanted
    assert router_resources(document) == wanted
    # what it leaves out keeps its default: an empty object drops no limit a quota may need
    document["spec"]["pdSpec"]["router"]["resources"] = {"requests": {"cpu": "2"}}
    assert router_resources(document) == {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
    document["spec"]["pdSpec"]["router"]["resources"] = {}
    assert router_resources(document) == {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}

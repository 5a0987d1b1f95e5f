"""The operator's reconcile, end to end on the objects it creates and patches.

No Kubernetes API server can run on this machine (docs/kubernetes.md says why), so these run
against ``k8s_fake.FakeApiServer``. Each lifecycle test is labelled step by step.
"""

import asyncio
import copy
import json
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
import yaml

from dpd.config.model import AdaptiveSpec
from dpd.k8s.install import operator_manifests
from dpd.k8s.operator_settings import WEBHOOK_CONFIG
from dpd.k8s.reconcile import LAST_APPLIED, merge_patch, plan_update, reconcile
from dpd.k8s.router_main import ThresholdReloader
from dpd.router.metrics import RouterMetrics
from dpd.router.routing import RoutingPolicy
from tests.unit.k8s_fake import FakeApiServer, apply_merge_patch

NS = "inference"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
CONFIGMAPS = f"/api/v1/namespaces/{NS}/configmaps"


def resource(example="examples/minimal.yaml", **spec_changes):
    body = yaml.safe_load(Path(example).read_text())
    body["metadata"].update(namespace=NS, uid="iec-uid-1", generation=1, resourceVersion="7")
    for path, value in spec_changes.items():
        node = body["spec"]
        *parents, last = path.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return body


def templates(api):
    return {p: copy.deepcopy(o["spec"]["template"]) for p, o in api.objects.items() if "/deployments/" in p}


async def created(body):
    api = FakeApiServer()
    await reconcile(api, body)
    for name in ("prefill", "decode", "router"):
        api.set_ready(f"{DEPLOYMENTS}/{body['metadata']['name']}-{name}")
    api.writes.clear()
    return api


@pytest.mark.parametrize(
    "old, new, patch",
    [
        ({"a": 1}, {"a": 1}, {}),
        ({"a": 1, "b": 2}, {"a": 1}, {"b": None}),
        ({"s": {"r": 1, "t": {"x": 1}}}, {"s": {"r": 3, "t": {"x": 1}}}, {"s": {"r": 3}}),
        ({"l": [1, 2]}, {"l": [2]}, {"l": [2]}),
    ],
)
def test_merge_patch(old, new, patch):
    assert merge_patch(old, new) == patch
    assert apply_merge_patch(old, patch) == new


async def test_create_then_status_then_nothing_to_do():
    body = resource()
    api = FakeApiServer()
    # step 1: first reconcile creates every rendered object, each owned by the resource
    status, actions = await reconcile(api, body)
    assert actions and all(a.startswith("create ") for a in actions)
    assert len(api.objects) == len(actions)
    for obj in api.objects.values():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "iec-uid-1"
        assert obj["metadata"]["namespace"] == NS
    # step 2: nothing is ready yet, and the status says which pool lags
    assert status["pools"]["prefill"] == {"replicas": 1, "readyReplicas": 0, "updatedReplicas": 0, "summary": "0/1"}
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["status"] == "False" and "decode 0/1 ready" in ready["message"]
    # step 3: the pods come up; the next reconcile writes nothing (defaults are not drift)
    for name in ("prefill", "decode", "router"):
        api.set_ready(f"{DEPLOYMENTS}/smollm2-minimal-{name}")
    api.writes.clear()
    status, actions = await reconcile(api, body)
    assert actions == [] and api.writes == []
    assert {c["type"]: c["status"] for c in status["conditions"]} == {"Valid": "True", "Ready": "True"}
    assert status["observedGeneration"] == 1


async def test_scale_change_patches_replicas_only():
    api = await created(resource())
    before = templates(api)
    # step 1: the user scales the prefill pool 1 → 3: the Deployment's replicas, and the
    # config copy the router reads (which it does not restart for)
    _, actions = await reconcile(api, resource(pdSpec__prefillSpec__replicas=3))
    assert actions == [f"patch {CONFIGMAPS}/smollm2-minimal-config", f"patch {DEPLOYMENTS}/smollm2-minimal-prefill"]
    _, path, patch = api.writes[1]
    assert patch["spec"] == {"replicas": 3} and set(patch) == {"spec", "metadata"}
    assert set(patch["metadata"]) == {"annotations"}
    # step 2: no pod template changed, so no pod restarts
    assert templates(api) == before
    assert api.objects[path]["spec"]["replicas"] == 3


async def test_threshold_change_reaches_the_router_without_restarting_anything(tmp_path):
    api = await created(resource())
    before = templates(api)
    # step 1: the threshold changes: only the config ConfigMap is patched
    _, actions = await reconcile(api, resource(pdSpec__routingThreshold=512))
    assert actions == [f"patch {CONFIGMAPS}/smollm2-minimal-config"]
    assert templates(api) == before
    # step 2: the kubelet refreshes the mounted file; the running router reloads it live
    mounted = tmp_path / "config.yaml"
    mounted.write_text(api.objects[f"{CONFIGMAPS}/smollm2-minimal-config"]["data"]["config.yaml"])
    router = SimpleNamespace(routing=RoutingPolicy("threshold", 2048, AdaptiveSpec(), RouterMetrics()))
    assert ThresholdReloader(router, str(mounted), None).reload_once()
    assert router.routing.threshold_tokens == 512


async def test_engine_args_change_rolls_only_that_pool():
    api = await created(resource())
    before = templates(api)
    _, actions = await reconcile(api, resource(pdSpec__decodingSpec__args=["--max-num-seqs", "64"]))
    assert actions == [f"patch {CONFIGMAPS}/smollm2-minimal-config", f"patch {DEPLOYMENTS}/smollm2-minimal-decode"]
    after = templates(api)
    changed = [p for p in before if before[p] != after[p]]
    assert changed == [f"{DEPLOYMENTS}/smollm2-minimal-decode"]
    assert after[changed[0]]["spec"]["containers"][0]["args"][-2:] == ["--max-num-seqs", "64"]
    assert after[changed[0]]["spec"]["containers"][0]["imagePullPolicy"] == "IfNotPresent"  # server defaults survive


async def test_hpa_owns_replicas_and_removing_autoscaling_deletes_the_hpa():
    body = resource("examples/gpu-rdma.yaml")
    api = await created(body)
    decode = f"{DEPLOYMENTS}/llama-8b-decode"
    # step 1: the HPA scales decode to 9; dpd leaves that alone
    api.scale_by_hpa(decode, 9)
    _, actions = await reconcile(api, body)
    assert actions == [] and api.objects[decode]["spec"]["replicas"] == 9
    # step 2: autoscaling removed from the spec: the HPAs go, replicas come back to the spec's
    body = resource("examples/gpu-rdma.yaml")
    del body["spec"]["pdSpec"]["autoScalingSpec"]
    _, actions = await reconcile(api, body)
    assert f"delete /apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/llama-8b-decode" in actions
    assert api.objects[decode]["spec"]["replicas"] == 4


async def test_a_tenants_dedicated_pool_comes_and_goes_with_the_spec():
    body = resource("examples/two-pools.yaml")
    base = body["metadata"]["name"]
    api = await created(body)
    # step 1: tenant a gets decode-1: its own Deployment, Service and PDB; the shared pool shrinks
    tenant = {"name": "a", "apiKeySha256": ["ab" * 32], "dedicatedWorkers": ["decode-1"]}
    replicas = body["spec"]["pdSpec"]["decodingSpec"]["replicas"]
    body = resource("examples/two-pools.yaml", tenants=[tenant])
    status, actions = await reconcile(api, body)
    dedicated = [a for a in actions if a.endswith(f"/{base}-decode-a")]
    assert sorted(a.split("/")[-2] for a in dedicated) == ["deployments", "poddisruptionbudgets", "services"]
    assert all(a.startswith("create ") for a in dedicated)
    assert api.objects[f"{DEPLOYMENTS}/{base}-decode"]["spec"]["replicas"] == replicas - 1
    assert status["pools"]["decode/a"]["summary"] == "0/1"
    # step 2: the tenant leaves the spec: its objects are deleted, the shared pool is whole again
    status, actions = await reconcile(api, resource("examples/two-pools.yaml"))
    assert sorted(a for a in actions if a.endswith("-decode-a")) == sorted(a.replace("create ", "delete ") for a in dedicated)
    assert api.objects[f"{DEPLOYMENTS}/{base}-decode"]["spec"]["replicas"] == replicas
    assert "decode/a" not in status["pools"]


async def test_deleted_object_is_recreated():
    api = await created(resource())
    await api.delete(f"{DEPLOYMENTS}/smollm2-minimal-router")
    _, actions = await reconcile(api, resource())
    assert actions == [f"create {DEPLOYMENTS}/smollm2-minimal-router"]


async def test_invalid_spec_changes_nothing_and_says_why():
    api = await created(resource())
    status, actions = await reconcile(api, resource(pdSpec__router__picker="random"))
    assert actions == [] and api.writes == []
    valid = {c["type"]: c for c in status["conditions"]}["Valid"]
    assert valid["status"] == "False"
    assert valid["message"] == "spec.pdSpec.router.picker: Input should be 'least-outstanding', 'power-of-two' or 'round-robin'"


def test_plan_update_against_what_dpd_last_applied():
    desired = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": "1"}}
    # an object dpd did not apply is taken over whole
    taken = plan_update(desired, {"metadata": {"name": "x"}, "data": {"a": "0"}})
    assert taken["data"] == {"a": "1"} and LAST_APPLIED in taken["metadata"]["annotations"]
    # unchanged since last applied: nothing, whatever else the live object carries
    live = {"metadata": {"annotations": {LAST_APPLIED: json.dumps(desired)}}, "data": {"a": "1", "added-by-someone": "x"}}
    assert plan_update(desired, live) == {}
    changed = {**desired, "data": {"a": "2"}}
    patch = plan_update(changed, live)
    assert patch["data"] == {"a": "2"} and json.loads(patch["metadata"]["annotations"][LAST_APPLIED]) == changed


def test_operator_install_manifests_validate():
    for obj in [*operator_manifests(), *operator_manifests(watch_namespaces=["team-a", "team-b"])]:
        kubernetes_validate.validate(obj, "1.33.0", strict=True)


# -- operator scope (issue 16, finding 3) --------------------------------------------------------
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection", "*"}


def test_the_namespaced_install_writes_only_in_its_namespaces():
    objects = operator_manifests("dpd-system", watch_namespaces=["team-a", "team-b"])
    (cluster_role,) = [o for o in objects if o["kind"] == "ClusterRole"]
    for rule in cluster_role["rules"]:  # cluster-wide: reads, and only its own webhook configuration
        if WRITE_VERBS & set(rule["verbs"]):
            assert rule["resources"] == ["validatingwebhookconfigurations"], rule
            assert set(rule["verbs"]) == {"create"} or rule["resourceNames"] == [WEBHOOK_CONFIG], rule
    roles = {o["metadata"]["namespace"]: o for o in objects if o["kind"] == "Role"}
    bindings = {o["metadata"]["namespace"]: o for o in objects if o["kind"] == "RoleBinding"}
    assert set(roles) == set(bindings) == {"team-a", "team-b"}
    assert any("secrets" in r["resources"] and "create" in r["verbs"] for r in roles["team-a"]["rules"])
    assert bindings["team-b"]["subjects"] == [{"kind": "ServiceAccount", "name": "dpd-operator", "namespace": "dpd-system"}]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["DPD_WATCH_NAMESPACES"] == "team-a,team-b"


def test_the_cluster_wide_install_patches_only_its_own_webhook_configuration():
    (cluster_role,) = [o for o in operator_manifests() if o["kind"] == "ClusterRole"]
    webhook_rules = [r for r in cluster_role["rules"] if r["resources"] == ["validatingwebhookconfigurations"]]
    assert all(r.get("resourceNames") == [WEBHOOK_CONFIG] for r in webhook_rules if set(r["verbs"]) - {"create"})
    assert any("deployments" in r["resources"] for r in cluster_role["rules"])


def test_the_operator_watches_the_namespaces_it_was_installed_for(monkeypatch):
    from dpd.k8s.operator import watched_namespaces

    monkeypatch.setenv("DPD_WATCH_NAMESPACES", "team-a, team-b")
    assert watched_namespaces(None) == ["team-a", "team-b"]
    assert watched_namespaces(["x"]) == ["x"]
    monkeypatch.delenv("DPD_WATCH_NAMESPACES")
    assert watched_namespaces(None) == []


def test_the_operator_runs_only_allowed_images_and_host_paths(monkeypatch):
    """A resource may not make the operator run any image or mount any node directory."""
    import kopf

    from dpd.k8s.operator import operator_policy, render_options, validate

    monkeypatch.delenv("DPD_ALLOWED_IMAGES", raising=False)
    monkeypatch.delenv("DPD_ALLOWED_HOST_PATHS", raising=False)
    validate(body=resource())  # the images dpd renders itself are allowed
    with pytest.raises(kopf.AdmissionError) as exc:
        validate(body=resource(worker={"image": "evil.example.com/miner:1"}))
    assert "image 'evil.example.com/miner:1' is not allowed by the operator (DPD_ALLOWED_IMAGES" in str(exc.value)
    local = resource(modelSourceConfig={"modelSourceType": "local", "modelLocation": "/etc"})
    with pytest.raises(kopf.AdmissionError) as exc:
        validate(body=local)
    assert "hostPath '/etc' is not allowed by the operator (DPD_ALLOWED_HOST_PATHS" in str(exc.value)
    monkeypatch.setenv("DPD_ALLOWED_IMAGES", "evil.example.com/*")
    monkeypatch.setenv("DPD_ALLOWED_HOST_PATHS", "/models")
    validate(body=resource(worker={"image": "evil.example.com/miner:1"}))
    validate(body=resource(modelSourceConfig={"modelSourceType": "local", "modelLocation": "/models/smol"}))
    with pytest.raises(kopf.AdmissionError):
        validate(body=resource(modelSourceConfig={"modelSourceType": "local", "modelLocation": "/models/../etc"}))
    policy = operator_policy(render_options())
    assert policy.allows_image("dpd:0.1.0") and not policy.allows_image("dpd-evil:0.1.0")


async def test_a_resource_the_policy_refuses_changes_nothing(monkeypatch):
    from dpd.k8s.policy import OperatorPolicy

    api = FakeApiServer()
    status, actions = await reconcile(api, resource(worker={"image": "evil.example.com/miner:1"}), policy=OperatorPolicy(("dpd:0.1.0",)))
    assert actions == [] and status["conditions"][0]["status"] == "False"
    assert "not allowed by the operator" in status["conditions"][0]["message"]


def test_kopf_validate_handler_answers_with_dpd_validate_messages():
    import kopf

    from dpd.k8s.operator import validate

    validate(body=resource())  # admitted: no exception
    with pytest.raises(kopf.AdmissionError) as exc:
        validate(body=resource(pdSpec__prefilSpec={"replicas": 2}, maxModelLen=1))
    assert str(exc.value).split("\n") == [
        "spec.maxModelLen: Input should be greater than or equal to 16",
        "spec.pdSpec.prefilSpec: unknown field (check spelling; see `dpd validate --schema`)",
    ]


# -- ownership (issue 16, finding 2): only objects the resource owns are patched or deleted -------
SECRETS = f"/api/v1/namespaces/{NS}/secrets"
HPAS = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers"


async def test_someone_elses_same_named_objects_are_never_deleted():
    api = FakeApiServer()
    # A user's own Secret and HPA that happen to have the names dpd would use (no owner reference).
    await api.create(SECRETS, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "smollm2-minimal-secrets", "namespace": NS}})
    await api.create(HPAS, {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                            "metadata": {"name": "smollm2-minimal-prefill", "namespace": NS}, "spec": {}})
    _, actions = await reconcile(api, resource())  # minimal.yaml: no secrets, no autoscaling
    assert not any(a.startswith("delete") for a in actions), actions
    assert await api.get(f"{SECRETS}/smollm2-minimal-secrets") is not None
    assert await api.get(f"{HPAS}/smollm2-minimal-prefill") is not None


async def test_a_same_named_object_is_a_conflict_in_the_status_not_adopted():
    api = FakeApiServer()
    foreign = {"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "smollm2-minimal-router", "namespace": NS, "labels": {"team": "other"}},
               "spec": {"replicas": 3, "template": {"spec": {"containers": [{"name": "c", "image": "other"}]}}}}
    await api.create(DEPLOYMENTS, copy.deepcopy(foreign))
    status, actions = await reconcile(api, resource())
    assert f"patch {DEPLOYMENTS}/smollm2-minimal-router" not in actions
    live = await api.get(f"{DEPLOYMENTS}/smollm2-minimal-router")
    assert live["spec"]["replicas"] == 3 and "ownerReferences" not in live["metadata"]
    assert live["spec"]["template"]["spec"]["containers"][0]["image"] == "other"
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "Conflict" and "smollm2-minimal-router" in ready["message"]


async def test_another_resources_objects_are_not_deleted_by_this_one():
    api = await created(resource())
    other_owner = {"apiVersion": "x/v1", "kind": "Other", "name": "o", "uid": "other-uid", "controller": True}
    await api.create(SECRETS, {"apiVersion": "v1", "kind": "Secret", "metadata": {
        "name": "smollm2-minimal-secrets", "namespace": NS, "ownerReferences": [other_owner]}})
    _, actions = await reconcile(api, resource())
    assert actions == [] and await api.get(f"{SECRETS}/smollm2-minimal-secrets") is not None


async def test_the_workers_key_is_created_once_at_random_and_kept():
    api = FakeApiServer()
    await reconcile(api, resource())
    secret = await api.get(f"{SECRETS}/smollm2-minimal-worker-key")
    key = secret.get("stringData", secret.get("data", {}))["key"]
    assert len(key) >= 32 and secret["metadata"]["ownerReferences"][0]["uid"] == "iec-uid-1"
    _, actions = await reconcile(api, resource(pdSpec__routingThreshold=64))
    assert not any("worker-key" in a for a in actions)
    again = await api.get(f"{SECRETS}/smollm2-minimal-worker-key")
    assert again.get("stringData", again.get("data", {}))["key"] == key


async def test_the_webhook_gets_a_certificate_the_api_server_can_verify(monkeypatch, unused_tcp_port):
    """Issue 16, finding 4: without a mounted certificate the operator makes its own (kopf's own
    fallback needs a package the image lacks, so the install would fail at start). A TLS client
    that trusts only the bundle kopf publishes verifies the server by the Service's DNS name."""
    import ssl

    import kopf

    from dpd.k8s.operator import configure

    host = "dpd-operator.dpd-system.svc"
    monkeypatch.setenv("DPD_WEBHOOK_HOST", host)
    monkeypatch.delenv("DPD_WEBHOOK_CERT_DIR", raising=False)
    settings = kopf.OperatorSettings()
    configure(settings=settings)
    server = settings.admission.server
    assert server.certfile and server.pkeyfile and oct(Path(server.pkeyfile).stat().st_mode & 0o777) == "0o600"
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(server.certfile, server.pkeyfile)

    async def answer(reader, writer):
        writer.write(b"ok")
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(answer, "127.0.0.1", unused_tcp_port, ssl=served)
    try:
        trusting = ssl.create_default_context(cafile=server.certfile)  # the CA bundle kopf publishes
        for name in (host, "dpd-operator.dpd-system", "dpd-operator"):
            reader, writer = await asyncio.open_connection("127.0.0.1", unused_tcp_port, ssl=trusting, server_hostname=name)
            assert await reader.read() == b"ok"
            writer.close()
        with pytest.raises(ssl.SSLCertVerificationError):
            await asyncio.open_connection("127.0.0.1", unused_tcp_port, ssl=trusting, server_hostname="elsewhere.svc")
    finally:
        listener.close()
        await listener.wait_closed()


async def test_the_operator_applies_the_dashboard_and_leaves_the_prometheus_rule_to_render():
    """Issue 15: where prometheus-operator's CRDs are not installed a PrometheusRule cannot be
    created, and one failed create would fail the whole reconcile; the dashboard's ConfigMap needs
    nothing installed. So the operator applies the ConfigMap, never the rule (`dpd render` prints it)."""
    api = FakeApiServer()
    # step 1: the dashboard's ConfigMap is created; no PrometheusRule is even looked up
    _, actions = await reconcile(api, resource())
    assert f"create {CONFIGMAPS}/smollm2-minimal-dashboard" in actions
    assert not [p for p in api.objects if "prometheusrules" in p]
    dashboard = await api.get(f"{CONFIGMAPS}/smollm2-minimal-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    # step 2: nothing changed: nothing written (the dashboard is deterministic)
    api.writes.clear()
    _, actions = await reconcile(api, resource())
    assert actions == []
    # step 3: metrics turned off: the dashboard's ConfigMap is deleted
    _, actions = await reconcile(api, resource(metrics={"enabled": False}))
    assert f"delete {CONFIGMAPS}/smollm2-minimal-dashboard" in actions
    assert await api.get(f"{CONFIGMAPS}/smollm2-minimal-dashboard") is None
    monitor = f"/apis/monitoring.coreos.com/v1/namespaces/{NS}/servicemonitors/smollm2-minimal"
    assert f"delete {monitor}" in actions and await api.get(monitor) is None  # Prometheus stops scraping it


async def test_an_fsx_source_gets_its_claim_and_leaves_the_cluster_scoped_volume_to_render():
    """The claim is namespaced (the operator creates it); the PersistentVolume is cluster-scoped,
    and the operator holds no cluster-wide rights: `dpd render` prints it for who installs."""
    api = FakeApiServer()
    body = resource("tests/unit/fixtures/hyperpod/fsx.yaml")
    status, actions = await reconcile(api, body)
    name = body["metadata"]["name"]
    assert [a for a in actions if "/persistentvolumeclaims/" in a] == [
        f"create /api/v1/namespaces/{NS}/persistentvolumeclaims/{name}-model-fsx"]
    assert not [p for p in api.objects if "/persistentvolumes/" in p]
    assert {c["type"]: c["status"] for c in status["conditions"]}["Valid"] == "True", status

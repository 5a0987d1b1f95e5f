"""A config document → the Kubernetes objects of one endpoint (pure, deterministic).

``render(document)`` returns plain dicts in a fixed order: the router's RBAC, the config
ConfigMap and secrets Secret, the Services, the prefill/decode/router Deployments, their
PodDisruptionBudgets, the per-pool HorizontalPodAutoscalers, the NetworkPolicies, and the
monitoring objects (monitoring.py: a ServiceMonitor, the dashboard's ConfigMap, a
PrometheusRule). ``dpd render`` prints them for GitOps; the operator applies the very same
objects but the PrometheusRule. Same input, byte-identical output: no timestamps, no random
names, maps sorted.

The config travels to the router as a ConfigMap (``config.yaml``) with the secret parts —
``router.adminKeySha256``, ``spec.tenants`` — moved to a Secret
(``secrets.yaml``). The router's pod template carries a hash of the config *without*
``routingThreshold``: a threshold change rewrites only the ConfigMap, which the running
router reloads, so nothing restarts.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import yaml

from dpd.config.load import parse_config
from dpd.config.model import CLUSTER_TLS_DIR, InferenceEndpointConfig, ResourceRequirements
from dpd.k8s.autoscaling import POOL_KEYS, PoolAutoscaling, RenderError, hpa, parse_autoscaling
from dpd.k8s.monitoring import dashboard_config_map, prometheus_rule, service_monitor
from dpd.k8s.security import POD_SECURITY, container_security
from dpd.k8s.workers import (
    DRAIN_NOTICE_S,
    SIDE_CHANNEL_PORT,
    WORKER_HTTP_PORT,
    drain_seconds,
    model_storage,
    model_volume,
    pod_template,
    worker_key_env,
)
from dpd.launch.plan import pool_is_gpu, tracing_port
from dpd.router.app import WORKER_KEY_ENV

DPD_IMAGE = "dpd:0.1.0"
VLLM_GPU_IMAGE = "vllm/vllm-openai:v0.32.0"
ROUTER_TEARDOWN_S = 5  # after the drain, for the process to exit before the kubelet's SIGKILL
# The router's unless ``router.resources`` says otherwise. A memory limit too: a namespace whose
# quota asks for one admits the pod (a router holds a tokenizer, its prefix index and its
# connections: well under this).
ROUTER_RESOURCES: dict[str, dict[str, str | int]] = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
CONFIG_PATH = "/etc/dpd/config/config.yaml"
SECRETS_PATH = "/etc/dpd/secrets/secrets.yaml"
METRICS_LABEL = "dpd.dev/metrics"
# The router's /metrics port on a cluster when router.metricsPort is unset (apart from the API,
# reachable by Prometheus only); every scraped Service names its metrics port "metrics".
CLUSTER_METRICS_PORT = 9090


def metrics_port(config: InferenceEndpointConfig) -> int:
    return config.spec.pdSpec.router.metricsPort or CLUSTER_METRICS_PORT
SCRAPE_LABEL = "dpd.dev/scrape"  # on the namespace Prometheus runs in: it may scrape the workers
POOLS = ("prefill", "decode")
SECRET_ROUTER_KEYS = ("adminKeySha256",)


@dataclass(frozen=True)
class RenderOptions:
    dpd_image: str = DPD_IMAGE  # router, model preparation, CPU workers
    worker_image: str | None = None  # default: spec.worker.image, else by buffer device


TENANT_LABEL = "dpd.dev/tenant"
DNS_LABEL_MAX = 63


@dataclass(frozen=True)
class WorkerGroup:
    """One Deployment of workers: a pool's shared workers, or those dedicated to one tenant.

    ``tenants[].dedicatedWorkers`` names local workers (``decode-1``); on a cluster a tenant's
    dedicated workers of a pool are a Deployment of their own with their count as replicas, and
    the pool's shared Deployment has the rest. Each group has its own headless Service, so the
    router's discovery knows which pods are whose."""

    pool: str  # prefill | decode
    tenant: str | None  # None: the pool's shared workers
    name: str
    replicas: int

    @property
    def key(self) -> str:
        """Discovery's and the status's name for the group: ``decode`` or ``decode/<tenant>``."""
        return self.pool if self.tenant is None else f"{self.pool}/{self.tenant}"

    @property
    def component(self) -> str:
        return self.pool if self.tenant is None else f"{self.pool}-dedicated"


def worker_groups(config: InferenceEndpointConfig) -> list[WorkerGroup]:
    """Every pool's shared group, then its tenants' groups (sorted by tenant); raises
    ``RenderError`` when a group's name cannot be a Service name."""
    pd = config.spec.pdSpec
    groups: list[WorkerGroup] = []
    problems = []
    for pool, spec in (("prefill", pd.prefillSpec), ("decode", pd.decodingSpec)):
        dedicated = {t.name: sum(1 for w in t.dedicatedWorkers if w.startswith(f"{pool}-")) for t in config.spec.tenants}
        dedicated = {t: count for t, count in sorted(dedicated.items()) if count}
        groups.append(WorkerGroup(pool, None, f"{config.metadata.name}-{pool}", spec.replicas - sum(dedicated.values())))
        for tenant, count in dedicated.items():
            name = f"{config.metadata.name}-{pool}-{tenant}"
            if len(name) > DNS_LABEL_MAX:
                problems.append(f"tenants[{tenant}].dedicatedWorkers: the {pool} Service {name!r} would be longer than "
                                f"{DNS_LABEL_MAX} characters; shorten metadata.name or the tenant's name")
            groups.append(WorkerGroup(pool, tenant, name, count))
    if problems:
        raise RenderError(problems)
    return groups


def group_selector(config: InferenceEndpointConfig, group: WorkerGroup) -> dict[str, str]:
    tenant = {} if group.tenant is None else {TENANT_LABEL: group.tenant}
    return {**selector(config, group.component), **tenant}


def shared_autoscaling(config: InferenceEndpointConfig, groups: list[WorkerGroup]) -> dict[str, PoolAutoscaling]:
    """``autoScalingSpec`` of the shared groups: the HPA scales only a pool's shared workers, so
    its default minimum is the pool's ``replicas`` less the dedicated ones."""
    pd = config.spec.pdSpec
    shared = {g.pool: g.replicas for g in groups if g.tenant is None}
    pools = {"prefill": pd.prefillSpec, "decode": pd.decodingSpec}
    scaling = parse_autoscaling(pd.autoScalingSpec, {p: spec.model_copy(update={"replicas": shared[p]}) for p, spec in pools.items()})
    empty = [f"spec.pdSpec.autoScalingSpec.{POOL_KEYS[p]}: every {p} worker is dedicated to a tenant, and the "
             f"autoscaler scales only shared workers; remove it or leave the pool some shared workers"
             for p in scaling if shared[p] == 0]
    if empty:
        raise RenderError(empty)
    return scaling


def pool_spread(config: InferenceEndpointConfig, pool: str, groups: list[WorkerGroup]) -> dict[str, Any]:
    """The label selector of every pod of ``pool``, shared and dedicated: what anti-affinity
    spreads (one pod of a pool per topology domain holds across its groups)."""
    if not any(g.pool == pool and g.tenant is not None for g in groups):
        return {"matchLabels": selector(config, pool)}
    return {"matchLabels": {"app.kubernetes.io/instance": config.metadata.name}, "matchExpressions": [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": [pool, f"{pool}-dedicated"]}]}


def group_labels(config: InferenceEndpointConfig, group: WorkerGroup) -> dict[str, str]:
    return {**labels(config, group.component), **group_selector(config, group)}


def names(config: InferenceEndpointConfig) -> dict[str, str]:
    base = config.metadata.name
    return {
        "prefill": f"{base}-prefill", "decode": f"{base}-decode", "router": f"{base}-router",
        "config": f"{base}-config", "secrets": f"{base}-secrets", "workers": f"{base}-workers",
        "dashboard": f"{base}-dashboard", "alerts": f"{base}-alerts", "monitor": base,
    }


def selector(config: InferenceEndpointConfig, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": config.metadata.name, "app.kubernetes.io/component": component}


def labels(config: InferenceEndpointConfig, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "dpd", **selector(config, component), "app.kubernetes.io/managed-by": "dpd"}


def config_document(body: dict[str, Any]) -> dict[str, Any]:
    """The config file a resource stands for: the API server's bookkeeping (uid,
    resourceVersion, generation, managedFields, annotations, status) left out, so it never
    changes what is rendered."""
    metadata = body.get("metadata") or {}
    document = {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {k: metadata[k] for k in ("name", "namespace") if k in metadata},
        "spec": body.get("spec"),
    }
    return {k: v for k, v in document.items() if v is not None}


def split_secrets(document: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the document without secrets, the secrets) — read defensively: tenants may not exist yet."""
    public = config_document(document)
    public["spec"] = copy.deepcopy(public.get("spec") or {})
    spec = public["spec"]
    router = (spec.get("pdSpec") or {}).get("router") or {}
    secrets: dict[str, Any] = {}
    for key in SECRET_ROUTER_KEYS:
        if router.get(key) is not None:
            secrets[key] = router.pop(key)
    if spec.get("tenants") is not None:
        secrets["tenants"] = spec.pop("tenants")
    return public, secrets


# The parts of the config the router reads only when it starts: a change to any of them restarts
# it. Pool sizes are found by discovery and the threshold is reloaded live, so neither does; engine
# arguments are the workers'.
ROUTER_START_FIELDS = ("modelName", "modelSourceConfig", "maxModelLen", "tenants", "intelligentRoutingSpec",
                       "loadBalancer", "kvCacheSpec")
ROUTER_START_PD_FIELDS = ("router", "routingPolicy", "kvTransferSpec")


def config_hash(public: dict[str, Any], secrets: dict[str, Any]) -> str:
    """Hash of what a running router cannot pick up without a restart."""
    spec = public.get("spec") or {}
    pd = spec.get("pdSpec") or {}
    data = {
        **{k: spec.get(k) for k in ROUTER_START_FIELDS},
        **{k: pd.get(k) for k in ROUTER_START_PD_FIELDS},
        "requestLimits": (spec.get("worker") or {}).get("requestLimits"),  # the reference's admission limits
        "secrets": secrets,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _images(config: InferenceEndpointConfig, options: RenderOptions) -> dict[str, str]:
    worker = options.worker_image or (config.spec.worker.image if config.spec.worker else None)
    if not worker:
        pd = config.spec.pdSpec
        is_gpu = any(pool_is_gpu(config, pool) for pool in (pd.prefillSpec, pd.decodingSpec))
        worker = VLLM_GPU_IMAGE if is_gpu else options.dpd_image
    return {"dpd": options.dpd_image, "worker": worker}


def _meta(config: InferenceEndpointConfig, name: str, component: str, extra_labels: dict[str, str] | None = None,
          **extra: Any) -> dict[str, Any]:
    ns = {"namespace": config.metadata.namespace} if config.metadata.namespace else {}
    return {"name": name, **ns, "labels": {**labels(config, component), **(extra_labels or {})}, **extra}


def _deployment(config: InferenceEndpointConfig, name: str, component: str, template: dict, replicas: int | None,
                match: dict[str, str] | None = None) -> dict:
    match = match or selector(config, component)
    spec: dict[str, Any] = {"selector": {"matchLabels": match}, "template": template}
    if replicas is not None:
        spec = {"replicas": replicas, **spec}
    # Workers are replaced one at a time, and a new one must be ready before an old one goes.
    spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(config, name, component, match), "spec": spec}


def router_resources(given: ResourceRequirements | None) -> dict[str, dict[str, str | int]]:
    """``router.resources`` over ``ROUTER_RESOURCES``, key by key: what it sets replaces the
    default, what it leaves out keeps it (the memory limit too)."""
    out = copy.deepcopy(ROUTER_RESOURCES)
    if given is not None:
        out["requests"].update(given.requests)
        out["limits"].update(given.limits)
    return {kind: values for kind, values in out.items() if values}


def _router_template(config: InferenceEndpointConfig, n: dict[str, str], images: dict[str, str], public: dict, secrets: dict) -> dict:
    router = config.spec.pdSpec.router
    volumes, mounts, init, model_env = model_volume(config, images["dpd"])
    volumes = [*volumes, {"name": "config", "configMap": {"name": n["config"]}}]
    mounts = [*mounts, {"name": "config", "mountPath": "/etc/dpd/config", "readOnly": True}]
    env = [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}, *model_env,
           worker_key_env(config, WORKER_KEY_ENV)]
    tls = config.spec.tlsConfig.secretName if config.spec.tlsConfig else None
    if tls:  # a kubernetes.io/tls Secret (cert-manager's Certificate writes one); the router serves HTTPS
        volumes.append({"name": "tls", "secret": {"secretName": tls}})
        mounts.append({"name": "tls", "mountPath": CLUSTER_TLS_DIR, "readOnly": True})
    if secrets:
        volumes.append({"name": "secrets", "secret": {"secretName": n["secrets"]}})
        mounts.append({"name": "secrets", "mountPath": "/etc/dpd/secrets", "readOnly": True})
        env.append({"name": "DPD_SECRETS_FILE", "value": SECRETS_PATH})
    container = {
        "name": "router",
        "image": images["dpd"],
        "command": ["dpd", "k8s-router", CONFIG_PATH],
        "env": env,
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": metrics_port(config), "protocol": "TCP"}],
        "resources": router_resources(router.resources),
        # /health is 200 only while a decoder is healthy: right for readiness (no traffic to a
        # router that can serve nothing), wrong for liveness (restarting it would not help).
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http", **({"scheme": "HTTPS"} if tls else {})},
                           "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
        "volumeMounts": mounts,
        # SIGTERM comes after the pause, once the Service has stopped sending new requests here;
        # then the router drains (finishes its streams) for up to drainTimeoutS.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(DRAIN_NOTICE_S)]}}},
        "securityContext": container_security(),
    }
    pod: dict[str, Any] = {
        "serviceAccountName": n["router"], "containers": [container], "volumes": volumes,
        "securityContext": POD_SECURITY,
        "terminationGracePeriodSeconds": DRAIN_NOTICE_S + drain_seconds(config) + ROUTER_TEARDOWN_S,
    }
    if init:
        pod["initContainers"] = init
    annotations = {"dpd.dev/config-hash": config_hash(public, secrets)}
    return {"metadata": {"labels": labels(config, "router"), "annotations": annotations}, "spec": pod}


def _rbac(config: InferenceEndpointConfig, n: dict[str, str]) -> list[dict]:
    meta = _meta(config, n["router"], "router")
    rules = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    subject = {
        "kind": "ServiceAccount", "name": n["router"],
        **({"namespace": config.metadata.namespace} if config.metadata.namespace else {}),
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": rules},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": n["router"]},
            "subjects": [subject],
        },
    ]


def _services(config: InferenceEndpointConfig, n: dict[str, str], groups: list[WorkerGroup]) -> list[dict]:
    out = []
    for group in groups:
        meta = _meta(config, group.name, group.component, {**group_selector(config, group), METRICS_LABEL: "true"})
        out.append({
            "apiVersion": "v1", "kind": "Service", "metadata": meta,
            # Headless: the router picks pods itself from the EndpointSlices; no kube-proxy hop.
            "spec": {"clusterIP": "None", "selector": group_selector(config, group), "ports": [
                {"name": "http", "port": WORKER_HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "nixl", "port": SIDE_CHANNEL_PORT, "targetPort": "nixl", "protocol": "TCP"},
                # vLLM serves /metrics on its API port; named for the ServiceMonitor.
                {"name": "metrics", "port": CLUSTER_METRICS_PORT, "targetPort": "http", "protocol": "TCP"},
            ]},
        })
    meta = _meta(config, n["router"], "router", {METRICS_LABEL: "true"})
    port = config.spec.pdSpec.router.port
    out.append({"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {
        "type": "ClusterIP", "selector": selector(config, "router"),
        "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"},
                  {"name": "metrics", "port": metrics_port(config), "targetPort": "metrics", "protocol": "TCP"}],
    }})
    return out


def _network_policies(config: InferenceEndpointConfig, n: dict[str, str]) -> list[dict]:
    instance = {"app.kubernetes.io/instance": config.metadata.name}
    components = [*POOLS, *(f"{pool}-dedicated" for pool in POOLS)]
    workers = {"matchLabels": instance, "matchExpressions": [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": components}]}
    peers = {"matchLabels": instance, "matchExpressions": [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["router", *components]}]}
    # Prometheus only from namespaces labelled for it (the monitoring namespace: `kubectl label
    # namespace monitoring dpd.dev/scrape=true`), and only on the HTTP port — where the workers'
    # API needs their key anyway; /metrics does not.
    prometheus = {"namespaceSelector": {"matchLabels": {SCRAPE_LABEL: "true"}},
                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    # Egress: the peers (HTTP hops, NIXL side channel, KV transfers) and DNS; the hub as well
    # when the workers download the model themselves.
    egress: list[dict[str, Any]] = [
        {"to": [{"podSelector": peers}]},
        {"to": [{"namespaceSelector": {}}], "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
    ]
    if config.spec.modelSourceConfig.modelSourceType in ("hub", "huggingface", "s3"):
        egress.append({"ports": [{"port": 443, "protocol": "TCP"}]})
    if (collector_port := tracing_port(config)) is not None:  # the workers' spans (router.tracing)
        egress.append({"ports": [{"port": collector_port, "protocol": "TCP"}]})
    router_port = config.spec.pdSpec.router.port
    return [
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(config, n["workers"], "workers"), "spec": {
            "podSelector": workers, "policyTypes": ["Ingress", "Egress"],
            "egress": egress,
            "ingress": [
                # The router (HTTP hops) and the other workers (NIXL side channel, KV pulls).
                {"from": [{"podSelector": peers}]},
                # Prometheus scrapes /metrics on the HTTP port only.
                {"from": [prometheus], "ports": [{"port": "http", "protocol": "TCP"}]},
            ],
        }},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(config, n["router"], "router"), "spec": {
            "podSelector": {"matchLabels": selector(config, "router")}, "policyTypes": ["Ingress"],
            # The API from anywhere; /metrics (tenant and worker names) from Prometheus only.
            "ingress": [{"ports": [{"port": router_port, "protocol": "TCP"}]},
                        {"from": [prometheus], "ports": [{"port": metrics_port(config), "protocol": "TCP"}]}],
        }},
    ]


def check_router_ports(config: InferenceEndpointConfig) -> None:
    """``RenderError`` when the router's API and metrics ports coincide on a cluster (an unset
    ``metricsPort`` is 9090 there), which would give its Service one port twice."""
    port = config.spec.pdSpec.router.port
    if metrics_port(config) == port:
        raise RenderError([f"spec.pdSpec.router.port: {port} is the port the router serves /metrics on in a cluster "
                           "when router.metricsPort is unset; choose another port or set router.metricsPort"])


def render_config(config: InferenceEndpointConfig, document: dict[str, Any], options: RenderOptions = RenderOptions()) -> list[dict]:
    check_router_ports(config)
    n = names(config)
    images = _images(config, options)
    groups = worker_groups(config)
    scaling = shared_autoscaling(config, groups)
    public, secrets = split_secrets(document)
    objects = _rbac(config, n)
    objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(config, n["config"], "router"),
                    "data": {"config.yaml": yaml.safe_dump(public, sort_keys=True)}})
    if secrets:
        objects.append({"apiVersion": "v1", "kind": "Secret", "metadata": _meta(config, n["secrets"], "router"),
                        "type": "Opaque", "stringData": {"secrets.yaml": yaml.safe_dump(secrets, sort_keys=True)}})
    objects += _services(config, n, groups)
    for group in groups:
        template = pod_template(config, group.pool, group_labels(config, group), pool_spread(config, group.pool, groups), images)
        # Only a pool's shared group autoscales; a tenant's dedicated workers are a fixed number.
        replicas = None if group.tenant is None and group.pool in scaling else group.replicas
        objects.append(_deployment(config, group.name, group.component, template, replicas, group_selector(config, group)))
    objects.append(_deployment(config, n["router"], "router", _router_template(config, n, images, public, secrets), 1))
    budgets = [(g.name, g.component, group_selector(config, g)) for g in groups]
    for name, component, match in [*budgets, (n["router"], "router", selector(config, "router"))]:
        objects.append({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(config, name, component, match),
                        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": match}}})
    ns = {"namespace": config.metadata.namespace} if config.metadata.namespace else {}
    for pool in POOLS:
        if pool in scaling:
            objects.append(hpa(n[pool], n[pool], labels(config, pool), ns, scaling[pool]))
    objects += _network_policies(config, n)
    objects += model_storage(config)
    metrics = config.spec.metrics
    if metrics is None or metrics.enabled:
        interval = metrics.metricsScrapeIntervalSeconds if metrics else 15
        name, namespace = config.metadata.name, config.metadata.namespace
        objects += [
            service_monitor(_meta(config, n["monitor"], "metrics"), {"app.kubernetes.io/instance": name, METRICS_LABEL: "true"},
                            interval),
            dashboard_config_map(_meta(config, n["dashboard"], "metrics"), name, namespace),
            prometheus_rule(_meta(config, n["alerts"], "metrics"), name, namespace),
        ]
    return objects


def render(document: dict[str, Any], options: RenderOptions = RenderOptions(), source: str = "<config>") -> list[dict]:
    """Validate ``document`` exactly as ``dpd validate`` does, then render it."""
    document = config_document(document)
    return render_config(parse_config(document, source), document, options)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the embedded config) as readable ``|`` blocks; no anchors/aliases."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def to_yaml(objects: list[dict]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=120)

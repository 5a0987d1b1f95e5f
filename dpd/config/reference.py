"""The reference resource's fields dpd accepts but does not apply, each with its reason.

dpd loads an existing ``InferenceEndpointConfig`` (``inference.sagemaker.aws.amazon.com/v1``)
as is: every field of the reference schema is accepted (typos still fail, with their field path).
Most fields do what they mean in dpd (see docs/kubernetes.md, "Migrating a HyperPod resource");
the ones below are accepted and reported once, by field path, as not applied — a warning from
``dpd validate``, ``dpd serve`` and ``dpd render``, never an error.
"""

from __future__ import annotations

from typing import Any

from dpd.config.model import InferenceEndpointConfig

SPEC_REASONS = {
    "InitialReplicaCount": "the pools' own replicas (pdSpec.prefillSpec/decodingSpec.replicas) size a P/D endpoint",
    "replicas": "the pools' own replicas (pdSpec.prefillSpec/decodingSpec.replicas) size a P/D endpoint",
    "autoScalingSpec": "a P/D endpoint autoscales per pool: pdSpec.autoScalingSpec",
    "dataCapture": "request/response capture to S3 is a SageMaker feature; dpd's request metrics are on /metrics",
    "dnsConfig": "Route 53 records are not managed by dpd; point DNS at the router's Service",
    "endpointName": "no SageMaker endpoint is registered; the router's Service is the endpoint",
    "instanceTypes": "use each pool's nodeSelector (node.kubernetes.io/instance-type) to choose among instance types",
    "invocationEndpoint": "dpd serves the OpenAI API (/v1/completions, /v1/chat/completions), not a SageMaker invocation path",
    "kubernetes": "extra init containers, volumes and scheduler settings are not rendered (a kubernetesVolume model "
                  "source reads its volume from kubernetes.volumes)",
    "maxDeployTimeInSeconds": "the workers' startup probes bound start-up instead (15 minutes)",
    "modelVersion": "informational; the served model is modelName",
    "nodeAffinity": "use each pool's nodeSelector and pdSpec.topologySpec",
    "tags": "AWS resource tags have no Kubernetes meaning here; use metadata.labels",
}
WORKER_REASONS = {
    "command": "dpd runs vLLM's OpenAI server itself (its arguments from the config and worker.args)",
    "modelInvocationPort": "workers listen on port 8000 behind the router; clients use the router's port",
    "workingDir": "vLLM's working directory is not changed",
}


def _set(model: Any, field: str) -> bool:
    return model is not None and field in model.model_fields_set


def not_applied(config: InferenceEndpointConfig) -> list[str]:
    """One line per accepted-but-not-applied field: ``<path>: accepted, not applied: <reason>``."""
    spec = config.spec
    notes: list[tuple[str, str]] = [(f"spec.{f}", why) for f, why in SPEC_REASONS.items() if _set(spec, f)]
    if spec.worker is not None:
        notes += [(f"spec.worker.{f}", why) for f, why in WORKER_REASONS.items() if _set(spec.worker, f)]
        if _set(spec.worker, "modelVolumeMount") and spec.modelSourceConfig.modelSourceType != "kubernetesVolume":
            notes.append(("spec.worker.modelVolumeMount", "only a kubernetesVolume model source mounts a volume of yours"))
    if spec.tlsConfig is not None:
        for f in ("customCertificateConfig", "tlsCertificateOutputS3Uri"):
            if _set(spec.tlsConfig, f):
                notes.append((f"spec.tlsConfig.{f}", "ACM and S3 certificates are SageMaker's; give the router a "
                              "certificate with tlsConfig.secretName (cluster) or certFile/keyFile (local)"))
    if spec.metrics is not None and _set(spec.metrics, "modelMetrics"):
        notes.append(("spec.metrics.modelMetrics", "the ServiceMonitor scrapes the router's /metrics and every worker's"))
    routing = spec.intelligentRoutingSpec
    if routing is not None:
        if routing.enabled and routing.routingStrategy in ("kvaware", "session"):
            notes.append(("spec.intelligentRoutingSpec.routingStrategy",
                          f"{routing.routingStrategy}: served by prefix-aware routing (router.prefixAware; a session's "
                          "turns share their prefix), from the router's own index, not KV events or a session header"))
        if _set(routing, "autoScalingSpec"):
            notes.append(("spec.intelligentRoutingSpec.autoScalingSpec", "the router runs one replica"))
    if spec.loadBalancer is not None and _set(spec.loadBalancer, "healthCheckPath"):
        notes.append(("spec.loadBalancer.healthCheckPath", "the router's health check is /health"))
    kv = spec.kvCacheSpec
    if kv is not None:
        if kv.enableL2Cache or _set(kv, "l2CacheSpec"):
            notes.append(("spec.kvCacheSpec.l2CacheSpec", "a remote L2 store is not configured; the disk tier is "
                          "pdSpec.kvCacheOffloadingSpec.disk"))
        if _set(kv, "cacheConfigFile"):
            notes.append(("spec.kvCacheSpec.cacheConfigFile", "the offloading connector is configured from the sizes in the config"))
    if spec.modelSourceConfig.huggingFaceModel is not None and spec.modelSourceConfig.huggingFaceModel.tokenSecretRef:
        pass  # applied on a cluster (HF_TOKEN from the Secret); locally HF_TOKEN comes from the environment
    if spec.pdSpec.kvCacheOffloadingSpec.disk is not None:
        notes.append(("spec.pdSpec.kvCacheOffloadingSpec.disk.sizeGiB", "vLLM's file-system tier takes no size; "
                      "bound it with the volume at disk.path"))
    topology = spec.pdSpec.topologySpec or {}
    for key in ("placementGroup", "sameAZ"):
        if key in topology:
            notes.append((f"spec.pdSpec.topologySpec.{key}", "EC2 placement is the node group's; use topologyKey / "
                          "requiredAntiAffinity and nodeSelector"))
    scaling = spec.pdSpec.autoScalingSpec or {}
    for pool_key, section in scaling.items():
        for key in sorted(set(section or {}) & REFERENCE_SCALING_ONLY):
            notes.append((f"spec.pdSpec.autoScalingSpec.{pool_key}.{key}", "dpd's HPAs scale on the router's and "
                          "workers' own metrics (metric, targetValue); KEDA triggers are not rendered"))
    return [f"{path}: accepted, not applied: {why}" for path, why in notes]


# Per-pool autoscaling fields of the reference that dpd accepts without applying.
REFERENCE_SCALING_ONLY = frozenset({
    "prometheusTrigger", "prometheusTriggerList", "cloudWatchTrigger", "cloudWatchTriggerList",
    "initialCooldownPeriod", "scaleUpStabilizationTime",
})

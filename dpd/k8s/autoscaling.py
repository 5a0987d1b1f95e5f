"""``pdSpec.autoScalingSpec`` → per-pool HorizontalPodAutoscalers on custom metrics.

The reference resource keeps ``autoScalingSpec`` free-form, so the model stores it as a map;
this module reads it (pure) with errors that name the field path, like ``dpd validate``.

Each pool scales on its own signal, served to the HPA by a Prometheus adapter from the
workers' vLLM metrics (``adapter_rules`` is the adapter's rule set):

- prefill (compute-bound): ``num_requests_waiting`` (requests queued on the worker) or
  ``prompt_tokens_rate`` (prompt tokens/s the worker prefills; target it below the measured
  prefill throughput per worker so the queue stays short);
- decode (memory-bound): ``num_requests_running`` (concurrent sequences) or
  ``kv_cache_usage`` (fraction of the KV cache in use, 0–1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpd.config.model import PoolSpec
from dpd.config.reference import REFERENCE_SCALING_ONLY

# metric name → (custom-metric name the adapter serves, Prometheus series, default target)
METRICS: dict[str, dict[str, tuple[str, str, float]]] = {
    "prefill": {
        "num_requests_waiting": ("dpd_vllm_num_requests_waiting", "vllm:num_requests_waiting", 4),
        "prompt_tokens_rate": ("dpd_vllm_prompt_tokens_rate", "vllm:prompt_tokens_total", 4000),
    },
    "decode": {
        "num_requests_running": ("dpd_vllm_num_requests_running", "vllm:num_requests_running", 32),
        "kv_cache_usage": ("dpd_vllm_kv_cache_usage", "vllm:kv_cache_usage_perc", 0.8),
    },
}
POOL_KEYS = {"prefill": "prefillAutoScaling", "decode": "decodingAutoScaling"}
_FIELDS = {"minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod", "metric", "targetValue",
           "scaleDownStabilizationTime"}  # the reference's name for the scale-down window, where cooldownPeriod is unset


class RenderError(ValueError):
    """A config that parses but cannot be rendered; ``problems`` name field paths."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(f"{len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass(frozen=True)
class PoolAutoscaling:
    pool: str
    min_replicas: int
    max_replicas: int
    cooldown_s: int
    metric: str
    target_value: float

    @property
    def custom_metric(self) -> str:
        return METRICS[self.pool][self.metric][0]


def _int(value: Any, path: str, problems: list[str], minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        problems.append(f"{path}: must be an integer >= {minimum}, got {value!r}")
        return minimum
    return value


def parse_autoscaling(spec: dict[str, Any] | None, pools: dict[str, PoolSpec]) -> dict[str, PoolAutoscaling]:
    """The pools that autoscale, keyed by pool name; raises ``RenderError`` on any mistake."""
    base = "spec.pdSpec.autoScalingSpec"
    problems: list[str] = []
    result: dict[str, PoolAutoscaling] = {}
    spec = spec or {}
    for key in sorted(set(spec) - set(POOL_KEYS.values())):
        problems.append(f"{base}.{key}: unknown field; allowed: {', '.join(POOL_KEYS.values())}")
    for pool, key in POOL_KEYS.items():
        section = spec.get(key)
        if section is None:
            continue
        path = f"{base}.{key}"
        if not isinstance(section, dict):
            problems.append(f"{path}: expected a mapping")
            continue
        for extra in sorted(set(section) - _FIELDS - REFERENCE_SCALING_ONLY):
            problems.append(f"{path}.{extra}: unknown field; allowed: {', '.join(sorted(_FIELDS))}")
        min_replicas = _int(section.get("minReplicaCount", max(1, pools[pool].replicas)), f"{path}.minReplicaCount", problems, 1)
        if "maxReplicaCount" not in section:
            problems.append(f"{path}.maxReplicaCount: required field is missing")
        max_replicas = _int(section.get("maxReplicaCount", min_replicas), f"{path}.maxReplicaCount", problems, 1)
        if max_replicas < min_replicas:
            problems.append(f"{path}.maxReplicaCount: must be >= minReplicaCount ({min_replicas}), got {max_replicas}")
        _int(section.get("pollingInterval", 30), f"{path}.pollingInterval", problems, 1)
        cooldown_key = "cooldownPeriod" if "cooldownPeriod" in section or "scaleDownStabilizationTime" not in section \
            else "scaleDownStabilizationTime"
        cooldown_s = _int(section.get(cooldown_key, 300), f"{path}.{cooldown_key}", problems, 0)
        metric = section.get("metric", next(iter(METRICS[pool])))
        if metric not in METRICS[pool]:
            problems.append(f"{path}.metric: must be one of {', '.join(METRICS[pool])}, got {metric!r}")
            continue
        target = section.get("targetValue", METRICS[pool][metric][2])
        if isinstance(target, bool) or not isinstance(target, int | float) or target <= 0:
            problems.append(f"{path}.targetValue: must be a number > 0, got {target!r}")
            continue
        result[pool] = PoolAutoscaling(pool, min_replicas, max_replicas, cooldown_s, metric, float(target))
    if problems:
        raise RenderError(sorted(problems))
    return result


def quantity(value: float) -> str:
    """A Kubernetes quantity: integers as is, fractions in milli-units (0.8 → ``800m``)."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def hpa(name: str, deployment: str, labels: dict[str, str], namespace: dict[str, str], scaling: PoolAutoscaling) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, **namespace, "labels": labels},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": scaling.custom_metric},
                        "target": {"type": "AverageValue", "averageValue": quantity(scaling.target_value)},
                    },
                }
            ],
            "behavior": {
                # Scale up at once (a queue is already latency); down only after the cooldown,
                # one pod at a time, so a decoder holding long generations is not cut in a burst.
                "scaleUp": {"stabilizationWindowSeconds": 0},
                "scaleDown": {
                    "stabilizationWindowSeconds": scaling.cooldown_s,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
                },
            },
        },
    }


def adapter_rules() -> dict[str, Any]:
    """The Prometheus adapter's ``rules`` serving every pool metric above per pod."""
    rules = []
    for pool_metrics in METRICS.values():
        for custom, series, _ in pool_metrics.values():
            is_counter = series.endswith("_total")
            query = (
                "sum(rate(<<.Series>>{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>)"
                if is_counter
                else "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"
            )
            rules.append(
                {
                    "seriesQuery": f'{{__name__="{series}",namespace!="",pod!=""}}',
                    "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
                    "name": {"matches": f"^{series}$", "as": custom},
                    "metricsQuery": query,
                }
            )
    return {"rules": rules}

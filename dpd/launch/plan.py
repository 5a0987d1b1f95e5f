"""From a config to the exact worker processes to start: commands, ports, cores, env.

Pure functions (no processes, no I/O) so the plan is unit-tested and printed by
``dpd serve --dry-run``. Workers are numbered prefill first, then decode; worker *i* gets HTTP
port ``workerBasePort + i`` and NIXL side-channel port ``sideChannelBasePort + stride*i``, the
stride being max(8, tensor-parallel size): vLLM adds the rank to the side-channel port, so the
ranks of one worker must not collide with the next.

In colocated mode the same workers run as independent full servers: no KV transfer config and
all of them in the router's decode pool. It is the baseline every benchmark compares against.

Devices (``choose_devices``): on CPU every worker is pinned to ``cpusPerWorker`` cores and gets
vLLM-CPU's settings; on a node with NVIDIA GPUs (and the CUDA engine installed) every worker
gets ``gpus_per_worker`` GPUs of its own (``CUDA_VISIBLE_DEVICES``, prefill workers first,
contiguous so a tensor-parallel group shares NVLink where the node has it), its KV buffer on the
GPU, and UCX transports that move KV between local GPUs by CUDA IPC (NVLink or PCIe peer).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from dpd.config.model import GPU_RESOURCE, InferenceEndpointConfig, PoolSpec

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
    cores: tuple[int, ...]  # CPU workers: the cores it is pinned to; () on GPU workers
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    gpus: tuple[str, ...] = ()  # GPU workers: its GPUs (CUDA_VISIBLE_DEVICES)
    events_endpoint: str | None = None  # where it publishes KV-cache events (prefix-aware routing), else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def devices(self) -> str:
        """What it computes on, for logs and ``--dry-run``."""
        if self.gpus:
            return f"GPU{'s' if len(self.gpus) > 1 else ''} {','.join(self.gpus)}"
        return f"cores {','.join(map(str, self.cores))}"


# -- devices ---------------------------------------------------------------------------------------

# Between GPUs of one node UCX moves KV by CUDA IPC (NVLink, else PCIe peer-to-peer); cuda_copy
# stages what IPC cannot reach; sm/self/tcp carry UCX's own wire-up. A pool's env may override.
GPU_UCX_TLS = "cuda_ipc,cuda_copy,sm,self,tcp"
CUDA_ENGINE, CPU_ENGINE = "vllm", "vllm-cpu"


@dataclass(frozen=True)
class Devices:
    """What a plan's workers compute on: ``kind`` and, for GPUs, the node's GPU ids to assign."""

    kind: Literal["cpu", "gpu"]
    gpus: tuple[str, ...] = ()
    why: str = ""


def detect_gpus() -> list[str]:
    """The NVIDIA GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` where set, else those
    ``nvidia-smi`` lists; [] on a machine without them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [g.strip() for g in visible.split(",") if g.strip()]
        return [] if not ids or ids[0].startswith("-") else ids
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip().isdigit()]


def installed_engine() -> str | None:
    """Which vLLM build is installed: ``vllm`` (CUDA), ``vllm-cpu``, or None."""
    for name in (CPU_ENGINE, CUDA_ENGINE):
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name
    return None


def _gpu_asks(config: InferenceEndpointConfig) -> list[str]:
    pd = config.spec.pdSpec
    asks = [f"pdSpec.{name}.resources {GPU_RESOURCE}" for name, pool in (("prefillSpec", pd.prefillSpec),
                                                                        ("decodingSpec", pd.decodingSpec)) if pool.gpus_requested]
    if pd.kvTransferSpec.bufferDevice == "cuda":
        asks.append("pdSpec.kvTransferSpec.bufferDevice: cuda")
    return asks


def choose_devices(config: InferenceEndpointConfig, *, gpus: list[str], engine: str | None) -> Devices:
    """CPU or GPU workers for this config on a node with ``gpus`` and ``engine`` installed (see
    ``pdSpec.local.device``); a clear ``PlanError`` where the config cannot run here."""
    wanted = config.spec.pdSpec.local.device
    asks = _gpu_asks(config)
    found = f"{len(gpus)} NVIDIA GPU{'s' if len(gpus) != 1 else ''}" if gpus else "no NVIDIA GPU"
    if wanted == "cpu":
        if asks:
            raise PlanError(f"pdSpec.local.device is cpu but the config asks for GPUs ({'; '.join(asks)})")
        return Devices("cpu", why="pdSpec.local.device: cpu")
    if gpus and engine != CPU_ENGINE:
        return Devices("gpu", tuple(gpus), why=f"{found} ({', '.join(gpus)})")
    if wanted == "gpu" or asks:
        reason = "pdSpec.local.device: gpu" if wanted == "gpu" else "the config asks for GPUs (" + "; ".join(asks) + ")"
        if not gpus:
            raise PlanError(f"{reason}, but this machine has {found} (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES "
                            "hides them); run it on a GPU node, or render it for a cluster with `dpd render`")
        raise PlanError(f"{reason}, but the installed engine is vllm-cpu; install the CUDA engine with "
                        "`DPD_ENGINE=gpu make install`")
    if gpus:
        return Devices("cpu", why=f"{found}, but the installed engine is vllm-cpu (`DPD_ENGINE=gpu make install` "
                                  "installs the CUDA one)")
    return Devices("cpu", why=found)


def _assign_gpus(pools: list[tuple[str, PoolSpec]], gpus: tuple[str, ...]) -> list[tuple[str, ...]]:
    need = sum(pool.replicas * pool.gpus_per_worker for _, pool in pools)
    if need > len(gpus):
        detail = ", ".join(f"{name} {pool.replicas} × {pool.gpus_per_worker}" for name, pool in pools if pool.replicas)
        raise PlanError(f"the config asks for {need} GPUs ({detail} per worker) but this machine has {len(gpus)} "
                        f"({', '.join(gpus) or 'none'}); lower replicas or tensorParallelSize")
    assigned, next_gpu = [], 0
    for _, pool in pools:
        for _ in range(pool.replicas):
            assigned.append(gpus[next_gpu:next_gpu + pool.gpus_per_worker])
            next_gpu += pool.gpus_per_worker
    return assigned


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


def kv_buffer_device(config: InferenceEndpointConfig, is_gpu: bool) -> str:
    """The KV buffer's device: the config's, where ``auto`` is ``cuda`` on GPU workers."""
    device = config.spec.pdSpec.kvTransferSpec.bufferDevice
    return ("cuda" if is_gpu else "cpu") if device == "auto" else device


def pool_is_gpu(config: InferenceEndpointConfig, pool: PoolSpec) -> bool:
    """On a cluster: whether a pool's workers are GPU workers (it asks for GPUs, or KV buffers on cuda)."""
    return bool(pool.gpus_requested) or config.spec.pdSpec.kvTransferSpec.bufferDevice == "cuda"


def kv_transfer_config(config: InferenceEndpointConfig, kv_role: str, buffer_device: str) -> dict:
    kv = config.spec.pdSpec.kvTransferSpec
    return {
        "kv_connector": kv.connector,
        "kv_role": kv_role,
        "kv_buffer_device": buffer_device,
        "kv_load_failure_policy": kv.kvLoadFailurePolicy,
        "kv_connector_extra_config": {
            "backends": list(kv.backends),
            "kv_lease_duration": kv.kvLeaseDurationS,
            "num_threads": kv.numThreads,
        },
    }


KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}  # a pool's NIXL role: its preferred phase
# The CPU tier of the reference's kvCacheSpec.enableL1Cache when the config gives no size.
DEFAULT_L1_CACHE_GIB = 20.0


def offload_cpu_gib(config: InferenceEndpointConfig) -> float:
    """GiB of CPU memory per GPU worker for offloaded KV blocks: ``kvCacheOffloadingSpec.cpuGiB``,
    else the reference's ``kvCacheSpec.enableL1Cache`` at ``DEFAULT_L1_CACHE_GIB``; 0 = none."""
    spec = config.spec
    offload = spec.pdSpec.kvCacheOffloadingSpec
    if offload.cpuGiB > 0:
        return offload.cpuGiB
    if spec.kvCacheSpec is not None and spec.kvCacheSpec.enableL1Cache:
        return DEFAULT_L1_CACHE_GIB
    if offload.disk is not None:
        return DEFAULT_L1_CACHE_GIB  # the disk tier sits behind a CPU tier
    return 0.0


def offloading_connector(config: InferenceEndpointConfig) -> dict | None:
    """vLLM's native offloading connector for GPU workers: a CPU tier, and a file-system tier
    behind it when ``kvCacheOffloadingSpec.disk`` is set; None without offloading."""
    cpu_gib = offload_cpu_gib(config)
    if cpu_gib <= 0:
        return None
    extra: dict = {"cpu_bytes_to_use": int(cpu_gib * (1 << 30))}
    disk = config.spec.pdSpec.kvCacheOffloadingSpec.disk
    if disk is not None:
        extra["spec_name"] = "TieringOffloadingSpec"
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": disk.path}]
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def worker_kv_config(config: InferenceEndpointConfig, kv_role: str | None, is_gpu: bool) -> dict | None:
    """The ``--kv-transfer-config`` of one worker: NIXL for P/D, composed with the offloading
    connector on GPU workers (vLLM's MultiConnector: NIXL first, so the P/D pull is tried before
    the CPU tier); the offloading connector alone on a colocated GPU worker; None otherwise."""
    offload = offloading_connector(config) if is_gpu else None
    nixl = kv_transfer_config(config, kv_role, kv_buffer_device(config, is_gpu)) if kv_role is not None else None
    if nixl is None or offload is None:
        return nixl or offload
    return {"kv_connector": "MultiConnector", "kv_role": kv_role,
            "kv_connector_extra_config": {"connectors": [nixl, offload]}}


def tracing_env(config: InferenceEndpointConfig) -> dict[str, str]:
    """A worker's environment for vLLM's tracing when ``router.tracing`` is on: OTLP over HTTP
    (vLLM's default is gRPC; the collector URL is an OTLP/HTTP one)."""
    if config.spec.pdSpec.router.tracing.otlpEndpoint is None:
        return {}
    return {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "dpd-worker"}


def tracing_port(config: InferenceEndpointConfig) -> int | None:
    """The collector's port, for the workers' egress policy; None when tracing is off."""
    endpoint = config.spec.pdSpec.router.tracing.otlpEndpoint
    if endpoint is None:
        return None
    parsed = urlsplit(endpoint)
    return parsed.port or (443 if parsed.scheme == "https" else 80)


RUN_DIR_PLACEHOLDER = "$RUN_DIR"  # the run directory in a plan printed before it exists (--dry-run)


def kv_events_endpoint(config: InferenceEndpointConfig, *, host: str, port: int, events_dir: str) -> str | None:
    """Where the worker serving on ``host:port`` publishes its KV-cache events, or None without
    prefix-aware routing's events. vLLM's publisher *binds* only a wildcard TCP address or an
    ``ipc://`` path and connects to anything else, so: on a cluster (a wildcard host) the pod's
    port + ``kvEventsPortOffset``; on one machine a Unix socket in ``events_dir`` (the run
    directory, private to the user: the events carry token ids)."""
    prefix = config.spec.pdSpec.router.prefixAware
    if not (prefix.enabled and prefix.kvEvents):
        return None
    if host in ("0.0.0.0", "::", "*"):
        return f"tcp://*:{port + prefix.kvEventsPortOffset}"
    return f"ipc://{events_dir}/kv-events-{port}"


def vllm_args(config: InferenceEndpointConfig, pool: PoolSpec, *, model: str, host: str, port: int,
              kv_role: str | None, is_gpu: bool = False, events_dir: str = RUN_DIR_PLACEHOLDER) -> list[str]:
    """The vLLM server arguments of one worker, before the pool's own ``args`` — the one
    builder the local launcher and the Kubernetes renderer share."""
    spec = config.spec
    args = [
        "--model", model,
        "--served-model-name", spec.modelName,
        "--host", host,
        "--port", str(port),
        "--max-model-len", str(spec.maxModelLen),
        # usage.prompt_tokens_details.cached_tokens: the router reports each request's prefix-cache hit.
        "--enable-prompt-tokens-details",
    ]
    if pool.tensorParallelSize > 1:
        args += ["--tensor-parallel-size", str(pool.tensorParallelSize)]
    if is_gpu and pool.gpuMemoryUtilization is not None:
        args += ["--gpu-memory-utilization", f"{pool.gpuMemoryUtilization:g}"]
    source = spec.modelSourceConfig
    if source.revision:
        args += ["--revision", source.revision]
    if (kv_config := worker_kv_config(config, kv_role, is_gpu)) is not None:
        args += ["--kv-transfer-config", json.dumps(kv_config, separators=(",", ":"), sort_keys=True)]
    # The router's prefix index follows the engine (router/kvevents.py).
    if (endpoint := kv_events_endpoint(config, host=host, port=port, events_dir=events_dir)) is not None:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events", "endpoint": endpoint}
        args += ["--kv-events-config", json.dumps(events, separators=(",", ":"), sort_keys=True)]
    if (collector := spec.pdSpec.router.tracing.otlpEndpoint) is not None:
        args += ["--otlp-traces-endpoint", collector]  # the router's traceparent makes its spans children of the hop's
    return args


VLLM_DEFAULT_BLOCK_SIZE = {False: 128, True: 16}  # vLLM 0.32's KV block size on CPU / GPU workers


def kv_block_size(config: InferenceEndpointConfig, is_gpu: bool) -> int:
    """The workers' KV block size, for the router's prefix index: ``router.prefixAware.blockSize``,
    else a pool's ``--block-size``, else vLLM's default for the device."""
    pd = config.spec.pdSpec
    if pd.router.prefixAware.blockSize is not None:
        return pd.router.prefixAware.blockSize
    for pool in (pd.decodingSpec, pd.prefillSpec):
        args = list(pool.args)
        for i, arg in enumerate(args):
            if arg == "--block-size" and i + 1 < len(args) and args[i + 1].isdigit():
                return int(args[i + 1])
            if arg.startswith("--block-size=") and arg.split("=", 1)[1].isdigit():
                return int(arg.split("=", 1)[1])
    return VLLM_DEFAULT_BLOCK_SIZE[is_gpu]


def _nixl_env(config: InferenceEndpointConfig, is_gpu: bool) -> dict[str, str]:
    env = {"UCX_RCACHE_MAX_UNRELEASED": "1024"}  # what vLLM asks for; it cannot set it itself once NIXL is imported
    if is_gpu:
        # No progress-delay shim on GPUs: a GPU node has cores to spare for NIXL's progress thread.
        return {**env, "UCX_TLS": GPU_UCX_TLS}
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
    devices: Devices | None = None,
    events_dir: str = RUN_DIR_PLACEHOLDER,
) -> list[WorkerPlan]:
    """The workers of ``config``; ``devices`` from ``choose_devices`` (default: CPU workers);
    ``events_dir`` the directory of the workers' KV-event sockets (the run directory)."""
    spec = config.spec
    devices = devices or Devices("cpu")
    is_gpu = devices.kind == "gpu"
    if has_native_bf16 is None:
        has_native_bf16 = is_gpu or cpu_has_native_bf16()
    pd = spec.pdSpec
    if pd.kvCacheOffloadingSpec.is_enabled and not is_gpu:
        raise PlanError(
            "spec.pdSpec.kvCacheOffloadingSpec: KV-cache offloading needs GPU workers; on vllm-cpu the KV cache "
            "already lives in CPU memory. Remove kvCacheOffloadingSpec to run on CPUs, or run it on a GPU node."
        )
    cores = cores if cores is not None else available_cores()
    pools = [("prefill", pd.prefillSpec), ("decode", pd.decodingSpec)]
    core_sets = _assign_cores(pools, cores) if not is_gpu else [() for _, pool in pools for _ in range(pool.replicas)]
    gpu_sets = _assign_gpus(pools, devices.gpus) if is_gpu else [() for _ in core_sets]
    local = pd.local
    stride = max(SIDE_CHANNEL_STRIDE, pd.prefillSpec.tensorParallelSize, pd.decodingSpec.tensorParallelSize)
    plans: list[WorkerPlan] = []
    index = 0
    # The reference's worker section, as on a cluster: its args before each pool's, its
    # environment (plain values; a valueFrom reads a cluster object) under dpd's and each pool's.
    worker = config.spec.worker
    shared_args = tuple(worker.args) if worker else ()
    shared_env = {e["name"]: str(e["value"]) for e in (worker.environmentVariables if worker else ())
                  if isinstance(e, dict) and "name" in e and "value" in e}
    for pool_name, pool in pools:
        kv_role = None if is_colocated else KV_ROLES[pool_name]
        for replica in range(pool.replicas):
            port = local.workerBasePort + index
            side_port = local.sideChannelBasePort + stride * index
            worker_cores, worker_gpus = core_sets[index], gpu_sets[index]
            command = [python, "-m", "vllm.entrypoints.openai.api_server",
                       *vllm_args(config, pool, model=model_path, host="127.0.0.1", port=port, kv_role=kv_role,
                                  is_gpu=is_gpu, events_dir=events_dir),
                       *dtype_args(shared_args + pool.args, has_native_bf16), *shared_args, *pool.args]
            device_env = ({"CUDA_VISIBLE_DEVICES": ",".join(worker_gpus)} if is_gpu else {
                "VLLM_CPU_KVCACHE_SPACE": f"{pool.kvCacheGiB:g}",
                "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in worker_cores),
            })
            env = {
                **shared_env,  # under dpd's own (cores, NIXL) and the pool's
                **(_nixl_env(config, is_gpu) if kv_role is not None else {}),
                **device_env,
                **tracing_env(config),
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
                    gpus=worker_gpus,
                    events_endpoint=kv_events_endpoint(config, host="127.0.0.1", port=port, events_dir=events_dir),
                )
            )
            index += 1
    return plans


def oversubscribed(plans: list[WorkerPlan]) -> bool:
    used = [c for p in plans for c in p.cores]
    return len(used) != len(set(used))

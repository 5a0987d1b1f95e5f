"""plan_workers: config -> exact worker commands, ports, cores and env (pure, no processes)."""

import json
import os

import pytest

from dpd.config import parse_config
from dpd.launch.plan import SIDE_CHANNEL_STRIDE, Devices, PlanError, oversubscribed, plan_workers

MODEL = "/models/smol"


def config(**pd_spec):
    return parse_config({"kind": "InferenceEndpointConfig", "spec": {"pdSpec": pd_spec}})


def plan(cfg=None, **kwargs):
    kwargs.setdefault("cores", [0, 1])
    kwargs.setdefault("python", "py")
    return plan_workers(cfg or config(), MODEL, **kwargs)


def flag(command, name):
    """The value following ``name`` in ``command``; None when the flag is absent."""
    command = list(command)
    if name not in command:
        return None
    assert command.count(name) == 1, command
    return command[command.index(name) + 1]


def kv_config(worker):
    value = flag(worker.command, "--kv-transfer-config")
    return None if value is None else json.loads(value)


@pytest.mark.parametrize(
    "index, name, pool, kv_role, port, core",
    [
        (0, "prefill-0", "prefill", "kv_producer", 8100, 0),
        (1, "decode-0", "decode", "kv_consumer", 8101, 1),
    ],
)
def test_default_config(index, name, pool, kv_role, port, core):
    plans = plan()
    assert [p.name for p in plans] == ["prefill-0", "decode-0"]
    w = plans[index]
    assert (w.name, w.pool, w.kv_role, w.port, w.cores) == (name, pool, kv_role, port, (core,))
    assert w.url == f"http://127.0.0.1:{port}"
    assert w.command[:3] == ("py", "-m", "vllm.entrypoints.openai.api_server")
    assert flag(w.command, "--model") == MODEL
    assert flag(w.command, "--served-model-name") == "smollm2-135m"
    assert flag(w.command, "--host") == "127.0.0.1"
    assert flag(w.command, "--port") == str(port)
    assert flag(w.command, "--max-model-len") == "8192"
    assert flag(w.command, "--tensor-parallel-size") is None
    kv = kv_config(w)
    assert kv["kv_connector"] == "NixlConnector"
    assert kv["kv_role"] == kv_role
    assert kv["kv_buffer_device"] == "cpu"
    assert kv["kv_connector_extra_config"]["backends"] == ["UCX"]
    env = dict(w.env)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(core)
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(w.side_channel_port)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_default_side_channel_ports_are_distinct_and_strided():
    plans = plan()
    ports = [p.side_channel_port for p in plans]
    assert ports == [5600, 5600 + SIDE_CHANNEL_STRIDE]
    assert len(set(ports)) == len(ports)
    assert not set(ports) & {p.port for p in plans}
    assert not oversubscribed(plans)


def test_env_is_sorted_pairs_and_plan_is_deterministic():
    a, b = plan(), plan()
    assert a == b
    for w in a:
        assert list(w.env) == sorted(w.env)


@pytest.mark.parametrize("pd", [{}, {"prefillSpec": {"replicas": 2}, "decodingSpec": {"replicas": 3}}])
def test_colocated_has_no_kv_transfer(pd):
    plans = plan(config(**pd), is_colocated=True)
    assert plans
    for w in plans:
        assert w.kv_role is None
        assert "--kv-transfer-config" not in w.command
        assert not any("kv_role" in part for part in w.command)


@pytest.mark.parametrize(
    "prefill, decode, cores, expected",
    [
        (1, 1, [0, 1], False),
        (2, 2, [0, 1], True),
        (1, 2, [0, 1], True),
        (2, 2, [0, 1, 2, 3], False),
        (1, 1, [5], True),
        (0, 1, [0], False),
    ],
)
def test_oversubscribed(prefill, decode, cores, expected):
    cfg = config(prefillSpec={"replicas": prefill}, decodingSpec={"replicas": decode})
    plans = plan(cfg, cores=cores)
    assert len(plans) == prefill + decode
    assert oversubscribed(plans) is expected
    assert {c for p in plans for c in p.cores} <= set(cores)


def test_two_plus_two_numbering_ports_and_cores():
    plans = plan(config(prefillSpec={"replicas": 2}, decodingSpec={"replicas": 2}))
    assert [(p.name, p.kv_role, p.port, p.cores) for p in plans] == [
        ("prefill-0", "kv_producer", 8100, (0,)),
        ("prefill-1", "kv_producer", 8101, (1,)),
        ("decode-0", "kv_consumer", 8102, (0,)),
        ("decode-1", "kv_consumer", 8103, (1,)),
    ]
    assert [p.side_channel_port for p in plans] == [5600 + SIDE_CHANNEL_STRIDE * i for i in range(4)]
    assert oversubscribed(plans)


def test_cpus_per_worker_pins_consecutive_cores():
    cfg = config(prefillSpec={"cpusPerWorker": 2}, decodingSpec={"cpusPerWorker": 2})
    plans = plan(cfg, cores=[4, 5, 6, 7])
    assert [p.cores for p in plans] == [(4, 5), (6, 7)]
    assert [dict(p.env)["VLLM_CPU_OMP_THREADS_BIND"] for p in plans] == ["4,5", "6,7"]
    assert not oversubscribed(plans)


@pytest.mark.parametrize(
    "pool, args, worker",
    [
        ("prefillSpec", ["--enforce-eager"], 0),
        ("decodingSpec", ["--max-num-seqs", "8", "--enforce-eager"], 1),
    ],
)
@pytest.mark.parametrize("is_colocated", [False, True])
def test_extra_args_are_appended(pool, args, worker, is_colocated):
    plans = plan(config(**{pool: {"args": args}}), is_colocated=is_colocated)
    assert list(plans[worker].command[-len(args):]) == args
    other = plans[1 - worker]
    assert "--enforce-eager" not in other.command


def test_pool_env_and_kv_cache_size():
    cfg = config(decodingSpec={"kvCacheGiB": 0.5, "env": {"FOO": "bar"}})
    prefill, decode = plan(cfg)
    assert dict(decode.env)["VLLM_CPU_KVCACHE_SPACE"] == "0.5"
    assert dict(decode.env)["FOO"] == "bar"
    assert "FOO" not in dict(prefill.env)


@pytest.mark.parametrize(
    "offload",
    [{"cpuGiB": 4}, {"cpuGiB": 0.5}, {"disk": {"path": "/var/kv", "sizeGiB": 10}}],
)
@pytest.mark.parametrize("is_colocated", [False, True])
def test_kv_offloading_on_cpu_is_a_plan_error(offload, is_colocated):
    cfg = config(kvCacheOffloadingSpec=offload, kvTransferSpec={"bufferDevice": "cpu"})
    with pytest.raises(PlanError, match=r"spec\.pdSpec\.kvCacheOffloadingSpec"):
        plan(cfg, is_colocated=is_colocated)


@pytest.mark.parametrize(
    "pd",
    [
        {"kvCacheOffloadingSpec": {"cpuGiB": 0}},
        {"kvCacheOffloadingSpec": {"cpuGiB": 4}, "kvTransferSpec": {"bufferDevice": "cuda"}},
    ],
)
def test_kv_offloading_allowed_when_disabled_or_on_gpu(pd):
    is_gpu = "kvTransferSpec" in pd
    plans = plan(config(**pd), devices=Devices("gpu", ("0", "1")) if is_gpu else None)
    if is_gpu:  # NIXL composed with the CPU offloading tier (test_vllm_parses_workers.py checks it with vLLM)
        assert [kv_config(p)["kv_connector"] for p in plans] == ["MultiConnector"] * 2
        nixl = [kv_config(p)["kv_connector_extra_config"]["connectors"][0] for p in plans]
        assert [c["kv_buffer_device"] for c in nixl] == ["cuda"] * 2
    else:
        assert [kv_config(p)["kv_buffer_device"] for p in plans] == ["cpu"] * 2


@pytest.mark.parametrize("tp, expected", [(1, None), (2, "2"), (4, "4")])
def test_tensor_parallel_size(tp, expected):
    prefill, decode = plan(config(prefillSpec={"tensorParallelSize": tp}))
    assert flag(prefill.command, "--tensor-parallel-size") == expected
    assert flag(decode.command, "--tensor-parallel-size") is None


def test_kv_transfer_spec_fields_reach_the_json():
    cfg = config(
        kvTransferSpec={"backends": ["UCX", "POSIX"], "kvLeaseDurationS": 90, "numThreads": 4, "kvLoadFailurePolicy": "fail"}
    )
    kv = kv_config(plan(cfg)[1])
    assert kv == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"backends": ["UCX", "POSIX"], "kv_lease_duration": 90, "num_threads": 4},
    }


def test_local_ports_and_model_settings_come_from_config():
    cfg = parse_config(
        {
            "spec": {
                "modelName": "tiny",
                "maxModelLen": 1024,
                "pdSpec": {"local": {"workerBasePort": 9000, "sideChannelBasePort": 7000}},
            }
        }
    )
    plans = plan(cfg)
    assert [p.port for p in plans] == [9000, 9001]
    assert [p.side_channel_port for p in plans] == [7000, 7000 + SIDE_CHANNEL_STRIDE]
    assert {flag(p.command, "--served-model-name") for p in plans} == {"tiny"}
    assert {flag(p.command, "--max-model-len") for p in plans} == {"1024"}


def test_rank_side_channel_ports_never_collide():
    cfg = config(prefillSpec={"tensorParallelSize": 16}, decodingSpec={"tensorParallelSize": 16})
    try:
        plans = plan(cfg)
    except PlanError:
        return  # rejecting the config is an acceptable fix too
    used = [p.side_channel_port + rank for p in plans for rank in range(16)]
    assert len(used) == len(set(used))


@pytest.mark.parametrize("delay_us, expect_shim", [(2000, True), (0, False)])
def test_nixl_progress_delay_env(delay_us, expect_shim):
    """Disaggregated workers get the NIXL progress-delay shim (docs/pd-stall.md); colocated never."""
    cfg = config(kvTransferSpec={"nixlProgressDelayUs": delay_us})
    for p in plan(cfg):
        env = dict(p.env)
        assert env["UCX_RCACHE_MAX_UNRELEASED"] == "1024"
        assert ("DPD_NIXL_PROGRESS_DELAY_US" in env) is expect_shim
        if expect_shim:
            assert env["DPD_NIXL_PROGRESS_DELAY_US"] == str(delay_us)
            assert env["PYTHONPATH"].split(os.pathsep)[0].endswith("worker_site")
    for p in plan(cfg, is_colocated=True):
        assert "DPD_NIXL_PROGRESS_DELAY_US" not in dict(p.env)


@pytest.mark.parametrize("has_bf16, args, expected", [
    (False, (), "float32"),  # an AVX2-only CPU: bf16 would be emulated
    (True, (), None),  # native bf16: vLLM's default
    (False, ("--dtype", "bfloat16"), "bfloat16"),  # the pool's own choice stands
    (False, ("--dtype=bfloat16",), None),
])
def test_dtype_follows_the_cpu(has_bf16, args, expected):
    plans = plan(config(prefillSpec={"args": list(args)}, decodingSpec={"args": list(args)}), has_native_bf16=has_bf16)
    for w in plans:
        assert flag(w.command, "--dtype") == expected


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    from dpd.launch.plan import cpu_has_native_bf16

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n")
    assert cpu_has_native_bf16(str(info)) is False
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert cpu_has_native_bf16(str(info)) is True
    assert cpu_has_native_bf16(str(tmp_path / "missing")) is True


@pytest.mark.parametrize("local, router, clash", [
    ({"workerBasePort": 7999}, {}, "both decode-0 HTTP and router"),  # decode-0 on 8000, the router's
    ({"workerBasePort": 9000, "sideChannelBasePort": 9000}, {}, "both prefill-0 HTTP and prefill-0 NIXL side channel"),
    ({}, {"metricsPort": 8101}, "both decode-0 HTTP and router metrics"),
])
def test_two_users_of_one_port_are_refused_before_anything_starts(local, router, clash):
    from dpd.launch.serve import LaunchError, planned_ports

    cfg = config(local=local, router=router)
    with pytest.raises(LaunchError, match=clash):
        planned_ports(plan(cfg), cfg.spec.pdSpec.router, is_colocated=False)
    assert len(planned_ports(plan(), config().spec.pdSpec.router, is_colocated=False)) == 5


def test_the_reference_worker_section_applies_locally_as_on_a_cluster():
    """worker.args go before each pool's own; worker.environmentVariables with plain values reach
    every worker (a pool's env wins); dpd's own flags cannot be overridden there either."""
    cfg = parse_config({"kind": "InferenceEndpointConfig", "spec": {
        "worker": {"args": ["--max-num-seqs", "8"], "environmentVariables": [
            {"name": "A", "value": "1"}, {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
        "pdSpec": {"decodingSpec": {"args": ["--max-num-seqs", "4"], "env": {"A": "2"}}}}})
    prefill, decode = plan(cfg)
    assert list(prefill.command[-2:]) == ["--max-num-seqs", "8"]
    assert list(decode.command[-4:]) == ["--max-num-seqs", "8", "--max-num-seqs", "4"]  # the pool's last: it wins
    assert dict(prefill.env)["A"] == "1" and dict(decode.env)["A"] == "2" and "B" not in dict(prefill.env)
    from dpd.config.load import ConfigError

    with pytest.raises(ConfigError, match="--port is set by dpd"):
        parse_config({"kind": "InferenceEndpointConfig", "spec": {"worker": {"args": ["--port", "8080"]}}})

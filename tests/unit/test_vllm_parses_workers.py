"""Every GPU worker command dpd plans (``dpd serve`` on a GPU node) or renders (``dpd render``)
is parsed by vLLM's own ``vllm serve`` argument parser, and its KV-transfer config is built by
vLLM's own config class — no GPU needed: a command that would not start on a GPU node fails here."""

from pathlib import Path

import pytest
import yaml

from dpd.config import load_config
from dpd.k8s.render import render
from dpd.launch.plan import Devices, plan_workers

GPU_EXAMPLES = sorted(str(p) for p in Path("examples").glob("gpu-*.yaml"))


@pytest.fixture(scope="module")
def vllm_parse():
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())

    def parse(argv):
        namespace = parser.parse_args(list(argv))  # an unknown flag or bad value exits (SystemExit)
        validate_parsed_serve_args(namespace)
        return namespace, AsyncEngineArgs.from_cli_args(namespace)

    return parse


def planned(path):
    config = load_config(path)
    num_gpus = sum(pool.replicas * pool.gpus_per_worker
                   for pool in (config.spec.pdSpec.prefillSpec, config.spec.pdSpec.decodingSpec))
    return config, plan_workers(config, "/models/m", python="py", devices=Devices("gpu", tuple(map(str, range(num_gpus)))))


def rendered_workers(path):
    docs = [d for d in render(yaml.safe_load(Path(path).read_text())) if d and d.get("kind") == "Deployment"]
    return [d for d in docs if d["spec"]["template"]["spec"]["containers"][0]["name"] == "vllm"]


def gpu_8x_with_router(tmp_path, **router) -> tuple[dict, Path]:
    """examples/gpu-8x.yaml with these ``router`` fields, and the file it was written to."""
    document = yaml.safe_load(Path("examples/gpu-8x.yaml").read_text())
    document["spec"]["pdSpec"].setdefault("router", {}).update(router)
    path = tmp_path / "endpoint.yaml"
    path.write_text(yaml.safe_dump(document))
    return document, path


def test_there_are_gpu_examples():
    assert len(GPU_EXAMPLES) >= 3, GPU_EXAMPLES


@pytest.mark.parametrize("path", GPU_EXAMPLES)
def test_planned_gpu_workers_parse(vllm_parse, path):
    config, plans = planned(path)
    for plan in plans:
        assert plan.command[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
        namespace, engine = vllm_parse(plan.command[3:])
        pool = config.spec.pdSpec.prefillSpec if plan.pool == "prefill" else config.spec.pdSpec.decodingSpec
        assert engine.tensor_parallel_size == pool.tensorParallelSize
        assert namespace.port == plan.port
        kv = engine.kv_transfer_config
        assert kv.kv_role == plan.kv_role
        if config.spec.pdSpec.kvCacheOffloadingSpec.is_enabled:
            nixl, offload = check_multi(kv)
        else:
            assert (kv.kv_connector, kv.kv_buffer_device) == ("NixlConnector", "cuda")
        if pool.gpuMemoryUtilization is not None:
            assert engine.gpu_memory_utilization == pool.gpuMemoryUtilization
        assert len(plan.gpus) == pool.gpus_per_worker


@pytest.mark.parametrize("path", GPU_EXAMPLES)
def test_rendered_gpu_workers_parse(vllm_parse, path):
    deployments = rendered_workers(path)
    assert deployments
    for deployment in deployments:
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["command"][1:] == ["-m", "vllm.entrypoints.openai.api_server"]
        _, engine = vllm_parse(container["args"])
        kv = engine.kv_transfer_config
        if kv.kv_connector == "MultiConnector":
            check_multi(kv)
        else:
            assert (kv.kv_connector, kv.kv_buffer_device) == ("NixlConnector", "cuda")


def check_multi(kv):
    """NIXL and the offloading connector, each built by vLLM's own config class."""
    from vllm.config import KVTransferConfig

    assert kv.kv_connector == "MultiConnector"
    children = [KVTransferConfig(**{"engine_id": kv.engine_id, **c}) for c in kv.kv_connector_extra_config["connectors"]]
    assert [c.kv_connector for c in children] == ["NixlConnector", "OffloadingConnector"]
    assert children[0].kv_buffer_device == "cuda" and children[0].kv_role == kv.kv_role
    assert children[1].kv_connector_extra_config["cpu_bytes_to_use"] > 0
    return children


def test_the_offloading_example_composes_nixl_and_offloading(vllm_parse):
    config, plans = planned("examples/gpu-8x.yaml")
    for plan in plans:
        _, engine = vllm_parse(plan.command[3:])
        _, offload = check_multi(engine.kv_transfer_config)
        assert offload.kv_connector_extra_config["cpu_bytes_to_use"] == 64 << 30


def test_a_disk_tier_is_a_file_system_tier_behind_the_cpu_one(vllm_parse, tmp_path):
    import yaml as _yaml

    document = _yaml.safe_load(Path("examples/gpu-8x.yaml").read_text())
    document["spec"]["pdSpec"]["kvCacheOffloadingSpec"]["disk"] = {"path": "/mnt/kv", "sizeGiB": 500}
    path = tmp_path / "disk.yaml"
    path.write_text(_yaml.safe_dump(document))
    _, plans = planned(str(path))
    _, engine = vllm_parse(plans[0].command[3:])
    _, offload = check_multi(engine.kv_transfer_config)
    assert offload.kv_connector_extra_config["spec_name"] == "TieringOffloadingSpec"
    assert offload.kv_connector_extra_config["secondary_tiers"] == [{"type": "fs", "root_dir": "/mnt/kv"}]


@pytest.mark.parametrize("path", sorted(str(p) for p in Path("tests/unit/fixtures/hyperpod").glob("*.yaml")))
def test_hyperpod_resources_render_workers_vllm_accepts(vllm_parse, path):
    for deployment in rendered_workers(path):
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        vllm_parse(container["args"])


def test_a_bad_pool_arg_is_caught_by_the_parser(vllm_parse):
    config, plans = planned(GPU_EXAMPLES[0])
    with pytest.raises(SystemExit):
        vllm_parse([*plans[0].command[3:], "--no-such-vllm-flag", "1"])


def test_examples_render_as_yaml():
    for path in GPU_EXAMPLES:
        assert yaml.safe_dump_all(render(yaml.safe_load(Path(path).read_text())))


def test_tracing_reaches_every_worker_vllm_accepts_it(vllm_parse, tmp_path):
    """Issue 15: router.tracing on → every worker, planned or rendered, exports to the same
    collector over OTLP/HTTP, and the workers' egress policy lets it."""
    collector = "http://otel-collector.monitoring:4318/v1/traces"
    document, path = gpu_8x_with_router(tmp_path, tracing={"otlpEndpoint": collector})
    _, plans = planned(str(path))
    for plan in plans:
        namespace, _ = vllm_parse(plan.command[3:])
        assert namespace.otlp_traces_endpoint == collector
        assert dict(plan.env)["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    docs = [d for d in render(document) if d]
    for worker in rendered_workers(str(path)):
        container = worker["spec"]["template"]["spec"]["containers"][0]
        namespace, _ = vllm_parse(container["args"])
        assert namespace.otlp_traces_endpoint == collector
        assert {"name": "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "value": "http/protobuf"} in container["env"]
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("workers"))
    assert {"ports": [{"port": 4318, "protocol": "TCP"}]} in policy["spec"]["egress"]


def test_prefix_aware_workers_publish_kv_events_vllm_accepts_it(vllm_parse, tmp_path):
    """Issue 14: with prefix-aware routing on, each worker publishes vLLM's KV-cache events — on
    one machine on a Unix socket in the run directory (the events carry token ids), on a cluster
    on the pod's HTTP port + kvEventsPortOffset. Either way an endpoint vLLM's publisher *binds*
    (it connects to any other, and then nothing reaches the router's subscriber)."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    _, path = gpu_8x_with_router(tmp_path, prefixAware={"enabled": True})
    _, plans = planned(str(path))
    for plan in plans:
        namespace, engine = vllm_parse(plan.command[3:])
        assert engine.kv_events_config.enable_kv_cache_events
        assert engine.kv_events_config.endpoint == f"ipc://$RUN_DIR/kv-events-{plan.port}" == plan.events_endpoint
        assert ZmqEventPublisher._is_bind_endpoint(engine.kv_events_config.endpoint)
        assert engine.kv_events_config.topic == "kv-events"
    for worker in rendered_workers(str(path)):
        container = worker["spec"]["template"]["spec"]["containers"][0]
        _, engine = vllm_parse(container["args"])
        assert engine.kv_events_config.endpoint == "tcp://*:9000"
        assert ZmqEventPublisher._is_bind_endpoint(engine.kv_events_config.endpoint)

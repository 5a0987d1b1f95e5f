"""Prefix-aware routing (issue 14): the block hashes, the index, and the choice it informs."""

from __future__ import annotations

import pytest

from dpd.config.model import AdaptiveSpec
from dpd.router.decide import Path, Reason
from dpd.router.metrics import RouterMetrics
from dpd.router.pools import Worker, make_pool
from dpd.router.prefix import PrefixIndex, block_hashes
from dpd.router.routing import RoutingPolicy


def test_block_hashes_are_vllms_own():
    """The names vLLM 0.32 gives a prompt's blocks (sha256, its fixed seed, cache_salt on the
    first block only), computed by vLLM's own function."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    ids = list(range(1000, 1000 + 40))
    for salt in (None, "tenant-salt"):
        expected, parent = [], None
        for start in range(0, 32, 16):  # two full blocks; the last 8 tokens are no block
            extra = (("cache_salt", salt),) if start == 0 and salt else None
            parent = kv_cache_utils.hash_block_tokens(sha256, parent, ids[start:start + 16], extra)
            expected.append(bytes(parent))
        assert block_hashes(ids, 16, salt) == expected
    assert block_hashes(ids, 16, "a")[1] != block_hashes(ids, 16, "b")[1]  # the salt reaches every block


def workers(n: int, pool: str = "decode"):
    made = make_pool(pool, [f"http://{pool}{i}" for i in range(n)], [f"{pool}-{i}" for i in range(n)],
                     failure_threshold=3, open_s=5)
    for worker in made.workers:
        worker.record_probe(True)
    return made


def test_the_index_matches_whole_leading_blocks_and_forgets_the_least_recent():
    pool = workers(2)
    w0, w1 = pool.workers
    index = PrefixIndex(block_size=4, max_blocks=3, load_weight_tokens=0)
    a = index.hashes(list(range(12)))  # 3 blocks
    index.record(w0, a)
    assert index.cached_tokens(w0, a) == 12 and index.cached_tokens(w1, a) == 0
    longer = index.hashes(list(range(12)) + [99] * 4)
    assert index.cached_tokens(w0, longer) == 12  # the shared prefix
    other = index.hashes([7] + list(range(1, 12)))  # differs in the first block: nothing shared
    assert index.cached_tokens(w0, other) == 0
    index.record(w0, index.hashes([5] * 4))  # a 4th block: the least recently used goes
    assert index.num_blocks(w0) == 3 and index.cached_tokens(w0, a) == 0  # its first block went: the chain breaks
    index.forget({w1.url})
    assert index.num_blocks(w0) == 0


def test_the_choice_weighs_prefix_against_load():
    pool = workers(2)
    w0, w1 = pool.workers
    index = PrefixIndex(block_size=4, max_blocks=100, load_weight_tokens=8)
    prompt = index.hashes(list(range(16)))
    index.record(w0, prompt)
    assert index.choose(pool.workers, prompt).worker is w0  # 16 cached tokens
    w0.num_in_flight = 3  # 16 - 3 x 8 < 0: the idle worker wins, but it holds nothing: no hit
    assert index.choose(pool.workers, prompt) is None
    index.record(w1, prompt[:2])
    w0.num_in_flight = 1  # w0: 16 - 8 = 8; w1: 8 - 0 = 8; the less loaded wins the tie
    choice = index.choose(pool.workers, prompt)
    assert choice.worker is w1 and choice.cached_tokens == 8


def policy(kind: str, *, colocated: bool = False, threshold: int = 100, min_cached: int = 8) -> RoutingPolicy:
    return RoutingPolicy(kind, threshold, AdaptiveSpec(), RouterMetrics(), is_colocated=colocated,
                         prefix_index=PrefixIndex(4, 1000, 0), min_cached_tokens=min_cached)


@pytest.mark.parametrize(
    ("kind", "colocated", "prompt_tokens", "cached", "expected"),
    [
        ("threshold", True, 40, 16, (Path.DIRECT, Reason.PREFIX_HIT, "decode-1")),
        ("threshold", True, 40, 4, (Path.DIRECT, Reason.COLOCATED, None)),  # below minCachedTokens
        ("threshold", False, 200, 160, (Path.DIRECT, Reason.PREFIX_HIT, "decode-1")),  # 40 uncached < 100
        ("threshold", False, 200, 40, (Path.DISAGGREGATED, Reason.ABOVE_THRESHOLD, "decode-1")),  # the holder decodes
        ("threshold", False, 40, 0, (Path.DIRECT, Reason.BELOW_THRESHOLD, None)),
        ("adaptive", False, 200, 160, (Path.DIRECT, Reason.PREFIX_HIT, "decode-1")),
        ("adaptive", True, 40, 16, (Path.DIRECT, Reason.PREFIX_HIT, "decode-1")),  # colocated: placement by prefix
    ],
)
def test_uncached_tokens_decide(kind, colocated, prompt_tokens, cached, expected):
    decode, prefill = workers(2), workers(0 if colocated else 1, "prefill")
    routing = policy(kind, colocated=colocated)
    ids = list(range(prompt_tokens))
    hashes = routing.prefix_index.hashes(ids)
    if cached:
        routing.prefix_index.record(decode.workers[1], hashes[: cached // 4])
    decision = routing.decide(prompt_tokens, 16, prefill, decode, None, hashes)
    assert (decision.path, decision.reason, decision.decode.name if decision.decode else None) == expected
    if expected[1] is Reason.PREFIX_HIT:
        assert decision.cached_tokens == cached
        # the worker's queue and measured rate count only what it computes; another worker, all of it
        assert decision.prefill_tokens(decode.workers[1], prompt_tokens) == prompt_tokens - cached
        assert decision.prefill_tokens(decode.workers[0], prompt_tokens) == prompt_tokens


def _vllm_batch(events: list, ts: float = 1.0) -> bytes:
    """A batch as vLLM's publisher encodes it (its own classes, msgspec's msgpack)."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    return msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=ts, events=events))


def test_the_engines_events_feed_the_index():
    """Issue 14: BlockStored / BlockRemoved / AllBlocksCleared as vLLM publishes them (int block
    hashes, its default) land on the blocks the router computes for the same prompt."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from dpd.router.kvevents import apply_batch

    index = PrefixIndex(block_size=4, max_blocks=100, load_weight_tokens=0)
    w = Worker("decode-0", "http://127.0.0.1:9", "decode")
    hashes = index.hashes(list(range(12)))  # three blocks
    assert index.kind == "approximate" and index.source(w.url) == "approximate"
    stored = kv_events.BlockStored(block_hashes=[maybe_convert_block_hash(h) for h in hashes], parent_block_hash=None,
                                   token_ids=list(range(12)), block_size=4, lora_id=None, medium="GPU", lora_name=None)
    assert apply_batch(index, w.url, _vllm_batch([stored])) == 1
    assert index.cached_tokens(w, hashes) == 12 and index.kind == "events" and index.source(w.url) == "events"
    removed = kv_events.BlockRemoved(block_hashes=[maybe_convert_block_hash(hashes[1])], medium="GPU")
    apply_batch(index, w.url, _vllm_batch([removed]))
    assert index.cached_tokens(w, hashes) == 4  # the chain breaks at the evicted block
    apply_batch(index, w.url, _vllm_batch([kv_events.AllBlocksCleared()]))
    assert index.cached_tokens(w, hashes) == 0
    with pytest.raises(ValueError):
        apply_batch(index, w.url, b"\xc1 not msgpack")


async def test_the_router_subscribes_to_each_workers_events():
    """A PUB socket where a worker publishes (its port + the offset): the subscriber applies what
    it sends; a sequence number that goes back (the worker restarted) clears the worker."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import asyncio

    import zmq
    import zmq.asyncio

    from dpd.router.kvevents import KvEvents
    from dpd.router.pools import Pool

    index = PrefixIndex(block_size=4, max_blocks=100, load_weight_tokens=0)
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    worker = Worker("decode-0", f"http://127.0.0.1:{port - 1000}", "decode")
    pool = Pool("decode", [worker])
    events = KvEvents(lambda: index, [pool], port_offset=1000)
    events.start()
    hashes = index.hashes(list(range(8)))
    stored = kv_events.BlockStored(block_hashes=[int.from_bytes(h[-8:], "big") for h in hashes], parent_block_hash=None,
                                   token_ids=list(range(8)), block_size=4, lora_id=None, medium="GPU", lora_name=None)
    try:
        for seq in range(5, 55):  # a SUB socket joins late: publish until it has seen one
            await pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), _vllm_batch([stored])])
            await asyncio.sleep(0.05)
            if index.cached_tokens(worker, hashes):
                break
        assert index.cached_tokens(worker, hashes) == 8 and index.source(worker.url) == "events"
        await pub.send_multipart([b"kv-events", (0).to_bytes(8, "big"), _vllm_batch([])])  # restarted
        for _ in range(40):
            await asyncio.sleep(0.05)
            if not index.cached_tokens(worker, hashes):
                break
        assert index.cached_tokens(worker, hashes) == 0
    finally:
        await events.stop()
        pub.close(linger=0)
        context.term()


def test_the_events_endpoint_of_an_ipv6_worker_is_bracketed():
    from dpd.router.kvevents import events_endpoint

    assert events_endpoint("http://[fd00::1]:8000", 1000) == "tcp://[fd00::1]:9000"
    assert events_endpoint("http://10.0.0.7:8000", 1000) == "tcp://10.0.0.7:9000"


async def test_a_worker_that_leaves_the_pool_leaves_the_index_and_a_dead_subscriber_restarts(monkeypatch):
    """Without a /metrics scrape too: a pod gone (and back on the same address, a restarted
    engine) holds nothing in the index; a subscriber that died is started again."""
    import asyncio

    from dpd.router.kvevents import KvEvents
    from dpd.router.pools import Pool

    index = PrefixIndex(block_size=4, max_blocks=100, load_weight_tokens=0)
    worker = Worker("decode-0", "http://127.0.0.1:1", "decode")
    pool = Pool("decode", [worker])
    events = KvEvents(lambda: index, [pool], port_offset=1000)
    started = []

    async def dies(w):
        started.append(w.url)
        raise TypeError("an unexpected block hash")

    monkeypatch.setattr(events, "_subscribe", dies)
    try:
        hashes = index.hashes(list(range(8)))
        index.stored(worker.url, hashes)
        assert index.cached_tokens(worker, hashes) == 8
        events.sync()
        await asyncio.sleep(0)
        events.sync()  # the first subscriber died: a second one
        await asyncio.sleep(0)
        assert started == [worker.url, worker.url]
        pool.workers = []
        events.sync()
        assert index.cached_tokens(worker, hashes) == 0 and index.num_blocks(worker) == 0
    finally:
        await events.stop()


async def test_events_from_vllms_own_publisher_reach_the_index(tmp_path):
    """vLLM's own ZmqEventPublisher on the endpoint the launcher plans for a local worker, and the
    router's subscriber on the endpoint the launcher hands it: the blocks arrive. (The loopback
    TCP endpoint planned before made both ends connect, and no event ever arrived.)"""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import asyncio
    import shutil
    import tempfile
    from pathlib import Path as FsPath

    import yaml

    from dpd.config.load import load_config
    from dpd.launch.plan import plan_workers
    from dpd.router.kvevents import KvEvents
    from dpd.router.pools import Pool

    document = yaml.safe_load(FsPath("examples/default.yaml").read_text())
    document["spec"]["pdSpec"].setdefault("router", {})["prefixAware"] = {"enabled": True}
    (tmp_path / "endpoint.yaml").write_text(yaml.safe_dump(document))
    socket_dir = tempfile.mkdtemp(prefix="dpd-test-")  # short: a Unix socket path has at most 107 bytes
    plan = plan_workers(load_config(tmp_path / "endpoint.yaml"), "/models/m", python="py", cores=[0, 1],
                        events_dir=socket_dir)[-1]
    assert plan.events_endpoint == f"ipc://{socket_dir}/kv-events-{plan.port}"
    publisher = kv_events.ZmqEventPublisher(0, endpoint=plan.events_endpoint, topic="kv-events")
    index = PrefixIndex(block_size=4, max_blocks=100, load_weight_tokens=0)
    worker = Worker(plan.name, plan.url, "decode")
    events = KvEvents(lambda: index, [Pool("decode", [worker])], port_offset=1000,
                      endpoints={plan.url: plan.events_endpoint})
    events.start()
    hashes = index.hashes(list(range(8)))
    stored = kv_events.BlockStored(block_hashes=[int.from_bytes(h[-8:], "big") for h in hashes], parent_block_hash=None,
                                   token_ids=list(range(8)), block_size=4, lora_id=None, medium="CPU", lora_name=None)
    try:
        for _ in range(60):  # a SUB socket joins late: publish until it has seen one
            publisher.publish(kv_events.KVEventBatch(ts=1.0, events=[stored]))
            await asyncio.sleep(0.05)
            if index.cached_tokens(worker, hashes):
                break
        assert index.cached_tokens(worker, hashes) == 8 and index.source(worker.url) == "events"
    finally:
        await events.stop()
        publisher.shutdown()
        shutil.rmtree(socket_dir, ignore_errors=True)

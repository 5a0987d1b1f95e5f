"""The engine's own account of its prefix cache: vLLM's KV-cache events, read by the router.

With prefix-aware routing on, every worker dpd starts publishes vLLM's KV-cache events over
ZMQ (``--kv-events-config``: publisher ``zmq``, topic ``kv-events``): on a cluster on the pod's
HTTP port + ``kvEventsPortOffset``, on one machine on a Unix socket in the run directory that
the launcher passes on (launch/plan.py ``kv_events_endpoint``). The router subscribes to each worker
and applies each batch to the prefix index (prefix.py): ``BlockStored`` adds blocks,
``BlockRemoved`` takes them away, ``AllBlocksCleared`` empties the worker. A sequence number that
goes back means the worker restarted (its cache is empty): the worker's blocks are dropped too.

Messages are decoded with msgspec alone (no vLLM import: the router's image need not carry the
engine): a batch is ``[ts, [event, …], dp_rank]`` and each event a map tagged by ``type``, the
wire form of vLLM's ``KVEventBatch``. A worker whose events never arrive (an engine without
them, a port the network blocks) keeps the approximate index the router records from routing;
``/admin/workers`` says which source each worker is on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from dpd.router.pools import Pool, Worker, stop_task
from dpd.router.prefix import PrefixIndex

log = logging.getLogger(__name__)

TOPIC = "kv-events"
SYNC_INTERVAL_S = 2.0


def events_endpoint(worker_url: str, port_offset: int) -> str:
    parts = urlsplit(worker_url)
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname  # IPv6
    return f"tcp://{host}:{(parts.port or 80) + port_offset}"


def apply_batch(index: PrefixIndex, url: str, payload: bytes) -> int:
    """Apply one published batch to ``index`` for the worker at ``url``; returns the events applied.
    Raises ValueError on a payload that is not a batch."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch")
    applied = 0
    for event in batch[1]:
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "BlockStored":
            if event.get("medium") in (None, "GPU", "CPU") and event.get("locality") in (None, "LOCAL"):
                index.stored(url, event.get("block_hashes") or ())
        elif kind == "BlockRemoved":
            index.removed(url, event.get("block_hashes") or ())
        elif kind == "AllBlocksCleared":
            index.cleared(url)
        else:
            continue
        applied += 1
    return applied


class KvEvents:
    """One SUB socket per worker of ``pools``, kept in step with them (workers come and go)."""

    def __init__(self, index_of: Callable[[], PrefixIndex | None], pools: Sequence[Pool], port_offset: int,
                 endpoints: Mapping[str, str] | None = None):
        self._index_of = index_of  # the index in force (prefix-aware routing may be switched live)
        self._pools = pools
        self._port_offset = port_offset
        self._endpoints = dict(endpoints or {})  # worker URL → its planned endpoint (the launcher's workers)
        self._context = zmq.asyncio.Context()
        self._subscribers: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None

    def sync(self) -> None:
        """Follow the pools: a worker that left loses its subscriber and its blocks in the index (a
        pod that comes back on the same address starts empty); a subscriber that died is logged and
        started again."""
        workers = {w.url: w for pool in self._pools for w in pool.workers}
        gone = [url for url in self._subscribers if url not in workers]
        for url in gone:
            self._subscribers.pop(url).cancel()
        index = self._index_of()
        if gone and index is not None:
            index.forget(set(workers))
        for url, task in list(self._subscribers.items()):
            if task.done():
                error = None if task.cancelled() else task.exception()
                log.warning("%s: KV events subscriber ended (%r); subscribing again", url, error)
                del self._subscribers[url]
        for url, worker in workers.items():
            if url not in self._subscribers:
                self._subscribers[url] = asyncio.create_task(self._subscribe(worker), name=f"kv-events {worker.name}")

    async def _subscribe(self, worker: Worker) -> None:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        socket.setsockopt(zmq.IPV6, 1)  # off by default in ZeroMQ: an IPv6 pod address would never connect
        endpoint = self._endpoints.get(worker.url) or events_endpoint(worker.url, self._port_offset)
        socket.connect(endpoint)
        last_seq = -1
        try:
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 3:
                    continue
                _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big")
                index = self._index_of()
                if index is None:
                    continue
                if seq < last_seq:  # the publisher restarted: its cache started empty
                    log.info("%s: KV events restarted (the worker restarted): its prefix index is cleared", worker.name)
                    index.cleared(worker.url)
                last_seq = seq
                try:
                    apply_batch(index, worker.url, payload)
                except ValueError as exc:
                    log.warning("%s: %s", worker.name, exc)
        finally:
            socket.close(linger=0)

    async def _run(self) -> None:
        while True:
            self.sync()
            await asyncio.sleep(SYNC_INTERVAL_S)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-events")

    async def stop(self) -> None:
        await stop_task(self._task)
        for task in self._subscribers.values():
            task.cancel()
        if self._subscribers:
            await asyncio.gather(*self._subscribers.values(), return_exceptions=True)
        self._subscribers.clear()
        self._context.term()




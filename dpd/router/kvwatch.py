"""KV transfers the engine itself reports as lost: read from each worker's ``/metrics``.

A decoder whose NIXL pull fails (``kvLoadFailurePolicy: recompute``) recomputes the prompt and
answers normally, and a prefiller whose lease (``kvLeaseDurationS``) ran out frees blocks no
decoder pulled: neither shows in the stream the router relays. vLLM counts both per worker
(``vllm:nixl_num_failed_transfers``, ``vllm:nixl_num_kv_expired_reqs``, and
``vllm:nixl_num_failed_notifications``), so the router reads those counters every
``interval_s`` and reports what grew as ``dpd_kv_transfer_failures_total{pool,worker,kind}``,
with a warning in its log: a disaggregated request that was silently recomputed is visible.

The same reading re-exports what the engine measured of the transfers that worked — the sums
and counts of ``vllm:nixl_xfer_time_seconds`` and ``vllm:nixl_bytes_transferred`` (reported by
the decoder that pulled) — as ``dpd_kv_transfers_total``, ``dpd_kv_transfer_seconds_total`` and
``dpd_kv_transfer_bytes_total{pool,worker}``, so one Prometheus target (the router) shows the
KV path; the engine's own histograms stay on each worker's ``/metrics``.

The first reading of a worker is its baseline; a counter that went down means the worker
restarted, and the new value is the baseline. Pure parsing (``nixl_counters``) is separate
from the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from dpd.router.metrics import RouterMetrics
from dpd.router.pools import Pool, Worker, stop_task

log = logging.getLogger(__name__)

# vLLM's counter (its family name, without ``_total``) -> our ``kind`` label.
WATCHED = {
    "vllm:nixl_num_failed_transfers": "failed_pull",
    "vllm:nixl_num_kv_expired_reqs": "lease_expired",
    "vllm:nixl_num_failed_notifications": "failed_notification",
}
# The transfers that worked: a histogram's sum or count -> our ``kind``.
MEASURED = {
    "vllm:nixl_xfer_time_seconds_count": "transfers",
    "vllm:nixl_xfer_time_seconds_sum": "transfer_seconds",
    "vllm:nixl_bytes_transferred_sum": "transfer_bytes",
}
WHAT = {
    "failed_pull": "KV pulls failed (the decoder recomputed those prompts, or failed them with kvLoadFailurePolicy: fail)",
    "lease_expired": "prefilled KV expired unpulled (kvLeaseDurationS)",
    "failed_notification": "KV-read notifications failed",
}


def nixl_counters(text: str) -> dict[str, float]:
    """Our ``kind`` -> the counter's value (summed over its label sets) in a ``/metrics`` page;
    kinds absent from the page are absent. Pure."""
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:  # the parser may file ``X_total`` under its own family
                kind = WATCHED.get(sample.name.removesuffix("_total")) or MEASURED.get(sample.name)
                if kind is not None:
                    values[kind] = values.get(kind, 0.0) + sample.value
    except ValueError:  # not an exposition page: nothing to read
        return {}
    return values


class KvWatch:
    def __init__(self, pools: Sequence[Pool], session: aiohttp.ClientSession, metrics: RouterMetrics, interval_s: float):
        self._pools = pools
        self._session = session
        self._metrics = metrics
        self._interval_s = interval_s
        self._baseline: dict[str, dict[str, float]] = {}  # worker url -> kind -> last value
        self._task: asyncio.Task | None = None

    def record(self, worker: Worker, values: dict[str, float]) -> dict[str, float]:
        """Take one reading of ``worker``; returns (and reports) what grew since the last."""
        last = self._baseline.get(worker.url)
        self._baseline[worker.url] = dict(values)
        if last is None:
            return {}
        grown: dict[str, float] = {}
        for kind, value in values.items():
            before = last.get(kind, 0.0)
            # A drop is a restarted worker: its counters began again at 0, so all of the new value
            # happened since (Prometheus' rule for a counter reset).
            delta = value if value < before else value - before
            if delta <= 0:
                continue
            grown[kind] = delta
            if kind in WHAT:
                self._metrics.kv_transfer_failures.labels(worker.pool, worker.name, kind).inc(delta)
                log.warning("%s: %d %s", worker.name, int(delta), WHAT[kind])
            else:
                self._counter(kind).labels(worker.pool, worker.name).inc(delta)
        return grown

    def _counter(self, kind: str) -> Counter:
        m = self._metrics
        return {"transfers": m.kv_transfers, "transfer_seconds": m.kv_transfer_seconds, "transfer_bytes": m.kv_transfer_bytes}[kind]

    async def scrape_once(self) -> None:
        workers = [w for pool in self._pools for w in pool.workers]
        await asyncio.gather(*(self._scrape(w) for w in workers))

    async def _scrape(self, worker: Worker) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=max(1.0, self._interval_s / 2))
            async with self._session.get(f"{worker.url}/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    return
                text = await resp.text(errors="replace")
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return  # the health prober reports unreachable workers
        self.record(worker, nixl_counters(text))

    def forget_removed(self) -> None:
        known = {w.url for pool in self._pools for w in pool.workers}
        for url in list(self._baseline):
            if url not in known:
                del self._baseline[url]

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            self.forget_removed()
            await self.scrape_once()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-watch")

    async def stop(self) -> None:
        await stop_task(self._task)

"""Workers and pools as the router sees them: URL, health, outstanding requests.

Health is both active and passive. A prober GETs every worker's ``/health`` each interval; a
failed connection during a request marks the worker down at once (``mark_failed``), and only a
successful probe brings it back. So a killed worker stops receiving requests on its first
failure, and a restarted one receives them again within one probe interval of being healthy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Worker:
    name: str
    url: str
    pool: str
    num_in_flight: int = 0
    is_healthy: bool = False
    last_error: str | None = None
    num_failures: int = 0
    changed_at: float = field(default_factory=time.monotonic)

    @contextmanager
    def track(self, on_change: Callable[[Worker], None] | None = None) -> Iterator[None]:
        """Count one outstanding request for the duration of the block."""
        self.num_in_flight += 1
        if on_change:
            on_change(self)
        try:
            yield
        finally:
            self.num_in_flight -= 1
            if on_change:
                on_change(self)

    def mark_failed(self, error: str) -> None:
        if self.is_healthy:
            log.warning("%s worker %s marked down: %s", self.pool, self.name, error)
            self.changed_at = time.monotonic()
        self.is_healthy = False
        self.last_error = error
        self.num_failures += 1

    def mark_healthy(self) -> None:
        if not self.is_healthy:
            log.info("%s worker %s is healthy", self.pool, self.name)
            self.changed_at = time.monotonic()
        self.is_healthy = True
        self.last_error = None


class Pool:
    def __init__(self, name: str, workers: list[Worker]):
        self.name = name
        self.workers = workers

    def available(self) -> list[Worker]:
        return [w for w in self.workers if w.is_healthy]

    def __len__(self) -> int:
        return len(self.workers)


def make_pool(name: str, urls: list[str], worker_names: list[str] | None = None) -> Pool:
    """A pool of workers named ``worker_names`` (the launcher's names) or ``<pool>-<i>``."""
    names = worker_names or [f"{name}-{i}" for i in range(len(urls))]
    if len(names) != len(urls):
        raise ValueError(f"{name} pool: {len(urls)} URLs but {len(names)} names")
    return Pool(name, [Worker(n, url.rstrip("/"), name) for n, url in zip(names, urls)])


class HealthProber:
    """Probes every worker's ``/health`` periodically until ``stop``."""

    def __init__(
        self,
        pools: list[Pool],
        session: aiohttp.ClientSession,
        interval_s: float,
        on_change: Callable[[Worker], None] | None = None,
    ):
        self._pools = pools
        self._session = session
        self._interval_s = interval_s
        self._on_change = on_change
        self._task: asyncio.Task | None = None

    async def probe_once(self) -> None:
        workers = [w for pool in self._pools for w in pool.workers]
        await asyncio.gather(*(self._probe(w) for w in workers))

    async def _probe(self, worker: Worker) -> None:
        was_healthy = worker.is_healthy
        try:
            timeout = aiohttp.ClientTimeout(total=max(1.0, self._interval_s))
            async with self._session.get(f"{worker.url}/health", timeout=timeout) as resp:
                if resp.status == 200:
                    worker.mark_healthy()
                else:
                    worker.mark_failed(f"/health returned {resp.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            worker.mark_failed(f"/health unreachable: {exc.__class__.__name__}")
        if self._on_change and was_healthy != worker.is_healthy:
            self._on_change(worker)

    async def _run(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self._interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="health-prober")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

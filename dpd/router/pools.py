"""Workers and pools as the router sees them: URL, breaker, drain state, outstanding requests.

Health is both active and passive, and both feed each worker's circuit breaker
(``breaker.CircuitBreaker``): a prober GETs every worker's ``/health`` each interval, and the
P/D flow reports every request's outcome. A killed worker stops receiving requests on its
first refused connection or failed probe; once it passes a probe again (after the breaker's
cooldown) it gets one trial request, and a good trial closes its breaker.

A pool hands out workers with ``pick``: never an open or draining worker, never a worker
dedicated to another tenant, and to a tenant with workers of its own in the pool only those;
a half-open worker only for its trial, unless no other worker is left (then trying beats a 503).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from dpd.router.breaker import BreakerState, CircuitBreaker
from dpd.router.load import LoadPriors, SharedRates, WorkerLoad

log = logging.getLogger(__name__)


class _Picker(Protocol):
    def pick(self, candidates: Sequence[Worker], *, exclude: frozenset[str] = frozenset()) -> Worker | None: ...


@dataclass(eq=False)
class Worker:
    name: str
    url: str
    pool: str
    # not given: a breaker of its own, named after the worker in __post_init__ (a default of None
    # would make the field's type a lie, which the simulator's compiled build checks)
    breaker: CircuitBreaker = field(default_factory=lambda: CircuitBreaker("", failure_threshold=3, open_s=5.0))
    owner: str | None = None  # the tenant this worker is dedicated to, if any
    num_in_flight: int = 0
    is_draining: bool = False
    has_been_up: bool = False
    load: WorkerLoad = field(default_factory=WorkerLoad)  # what the router measures of its work

    def __post_init__(self) -> None:
        if not self.breaker.name:
            self.breaker.name = self.name

    @property
    def is_healthy(self) -> bool:
        return self.breaker.state is not BreakerState.OPEN

    @contextmanager
    def track(self) -> Iterator[None]:
        """Count one outstanding request for the duration of the block."""
        self.num_in_flight += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1

    def record_probe(self, is_ok: bool, error: str | None = None, *, is_late: bool = False) -> None:
        if is_ok and not self.has_been_up:
            # First sight of the worker (router start-up): no trial needed.
            self.has_been_up = True
            self.breaker.force(BreakerState.CLOSED)
            return
        self.breaker.record_probe(is_ok, error, is_late=is_late)

    def state(self) -> dict:
        return {
            "name": self.name,
            "pool": self.pool,
            "url": self.url,
            "breaker": self.breaker.state.value,
            "draining": self.is_draining,
            "in_flight": self.num_in_flight,
            "dedicated_to": self.owner,
            "last_error": self.breaker.last_error,
            **self.load.state(),
        }


class Pool:
    def __init__(
        self,
        name: str,
        workers: list[Worker],
        breaker: CircuitBreaker | None = None,
        new_worker: Callable[[str, str], Worker] | None = None,
    ):
        self.name = name
        self.workers = workers
        # The pool's own breaker (the prefill pool's: consecutive failed disaggregated attempts).
        self.breaker = breaker
        self._new_worker = new_worker or (lambda worker_name, url: Worker(worker_name, url, name))
        # Tenants with workers of their own in this pool: they use only those, even when none
        # is up (a 503, never a shared worker). Known from the config, not from which workers
        # are present: on a cluster a tenant's pods come and go with their readiness.
        self.dedicated_tenants: set[str] = {w.owner for w in workers if w.owner is not None}

    def replace_workers(self, members: Sequence[tuple[str, str]], owner: str | None = None) -> None:
        """Make the pool's workers of ``owner`` (a tenant's dedicated ones, or with ``None`` the
        shared ones) ``members`` (name, URL) — discovery's view of that group's ready pods; the
        other groups' workers stay. A worker still present keeps its object (in-flight count,
        breaker); a new one starts closed, since it was found ready (its readiness probe is the
        worker's ``/health``)."""
        if owner is not None:
            self.dedicated_tenants.add(owner)
        current = {w.url: w for w in self.workers if w.owner == owner}
        workers = [w for w in self.workers if w.owner != owner]
        for worker_name, url in members:
            worker = current.get(url.rstrip("/"))
            if worker is None:
                worker = self._new_worker(worker_name, url.rstrip("/"))
                worker.owner = owner
                worker.record_probe(True)
            workers.append(worker)
        self.workers = workers

    def available(self, tenant: str | None = None) -> list[Worker]:
        """Workers that may take a request of ``tenant`` now (half-open ones only as a last resort)."""
        usable = self._usable(tenant)
        return [w for w in usable if w.breaker.allows_request()] or [
            w for w in usable if w.breaker.state is BreakerState.HALF_OPEN
        ]

    def is_available(self, tenant: str | None = None) -> bool:
        if self.breaker is not None and not self.breaker.allows_request():
            return False
        return bool(self.available(tenant))

    def pick(self, picker: _Picker, tenant: str | None = None, exclude: frozenset[str] = frozenset()) -> Worker | None:
        worker = picker.pick(self.available(tenant), exclude=exclude)
        return None if worker is None else self.claim(worker)

    def claim(self, worker: Worker, *, with_pool_breaker: bool = True) -> Worker:
        """Send a request to ``worker`` (picked, or planned by the adaptive policy): in half-open
        it is the breaker's trial. A whole request on a prefill worker is no disaggregated
        attempt, so it leaves the pool's breaker alone (``with_pool_breaker=False``)."""
        worker.breaker.begin()
        if self.breaker is not None and with_pool_breaker:
            self.breaker.begin()
        return worker

    def _usable(self, tenant: str | None) -> list[Worker]:
        live = [w for w in self.workers if not w.is_draining]
        owner = tenant if tenant in self.dedicated_tenants else None
        return [w for w in live if w.owner == owner]

    def find(self, name: str) -> Worker | None:
        return next((w for w in self.workers if w.name == name), None)

    def __len__(self) -> int:
        return len(self.workers)


def make_pool(
    name: str,
    urls: list[str],
    worker_names: list[str] | None = None,
    *,
    failure_threshold: int = 3,
    open_s: float = 5.0,
    owners: dict[str, str] | None = None,
    pool_breaker: CircuitBreaker | None = None,
    on_transition: Callable[[str, BreakerState], None] | None = None,
    priors: LoadPriors | None = None,
    shared: SharedRates | None = None,
) -> Pool:
    """A pool of workers named ``worker_names`` (the launcher's names) or ``<pool>-<i>``.
    Workers start open (unseen) until their first good probe."""
    names = worker_names or [f"{name}-{i}" for i in range(len(urls))]
    if len(names) != len(urls):
        raise ValueError(f"{name} pool: {len(urls)} URLs but {len(names)} names")
    owners = owners or {}

    def new_worker(worker_name: str, url: str) -> Worker:
        breaker = CircuitBreaker(worker_name, failure_threshold, open_s, on_transition=on_transition, state=BreakerState.OPEN)
        return Worker(worker_name, url.rstrip("/"), name, breaker, owner=owners.get(worker_name),
                      load=WorkerLoad(priors or LoadPriors(), shared=shared))

    return Pool(name, [new_worker(n, url) for n, url in zip(names, urls)], pool_breaker, new_worker)


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
        was_state = worker.breaker.state
        try:
            # A connection is accepted by the kernel even while the worker's process is starved of
            # CPU: not connecting in time means unreachable (a vanished pod's address), not late.
            total_s = max(1.0, self._interval_s)
            timeout = aiohttp.ClientTimeout(total=total_s, sock_connect=total_s / 2)
            async with self._session.get(f"{worker.url}/health", timeout=timeout) as resp:
                if resp.status == 200:
                    worker.record_probe(True)
                else:
                    worker.record_probe(False, f"/health returned {resp.status}")
        except aiohttp.ConnectionTimeoutError:
            worker.record_probe(False, "/health unreachable: no connection in time")
        except TimeoutError:  # connected, no answer in time: late, not refused (breaker.py)
            worker.record_probe(False, f"/health timed out after {total_s:.0f}s", is_late=True)
        except (aiohttp.ClientError, OSError) as exc:
            worker.record_probe(False, f"/health unreachable: {exc.__class__.__name__}")
        if self._on_change and was_state is not worker.breaker.state:
            self._on_change(worker)

    async def _run(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self._interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="health-prober")

    async def stop(self) -> None:
        await stop_task(self._task)


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel a background loop and wait until it has ended (None: nothing to stop)."""
    if task:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

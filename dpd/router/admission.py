"""Admission control: a bounded number of requests in flight, a bounded queue, a queue timeout.

One gate per pool (``router.admission.prefill`` / ``.decode``): a prefill hop holds a prefill
slot, a decode hop a decode slot until its stream ends. No request holds both at once, so the
gates never wait on each other in a cycle (``flow.PdFlow`` takes them).

A request first takes a slot of the ``AdmissionGate``. With a slot free it proceeds at once;
otherwise it waits in a FIFO queue of at most ``max_queue`` requests for at most
``queue_timeout_s``. A full queue or an expired wait is a 429 with ``Retry-After``: the
endpoint sheds load it cannot serve within its SLO instead of letting every request's latency
grow without bound (DPD does not replace admission control). Slots are released when the
request finishes, however it finishes.

Tenants share the gate fairly: a freed slot goes to the waiter whose tenant holds the fewest
slots, then queues the fewest (the oldest among equals, so without tenants the queue is FIFO), and a full queue makes
room for a tenant with few requests in the gate by displacing the newest waiter of the tenant
with the most (a 429 for it) — one tenant's flood cannot push every other tenant into 429s.

Invariants: ``num_in_flight <= max_in_flight``; ``len(queue) <= max_queue``; a waiter that
gives up (timeout or cancellation) never takes a slot; ``sum(held) == num_in_flight``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from dpd.config.model import PoolAdmissionSpec
from dpd.router.errors import ApiError
from dpd.router.metrics import RouterMetrics


def overloaded(reason: str, retry_after_s: float, label: str, status: int = 429) -> ApiError:
    return ApiError(status, f"The endpoint is overloaded ({reason}); retry later.",
                    type="rate_limit_error" if status == 429 else "overloaded_error",
                    code="overloaded", retry_after_s=retry_after_s, metric_label=label)


@dataclass(eq=False)
class _Waiter:
    tenant: str | None
    future: asyncio.Future[None]


class AdmissionGate:
    def __init__(self, max_in_flight: int, max_queue: int, queue_timeout_s: float, overflow_status: int = 429):
        if max_in_flight < 1 or max_queue < 0 or queue_timeout_s <= 0:
            raise ValueError("max_in_flight >= 1, max_queue >= 0 and queue_timeout_s > 0 are required")
        self.overflow_status = overflow_status
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.num_in_flight = 0
        self.num_shed = 0
        self._waiters: list[_Waiter] = []  # in arrival order
        self._held: collections.Counter[str | None] = collections.Counter()  # slots per tenant

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    def held_by(self, tenant: str | None) -> int:
        return self._held[tenant]

    @contextlib.asynccontextmanager
    async def admit(self, tenant: str | None = None) -> AsyncIterator[float]:
        """Hold one slot for the block; yields the seconds spent queued."""
        waited_s = await self.acquire(tenant=tenant)
        try:
            yield waited_s
        finally:
            self.release(tenant)

    async def acquire(self, max_wait_s: float | None = None, tenant: str | None = None) -> float:
        """Take a slot for ``tenant``, queueing if none is free for at most ``queue_timeout_s`` (or
        ``max_wait_s`` when shorter: a request whose prefilled KV would expire meanwhile); raise a
        429 ``ApiError`` when shed. Every successful ``acquire`` must be matched by exactly one
        ``release(tenant)``."""
        timeout_s = self.queue_timeout_s if max_wait_s is None else max(0.0, min(self.queue_timeout_s, max_wait_s))
        if self.num_in_flight < self.max_in_flight and not self._waiters:
            self.num_in_flight += 1
            self._held[tenant] += 1
            return 0.0
        if len(self._waiters) >= self.max_queue:
            victim = self._displaceable(tenant)
            if victim is None:
                self.num_shed += 1
                raise overloaded("queue full", self.queue_timeout_s, "queue_full", self.overflow_status)
            # The queue is full of another tenant's requests: its newest gives up its place.
            self._waiters.remove(victim)
            victim.future.set_exception(overloaded("queue full", self.queue_timeout_s, "queue_full", self.overflow_status))
        started = time.monotonic()
        waiter = _Waiter(tenant, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
        except ApiError:  # displaced from the queue by another tenant
            self.num_shed += 1
            raise
        except (TimeoutError, asyncio.CancelledError) as exc:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                # The slot was handed to us just as we gave up: pass it on.
                self.release(tenant)
            else:
                if not future.done():
                    future.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.num_shed += 1
            raise overloaded(f"queued longer than {timeout_s:g}s", self.queue_timeout_s, "queue_timeout",
                             self.overflow_status) from None
        return time.monotonic() - started

    def _displaceable(self, tenant: str | None) -> _Waiter | None:
        """When the queue is full: the newest waiter of the tenant with the most requests in the
        gate (held and queued), if it has at least two more than ``tenant`` — so one tenant's flood
        cannot keep every other tenant out. Without tenants (all ``None``) no one is displaced: FIFO."""
        queued = collections.Counter(w.tenant for w in self._waiters)
        if not queued:
            return None
        in_gate = {t: n + self._held[t] for t, n in queued.items()}
        top = max(in_gate, key=in_gate.__getitem__)
        if top == tenant or in_gate[top] < queued[tenant] + self._held[tenant] + 2:
            return None
        return next(w for w in reversed(self._waiters) if w.tenant == top)

    def release(self, tenant: str | None = None) -> None:
        """Give back ``tenant``'s slot: straight to the next waiter — of the tenant holding the
        fewest slots, then queueing the fewest, the oldest among equals (FIFO without tenants) —
        else free it."""
        self._held[tenant] -= 1
        if self._held[tenant] <= 0:
            del self._held[tenant]
        self._waiters = [w for w in self._waiters if not w.future.done()]
        if self._waiters:
            queued = collections.Counter(w.tenant for w in self._waiters)
            # min() keeps the first of equals: the oldest waiter.
            waiter = min(self._waiters, key=lambda w: (self._held[w.tenant], queued[w.tenant]))
            self._waiters.remove(waiter)
            self._held[waiter.tenant] += 1
            waiter.future.set_result(None)  # num_in_flight stays the same
            return
        self.num_in_flight -= 1


def gate_from_spec(spec: PoolAdmissionSpec | None, overflow_status: int = 429) -> AdmissionGate | None:
    return None if spec is None else AdmissionGate(spec.maxInFlight, spec.maxQueue, spec.queueTimeoutS, overflow_status)


async def admit(gate: AdmissionGate | None, pool: str, metrics: RouterMetrics,
                max_wait_s: float | None = None, tenant: str | None = None) -> Callable[[], None]:
    """Take a slot of ``pool``'s gate (queueing if need be, at most ``max_wait_s`` when given) and
    return its idempotent release; a 429 when shed. No gate: nothing to take."""
    if gate is None:
        return _noop
    try:
        waited_s = await gate.acquire(max_wait_s, tenant)
    except ApiError as error:
        metrics.shed.labels(pool, error.metric_label or "queue_full").inc()
        raise
    finally:
        metrics.queue_depth.labels(pool).set(gate.queue_depth)
    metrics.queue_wait.labels(pool).observe(waited_s)
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            gate.release(tenant)

    return release


def _noop() -> None:
    pass

"""AdmissionGate: slots, FIFO queue, 429s, and no slot leaked however a request ends."""

import asyncio

import pytest

from dpd.router.admission import AdmissionGate
from dpd.router.errors import ApiError


async def hold(gate: AdmissionGate, release: asyncio.Event, order: list[int], i: int) -> None:
    async with gate.admit():
        order.append(i)
        await release.wait()


async def test_admits_up_to_the_limit_then_queues_in_order():
    gate = AdmissionGate(max_in_flight=2, max_queue=5, queue_timeout_s=5)
    release, order = asyncio.Event(), []
    tasks = [asyncio.create_task(hold(gate, release, order, i)) for i in range(5)]
    await asyncio.sleep(0.01)
    assert order == [0, 1] and gate.num_in_flight == 2 and gate.queue_depth == 3
    release.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert gate.num_in_flight == 0 and gate.queue_depth == 0


@pytest.mark.parametrize("max_queue", [0, 1])
async def test_full_queue_is_a_429_with_retry_after(max_queue):
    gate = AdmissionGate(max_in_flight=1, max_queue=max_queue, queue_timeout_s=5)
    release, order = asyncio.Event(), []
    held = [asyncio.create_task(hold(gate, release, order, i)) for i in range(1 + max_queue)]
    await asyncio.sleep(0.01)
    with pytest.raises(ApiError) as info:
        async with gate.admit():
            pass
    assert info.value.status == 429 and info.value.retry_after_s == 5
    assert info.value.body()["error"]["code"] == "overloaded"
    assert gate.num_shed == 1
    release.set()
    await asyncio.gather(*held)
    assert gate.num_in_flight == 0


async def test_queue_timeout_is_a_429_and_leaks_nothing():
    gate = AdmissionGate(max_in_flight=1, max_queue=3, queue_timeout_s=0.05)
    release, order = asyncio.Event(), []
    holder = asyncio.create_task(hold(gate, release, order, 0))
    await asyncio.sleep(0.01)
    with pytest.raises(ApiError, match="queued longer"):
        async with gate.admit():
            pass
    assert gate.queue_depth == 0 and gate.num_in_flight == 1
    release.set()
    await holder
    assert gate.num_in_flight == 0


async def test_cancelled_waiter_never_takes_a_slot():
    gate = AdmissionGate(max_in_flight=1, max_queue=3, queue_timeout_s=5)
    release, order = asyncio.Event(), []
    holder = asyncio.create_task(hold(gate, release, order, 0))
    await asyncio.sleep(0.01)
    waiter = asyncio.create_task(hold(gate, release, order, 1))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    release.set()
    await holder
    assert order == [0] and gate.num_in_flight == 0 and gate.queue_depth == 0


async def test_slot_is_released_when_the_request_fails():
    gate = AdmissionGate(max_in_flight=1, max_queue=0, queue_timeout_s=1)
    with pytest.raises(RuntimeError):
        async with gate.admit():
            raise RuntimeError("worker failed")
    async with gate.admit():
        assert gate.num_in_flight == 1
    assert gate.num_in_flight == 0


@pytest.mark.parametrize("args", [(0, 1, 1), (1, -1, 1), (1, 1, 0)])
def test_invalid_limits(args):
    with pytest.raises(ValueError):
        AdmissionGate(*args)


# -- tenants share the gate fairly (issue 16, finding 6) -------------------------------------------
async def test_a_freed_slot_goes_to_the_tenant_holding_fewest():
    gate = AdmissionGate(max_in_flight=2, max_queue=10, queue_timeout_s=5)
    await gate.acquire(tenant="flood")
    await gate.acquire(tenant="flood")
    order: list[str] = []

    async def wait(tenant: str) -> None:
        await gate.acquire(tenant=tenant)
        order.append(tenant)

    waiters = [asyncio.create_task(wait(t)) for t in ("flood", "flood", "flood", "quiet")]
    await asyncio.sleep(0.01)
    gate.release("flood")  # quiet arrived last but holds nothing: it goes first
    await asyncio.sleep(0.01)
    assert order == ["quiet"]
    gate.release("flood")
    gate.release("quiet")
    await asyncio.sleep(0.01)
    assert order == ["quiet", "flood", "flood"]
    assert gate.held_by("flood") == 2 and gate.num_in_flight == 2
    for _ in range(2):
        gate.release("flood")
    await asyncio.gather(*waiters)
    gate.release("flood")
    assert gate.num_in_flight == 0 and gate.queue_depth == 0


async def test_a_full_queue_makes_room_for_another_tenant_by_displacing_the_flood():
    gate = AdmissionGate(max_in_flight=1, max_queue=3, queue_timeout_s=5)
    await gate.acquire(tenant="flood")
    flood = [asyncio.create_task(gate.acquire(tenant="flood")) for _ in range(3)]
    await asyncio.sleep(0.01)
    with pytest.raises(ApiError):  # the flood cannot displace itself
        await gate.acquire(tenant="flood")
    quiet = asyncio.create_task(gate.acquire(tenant="quiet"))
    await asyncio.sleep(0.01)
    assert flood[2].done() and isinstance(flood[2].exception(), ApiError)  # the newest flood waiter gave way
    assert flood[2].exception().status == 429 and not quiet.done()
    gate.release("flood")
    await asyncio.sleep(0.01)
    assert quiet.done() and gate.held_by("quiet") == 1
    gate.release("quiet")
    await flood[0]
    gate.release("flood")
    await flood[1]
    gate.release("flood")
    assert gate.num_in_flight == 0 and gate.queue_depth == 0 and gate.num_shed == 2


async def test_without_tenants_the_queue_is_fifo_and_never_displaces():
    gate = AdmissionGate(max_in_flight=1, max_queue=1, queue_timeout_s=5)
    await gate.acquire()
    first = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0.01)
    with pytest.raises(ApiError):
        await gate.acquire()
    assert not first.done()
    gate.release()
    await first
    gate.release()
    assert gate.num_in_flight == 0

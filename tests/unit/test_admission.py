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

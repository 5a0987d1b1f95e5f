"""kvwatch: what grew between two readings of a worker's NIXL counters, a restart included."""

from __future__ import annotations

from dpd.router.kvwatch import KvWatch
from dpd.router.metrics import RouterMetrics
from dpd.router.pools import Worker


def test_growth_is_reported_and_a_restart_counts_everything_since():
    metrics = RouterMetrics()
    watch = KvWatch([], session=None, metrics=metrics, interval_s=5)  # type: ignore[arg-type]
    worker = Worker("decode-0", "http://127.0.0.1:8101", "decode")
    assert watch.record(worker, {"failed_pull": 5.0, "transfers": 10.0}) == {}  # the first reading is the baseline
    assert watch.record(worker, {"failed_pull": 7.0, "transfers": 10.0}) == {"failed_pull": 2.0}
    # restarted: its counters began again at 0 and it failed 3 pulls since
    assert watch.record(worker, {"failed_pull": 3.0, "transfers": 1.0}) == {"failed_pull": 3.0, "transfers": 1.0}
    failures = metrics.kv_transfer_failures.labels("decode", "decode-0", "failed_pull")._value.get()
    assert failures == 5.0

"""The circuit breaker's state machine, on a hand-driven clock."""

from __future__ import annotations

from dpd.router.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, **kwargs) -> tuple[CircuitBreaker, list[BreakerState]]:
    seen: list[BreakerState] = []
    b = CircuitBreaker("w", kwargs.pop("threshold", 3), kwargs.pop("open_s", 5.0), clock=clock,
                       on_transition=lambda name, state: seen.append(state), **kwargs)
    return b, seen


def test_opens_after_threshold_consecutive_failures_only():
    clock = Clock()
    b, seen = breaker(clock)
    b.record_failure("x")
    b.record_failure("x")
    b.record_success()  # resets the count
    b.record_failure("x")
    b.record_failure("x")
    assert b.state is BreakerState.CLOSED
    b.record_failure("x")
    assert b.state is BreakerState.OPEN and not b.allows_request() and seen == [BreakerState.OPEN]


def test_definite_failure_opens_at_once():
    b, _ = breaker(Clock())
    b.record_failure("connection refused", is_definite=True)
    assert b.state is BreakerState.OPEN and b.last_error == "connection refused"


def test_half_open_needs_cooldown_and_a_good_probe_then_one_trial():
    clock = Clock()
    b, seen = breaker(clock)
    b.record_failure("x", is_definite=True)
    b.record_probe(True)  # too early: the cooldown has not passed
    assert b.state is BreakerState.OPEN
    clock.now += 5.0
    assert not b.allows_request()  # a worker's breaker waits for a good probe
    b.record_probe(True)
    assert b.state is BreakerState.HALF_OPEN and b.allows_request()
    b.begin()  # the trial
    assert not b.allows_request()  # one trial at a time
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allows_request()
    assert seen == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED]


def test_failed_trial_reopens_and_restarts_the_cooldown():
    clock = Clock()
    b, _ = breaker(clock)
    b.record_failure("x", is_definite=True)
    clock.now += 5
    b.record_probe(True)
    b.begin()
    clock.now += 1
    b.record_failure("still broken")
    assert b.state is BreakerState.OPEN and b.opened_at == clock.now
    clock.now += 4.9
    b.record_probe(True)
    assert b.state is BreakerState.OPEN


def test_failed_probe_opens_and_the_cooldown_runs_from_the_opening():
    clock = Clock()
    b, _ = breaker(clock)
    b.record_probe(False, "/health returned 503")
    assert b.state is BreakerState.OPEN
    clock.now += 3
    b.record_probe(False, "/health unreachable")  # still down: known, changes nothing
    clock.now += 3  # 6 s after opening, 3 s after the last failed probe
    b.record_probe(True)
    assert b.state is BreakerState.HALF_OPEN


def test_neutral_outcome_frees_the_trial_without_judging():
    clock = Clock()
    b, _ = breaker(clock)
    b.record_failure("x", is_definite=True)
    clock.now += 5
    b.record_probe(True)
    b.begin()
    b.record_neutral()
    assert b.state is BreakerState.HALF_OPEN and b.allows_request()


def test_pool_breaker_half_opens_on_its_own_after_the_cooldown():
    clock = Clock()
    b, _ = breaker(clock, threshold=2, needs_probe=False)
    b.record_failure("prefill_timeout")
    b.record_failure("decode_stall")
    assert b.state is BreakerState.OPEN and not b.allows_request()
    clock.now += 5
    assert b.allows_request() and b.state is BreakerState.HALF_OPEN


def test_force_open_owes_no_cooldown():
    clock = Clock()
    b, _ = breaker(clock)
    b.force(BreakerState.OPEN)
    b.record_probe(True)
    assert b.state is BreakerState.HALF_OPEN


def test_late_probes_open_only_failure_threshold_times_running():
    """A probe that timed out (a busy worker, a starved machine) is no refused connection: it
    opens the breaker only ``failure_threshold`` times in a row; one answered in time resets that."""
    clock = Clock()
    b, seen = breaker(clock)
    b.record_probe(False, "/health timed out", is_late=True)
    b.record_probe(False, "/health timed out", is_late=True)
    b.record_probe(True)  # answered in time: the count starts again
    b.record_probe(False, "/health timed out", is_late=True)
    b.record_probe(False, "/health timed out", is_late=True)
    assert b.state is BreakerState.CLOSED and b.allows_request() and seen == []
    b.record_failure("a failed request")  # requests keep their own count
    assert b.state is BreakerState.CLOSED
    b.record_probe(False, "/health timed out", is_late=True)
    assert b.state is BreakerState.OPEN and b.last_error == "/health timed out"
    clock.now += 5
    b.record_probe(True)
    assert b.state is BreakerState.HALF_OPEN


def test_late_probes_while_a_worker_loads_are_forgotten_once_it_is_up():
    b, _ = breaker(Clock(), state=BreakerState.OPEN)  # as a worker starts: open until first seen up
    for _ in range(5):
        b.record_probe(False, "/health timed out", is_late=True)  # vLLM loading, its port open
    b.force(BreakerState.CLOSED)  # its first good probe
    b.record_probe(False, "/health timed out", is_late=True)
    assert b.state is BreakerState.CLOSED and b.num_consecutive_late_probes == 1


def test_a_late_probe_does_not_reset_a_refusals_opening():
    clock = Clock()
    b, _ = breaker(clock)
    b.record_probe(False, "/health unreachable")
    clock.now += 5
    b.record_probe(False, "/health timed out", is_late=True)  # still not answering in time
    assert b.state is BreakerState.OPEN
    b.record_probe(True)
    assert b.state is BreakerState.HALF_OPEN

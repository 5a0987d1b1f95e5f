"""The outcome table: what the prefill pool's breaker learns from each way an attempt ends."""

from __future__ import annotations

import pytest

from dpd.router.breaker import BreakerState, CircuitBreaker
from dpd.router.outcomes import OUTCOMES, HopOutcome, Verdict, tell_pool_breaker

# (outcome, failures counted after 1 report, falls back)
ROWS = [
    (HopOutcome.OK, 0, False),
    (HopOutcome.PREFILL_BREAKER_OPEN, 1, True),  # not told: the earlier failure stays counted
    (HopOutcome.PREFILL_UNAVAILABLE, 1, True),
    (HopOutcome.CANCELLED, 1, False),
    (HopOutcome.PREFILL_ERROR, 2, True),
    (HopOutcome.PREFILL_TIMEOUT, 2, True),
    (HopOutcome.PREFILL_NO_KV, 2, True),
    (HopOutcome.DECODE_STALL, 2, True),
    (HopOutcome.DECODE_ERROR, 1, True),
    (HopOutcome.DECODE_UNAVAILABLE, 1, True),
]


def test_every_outcome_has_a_row():
    assert {row[0] for row in ROWS} == set(HopOutcome) == set(OUTCOMES)


@pytest.mark.parametrize("outcome, failures, falls_back", ROWS, ids=[r[0].value for r in ROWS])
def test_outcome_row(outcome, failures, falls_back):
    breaker = CircuitBreaker("*", failure_threshold=5, open_s=5.0, needs_probe=False)
    breaker.record_failure("an earlier failed attempt")
    tell_pool_breaker(breaker, outcome)
    assert breaker.num_consecutive_failures == failures
    assert OUTCOMES[outcome].falls_back is falls_back
    assert breaker.state is BreakerState.CLOSED


def test_failures_open_the_pool_breaker_and_no_breaker_is_fine():
    breaker = CircuitBreaker("*", failure_threshold=2, open_s=5.0, needs_probe=False)
    for _ in range(2):
        tell_pool_breaker(breaker, HopOutcome.DECODE_STALL)
    assert breaker.state is BreakerState.OPEN and breaker.last_error == "decode_stall"
    tell_pool_breaker(None, HopOutcome.PREFILL_ERROR)
    assert OUTCOMES[HopOutcome.PREFILL_BREAKER_OPEN].pool_breaker is Verdict.NONE

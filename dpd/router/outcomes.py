"""How a disaggregated attempt ended, and what each ending means — one table.

The P/D flow (``flow.py``) reports every disaggregated attempt as a ``HopOutcome``; ``OUTCOMES``
says, per outcome, what the prefill pool's circuit breaker learns and whether the request is
then served direct (``fallback``, with ``x-dpd-fallback`` and ``dpd_fallbacks_total{reason}``
naming the outcome). Worker breakers are fed by the hops themselves (a prefill or decode hop's
own success or failure); this table is the pool-level policy, read by the flow and by tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from dpd.router.breaker import CircuitBreaker


class HopOutcome(str, Enum):
    OK = "ok"
    PREFILL_BREAKER_OPEN = "prefill_breaker_open"  # the pool's breaker refused the attempt
    PREFILL_UNAVAILABLE = "prefill_unavailable"  # no prefill worker the tenant may use
    CANCELLED = "cancelled"  # the client left, or the router is stopping
    PREFILL_ERROR = "prefill_error"  # the prefill hop failed (5xx, refused, broken response)
    PREFILL_TIMEOUT = "prefill_timeout"  # past prefillTimeoutS
    PREFILL_NO_KV = "prefill_no_kv"  # the prefiller answered without kv_transfer_params
    DECODE_STALL = "decode_stall"  # no first token within decodeFirstTokenTimeoutS (the NIXL stall)
    DECODE_ERROR = "decode_error"  # the decode hop failed (a decoder's fault, not the prefill pool's)
    # No decoder the tenant may use, before the split (then not split: its KV would have nowhere
    # to go) or after its prefill hop: a prefill worker serves it whole, since every worker can.
    DECODE_UNAVAILABLE = "decode_unavailable"


class Verdict(Enum):
    SUCCESS = "success"
    NEUTRAL = "neutral"  # nothing learnt about the prefill pool
    FAILURE = "failure"
    NONE = "none"  # the breaker was not consulted, so it is not told


@dataclass(frozen=True)
class OutcomeRule:
    pool_breaker: Verdict
    falls_back: bool  # the request is served direct instead
    # The prefill hop succeeded, so its worker's prefix cache holds the whole prompt: under the
    # adaptive policy with prefix-aware routing, the fallback is tried there first and computes
    # the last block instead of the prompt (``PdFlow.open``).
    prefilled: bool = False


OUTCOMES: dict[HopOutcome, OutcomeRule] = {
    HopOutcome.OK: OutcomeRule(Verdict.SUCCESS, falls_back=False),
    HopOutcome.PREFILL_BREAKER_OPEN: OutcomeRule(Verdict.NONE, falls_back=True),
    HopOutcome.PREFILL_UNAVAILABLE: OutcomeRule(Verdict.NEUTRAL, falls_back=True),
    HopOutcome.CANCELLED: OutcomeRule(Verdict.NEUTRAL, falls_back=False),
    HopOutcome.PREFILL_ERROR: OutcomeRule(Verdict.FAILURE, falls_back=True),
    HopOutcome.PREFILL_TIMEOUT: OutcomeRule(Verdict.FAILURE, falls_back=True),
    HopOutcome.PREFILL_NO_KV: OutcomeRule(Verdict.FAILURE, falls_back=True),
    # A stall is the pair's failure: it counts against the prefill pool, so repeated stalls send
    # long prompts direct instead of taking the decoder out.
    HopOutcome.DECODE_STALL: OutcomeRule(Verdict.FAILURE, falls_back=True, prefilled=True),
    HopOutcome.DECODE_ERROR: OutcomeRule(Verdict.NEUTRAL, falls_back=True, prefilled=True),
    HopOutcome.DECODE_UNAVAILABLE: OutcomeRule(Verdict.NEUTRAL, falls_back=True, prefilled=True),
}


def tell_pool_breaker(breaker: CircuitBreaker | None, outcome: HopOutcome) -> None:
    if breaker is None:
        return
    verdict = OUTCOMES[outcome].pool_breaker
    if verdict is Verdict.SUCCESS:
        breaker.record_success()
    elif verdict is Verdict.NEUTRAL:
        breaker.record_neutral()
    elif verdict is Verdict.FAILURE:
        breaker.record_failure(outcome.value)


class StreamBreak(str, Enum):
    """How a worker's stream failed after its first event reached the router (``migrate.py``)."""

    BROKEN = "stream_broken"  # connection reset, worker exit, an unreadable chunk
    TRUNCATED = "stream_truncated"  # the stream ended without a finish reason or [DONE]
    IDLE = "stream_idle"  # no chunk within streamIdleTimeoutS (a frozen worker)
    ERROR_EVENT = "worker_error_event"  # the worker sent an error event before the answer finished


@dataclass(frozen=True)
class BreakRule:
    worker_breaker: Verdict  # what the failed worker's own breaker learns
    migrates: bool  # the request continues on another worker (when it can: migrate.why_not_migratable)


STREAM_BREAKS: dict[StreamBreak, BreakRule] = {
    StreamBreak.BROKEN: BreakRule(Verdict.FAILURE, migrates=True),
    StreamBreak.TRUNCATED: BreakRule(Verdict.FAILURE, migrates=True),
    StreamBreak.IDLE: BreakRule(Verdict.FAILURE, migrates=True),
    StreamBreak.ERROR_EVENT: BreakRule(Verdict.FAILURE, migrates=True),
}


def tell_worker_breaker(breaker: CircuitBreaker, what: StreamBreak, detail: str) -> None:
    verdict = STREAM_BREAKS[what].worker_breaker
    if verdict is Verdict.FAILURE:
        breaker.record_failure(f"{what.value}: {detail}")
    elif verdict is Verdict.NEUTRAL:
        breaker.record_neutral()
    elif verdict is Verdict.SUCCESS:
        breaker.record_success()

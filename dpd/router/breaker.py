"""Circuit breakers: stop sending requests where they keep failing, try again after a cooldown.

A ``CircuitBreaker`` is closed (requests flow), open (none do) or half-open (one trial request
at a time). Per worker:

  closed    --``failure_threshold`` consecutive failed requests, one refused connection,
              one failed health probe, or ``failure_threshold`` consecutive health
              probes that timed out-->                                               open
  open      --``open_s`` elapsed and the worker passes its health probe-->          half-open
  half-open --the trial request succeeds--> closed;  --it fails--> open (cooldown restarts)

Per pool (the prefill pool's breaker): the same machine driven by consecutive failed
disaggregated attempts of any of its workers (prefill errors and timeouts, decode stalls), and
half-open as soon as its cooldown passes. While it is open, long prompts take the direct path,
so a degraded prefill pool costs them speed, never an error.

A probe that times out is not a failed one: on a machine short of CPU a busy worker (or the
router's own loop) can answer ``/health`` late while it serves every request, and a breaker
opened on one late answer turned a healthy worker away (the only decoder: 503s for every
request until its cooldown passed). Late probes count toward their own threshold instead, reset
by a probe answered in time; a worker that is really hung also fails its requests' deadlines.

Everything here is synchronous and driven by the caller's clock; the router reports outcomes.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class BreakerState(enum.Enum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"

    @property
    def gauge_value(self) -> int:
        return {"closed": 0, "half_open": 1, "open": 2}[self.value]


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        failure_threshold: int,
        open_s: float,
        *,
        needs_probe: bool = True,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Callable[[str, BreakerState], None] | None = None,
        state: BreakerState = BreakerState.CLOSED,
    ):
        self.name = name
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.needs_probe = needs_probe  # a worker's breaker half-opens only after a good probe
        self._clock = clock
        self._on_transition = on_transition
        self.state = state
        self.num_consecutive_failures = 0
        self.num_consecutive_late_probes = 0
        self.opened_at = clock() if state is BreakerState.OPEN else 0.0
        self.is_trial_in_flight = False
        self.last_error: str | None = None

    # -- what may be sent ---------------------------------------------------------------------
    def allows_request(self) -> bool:
        """Whether a request may go through now (without taking the half-open trial)."""
        if self.state is BreakerState.OPEN and not self.needs_probe and self._cooled_down():
            self._move(BreakerState.HALF_OPEN)
        if self.state is BreakerState.CLOSED:
            return True
        return self.state is BreakerState.HALF_OPEN and not self.is_trial_in_flight

    def begin(self) -> None:
        """A request was sent: in half-open it is the trial, and the only one until it ends."""
        if self.state is BreakerState.HALF_OPEN:
            self.is_trial_in_flight = True

    # -- outcomes -------------------------------------------------------------------------------
    def record_success(self) -> None:
        self.num_consecutive_failures = 0
        self.is_trial_in_flight = False
        if self.state is not BreakerState.CLOSED:
            self._move(BreakerState.CLOSED)

    def record_neutral(self) -> None:
        """The request ended without telling anything about the worker (e.g. the client left)."""
        self.is_trial_in_flight = False

    def record_failure(self, error: str, *, is_definite: bool = False) -> None:
        """A failed request; ``is_definite`` (refused connection, failed probe) opens at once."""
        self.last_error = error
        self.num_consecutive_failures += 1
        was_trial = self.is_trial_in_flight
        self.is_trial_in_flight = False
        if self.state is BreakerState.OPEN:
            # Failed probes of a worker that is down confirm what is known: the cooldown runs from
            # the opening, so a worker that comes back after it gets its trial at its first good probe.
            return
        if is_definite or was_trial or self.state is BreakerState.HALF_OPEN or (
            self.num_consecutive_failures >= self.failure_threshold
        ):
            self.opened_at = self._clock()
            self._move(BreakerState.OPEN)

    def record_probe(self, is_ok: bool, error: str | None = None, *, is_late: bool = False) -> None:
        """A health probe's answer: ``is_ok``, or an error; ``is_late``: no answer within the
        probe's timeout, which opens the breaker only ``failure_threshold`` times running."""
        if is_ok:
            self.num_consecutive_late_probes = 0
        elif is_late:
            self.num_consecutive_late_probes += 1
            if self.num_consecutive_late_probes < self.failure_threshold:
                self.last_error = error or "health probe timed out"
                return
        if not is_ok:
            self.record_failure(error or "health probe failed", is_definite=True)
        elif self.state is BreakerState.OPEN and self._cooled_down():
            self._move(BreakerState.HALF_OPEN)

    def force(self, state: BreakerState) -> None:
        """Set the state directly (start-up: a worker is open until its first good probe)."""
        if state is BreakerState.OPEN:
            self.opened_at = self._clock() - self.open_s  # no cooldown owed for a worker never seen up
        self.is_trial_in_flight = False
        self.num_consecutive_late_probes = 0  # those counted while it was loading are history
        if state is not self.state:
            self._move(state)

    def _cooled_down(self) -> bool:
        return self._clock() - self.opened_at >= self.open_s

    def _move(self, state: BreakerState) -> None:
        log.log(
            logging.WARNING if state is BreakerState.OPEN else logging.INFO,
            "breaker %s: %s -> %s%s", self.name, self.state.value, state.value,
            f" ({self.last_error})" if state is BreakerState.OPEN and self.last_error else "",
        )
        self.state = state
        if state is BreakerState.CLOSED:
            self.num_consecutive_failures = 0
            self.num_consecutive_late_probes = 0
        if self._on_transition:
            self._on_transition(self.name, state)

"""What the router measures of each worker while it serves: the live state a cost model reads.

Everything here comes from traffic the router itself routes — no worker is asked and no rate is
a constant in the code (the config's priors only stand in until the first measurement):

* ``queued_prefill_tokens`` — prompt tokens sent to the worker whose prefill has not finished
  (the prefill hop has not answered, or a whole request has not streamed its first token);
* ``streams`` — requests decoding on the worker (first token seen, stream still open), each
  with its start, its expected length and the tokens seen so far, so the policy can tell how
  much stall each can still absorb within its TPOT SLO (``stream_slacks_s``);
* ``prefill_tokens_per_s`` — measured prefill rate. The worker is treated as one server that
  works through its prefills in order: a prefill's *service time* runs from when it was sent or
  the previous prefill on the worker finished, whichever is later, to its own end; the sample
  is its tokens over that time; the rate is recent samples' tokens over their time
  (``RecentRate``). Prompts shorter than ``min_sample_tokens`` are not sampled: their time is
  mostly fixed per-request overhead, not prefill;
* ``prefill_utilization`` — the share of recent time the worker spent prefilling (an
  exponentially decayed sum of service times over ``window_s``): how much a stream placed on
  it can expect to be stalled;
* ``decode_tokens_per_s`` — one stream's measured generation rate on the worker.

``EndpointLoad`` holds what is not per worker: the disaggregated path's own overhead (the
decode hop's first-token latency: the KV pull plus one step and a hop; a recent median) and the
typical output length (EWMA), and how far the policy's TTFT predictions missed lately, per path
(``ttft_errors``: measured − predicted, a recent window; the adaptive policy reads a plan's chance
of missing its TTFT target from it). ``SharedRates`` pools every worker's samples: a worker not yet
measured is predicted at its peers' measured rates, not at the config's prior (a prior far
from this hardware's rates sent whole requests to the one unmeasured worker). A clock is
injected so tests drive time by hand.
"""

from __future__ import annotations

import bisect
import math
import operator
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Clock = Callable[[], float]
SAME_STEP_S = 0.005  # prefills that end this close together finished in one engine step
SAME_STEP_SHARE = 0.1  # … or this close, as a share of the batch's time so far (ends seen late)


class Ewma:
    """An exponentially weighted mean that starts at a prior and counts its samples."""

    def __init__(self, prior: float, alpha: float = 0.3):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.value = prior
        self.alpha = alpha
        self.num_samples = 0

    def add(self, sample: float) -> None:
        if not math.isfinite(sample):
            return
        self.value = sample if self.num_samples == 0 else self.value + self.alpha * (sample - self.value)
        self.num_samples += 1


class RecentMedian:
    """The median of the last ``window`` samples, or the prior until ``min_samples`` arrived.

    NOTE: a median, not a mean: a worker's first requests after start-up run while vLLM
    compiles for new shapes (a 2,000-token prefill measured 50 s instead of 6 s here), and the
    first KV transfer registers memory; an EWMA seeded by such a sample would steer traffic
    away from the worker for many requests, a median forgets it once the window has seen
    ordinary ones."""

    def __init__(self, prior: float, window: int = 8, min_samples: int = 3):
        self.prior = prior
        self.window = window
        self.min_samples = min_samples
        self._samples: list[float] = []
        self.num_samples = 0
        self.is_measured = False  # ``min_samples`` arrived
        self._median: float | None = None  # of ``_samples``, until they change (read once per candidate plan)

    def add(self, sample: float) -> None:
        if not math.isfinite(sample):
            return
        self._samples.append(sample)
        if len(self._samples) > self.window:
            del self._samples[0]
        self.num_samples += 1
        self.is_measured = len(self._samples) >= self.min_samples
        self._median = None

    def replace_last(self, sample: float) -> None:
        if self._samples and math.isfinite(sample):
            self._samples[-1] = sample
            self._median = None

    @property
    def value(self) -> float:
        if self._median is None:
            if not self.is_measured:
                return self.prior
            ordered = sorted(self._samples)
            mid = len(ordered) // 2
            self._median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        return self._median


class RecentRate:
    """Tokens per second over the last ``window`` samples of (tokens, seconds): their total tokens
    over their total time; the prior until ``min_samples``. A sample slower than an eighth of
    the rest's rate is left out: a worker's first prefills, slowed by vLLM compiling for new
    shapes (a 2,000-token prefill once measured 50 s instead of 6 s here), would otherwise hold
    the rate down — and traffic off the worker — until the window forgot them.

    NOTE: a ratio of sums, not a median of ratios. A prefill's service time runs from the end of
    the one before it, so when vLLM finishes several in one step and the router sees their ends
    apart (its loop busy relaying streams), the first carries the step's whole time and the rest
    almost none: their own rates are absurd (a median of them predicted 600-token splits at
    0.1–0.5 s that took 10–16 s, in a burst). Summed, the time lands where it belongs."""

    def __init__(self, prior: float, window: int = 8, min_samples: int = 3):
        self.prior = prior
        self.window = window
        self.min_samples = min_samples
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.num_samples = 0
        self.is_measured = False  # ``min_samples`` arrived (an attribute: read for every worker of a pool)
        self._value: float | None = None  # of ``_samples``, until they change

    def add(self, num_tokens: float, seconds: float) -> None:
        if not (math.isfinite(num_tokens) and math.isfinite(seconds)) or seconds <= 0:
            return
        self._samples.append((num_tokens, seconds))
        self.num_samples += 1
        self.is_measured = len(self._samples) >= self.min_samples
        self._value = None

    def replace_last(self, num_tokens: float, seconds: float) -> None:
        if self._samples and math.isfinite(num_tokens) and math.isfinite(seconds) and seconds > 0:
            self._samples[-1] = (num_tokens, seconds)
            self._value = None

    @property
    def value(self) -> float:
        if self._value is None:
            if not self.is_measured:
                return self.prior
            total_tokens, total_s = 0.0, 0.0
            # Added left to right, on every Python version and as the compiled build adds (sum()
            # of floats compensates its rounding from 3.12 on: its last bit could differ).
            for tokens, seconds in self._samples:
                total_tokens += tokens
                total_s += seconds
            kept_tokens, kept_s = total_tokens, total_s
            for tokens, seconds in self._samples:
                rest_s = total_s - seconds
                if rest_s > 0 and tokens / seconds * 8 < (total_tokens - tokens) / rest_s:
                    kept_tokens, kept_s = kept_tokens - tokens, kept_s - seconds
            self._value = kept_tokens / kept_s
        return self._value


class Residuals:
    """The last ``window`` prediction errors (measured − predicted, seconds) of one kind of plan.

    The cost model's TTFT of a split is a sum of medians (a prefill rate, the decode hop's
    overhead); under load the parts vary together — a prefiller with streams of its own
    prefills slower, a decoder mid-way through a long step answers the hop late — so its
    errors spread far wider than a whole request's (measured here: P90 +2.7 s against +0.5 s).
    The policy asks ``share_above(target − predicted)``: the chance the plan misses a target.
    Errors older than ``max_age_s`` are forgotten: a plan judged late stops being chosen, so its
    window would otherwise never change; emptied, it lets the plan be tried and measured again."""

    def __init__(self, window: int = 64, min_samples: int = 8, max_age_s: float = 60.0, clock: Clock = time.monotonic):
        self.min_samples = min_samples
        self.max_age_s = max_age_s
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)  # (when, error)
        self._sorted: list[float] | None = None  # of ``_samples``' errors, once read: then kept sorted in place
        self.num_samples = 0

    @property
    def is_measured(self) -> bool:
        self._expire()
        return len(self._samples) >= self.min_samples

    def add(self, sample: float) -> None:
        if not math.isfinite(sample):
            return
        if self._samples and len(self._samples) == self._samples.maxlen:  # the oldest leaves the window
            self._unsort(self._samples[0][1])
        self._samples.append((self._clock(), sample))
        self.num_samples += 1
        if self._sorted is not None:  # kept sorted in place: a sample a request, read once a decision
            bisect.insort(self._sorted, sample)

    def _expire(self) -> None:
        oldest = self._clock() - self.max_age_s
        while self._samples and self._samples[0][0] < oldest:
            self._unsort(self._samples.popleft()[1])

    def _unsort(self, error: float) -> None:
        if self._sorted is not None:
            del self._sorted[bisect.bisect_left(self._sorted, error)]

    def _ordered(self) -> list[float]:
        self._expire()
        if self._sorted is None:
            self._sorted = sorted(error for _, error in self._samples)
        return self._sorted

    def measured_errors(self) -> list[float] | None:
        """The recent errors, sorted, or None while too few (what ``share_above`` reads, for a
        caller that asks many times in one decision): read, not modified, and valid until the
        next sample or the next read that finds one expired (the list is kept sorted in place)."""
        return self._ordered() if self.is_measured else None

    def share_above(self, margin_s: float) -> float:
        """The share of recent errors larger than ``margin_s``; with too few, the prediction is
        taken as exact (1 if ``margin_s`` < 0, else 0)."""
        return share_above(self.measured_errors(), margin_s)

    def quantile(self, q: float) -> float | None:
        ordered = self._ordered()
        if not ordered:
            return None
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def share_above(errors: list[float] | None, margin_s: float) -> float:
    """The share of sorted ``errors`` larger than ``margin_s`` (``Residuals.measured_errors``);
    None (too few measured): 1 if ``margin_s`` < 0, else 0."""
    if errors is None:
        return float(margin_s < 0)
    return (len(errors) - bisect.bisect_right(errors, margin_s)) / len(errors)


_gap = operator.itemgetter(0)  # a gap run's gap


class PrefillTicket:
    """One prefill in flight on a worker; ``WorkerLoad.end_prefill`` closes it exactly once. A
    ticket is its identity: two alike in every field are still two prefills.

    Here and in ``StreamTicket``, a plain class with an explicit ``__init__`` rather than a
    dataclass: the simulator's compiled build (``dpd.sim.compiled``) constructs it natively, where
    a dataclass's generated ``__init__`` stays interpreted Python (one of each per request)."""

    __slots__ = ("num_tokens", "sent_at", "expected_tokens", "is_open")

    def __init__(self, num_tokens: int, sent_at: float, expected_tokens: int | None = None):
        self.num_tokens = num_tokens
        self.sent_at = sent_at
        self.expected_tokens = expected_tokens  # a whole request's output: it will decode here after its prefill
        self.is_open = True


class StreamTicket:
    """One stream decoding on a worker: its first token's time, the tokens it is expected to
    generate (``max_tokens``, else the endpoint's typical output) and those seen so far. Likewise
    its identity: ``in`` and ``remove`` find this stream, not one equal to it."""

    __slots__ = ("started_at", "expected_tokens", "num_tokens", "last_token_at", "gap_runs")

    def __init__(self, started_at: float, expected_tokens: int):
        self.started_at = started_at
        self.expected_tokens = expected_tokens
        self.num_tokens = 1
        self.last_token_at: float | None = None
        # per event after the first token: (the gap before each of its tokens, its tokens) — for the
        # undisturbed decode rate; run-length coded, so the gaps number num_tokens - 1
        self.gap_runs: list[tuple[float, int]] = []

    def add_tokens(self, num_tokens: int, now: float) -> None:
        """``num_tokens`` in all have been seen by ``now`` (an event may carry several)."""
        self.add_token_runs(((num_tokens - self.num_tokens, 0.0, now),))

    def add_token_runs(self, runs: Sequence[tuple[int, float, float]]) -> None:
        """``add_tokens`` for each run in order: (new tokens, —, the last one's time) — the
        simulator hands a stream several engine steps' tokens at once, as its engine logs them
        (the middle figure, the engine's own step time, is not read: the gaps are timed here,
        as a real stream's are)."""
        gap_runs, num_tokens, last = self.gap_runs, self.num_tokens, self.last_token_at
        for new, _, now in runs:
            if new > 0:
                gap_runs.append(((now - (self.started_at if last is None else last)) / new, new))
                num_tokens += new
                last = now
        self.num_tokens, self.last_token_at = num_tokens, last

    def median_gap_s(self) -> float:
        """The median gap between tokens (of an even count, the upper middle one); NaN before a second token."""
        k = (self.num_tokens - 1) // 2
        for gap, count in sorted(self.gap_runs, key=_gap):  # equal gaps in any order: the same median
            if k < count:
                return gap
            k -= count
        return math.nan


@dataclass(frozen=True)
class LoadPriors:
    """Values used until a worker has been measured (the config's ``router.adaptive``)."""

    prefill_tokens_per_s: float = 500.0
    decode_tokens_per_s: float = 30.0
    split_overhead_s: float = 0.3
    output_tokens: float = 128.0


class SharedRates:
    """Every worker's rate samples together: what an unmeasured worker is predicted at."""

    def __init__(self, priors: LoadPriors = LoadPriors(), window: int = 16):
        self.prefill_rate = RecentRate(priors.prefill_tokens_per_s, window=window)
        self.decode_rate = RecentMedian(priors.decode_tokens_per_s, window=window)


class WorkerLoad:
    def __init__(self, priors: LoadPriors = LoadPriors(), clock: Clock = time.monotonic, *,
                 window_s: float = 60.0, min_sample_tokens: int = 128, shared: SharedRates | None = None):
        self._clock = clock
        self.window_s = window_s
        self.min_sample_tokens = min_sample_tokens
        self.queued_prefill_tokens = 0
        self.streams: list[StreamTicket] = []
        self.prefill_rate = RecentRate(priors.prefill_tokens_per_s)
        self._measured_prefill_rate: float | None = None  # ``prefill_tokens_per_s`` once measured here
        self.decode_rate = RecentMedian(priors.decode_tokens_per_s)
        self.shared = shared if shared is not None else SharedRates(priors)
        self.prefills: list[PrefillTicket] = []
        self._last_prefill_end = -math.inf
        self._batch_tokens, self._batch_s = 0, 0.0  # the last sample's batch (prefills ending in one step)
        self._shared_mark = -1  # the shared window's sample count just after this worker's last sample
        self._busy_s = 0.0  # decayed sum of service times
        self._busy_at = clock()
        self._recent: deque[tuple[float, float]] = deque(maxlen=256)  # (end, service s) of recent prefills
        self._recent_sorted: list[float] | None = None  # their service times, sorted (once read: then kept so in place)
        self._watchers: list[set[WorkerLoad]] = []  # sets this load adds itself to when it changes (watch)

    def watch(self, changed: set[WorkerLoad]) -> None:
        """Add this load to ``changed`` now and whenever its queued prefill tokens, its streams or its
        own prefill rate change (``ShortlistIndex`` re-reads only the workers that changed)."""
        self._watchers.append(changed)
        changed.add(self)

    # -- prefill ---------------------------------------------------------------------------------
    def begin_prefill(self, num_tokens: int, expected_tokens: int | None = None) -> PrefillTicket:
        """A prefill sent; ``expected_tokens`` when the request will also decode here (whole)."""
        self.queued_prefill_tokens += num_tokens
        ticket = PrefillTicket(num_tokens, self._clock(), expected_tokens)
        self.prefills.append(ticket)
        for changed in self._watchers:
            changed.add(self)
        return ticket

    def end_prefill(self, ticket: PrefillTicket, *, is_ok: bool) -> None:
        """The prefill finished (``is_ok``) or was abandoned; only finished ones are measured."""
        if not ticket.is_open:
            return
        ticket.is_open = False
        self.prefills.remove(ticket)
        self.queued_prefill_tokens -= ticket.num_tokens
        for changed in self._watchers:  # read when next asked: the rate below may change too
            changed.add(self)
        if not is_ok:
            return
        now = self._clock()
        gap_s = now - self._last_prefill_end
        if self._batch_tokens and gap_s <= max(SAME_STEP_S, SAME_STEP_SHARE * self._batch_s):
            # Finished in the same engine step as the previous one (seen a little later when
            # the router's loop is busy): one sample for the batch.
            self._batch_tokens += ticket.num_tokens if ticket.num_tokens >= self.min_sample_tokens else 0
            self._last_prefill_end = now
            self._add_busy(gap_s, now)
            self._batch_s += gap_s
            self.prefill_rate.replace_last(self._batch_tokens, self._batch_s)
            self._measured_prefill_rate = None
            if self.shared.prefill_rate.num_samples == self._shared_mark:  # its last sample is still ours
                self.shared.prefill_rate.replace_last(self._batch_tokens, self._batch_s)
            return
        started = max(ticket.sent_at, self._last_prefill_end)
        self._last_prefill_end = now
        service_s = max(now - started, 1e-3)
        self._add_busy(service_s, now)
        self._batch_tokens, self._batch_s = 0, service_s
        if ticket.num_tokens >= self.min_sample_tokens:
            self._batch_tokens = ticket.num_tokens
            self.prefill_rate.add(ticket.num_tokens, service_s)
            self._measured_prefill_rate = None
            self.shared.prefill_rate.add(ticket.num_tokens, service_s)
            self._shared_mark = self.shared.prefill_rate.num_samples

    @property
    def num_prefills(self) -> int:
        return len(self.prefills)

    @property
    def prefill_tokens_per_s(self) -> float:
        # The adaptive policy reads it for every worker of a large pool on every decision: once
        # measured here (it then never reads the peers' again), kept until a sample changes it.
        rate = self._measured_prefill_rate
        if rate is not None:
            return rate
        own, shared = self.prefill_rate, self.shared.prefill_rate
        if own.is_measured:
            rate = self._measured_prefill_rate = max(own.value, 1.0)
            return rate
        return max(shared.value if shared.is_measured else own.value, 1.0)  # _own_or_shared, inlined

    def prefill_s(self, num_tokens: int) -> float:
        """Predicted time until a prefill of ``num_tokens`` sent now finishes (queue included)."""
        return (self.queued_prefill_tokens + num_tokens) / self.prefill_tokens_per_s

    def prefill_utilization(self) -> float:
        now = self._clock()
        return min(1.0, self._decayed(now) / self.window_s)

    def _decayed(self, now: float) -> float:
        return self._busy_s * math.exp(-max(0.0, now - self._busy_at) / self.window_s)

    def stalls_longer_than_per_s(self, stall_s: float, recent: list[float] | None = None) -> float:
        """How often, per second over the last ``window_s``, a prefill here ran longer than
        ``stall_s`` — each one stalled every stream on the worker that long. ``recent``: this
        worker's ``recent_services_s()``, when the caller asks many times in one decision."""
        services = self.recent_services_s() if recent is None else recent
        return (len(services) - bisect.bisect_right(services, stall_s)) / self.window_s

    def recent_services_s(self) -> list[float]:
        """The service times of the prefills that ended within the last ``window_s``, sorted
        (one list, kept sorted in place as prefills end and leave the window: read, not modified,
        and valid until the next prefill ends or the next read finds one past the window)."""
        since = self._clock() - self.window_s
        recent, ordered = self._recent, self._recent_sorted
        while recent and recent[0][0] < since:  # in order of their end: the oldest leave first
            service = recent.popleft()[1]
            if ordered is not None:
                del ordered[bisect.bisect_left(ordered, service)]
        if ordered is None:
            ordered = self._recent_sorted = sorted(service for _, service in recent)
        return ordered

    def _add_busy(self, service_s: float, now: float) -> None:
        recent, ordered = self._recent, self._recent_sorted
        if ordered is not None:  # kept sorted in place, as the services come and go
            if len(recent) == recent.maxlen:
                del ordered[bisect.bisect_left(ordered, recent[0][1])]
            bisect.insort(ordered, service_s)
        recent.append((now, service_s))
        self._busy_s = self._decayed(now) + service_s
        self._busy_at = now

    # -- decode ----------------------------------------------------------------------------------
    @property
    def num_streams(self) -> int:
        return len(self.streams)

    def begin_stream(self, expected_tokens: int) -> StreamTicket:
        """A stream's first token arrived; the caller counts its tokens on the ticket."""
        ticket = StreamTicket(self._clock(), max(1, expected_tokens))
        self.streams.append(ticket)
        for changed in self._watchers:
            changed.add(self)
        return ticket

    def end_stream(self, ticket: StreamTicket, num_tokens: int | None = None) -> None:
        """The stream ended after ``num_tokens`` tokens (default: those counted on the ticket)."""
        if ticket not in self.streams:
            return
        self.streams.remove(ticket)
        for changed in self._watchers:
            changed.add(self)
        if num_tokens is not None:
            ticket.add_tokens(num_tokens, self._clock())
        if ticket.num_tokens - 1 >= 4:
            # The median gap: the rate between stalls. A stream's mean rate counts the stalls
            # other requests' prefills caused, which the policy predicts separately.
            gap = ticket.median_gap_s()
            if gap > 0:
                self.decode_rate.add(1 / gap)
                self.shared.decode_rate.add(1 / gap)

    @property
    def decode_tokens_per_s(self) -> float:
        return max(_own_or_shared(self.decode_rate, self.shared.decode_rate), 0.1)

    def stream_slacks_s(self, tpot_slo_s: float) -> list[float]:
        """For each stream — running, or a whole request whose prefill is queued here and which
        will decode while a prefill sent now runs — the stall it can still absorb and keep its
        TPOT within the SLO: its budget (``tpot_slo_s`` × tokens after the first) less the time
        it has decoded and the time its remaining tokens need at the measured rate. Negative: it
        misses already."""
        now, rate = self._clock(), self.decode_tokens_per_s
        out = []
        for s in self.streams:
            expected = max(s.expected_tokens, s.num_tokens)
            out.append(tpot_slo_s * (expected - 1) - (now - s.started_at) - (expected - s.num_tokens) / rate)
        for p in self.prefills:
            if p.expected_tokens is not None and p.expected_tokens > 1:
                out.append((tpot_slo_s - 1 / rate) * (p.expected_tokens - 1))
        return out

    def state(self) -> dict:
        return {
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "prefills": self.num_prefills,
            "streams": self.num_streams,
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 1),
            "prefill_rate_samples": self.prefill_rate.num_samples,
            "prefill_utilization": round(self.prefill_utilization(), 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
        }


def _own_or_shared(own: RecentMedian, shared: RecentMedian) -> float:
    """A worker's own measurement once it has one, else its peers', else the prior."""
    if own.is_measured or not shared.is_measured:
        return own.value
    return shared.value


@dataclass
class EndpointLoad:
    """Measurements that belong to the endpoint, not one worker."""

    priors: LoadPriors = field(default_factory=LoadPriors)
    split_overhead: RecentMedian = field(init=False)
    output_tokens: Ewma = field(init=False)
    streams_per_decoder: Ewma = field(init=False)
    ttft_errors: dict[str, Residuals] = field(init=False)  # by planned path: "direct", "disaggregated"
    clock: Clock = time.monotonic

    def __post_init__(self) -> None:
        self.ttft_errors = {"direct": Residuals(clock=self.clock), "disaggregated": Residuals(clock=self.clock)}
        self.split_overhead = RecentMedian(self.priors.split_overhead_s)
        self.output_tokens = Ewma(self.priors.output_tokens, alpha=0.1)
        self.streams_per_decoder = Ewma(0.0, alpha=0.1)

"""A discrete-event simulator of one endpoint, driving the router's own decision code.

Workers are modelled at the level of engine steps, the way vLLM's scheduler works: each step
gives every running stream its next token and spends what is left of the token budget
(``max_batched_tokens``) on waiting prefills, oldest first, in chunks, up to ``max_num_seqs``
requests in all; a step takes
``step_overhead_s + prefill tokens / prefill_tokens_per_s + streams × decode_s_per_stream``.
So a long prefill stalls every stream of its worker for its whole step, as on a CPU worker.

The router side is not re-implemented: each request is decided by ``AdaptiveDecider`` or
``ThresholdDecider`` over ``Worker`` objects whose ``WorkerLoad`` is fed exactly as the real
flow feeds it (prefill tickets, stream tickets, the split's overhead), on the simulated clock.
It is a tool for comparing policies in seconds before measuring them for real
(``dpd bench ladder``); its figures are predictions, not measurements.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dpd.router.adaptive import AdaptiveDecider, Candidates, ShortlistIndex, Slo
from dpd.router.decide import Path, ThresholdDecider
from dpd.router.load import EndpointLoad, LoadPriors, SharedRates, WorkerLoad
from dpd.router.pick import LeastOutstandingPicker
from dpd.router.pools import Worker

POLICIES = ("colocated", "threshold", "adaptive")


@dataclass(frozen=True)
class EngineProfile:
    """One worker's speed. The defaults are this project's CPU workers (SmolLM2-135M, float32,
    one core each): a 768-token prefill ~3 s, a decode step ~60 ms."""

    prefill_tokens_per_s: float = 265.0
    step_overhead_s: float = 0.05
    decode_s_per_stream: float = 0.002
    max_batched_tokens: int = 2048
    max_num_seqs: int = 256  # requests in a step at most (vLLM's default on CPU and smaller GPUs)
    kv_transfer_s: float = 0.25  # the decode hop's first token after the prefill answered

    def __post_init__(self) -> None:
        # A profile is read from a file a user may have edited: a zero step time would loop
        # forever, a negative rate would plan nonsense, a string would fail mid-search.
        for name, low, is_int in (("prefill_tokens_per_s", 0, False), ("step_overhead_s", None, False),
                                  ("decode_s_per_stream", None, False), ("kv_transfer_s", None, False),
                                  ("max_batched_tokens", 0, True), ("max_num_seqs", 0, True)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int if is_int else (int, float)):
                raise ValueError(f"{name} must be {'an integer' if is_int else 'a number'}, not {value!r}")
            if not math.isfinite(value) or value < 0 or (low is not None and value <= low):
                raise ValueError(f"{name} must be {'positive' if low is not None else 'zero or more'} and finite, "
                                 f"not {value!r}")
        if self.step_overhead_s + self.decode_s_per_stream <= 0:
            raise ValueError("a decode step must take some time: step_overhead_s or decode_s_per_stream above 0")


@dataclass(eq=False)  # each job is itself: found in the engine's lists by identity
class Job:
    prompt_tokens: int
    output_tokens: int
    on_first: Callable[[float], None]
    on_tokens: Callable[[int, float, float], None]  # (tokens, the gap before each, the last one's time)
    on_done: Callable[[float], None]
    remaining_prefill: int = 0
    generated: int = 0

    def __post_init__(self) -> None:
        self.remaining_prefill = self.prompt_tokens


class Sim:
    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self) -> None:
        while self._events:
            self.now, _, fn = heapq.heappop(self._events)
            fn()


class Engine:
    """One worker's engine: a FIFO of prefills and a batch of running streams.

    A stretch of decode-only steps (nothing waiting) is one event, not one per step: the batch
    does not change until its first stream ends or a request arrives, so its steps are equal and
    their tokens are known in advance (each stream's next ``k`` tokens, ``step_s`` apart). An
    arrival cuts the stretch at the end of the step under way, as the real scheduler admits a new
    request only between steps; ``sync`` hands the streams the tokens of the steps already done
    when the router looks at them (a real worker streams each one). Token times are the same as
    stepping one by one."""

    def __init__(self, sim: Sim, profile: EngineProfile):
        self.sim = sim
        self.profile = profile
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.is_busy = False
        self._cruise: tuple[float, float, int] | None = None  # decode-only steps: (start, step s, steps)
        self._generation = 0  # a cut stretch's scheduled end is stale

    def submit(self, job: Job) -> None:
        self.waiting.append(job)
        if self._cruise is not None:
            self._cut()
        self._maybe_step()

    def sync(self) -> None:
        """Give the running streams the tokens of the decode-only steps completed by now."""
        if self._cruise is None:
            return
        start, step_s, steps = self._cruise
        done = min(int((self.sim.now - start) / step_s), steps - 1)
        if done <= 0:
            return
        end = start + done * step_s
        for job in self.running:
            job.generated += done
            job.on_tokens(done, step_s, end)
        self._cruise = (end, step_s, steps - done)

    def _cut(self) -> None:
        """End the decode-only stretch with the step under way (a new request waits for it)."""
        self.sync()
        assert self._cruise is not None
        start, step_s, steps = self._cruise
        if steps > 1:
            self._cruise = (start, step_s, 1)
            self._generation += 1
            generation = self._generation
            self.sim.at(start + step_s, lambda: self._end_cruise(generation))

    def _maybe_step(self) -> None:
        if self.is_busy or not (self.waiting or self.running):
            return
        p = self.profile
        self.is_busy = True
        if not self.waiting:
            steps = min(job.output_tokens - job.generated for job in self.running)
            step_s = p.step_overhead_s + len(self.running) * p.decode_s_per_stream
            self._cruise = (self.sim.now, step_s, steps)
            generation = self._generation
            self.sim.at(self.sim.now + steps * step_s, lambda: self._end_cruise(generation))
            return
        budget = p.max_batched_tokens - len(self.running)
        decoding = list(self.running)
        chunks: list[tuple[Job, int]] = []
        room = p.max_num_seqs - len(self.running)
        for job in self.waiting:
            if budget <= 0 or len(chunks) >= room:
                break
            take = min(job.remaining_prefill, budget) if job.remaining_prefill else 1
            chunks.append((job, take))
            budget -= take
        prefill_tokens = sum(take for job, take in chunks if job.remaining_prefill)
        step_s = p.step_overhead_s + prefill_tokens / p.prefill_tokens_per_s + len(decoding) * p.decode_s_per_stream
        self.sim.at(self.sim.now + step_s, lambda: self._end_step(decoding, chunks, step_s))

    def _end_cruise(self, generation: int) -> None:
        if generation != self._generation or self._cruise is None:
            return
        _, step_s, steps = self._cruise
        self._cruise = None
        self._finish_tokens(self.running, steps, step_s)
        self.is_busy = False
        self._maybe_step()

    def _finish_tokens(self, decoding: list[Job], steps: int, step_s: float) -> None:
        now = self.sim.now
        ended = []
        for job in decoding:
            job.generated += steps
            job.on_tokens(steps, step_s, now)
            if job.generated >= job.output_tokens:
                ended.append(job)
        for job in ended:
            self.running.remove(job)
            job.on_done(now)

    def _end_step(self, decoding: list[Job], chunks: list[tuple[Job, int]], step_s: float) -> None:
        now = self.sim.now
        self.is_busy = False
        self._finish_tokens(decoding, 1, step_s)
        for job, take in chunks:
            job.remaining_prefill = max(0, job.remaining_prefill - take)
            if job.remaining_prefill:
                continue
            self.waiting.remove(job)
            job.generated = 1
            job.on_first(now)
            if job.output_tokens <= 1:
                job.on_done(now)
            else:
                self.running.append(job)
        self._maybe_step()


@dataclass
class Outcome:
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    path: str = ""
    reason: str = ""
    first_s: float = float("nan")
    last_s: float = float("nan")
    num_tokens: int = 0
    gaps: list[tuple[float, int]] = field(default_factory=list)  # inter-token gaps, run-length coded (s, count)
    predicted_ttft_s: float | None = None  # the adaptive policy's, audited at the first token as the router does

    def add_first(self, t: float) -> None:
        self.first_s = self.last_s = t
        self.num_tokens = 1

    def add_tokens(self, num_tokens: int, gap_s: float, last_s: float) -> None:
        if self.gaps and self.gaps[-1][0] == gap_s:
            self.gaps[-1] = (gap_s, self.gaps[-1][1] + num_tokens)
        else:
            self.gaps.append((gap_s, num_tokens))
        self.num_tokens += num_tokens
        self.last_s = last_s

    @property
    def token_times(self) -> list[float]:
        if not self.num_tokens:
            return []
        times = [self.first_s]
        for gap, count in self.gaps:
            base = times[-1]
            times.extend([base + gap * (i + 1) for i in range(count)])
        times[-1] = self.last_s
        return times

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        if self.num_tokens < 2:
            return 0.0
        return (self.last_s - self.first_s) / (self.num_tokens - 1)

    def meets(self, slo: Slo) -> bool:
        return self.ttft_s <= slo.ttft_s and self.tpot_s <= slo.tpot_s


class SimEndpoint:
    """Two pools of simulated workers behind the router's deciders."""

    def __init__(self, policy: str, *, num_prefill: int = 1, num_decode: int = 1, threshold_tokens: int = 512,
                 floor_tokens: int = 0, profile: EngineProfile = EngineProfile(), priors: LoadPriors = LoadPriors(),
                 slo: Slo = Slo(), stall_weight: float = 1.0, max_stall_s: float | None = None, seed: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        self.sim = Sim()
        self.policy = policy
        self.profile = profile
        shared = SharedRates(priors)

        def worker(name: str, pool: str) -> Worker:
            return Worker(name, "sim://" + name, pool, load=_SimulatedLoad(priors, lambda: self.sim.now, shared=shared))

        if policy == "colocated":
            num_decode, num_prefill = num_decode + num_prefill, 0
        self.prefill = [worker(f"prefill-{i}", "prefill") for i in range(num_prefill)]
        self.decode = [worker(f"decode-{i}", "decode") for i in range(num_decode)]
        self.engines = {w.name: Engine(self.sim, profile) for w in (*self.prefill, *self.decode)}
        for w in (*self.prefill, *self.decode):
            assert isinstance(w.load, _SimulatedLoad)
            w.load.engine = self.engines[w.name]
        self.endpoint = EndpointLoad(priors, clock=lambda: self.sim.now)
        self.threshold = ThresholdDecider(threshold_tokens, is_colocated=policy == "colocated")
        self.adaptive = AdaptiveDecider(floor_tokens, self.endpoint, stall_weight=stall_weight, slo=slo,
                                        max_stall_s=max_stall_s)
        self.picker = LeastOutstandingPicker(random.Random(seed))  # the router's default picker
        # The pools never change here: the shortlist's keys are kept as loads change, not read
        # from every worker on every decision (the same workers chosen; ShortlistIndex).
        self.candidates = Candidates(self.prefill, self.decode, self.prefill,
                                     index=ShortlistIndex(self.prefill, self.decode) if policy == "adaptive" else None)

    def replay(self, requests: list[tuple[float, int, int]],
               progress: Callable[[float], None] | None = None) -> list[Outcome]:
        """Serve (arrival s, prompt tokens, output tokens) requests; their outcomes in order.
        ``progress``: called with the share of requests routed, every 1%."""
        outcomes = [Outcome(n, m, t) for t, n, m in requests]
        step = max(1, len(outcomes) // 100)
        for i, outcome in enumerate(outcomes):
            self.sim.at(outcome.arrival_s, lambda o=outcome: self._route(o))  # type: ignore[misc]
            if progress is not None and (i + 1) % step == 0:
                self.sim.at(outcome.arrival_s, lambda share=(i + 1) / len(outcomes): progress(share))  # type: ignore[misc]
        self.sim.run()
        return outcomes

    def _route(self, o: Outcome) -> None:
        n, m = o.prompt_tokens, o.output_tokens
        if self.policy == "adaptive":
            plan = self.adaptive.plan(n, m, self.candidates)
            assert plan is not None
            path, reason, p, d = plan.path, plan.reason.value, plan.prefill, plan.decode
            o.predicted_ttft_s = plan.predicted_ttft_s
        else:
            decision = self.threshold.decide(n, has_prefill_capacity=bool(self.prefill))
            path, reason = decision.path, decision.reason.value
            p = self.picker.pick(self.prefill) if path is Path.DISAGGREGATED else None
            d = self.picker.pick(self.decode)
        assert d is not None
        o.path, o.reason = path.value, reason
        if path is Path.DISAGGREGATED and p is not None:
            self._split(o, p, d)
        else:
            self._whole(o, d)

    def _decode_on(self, o: Outcome, w: Worker, prompt_tokens: int, on_first: Callable[[float], None]) -> None:
        w.num_in_flight += 1
        state: dict = {}

        def first(t: float) -> None:
            on_first(t)
            o.add_first(t)
            if o.predicted_ttft_s is not None:
                self.endpoint.ttft_errors[o.path].add(o.ttft_s - o.predicted_ttft_s)
            state["stream"] = w.load.begin_stream(o.output_tokens)

        def tokens(num_tokens: int, gap_s: float, t: float) -> None:
            o.add_tokens(num_tokens, gap_s, t)
            state["stream"].add_tokens(o.num_tokens, t)

        def done(t: float) -> None:
            w.num_in_flight -= 1
            if "stream" in state:
                w.load.end_stream(state["stream"], o.output_tokens)
            self.endpoint.output_tokens.add(o.output_tokens)

        self.engines[w.name].submit(Job(prompt_tokens, o.output_tokens, first, tokens, done))

    def _whole(self, o: Outcome, w: Worker) -> None:
        ticket = w.load.begin_prefill(o.prompt_tokens, o.output_tokens)
        self._decode_on(o, w, o.prompt_tokens, lambda t: w.load.end_prefill(ticket, is_ok=True))

    def _split(self, o: Outcome, p: Worker, d: Worker) -> None:
        ticket = p.load.begin_prefill(o.prompt_tokens)
        p.num_in_flight += 1

        def prefilled(t: float) -> None:
            p.load.end_prefill(ticket, is_ok=True)
            p.num_in_flight -= 1
            sent = self.sim.now
            self.sim.at(sent + self.profile.kv_transfer_s, lambda: self._decode_on(
                o, d, 0, lambda t2: self.endpoint.split_overhead.add(t2 - sent)))

        self.engines[p.name].submit(Job(o.prompt_tokens, 1, _ignore, _ignore_tokens, prefilled))


def _ignore(t: float) -> None:
    pass


def _ignore_tokens(num_tokens: int, gap_s: float, t: float) -> None:
    pass


class _SimulatedLoad(WorkerLoad):
    """The router's own ``WorkerLoad`` of a simulated worker. Before the router reads how far its
    streams have got, the engine hands them the tokens of the decode steps done by now (a real
    worker streams each token as it is made)."""

    engine: Engine | None = None

    def stream_slacks_s(self, tpot_slo_s: float) -> list[float]:
        if self.engine is not None:
            self.engine.sync()
        return super().stream_slacks_s(tpot_slo_s)

"""A discrete-event simulator of one endpoint, driving the router's own decision code.

Workers are modelled at the level of engine steps, the way vLLM's scheduler works: each step
gives every running stream its next token and spends what is left of the token budget
(``max_batched_tokens``) on waiting prefills, oldest first, in chunks; a step takes
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
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dpd.router.adaptive import AdaptiveDecider, Candidates, Slo
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
    kv_transfer_s: float = 0.25  # the decode hop's first token after the prefill answered


@dataclass
class Job:
    prompt_tokens: int
    output_tokens: int
    on_first: Callable[[float], None]
    on_token: Callable[[float], None]
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
    """One worker's engine: a FIFO of prefills and a batch of running streams."""

    def __init__(self, sim: Sim, profile: EngineProfile):
        self.sim = sim
        self.profile = profile
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.is_busy = False

    def submit(self, job: Job) -> None:
        self.waiting.append(job)
        self._maybe_step()

    def _maybe_step(self) -> None:
        if self.is_busy or not (self.waiting or self.running):
            return
        p = self.profile
        budget = p.max_batched_tokens - len(self.running)
        decoding = list(self.running)
        chunks: list[tuple[Job, int]] = []
        for job in self.waiting:
            if budget <= 0:
                break
            take = min(job.remaining_prefill, budget) if job.remaining_prefill else 1
            chunks.append((job, take))
            budget -= take
        prefill_tokens = sum(take for job, take in chunks if job.remaining_prefill)
        step_s = p.step_overhead_s + prefill_tokens / p.prefill_tokens_per_s + len(decoding) * p.decode_s_per_stream
        self.is_busy = True
        self.sim.at(self.sim.now + step_s, lambda: self._end_step(decoding, chunks))

    def _end_step(self, decoding: list[Job], chunks: list[tuple[Job, int]]) -> None:
        now = self.sim.now
        self.is_busy = False
        for job in decoding:
            job.generated += 1
            job.on_token(now)
            if job.generated >= job.output_tokens:
                self.running.remove(job)
                job.on_done(now)
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
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        if len(self.token_times) < 2:
            return 0.0
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    def meets(self, slo: Slo) -> bool:
        return self.ttft_s <= slo.ttft_s and self.tpot_s <= slo.tpot_s


class SimEndpoint:
    """Two pools of simulated workers behind the router's deciders."""

    def __init__(self, policy: str, *, num_prefill: int = 1, num_decode: int = 1, threshold_tokens: int = 512,
                 floor_tokens: int = 0, profile: EngineProfile = EngineProfile(), priors: LoadPriors = LoadPriors(),
                 slo: Slo = Slo(), stall_weight: float = 1.0, seed: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        self.sim = Sim()
        self.policy = policy
        self.profile = profile
        shared = SharedRates(priors)

        def worker(name: str, pool: str) -> Worker:
            return Worker(name, "sim://" + name, pool, load=WorkerLoad(priors, lambda: self.sim.now, shared=shared))

        if policy == "colocated":
            num_decode, num_prefill = num_decode + num_prefill, 0
        self.prefill = [worker(f"prefill-{i}", "prefill") for i in range(num_prefill)]
        self.decode = [worker(f"decode-{i}", "decode") for i in range(num_decode)]
        self.engines = {w.name: Engine(self.sim, profile) for w in (*self.prefill, *self.decode)}
        self.endpoint = EndpointLoad(priors)
        self.threshold = ThresholdDecider(threshold_tokens, is_colocated=policy == "colocated")
        self.adaptive = AdaptiveDecider(floor_tokens, self.endpoint, stall_weight=stall_weight, slo=slo)
        self.picker = LeastOutstandingPicker(random.Random(seed))  # the router's default picker

    def replay(self, requests: list[tuple[float, int, int]]) -> list[Outcome]:
        """Serve (arrival s, prompt tokens, output tokens) requests; their outcomes in order."""
        outcomes = [Outcome(n, m, t) for t, n, m in requests]
        for outcome in outcomes:
            self.sim.at(outcome.arrival_s, lambda o=outcome: self._route(o))  # type: ignore[misc]
        self.sim.run()
        return outcomes

    def _route(self, o: Outcome) -> None:
        n, m = o.prompt_tokens, o.output_tokens
        if self.policy == "adaptive":
            plan = self.adaptive.plan(n, m, Candidates(self.prefill, self.decode, self.prefill))
            assert plan is not None
            path, reason, p, d = plan.path, plan.reason.value, plan.prefill, plan.decode
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
            o.first_s = t
            o.token_times.append(t)
            state["stream"] = w.load.begin_stream(o.output_tokens)

        def token(t: float) -> None:
            o.token_times.append(t)
            if "stream" in state:
                state["stream"].add_tokens(len(o.token_times), t)

        def done(t: float) -> None:
            w.num_in_flight -= 1
            if "stream" in state:
                w.load.end_stream(state["stream"], o.output_tokens)
            self.endpoint.output_tokens.add(o.output_tokens)

        self.engines[w.name].submit(Job(prompt_tokens, o.output_tokens, first, token, done))

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

        noop = lambda t: None  # noqa: E731
        self.engines[p.name].submit(Job(o.prompt_tokens, 1, noop, noop, prefilled))

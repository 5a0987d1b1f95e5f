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

import gc
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

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
    # What taking in a pulled KV costs the decoder, per prompt token pulled: its step that admits
    # the request is that much longer (every stream it runs waits). dpd profile measures it; 0
    # (older profiles) leaves the decoder undisturbed by splits.
    kv_pull_s_per_token: float = 0.0
    # Workers sharing a machine's cores slow one another (dpd profile measures it on two of the
    # endpoint's workers): a step's prefill takes ``prefill_slowdown`` times as long while another
    # worker of its machine is decoding, its decode part ``decode_slowdown`` times while another
    # is computing a prefill. ``machine_workers``: how many workers share a machine (1, or both
    # slowdowns 1.0: each worker undisturbed by the others, as in older profiles).
    prefill_slowdown: float = 1.0
    decode_slowdown: float = 1.0
    machine_workers: int = 1

    def __post_init__(self) -> None:
        # A profile is read from a file a user may have edited: a zero step time would loop
        # forever, a negative rate would plan nonsense, a string would fail mid-search.
        for name, low, is_int in (("prefill_tokens_per_s", 0, False), ("step_overhead_s", None, False),
                                  ("decode_s_per_stream", None, False), ("kv_transfer_s", None, False),
                                  ("kv_pull_s_per_token", None, False), ("prefill_slowdown", 0, False),
                                  ("decode_slowdown", 0, False), ("max_batched_tokens", 0, True),
                                  ("max_num_seqs", 0, True), ("machine_workers", 0, True)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int if is_int else (int, float)):
                raise ValueError(f"{name} must be {'an integer' if is_int else 'a number'}, not {value!r}")
            if not math.isfinite(value) or value < 0 or (low is not None and value <= low):
                raise ValueError(f"{name} must be {'positive' if low is not None else 'zero or more'} and finite, "
                                 f"not {value!r}")
        if self.step_overhead_s + self.decode_s_per_stream <= 0:
            raise ValueError("a decode step must take some time: step_overhead_s or decode_s_per_stream above 0")
        for name in ("prefill_slowdown", "decode_slowdown"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be 1 or more (how many times longer), not {getattr(self, name)!r}")

    @property
    def has_interference(self) -> bool:
        return self.machine_workers > 1 and (self.prefill_slowdown != 1 or self.decode_slowdown != 1)


Delivery = tuple[int, float, float]  # decode steps whose tokens a stream got: (steps, the gap before each, the last one's time)


class Job:
    """A request on one engine; each job is itself (found in the engine's lists by identity).

    Here and in ``Outcome``, a plain class with an explicit ``__init__`` rather than a dataclass:
    the compiled build (``dpd.sim.compiled``) constructs it natively, where a dataclass's
    generated ``__init__`` stays interpreted Python (one or two of each per simulated request)."""

    __slots__ = ("prompt_tokens", "output_tokens", "on_first", "on_tokens", "on_done", "remaining_prefill",
                 "generated", "finish_at", "seen", "pulled_tokens")

    def __init__(self, prompt_tokens: int, output_tokens: int, on_first: Callable[[float], None],
                 on_tokens: Callable[[list[Delivery]], None], on_done: Callable[[float], None], *,
                 pulled_tokens: int = 0):
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.on_first = on_first
        self.on_tokens = on_tokens  # the deliveries since the last call, oldest first
        self.on_done = on_done
        self.remaining_prefill = prompt_tokens
        self.generated = 0  # tokens handed to on_first and on_tokens so far
        self.finish_at = 0  # while decoding: the engine's step count at which its last token is made
        self.seen = 0  # while decoding: the engine's deliveries handed to it so far
        self.pulled_tokens = pulled_tokens  # a split's decode: the prompt tokens whose KV it pulled (its admission's cost)


class Sim:
    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0  # events at the same time run in the order they were scheduled

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn))

    def run(self, arrivals: list[tuple[float, Callable[[], None]]] | None = None) -> None:
        """Run the events until none is left. ``arrivals``: events known in advance, sorted by time,
        run in that order as if scheduled when the run starts — kept out of the heap (a heap of
        the whole trace made every event's push and pop log(requests) deep)."""
        # A run makes millions of short-lived objects (events, tickets, token lists) and frees
        # them by reference count; the cyclic collector, run every 700 allocations by default,
        # walked the young ones each time to find no cycle — up to a fifth of a two-worker run's
        # time. It still runs, less often; the thresholds are put back after.
        thresholds = gc.get_threshold()
        gc.set_threshold(max(thresholds[0], 100_000), *thresholds[1:])
        events, pop = self._events, heapq.heappop
        pending = arrivals or []
        if any(pending[i][0] > pending[i + 1][0] for i in range(len(pending) - 1)):
            raise ValueError("arrivals must be sorted by time")
        self._seq += 1
        first_seq = self._seq  # events scheduled before the run go before arrivals at the same time
        i, n = 0, len(pending)
        try:
            while True:
                if i < n and (not events or pending[i][0] < events[0][0]
                              or (pending[i][0] == events[0][0] and events[0][1] > first_seq)):
                    self.now, fn = pending[i]
                    i += 1
                elif events:
                    self.now, _, fn = pop(events)
                else:
                    break
                fn()
        finally:
            gc.set_threshold(*thresholds)


class Machine:
    """The engines sharing one machine's cores, and how many of them are decoding (have running
    streams) and computing a prefill, each as of its step under way."""

    __slots__ = ("engines", "decoding", "prefilling")

    def __init__(self) -> None:
        self.engines: list[Engine] = []
        self.decoding = 0
        self.prefilling = 0


class Engine:
    """One worker's engine: a FIFO of prefills and a batch of running streams.

    A stretch of decode-only steps (nothing waiting) is one event, not one per step: the batch
    does not change until its first stream ends or a request arrives, so its steps are equal and
    their tokens are known in advance (each stream's next ``k`` tokens, ``step_s`` apart). An
    arrival cuts the stretch at the end of the step under way, as the real scheduler admits a new
    request only between steps. Token times are the same as stepping one by one.

    Every running stream gets every step's token, so the engine logs each delivery once — (steps,
    gap, time) — rather than handing it to each stream: a stream is handed the deliveries it has
    not seen when it ends, and every stream is when the router looks at them (``sync``; a real
    worker streams each token as it is made). A stream ends at a step count fixed when it starts
    (its first token's count plus the tokens it still has to make).

    On a ``Machine`` with other engines, a step's speed follows theirs as the step starts (the
    profile's ``prefill_slowdown`` and ``decode_slowdown``): a stretch is cut when another engine
    there starts or stops computing prefills, so its next steps run at the new pace."""

    LOG_KEEP = 1024  # deliveries kept before those every running stream has seen are dropped

    def __init__(self, sim: Sim, profile: EngineProfile):
        self.sim = sim
        self.profile = profile
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.is_busy = False
        self._cruise: tuple[float, float, int] | None = None  # decode-only steps: (start, step s, steps)
        self._generation = 0  # a cut stretch's scheduled end is stale
        self._steps = 0  # decode steps made for the running streams so far
        self._log: list[Delivery] = []  # the latest deliveries; _log[0] is delivery number _log_base
        self._log_base = 0
        self.machine: Machine | None = None  # set where the profile's workers slow one another
        self._is_prefilling = False  # as counted on the machine
        self._is_decoding = False

    def submit(self, job: Job) -> None:
        self.waiting.append(job)
        if self._cruise is not None:
            self._cut()
        self._maybe_step()

    def sync(self) -> None:
        """Hand every running stream the tokens made by now, those of a stretch's steps done so far included."""
        self._deliver_done()
        for job in self.running:
            self._hand(job)

    def _deliver(self, steps: int, step_s: float, t: float) -> None:
        self._log.append((steps, step_s, t))
        self._steps += steps

    def _hand(self, job: Job) -> None:
        """Hand ``job`` the deliveries it has not seen."""
        end = self._log_base + len(self._log)
        if job.seen < end:
            job.on_tokens(self._log[job.seen - self._log_base:])
            job.seen = end
            job.generated = job.output_tokens - (job.finish_at - self._steps)

    def _deliver_done(self) -> None:
        """Deliver the tokens of the decode-only steps completed by now (the stretch goes on)."""
        if self._cruise is None:
            return
        start, step_s, steps = self._cruise
        done = min(int((self.sim.now - start) / step_s), steps - 1)
        if done <= 0:
            return
        end = start + done * step_s
        self._deliver(done, step_s, end)
        self._cruise = (end, step_s, steps - done)

    def _cut(self) -> None:
        """End the decode-only stretch with the step under way (a new request waits for it)."""
        self._deliver_done()
        assert self._cruise is not None
        start, step_s, steps = self._cruise
        if steps > 1:
            self._cruise = (start, step_s, 1)
            self._generation += 1
            generation = self._generation
            self.sim.at(start + step_s, lambda: self._end_cruise(generation))

    def _set_state(self, prefilling: bool, decoding: bool) -> None:
        """Count this engine's step on its machine; where that changes whether the others decode
        beside a prefill, cut their stretches (their next steps at the new pace)."""
        m = self.machine
        assert m is not None
        if decoding != self._is_decoding:
            m.decoding += 1 if decoding else -1
            self._is_decoding = decoding
        if prefilling != self._is_prefilling:
            m.prefilling += 1 if prefilling else -1
            self._is_prefilling = prefilling
            if m.prefilling == (1 if prefilling else 0) and self.profile.decode_slowdown != 1:
                for engine in m.engines:
                    if engine is not self and engine._cruise is not None:
                        engine._cut()

    def _maybe_step(self) -> None:
        if self.is_busy:
            return
        if not (self.waiting or self.running):
            if self.machine is not None:
                self._set_state(False, False)
            return
        p = self.profile
        m = self.machine
        self.is_busy = True
        if not self.waiting:
            first_end = self.running[0].finish_at
            for job in self.running:
                if job.finish_at < first_end:
                    first_end = job.finish_at
            steps = first_end - self._steps
            step_s = p.step_overhead_s + len(self.running) * p.decode_s_per_stream
            if m is not None:
                if m.prefilling > (1 if self._is_prefilling else 0):  # another engine computes a prefill
                    step_s *= p.decode_slowdown
                self._set_state(False, True)
            self._cruise = (self.sim.now, step_s, steps)
            generation = self._generation
            self.sim.at(self.sim.now + steps * step_s, lambda: self._end_cruise(generation))
            return
        budget = p.max_batched_tokens - len(self.running)
        chunks: list[tuple[Job, int]] = []
        room = p.max_num_seqs - len(self.running)
        prefill_tokens, pulled_tokens = 0, 0
        for job in self.waiting:
            if budget <= 0 or len(chunks) >= room:
                break
            take = min(job.remaining_prefill, budget) if job.remaining_prefill else 1
            chunks.append((job, take))
            budget -= take
            if job.remaining_prefill:
                prefill_tokens += take
            pulled_tokens += job.pulled_tokens
        if m is None:
            step_s = p.step_overhead_s + prefill_tokens / p.prefill_tokens_per_s + len(self.running) * p.decode_s_per_stream
        else:
            # (the same sum as above where neither slowdown applies: x * 1.0 is x; a step with no
            # stream running has no decode part to slow)
            decode_f = (p.decode_slowdown if self.running and m.prefilling > (1 if self._is_prefilling else 0)
                        else 1.0)
            prefill_f = p.prefill_slowdown if m.decoding > (1 if self._is_decoding else 0) else 1.0
            step_s = (p.step_overhead_s * decode_f + prefill_tokens / p.prefill_tokens_per_s * prefill_f
                      + len(self.running) * p.decode_s_per_stream * decode_f)
            self._set_state(prefill_tokens > 0, bool(self.running))
        if p.kv_pull_s_per_token:
            step_s += pulled_tokens * p.kv_pull_s_per_token
        # The batch cannot change before the step ends: streams join and leave only there.
        self.sim.at(self.sim.now + step_s, lambda: self._end_step(chunks, step_s))

    def _end_cruise(self, generation: int) -> None:
        if generation != self._generation or self._cruise is None:
            return
        _, step_s, steps = self._cruise
        self._cruise = None
        self._finish_tokens(steps, step_s)
        self.is_busy = False
        self._maybe_step()

    def _finish_tokens(self, steps: int, step_s: float) -> None:
        """Every running stream's next ``steps`` tokens, the last now; the streams done leave."""
        if not self.running:
            return
        now = self.sim.now
        self._deliver(steps, step_s, now)
        ended = [job for job in self.running if job.finish_at <= self._steps]
        if not ended:
            return
        for job in ended:
            self._hand(job)
            self.running.remove(job)
            job.on_done(now)
        if not self.running:
            self._log_base += len(self._log)
            self._log.clear()
        elif len(self._log) > self.LOG_KEEP:
            oldest = min(job.seen for job in self.running)
            del self._log[:oldest - self._log_base]
            self._log_base = oldest

    def _end_step(self, chunks: list[tuple[Job, int]], step_s: float) -> None:
        now = self.sim.now
        self.is_busy = False
        self._finish_tokens(1, step_s)
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
                job.finish_at = self._steps + job.output_tokens - 1
                job.seen = self._log_base + len(self._log)
                self.running.append(job)
        self._maybe_step()


class Outcome:
    """One simulated request: what it asked for, the path it took and when its tokens came."""

    __slots__ = ("prompt_tokens", "output_tokens", "arrival_s", "path", "reason", "first_s", "last_s", "num_tokens",
                 "predicted_ttft_s", "_deliveries")

    def __init__(self, prompt_tokens: int, output_tokens: int, arrival_s: float):
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.arrival_s = arrival_s
        self.path = ""
        self.reason = ""
        self.first_s = math.nan
        self.last_s = math.nan
        self.num_tokens = 0
        self.predicted_ttft_s: float | None = None  # the adaptive policy's, audited at the first token as the router does
        self._deliveries: list[Delivery] = []  # after the first token, oldest first

    def add_first(self, t: float) -> None:
        self.first_s = self.last_s = t
        self.num_tokens = 1

    def add_tokens(self, deliveries: list[Delivery], num_tokens: int) -> None:
        """The tokens of some decode steps (``Engine``'s deliveries, oldest first); ``num_tokens`` made in all."""
        self._deliveries.extend(deliveries)
        self.num_tokens = num_tokens
        self.last_s = deliveries[-1][2]

    @property
    def gaps(self) -> list[tuple[float, int]]:
        """The inter-token gaps after the first token, run-length coded: (s, count). Built when
        read (a plan reads them once; a speed run never)."""
        gaps: list[tuple[float, int]] = []
        for steps, gap_s, _ in self._deliveries:
            if gaps and gaps[-1][0] == gap_s:
                gaps[-1] = (gap_s, gaps[-1][1] + steps)
            else:
                gaps.append((gap_s, steps))
        return gaps

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
        if profile.has_interference:
            # machines of machine_workers engines each, the pools' workers taken in turn (p0, d0, p1, …)
            machine = Machine()
            in_turn = [w for pair in itertools.zip_longest(self.prefill, self.decode) for w in pair if w is not None]
            for w in in_turn:
                if len(machine.engines) == profile.machine_workers:
                    machine = Machine()
                engine = self.engines[w.name]
                engine.machine = machine
                machine.engines.append(engine)
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

    def switch(self, policy: str, threshold_tokens: int) -> None:
        """Serve what comes next under another P/D policy (as ``PUT /admin/policy`` does), keeping
        what the router has learned. A colocated endpoint has no prefill pool to switch to."""
        if policy not in ("threshold", "adaptive") or self.policy == "colocated":
            raise ValueError(f"cannot switch a {self.policy} endpoint to {policy}")
        self.policy = policy
        self.threshold.set_threshold(threshold_tokens)  # one threshold for both, as the router's set_threshold
        self.adaptive.set_threshold(threshold_tokens)

    def replay(self, requests: list[tuple[float, int, int]],
               progress: Callable[[float], None] | None = None) -> list[Outcome]:
        """Serve (arrival s, prompt tokens, output tokens) requests; their outcomes in order.
        ``progress``: called with the share of requests routed, every 1%."""
        outcomes = [Outcome(n, m, t) for t, n, m in requests]
        step = max(1, len(outcomes) // 100)
        arrivals: list[tuple[float, Callable[[], None]]] = []
        for i, outcome in enumerate(outcomes):
            arrivals.append((outcome.arrival_s, lambda o=outcome: self._route(o)))  # type: ignore[misc]
            if progress is not None and (i + 1) % step == 0:
                arrivals.append((outcome.arrival_s, lambda share=(i + 1) / len(outcomes): progress(share)))  # type: ignore[misc]
        arrivals.sort(key=lambda a: a[0])  # stable: equal times in the order given
        self.sim.run(arrivals)
        return outcomes

    def _route(self, o: Outcome) -> None:
        n, m = o.prompt_tokens, o.output_tokens
        if self.policy == "adaptive":
            plan = self.adaptive.plan(n, m, self.candidates)
            assert plan is not None
            path, reason, p, d = plan.path, plan.reason._value_, plan.prefill, plan.decode
            o.predicted_ttft_s = plan.predicted_ttft_s
        else:
            decision = self.threshold.decide(n, has_prefill_capacity=bool(self.prefill))
            path, reason = decision.path, decision.reason._value_
            p = self.picker.pick(self.prefill) if path is Path.DISAGGREGATED else None
            d = self.picker.pick(self.decode)
        assert d is not None
        # (_value_, the member's value as stored: .value is a property, a Python call each time)
        o.path, o.reason = path._value_, reason
        if path is Path.DISAGGREGATED and p is not None:
            self._split(o, p, d)
        else:
            self._whole(o, d)

    def _decode_on(self, o: Outcome, w: Worker, prompt_tokens: int, on_first: Callable[[float], None],
                   pulled_tokens: int = 0) -> None:
        w.num_in_flight += 1
        state: dict = {}

        def first(t: float) -> None:
            on_first(t)
            o.add_first(t)
            if o.predicted_ttft_s is not None:
                self.endpoint.ttft_errors[o.path].add(o.ttft_s - o.predicted_ttft_s)
            state["stream"] = w.load.begin_stream(o.output_tokens)

        def tokens(deliveries: list[Delivery]) -> None:
            # the router's ticket, fed as a real stream feeds it: each step's tokens at its time
            stream = state["stream"]
            stream.add_token_runs(deliveries)
            o.add_tokens(deliveries, stream.num_tokens)

        def done(t: float) -> None:
            w.num_in_flight -= 1
            if "stream" in state:
                w.load.end_stream(state["stream"], o.output_tokens)
            self.endpoint.output_tokens.add(o.output_tokens)

        self.engines[w.name].submit(Job(prompt_tokens, o.output_tokens, first, tokens, done, pulled_tokens=pulled_tokens))

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
            # kv_transfer_s is measured to the decoder's first token, the pull's cost to it included:
            # that cost is spent in the decoder's step that admits the request (Engine._maybe_step),
            # so the request is handed over that much earlier (its first token about as measured;
            # exactly where both land in the same step, and later if the cost exceeds kv_transfer_s).
            wait_s = max(0.0, self.profile.kv_transfer_s - o.prompt_tokens * self.profile.kv_pull_s_per_token)
            self.sim.at(sent + wait_s, lambda: self._decode_on(
                o, d, 0, lambda t2: self.endpoint.split_overhead.add(t2 - sent), pulled_tokens=o.prompt_tokens))

        self.engines[p.name].submit(Job(o.prompt_tokens, 1, _ignore, _ignore_tokens, prefilled))


def _ignore(t: float) -> None:
    pass


def _ignore_tokens(deliveries: list[Delivery]) -> None:
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

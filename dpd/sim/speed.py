"""``dpd plan --speed``: how fast the simulator runs on this machine.

Two measurements, each timed on the wall clock of one process (the router's decision code is
single-threaded Python; ``dpd plan --jobs`` spreads a search's candidates over the cores):

* **per policy** — the same requests (the trace, time-compressed to a rate that loads a two-worker
  endpoint) through a colocated pair, a static 1P:1D split and the adaptive policy: simulated
  requests per second of wall time;
* **a cluster** — ``workers`` workers (a 1:1 P:D split under the static threshold and the
  router's own least-outstanding picker, or under the adaptive policy) serving ``hours`` of the trace replicated until its load fills
  them: the trace's requests in copies, each copy's arrivals jittered by up to a second, so the
  arrival pattern over the hour stays the trace's. The load aimed at is ``utilization`` of the
  workers' work (prompt ÷ prefill rate + output × a step's cost shared by four streams).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from dpd.router.adaptive import Slo
from dpd.sim.engine import EngineProfile, SimEndpoint

Request = tuple[float, int, int]  # (arrival s, prompt tokens, output tokens)


@dataclass(frozen=True)
class Speed:
    what: str
    num_workers: int
    num_requests: int
    simulated_s: float  # the simulated clock's span
    wall_s: float
    attainment: float

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / max(self.wall_s, 1e-9)


def work_s(request: Request, profile: EngineProfile, batch: int = 4) -> float:
    """A request's work on one worker: its prefill, and its share of the decode steps when
    ``batch`` streams share them."""
    _, prompt, output = request
    return prompt / profile.prefill_tokens_per_s + output * (profile.decode_s_per_stream + profile.step_overhead_s / batch)


def replicated(trace: list[Request], num_workers: int, profile: EngineProfile, *, hours: float = 1.0,
               utilization: float = 0.7, seed: int = 0) -> list[Request]:
    """The trace's first ``hours`` (cycled if it is shorter), copied until its work fills
    ``num_workers`` workers to ``utilization``; each copy's arrivals jittered by up to 1 s."""
    if not trace:
        raise ValueError("the trace is empty")
    span_s = hours * 3600
    # the cycle: the trace's span and one mean gap (a trace of n requests covers n gaps)
    trace_span = max(trace[-1][0] - trace[0][0], 1e-9) * len(trace) / max(len(trace) - 1, 1)
    t0 = trace[0][0]
    hour: list[Request] = []
    cycle = 0
    while True:
        shift = cycle * trace_span - t0
        piece = [(t + shift, p, o) for t, p, o in trace if t + shift < span_s]
        hour.extend(piece)
        cycle += 1
        if not piece or cycle * trace_span >= span_s:
            break
    work = sum(work_s(r, profile) for r in hour)
    copies = max(1, math.ceil(utilization * num_workers * span_s / max(work, 1e-9)))
    rng = random.Random(seed)
    out = [(t + (rng.random() if c else 0.0), p, o) for c in range(copies) for t, p, o in hour]
    out.sort(key=lambda r: r[0])
    return out


def timed(what: str, endpoint: SimEndpoint, requests: list[Request], slo: Slo, num_workers: int,
          progress: Callable[[float], None] | None = None) -> Speed:
    started = time.perf_counter()
    outcomes = endpoint.replay(requests, progress=progress)
    wall_s = time.perf_counter() - started
    met = sum(o.meets(slo) for o in outcomes)
    span = max(o.last_s if o.num_tokens else o.arrival_s for o in outcomes) - min(o.arrival_s for o in outcomes)
    return Speed(what, num_workers, len(requests), span, wall_s, met / len(outcomes))


def per_policy(requests: list[Request], profile: EngineProfile, slo: Slo, threshold_tokens: int) -> list[Speed]:
    runs = [("colocated × 2", SimEndpoint("colocated", num_prefill=1, num_decode=1, profile=profile, slo=slo)),
            (f"1P:1D threshold {threshold_tokens}", SimEndpoint("threshold", threshold_tokens=threshold_tokens,
                                                                 profile=profile, slo=slo)),
            ("1P:1D adaptive", SimEndpoint("adaptive", profile=profile, slo=slo))]
    return [timed(what, endpoint, requests, slo, 2) for what, endpoint in runs]


def cluster(requests: list[Request], num_workers: int, profile: EngineProfile, slo: Slo, threshold_tokens: int,
            policy: str = "threshold", progress: Callable[[float], None] | None = None) -> Speed:
    num_prefill = num_workers // 2
    endpoint = SimEndpoint(policy, num_prefill=num_prefill, num_decode=num_workers - num_prefill,
                           threshold_tokens=threshold_tokens, profile=profile, slo=slo)
    what = f"{num_prefill}P:{num_workers - num_prefill}D " + (f"threshold {threshold_tokens}" if policy == "threshold"
                                                              else policy)
    return timed(what, endpoint, requests, slo, num_workers, progress)


def table(rows: list[Speed]) -> str:
    lines = ["| endpoint | workers | requests | simulated time | wall time | simulated requests/s | attainment |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.what} | {r.num_workers} | {r.num_requests:,} | {r.simulated_s / 60:.1f} min | {r.wall_s:.1f} s | "
                     f"{r.requests_per_s:,.0f} | {r.attainment:.0%} |")
    return "\n".join(lines)

"""``dpd plan``: which endpoint to run for a trace and an SLO — worker counts, the P:D split and
the routing policy — found by simulating every candidate with the router's own deciders
(engine.py) on a profile of the workers (profile.py).

Each candidate serves the same requests (the trace's window, time-compressed to the rate the
user asks for). A row reports SLO attainment, goodput (requests meeting the SLO per second),
P99 TTFT and ITL, and the cost per million output tokens when a price per worker-hour is given.
The recommendation is the candidate with the fewest workers whose attainment reaches the
target (ties: higher attainment, then goodput); if none does, the highest attainment. Its
configuration is written as an ``InferenceEndpointConfig`` ready for ``dpd serve``.

Figures are predictions: how close they come to measurement on this machine is in
BENCHMARKS.md ("The simulator against the ladder").
"""

from __future__ import annotations

import copy
import math
import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import yaml

from dpd.bench.stats import percentile, weighted_percentile
from dpd.config import load_config
from dpd.router.adaptive import Slo
from dpd.sim.engine import EngineProfile, Outcome, SimEndpoint


@dataclass(frozen=True)
class Candidate:
    policy: str  # colocated, threshold, adaptive
    num_prefill: int
    num_decode: int
    threshold_tokens: int = 0

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    def describe(self) -> str:
        if self.policy == "colocated":
            return f"colocated × {self.num_decode}"
        what = f"threshold {self.threshold_tokens}" if self.policy == "threshold" else "adaptive"
        return f"{self.num_prefill}P:{self.num_decode}D {what}"


@dataclass(frozen=True)
class Row:
    candidate: Candidate
    attainment: float
    goodput_rps: float
    ttft_p99_s: float
    itl_p99_s: float
    cost_per_m_tokens: float | None


POLICIES = ("colocated", "threshold", "adaptive")  # what `dpd plan --policies` searches over


def candidates(max_workers: int, policies: tuple[str, ...], thresholds: tuple[int, ...],
               min_workers: int = 1) -> Iterator[Candidate]:
    for total in range(min_workers, max_workers + 1):
        if "colocated" in policies:
            yield Candidate("colocated", 0, total)
        for p in range(1, total):
            if "threshold" in policies:
                for t in thresholds:
                    yield Candidate("threshold", p, total - p, t)
            if "adaptive" in policies:
                yield Candidate("adaptive", p, total - p)


def evaluate(candidate: Candidate, requests: list[tuple[float, int, int]], profile: EngineProfile, slo: Slo,
             price_per_worker_hour: float | None = None) -> Row:
    sim = SimEndpoint(candidate.policy, num_prefill=candidate.num_prefill, num_decode=candidate.num_decode,
                      threshold_tokens=candidate.threshold_tokens, profile=profile, slo=slo)
    outcomes = sim.replay(requests)
    return summarize(candidate, outcomes, slo, price_per_worker_hour)


def summarize(candidate: Candidate, outcomes: list[Outcome], slo: Slo, price_per_worker_hour: float | None) -> Row:
    met = sum(o.meets(slo) for o in outcomes)
    start = min(o.arrival_s for o in outcomes)
    end = max(o.last_s if o.num_tokens else o.arrival_s for o in outcomes)
    duration_s = max(end - start, 1e-9)
    gaps = [run for o in outcomes for run in o.gaps]
    cost = None
    if price_per_worker_hour is not None:
        tokens = sum(o.num_tokens for o in outcomes)
        cost = candidate.num_workers * price_per_worker_hour * duration_s / 3600 / max(tokens, 1) * 1e6
    return Row(candidate, met / len(outcomes), met / duration_s, percentile([o.ttft_s for o in outcomes], 0.99),
               weighted_percentile(gaps, 0.99) if gaps else math.nan, cost)


def search(requests: list[tuple[float, int, int]], profile: EngineProfile, slo: Slo, *, max_workers: int,
           policies: tuple[str, ...] = POLICIES, thresholds: tuple[int, ...] = (512, 1024),
           min_workers: int = 1, price_per_worker_hour: float | None = None,
           progress: Callable[[int, int], None] | None = None, jobs: int = 1) -> list[Row]:
    """Every candidate simulated on the same requests; rows in the candidates' order. ``jobs`` > 1:
    that many processes share the candidates (each simulation is independent and single-threaded)."""
    todo = list(candidates(max_workers, policies, thresholds, min_workers))
    args = (requests, profile, slo, price_per_worker_hour)
    if jobs <= 1 or len(todo) < 2:
        rows = []
        for i, candidate in enumerate(todo):
            rows.append(evaluate(candidate, *args))
            if progress is not None:
                progress(i + 1, len(todo))
        return rows
    found: dict[int, Row] = {}
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=context, initializer=_set_work,
                             initargs=args) as pool:
        # The slowest candidates (most workers, the adaptive decider) first, so none is left last.
        order = sorted(range(len(todo)), key=lambda i: (-todo[i].num_workers, todo[i].policy != "adaptive"))
        futures = {pool.submit(_evaluate_one, todo[i]): i for i in order}
        for future in as_completed(futures):
            found[futures[future]] = future.result()
            if progress is not None:
                progress(len(found), len(todo))
    return [found[i] for i in range(len(todo))]


_WORK: tuple = ()  # a search process's requests, profile, SLO and price (set once, not sent per candidate)


def _set_work(*args: object) -> None:
    global _WORK
    _WORK = args


def _evaluate_one(candidate: Candidate) -> Row:
    return evaluate(candidate, *_WORK)


def best(rows: list[Row], target: float) -> Row:
    meeting = [r for r in rows if r.attainment >= target]
    if meeting:
        return min(meeting, key=lambda r: (r.candidate.num_workers, -r.attainment, -r.goodput_rps))
    return max(rows, key=lambda r: (r.attainment, r.goodput_rps, -r.candidate.num_workers))


def table(rows: list[Row], target: float, limit: int = 20) -> str:
    ranked = sorted(rows, key=lambda r: (r.attainment < target, r.candidate.num_workers, -r.attainment, -r.goodput_rps))
    lines = ["| candidate | workers | attainment | goodput (req/s) | TTFT P99 (s) | ITL P99 (ms) | cost / M tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in ranked[:limit]:
        cost = "—" if r.cost_per_m_tokens is None else f"{r.cost_per_m_tokens:.2f}"
        lines.append(f"| {r.candidate.describe()} | {r.candidate.num_workers} | {r.attainment:.0%} | {r.goodput_rps:.3f} | "
                     f"{r.ttft_p99_s:.2f} | {r.itl_p99_s * 1000:.0f} | {cost} |")
    if len(ranked) > limit:
        lines.append(f"| … {len(ranked) - limit} more | | | | | | |")
    return "\n".join(lines)


def config_for(row: Row, slo: Slo, base: dict | None = None) -> dict:
    """The recommended endpoint as an InferenceEndpointConfig document (the embedded default,
    or ``base``, with the pools, the policy and the SLO set)."""
    if base is not None:
        doc = copy.deepcopy(base)
    else:  # the embedded default, its non-default fields only (the loader fills in the rest)
        default = load_config()
        doc = {"apiVersion": default.apiVersion, "kind": default.kind,
               **default.model_dump(mode="json", exclude_defaults=True)}
    pd = doc.setdefault("spec", {}).setdefault("pdSpec", {})
    c = row.candidate
    pd.setdefault("prefillSpec", {})["replicas"] = c.num_prefill
    pd.setdefault("decodingSpec", {})["replicas"] = c.num_decode
    if c.policy != "colocated":
        pd["routingPolicy"] = c.policy
        pd["routingThreshold"] = c.threshold_tokens
    router = pd.setdefault("router", {})
    router["slo"] = {**router.get("slo", {}), "ttftS": slo.ttft_s, "tpotS": slo.tpot_s}
    return doc


def render_config(row: Row, slo: Slo, base: dict | None = None) -> str:
    c = row.candidate
    head = (f"# dpd plan: {c.describe()} — predicted {row.attainment:.0%} within TTFT ≤ {slo.ttft_s:g} s, "
            f"TPOT ≤ {slo.tpot_s:g} s (a simulation, not a measurement)\n")
    if c.policy == "colocated":
        head += "# colocated: run it with `dpd serve THIS_FILE --colocated`\n"
    return head + yaml.safe_dump(config_for(row, slo, base), sort_keys=False)

"""Benchmark metrics, defined as ``vllm bench serve`` defines them.

Per request: TTFT (request sent → first token), E2E, the inter-token gaps, and
TPOT = (E2E − TTFT) / (N − 1) for N ≥ 2 output tokens. ITL pools every gap of every request.
SLO attainment is the share of requests meeting both the TTFT and the TPOT SLO (a request
with one output token has no TPOT and meets that SLO trivially); goodput is those requests
per second of the *offered* window — the arrival schedule's span, ``n ÷ rate`` — so it is
attainment × the offered rate and does not depend on how long an overloaded run takes to drain
(a completion window would count a backlog's drain time against the rate it was offered at).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 1]; NaN when empty. Values
    may be +inf (a failed request's latency): a rank that lands on or past one is +inf."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    if k == lo or ordered[hi] == ordered[lo]:  # no interpolation (inf x 0 would be NaN)
        return ordered[lo]
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def weighted_percentile(counted: list[tuple[float, int]], q: float) -> float:
    """``percentile`` of values given as (value, how many times): the same figure as on the
    expanded list, without expanding it (the simulator's gaps come run-length coded)."""
    ordered = sorted((v, n) for v, n in counted if n > 0)
    total = sum(n for _, n in ordered)
    if not total:
        return float("nan")
    k = (total - 1) * q
    lo = int(k)
    lo_value = hi_value = ordered[-1][0]
    seen = 0
    for value, n in ordered:
        if seen <= lo < seen + n:
            lo_value = value
        if seen <= lo + 1 < seen + n:
            hi_value = value
            break
        seen += n
    if lo + 1 >= total:
        hi_value = lo_value
    if k == lo or hi_value == lo_value:
        return lo_value
    return lo_value + (hi_value - lo_value) * (k - lo)


def counter_totals(metrics_text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum each Prometheus sample ``name`` over all its label sets in an exposition text."""
    return {
        name: sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", metrics_text, re.M))
        for name in names
    }


@dataclass
class RequestRecord:
    ttft_s: float
    e2e_s: float
    num_output_tokens: int
    itls_s: list[float] = field(default_factory=list)
    path: str = ""
    reason: str = ""  # the router's x-dpd-reason
    request_class: str = ""
    is_ok: bool = True
    num_merged_chunks: int = 0  # chunks that carried more than one token (their gap is split per token)
    send_lag_s: float = 0.0  # actual send time − scheduled arrival: the client's own lag
    index: int = -1  # the request's position in its trace: pairs the same request across scenarios
    num_prompt_tokens: int = 0  # the server's usage
    num_cached_tokens: int = 0  # of those, served from a prefix cache (usage.prompt_tokens_details.cached_tokens)

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def is_met(self, r: RequestRecord) -> bool:
        tpot = r.tpot_s
        return r.is_ok and r.ttft_s <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo) -> dict[str, float]:
    """Attainment, goodput and latency percentiles of one run; ``duration_s``: the window the
    rates are per (the offered window, module doc). A failed request counts as +inf
    in the TTFT and TPOT percentiles (dropping it would make a failing run look fast); ITL pools
    the gaps of the requests that streamed."""
    ok = [r for r in records if r.is_ok]
    ttfts = [r.ttft_s if r.is_ok else math.inf for r in records]
    tpots = [t for r in ok if (t := r.tpot_s) is not None] + [math.inf] * (len(records) - len(ok))
    itls = [gap for r in ok for gap in r.itls_s]
    num_met = sum(slo.is_met(r) for r in records)
    out: dict[str, float] = {"num_requests": len(records), "num_failed": len(records) - len(ok)}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = percentile(values, q / 100)
    prompt = sum(r.num_prompt_tokens for r in ok)
    cached = sum(r.num_cached_tokens for r in ok)
    out["prompt_tokens"], out["cached_tokens"] = prompt, cached
    out["prefill_tokens_computed"] = prompt - cached  # what the workers' prefix caches did not hold
    out["prefix_hit_rate"] = cached / prompt if prompt else float("nan")
    out["slo_attainment"] = num_met / len(records) if records else float("nan")
    out["goodput_rps"] = num_met / duration_s if duration_s > 0 else float("nan")
    out["throughput_rps"] = len(ok) / duration_s if duration_s > 0 else float("nan")
    return out


def bootstrap_ci(statistic: Callable[[list[int]], float], num_items: int, *, num_resamples: int = 1000,
                 level: float = 0.95, seed: int = 0, groups: Sequence[Sequence[int]] | None = None) -> tuple[float, float]:
    """Percentile-bootstrap interval of ``statistic`` over ``num_items`` items (requests):
    each resample draws item indices with replacement and hands them to ``statistic``, which
    computes the figure from those items only — so a paired ratio (the same requests in two
    scenarios) resamples requests once for both, and pooled figures (ITL) resample requests,
    never individual gaps. NaN resamples are dropped; (NaN, NaN) when none is finite.

    ``groups`` (the items of each round of a repeated benchmark), when there are several: each
    resample draws the rounds with replacement, then the items within each drawn round — so
    the interval carries the spread between rounds (order, machine state), which resampling
    requests alone cannot see."""
    if num_items <= 0:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    rounds = [list(g) for g in groups or () if g]
    values = []
    for _ in range(num_resamples):
        if len(rounds) > 1:
            drawn = [rounds[rng.randrange(len(rounds))] for _ in rounds]
            value = statistic([g[rng.randrange(len(g))] for g in drawn for _ in g])
        else:
            value = statistic([rng.randrange(num_items) for _ in range(num_items)])
        if value == value:
            values.append(value)
    if not values:
        return float("nan"), float("nan")
    tail = (1 - level) / 2
    return percentile(values, tail), percentile(values, 1 - tail)


def fitted_capacity(met_by_rate: dict[float, list[bool]], bar: float = 0.9) -> float:
    """The rate at which attainment falls to ``bar`` on the curve through the measured points:
    attainment made non-increasing in rate (each point the minimum of it and every lower
    rate's — more load never helps, so a rise is noise), then linear between neighbouring
    rates. ``inf`` if even the highest rate meets ``bar`` (capacity is above the ladder), 0 if
    the lowest misses it (below)."""
    rates = sorted(r for r in met_by_rate if met_by_rate[r])
    if not rates:
        return math.nan
    curve, floor = [], 1.0
    for rate in rates:
        floor = min(floor, sum(met_by_rate[rate]) / len(met_by_rate[rate]))
        curve.append((rate, floor))
    if curve[0][1] < bar:
        return 0.0
    for (r0, a0), (r1, a1) in zip(curve, curve[1:]):
        if a1 < bar:
            return r0 + (r1 - r0) * (a0 - bar) / (a0 - a1)
    return math.inf


def fitted_capacity_ci(met_by_rate: dict[float, list[bool]], bar: float = 0.9, *, num_resamples: int = 1000,
                       level: float = 0.95, seed: int = 0,
                       rounds_by_rate: dict[float, list[int]] | None = None) -> tuple[float, float]:
    """A percentile-bootstrap interval of ``fitted_capacity``: each rate's requests resampled
    with replacement, independently (each rate is its own run). With ``rounds_by_rate`` (the
    round of each flag) and several rounds, each resample first draws the rounds, the same for
    every rate (a round is one stretch of the machine's time), then the requests within them."""
    rng = random.Random(seed)
    grouped: dict[float, dict[int, list[bool]]] = {}
    for rate, flags in met_by_rate.items():
        for flag, k in zip(flags, (rounds_by_rate or {}).get(rate, [0] * len(flags))):
            grouped.setdefault(rate, {}).setdefault(k, []).append(flag)
    round_ids = sorted({k for by_round in grouped.values() for k in by_round})
    values = []
    for _ in range(num_resamples):
        if len(round_ids) > 1:
            drawn = [round_ids[rng.randrange(len(round_ids))] for _ in round_ids]
            resampled = {rate: [g[rng.randrange(len(g))] for k in drawn for g in [by_round.get(k, [])] for _ in g]
                         for rate, by_round in grouped.items()}
            resampled = {rate: flags for rate, flags in resampled.items() if flags}
        else:
            resampled = {rate: [flags[rng.randrange(len(flags))] for _ in flags]
                         for rate, flags in met_by_rate.items() if flags}
        value = fitted_capacity(resampled, bar)
        if value == value:
            values.append(value)
    if not values:
        return math.nan, math.nan
    values.sort()  # nearest rank: resamples above the ladder are inf, which interpolation would turn into NaN
    tail = (1 - level) / 2
    return values[int(tail * (len(values) - 1))], values[math.ceil((1 - tail) * (len(values) - 1))]


def isolated_latencies(records: list[RequestRecord]) -> dict[int, tuple[float, float | None]]:
    """Per request index, the best (TTFT, TPOT) it got in any of ``records`` (every scenario and
    rate of one workload): a stand-in for its latency on an idle endpoint, which the SLO scale
    multiplies. It can only overstate the isolated latency (so a scaled SLO is, if anything,
    looser) and it needs no extra runs."""
    best: dict[int, tuple[float, float | None]] = {}
    for r in records:
        if not r.is_ok:
            continue
        ttft, tpot = best.get(r.index, (math.inf, None))
        new_tpot = r.tpot_s if tpot is None else (tpot if r.tpot_s is None else min(tpot, r.tpot_s))
        best[r.index] = (min(ttft, r.ttft_s), new_tpot)
    return best


def scaled_attainment(records: list[RequestRecord], isolated: dict[int, tuple[float, float | None]], scale: float) -> float:
    """Share of ``records`` within ``scale`` × their own isolated TTFT and TPOT (DistServe's SLO
    scale): a conclusion that holds at several scales does not hinge on one threshold."""
    if not records:
        return math.nan
    met = 0
    for r in records:
        base = isolated.get(r.index)
        if not r.is_ok or base is None:
            continue
        ttft_ok = r.ttft_s <= scale * base[0]
        tpot = r.tpot_s
        tpot_ok = tpot is None or base[1] is None or tpot <= scale * base[1]
        met += ttft_ok and tpot_ok
    return met / len(records)

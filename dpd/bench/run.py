"""``dpd bench run``: scenarios side by side on the same cores, same workload, same rates.

Scenarios:
  colocated        ``dpd serve --colocated``: both workers as full servers behind dpd's router
  colocated-prefix the same colocated endpoint with prefix-aware routing (router.prefixAware)
  dpd              ``dpd serve`` with the routing threshold
  dpd-always       the same P/D endpoint with threshold 0 (every request disaggregated)
  dpd-adaptive     the same P/D endpoint under the adaptive policy (floor 0)
  dpd-prefix       the adaptive policy with prefix-aware routing
  vllm-router      the same P/D workers behind ``vllm-router`` in its P/D mode (the peer)
(the ``-prefix`` scenarios are not in the default set: run them with ``--workload sessions``)
Two endpoints are started on the same two cores, one after the other: the colocated one, then
one P/D endpoint shared by the three P/D scenarios (the threshold is changed live through the
admin API; vllm-router is put in front of its workers). Each scenario is warmed up first.

Per scenario: capacity — the highest of the listed rates at which it and every lower one meet SLO
attainment >= 90%, or by bisection between two rates (``bisect_steps``, which assumes attainment
falls as the rate rises); then one run at the same offered load
for every scenario (``compare_at`` × colocated capacity), where the ratios to colocated are
taken. Optionally a threshold sweep on the P/D endpoint: goodput versus threshold.
The workload is the Azure conv+code trace or a synthetic mix, scaled to the machine; the
scaling is recorded in the results.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import requests

from dpd.bench.client import replay
from dpd.bench.ladder import capacity, paired_ratio
from dpd.bench.overhead import peer_router
from dpd.bench.stats import RequestRecord, Slo, bootstrap_ci, counter_totals, summarize
from dpd.bench.workloads import Scaling, TraceRequest, agent_sessions, load_trace, scale, synthetic
from dpd.launch.child import ServeProcess, write_config

SCENARIOS = ("colocated", "dpd", "dpd-always", "dpd-adaptive", "vllm-router")  # the default set
ALL_SCENARIOS = ("colocated", "colocated-prefix", "dpd", "dpd-always", "dpd-adaptive", "dpd-prefix", "vllm-router")
COLOCATED_SCENARIOS = ("colocated", "colocated-prefix")
PD_SCENARIOS = ("dpd", "dpd-always", "dpd-adaptive", "dpd-prefix", "vllm-router")
CAPACITY_ATTAINMENT = 0.9
TRACE_OFFSET = 2000  # requests skipped: the trace's first minutes are sparser than the rest
COUNTERS = ("dpd_pd_stalls_total", "dpd_fallbacks_total")


@dataclass(frozen=True)
class BenchSpec:
    trace_dir: str
    rates_rps: tuple[float, ...]  # the rates swept; with bisect_steps > 0, the bracket [lo, hi]
    duration_s: float
    threshold_tokens: int
    slo: Slo
    max_prompt_tokens: int
    max_output_tokens: int
    output_scale: float
    scenarios: tuple[str, ...] = SCENARIOS
    model: str = "smollm2-135m"
    bisect_steps: int = 0
    compare_at: float = 0.7  # the same-load comparison, as a share of colocated capacity (0: none)
    sweep_thresholds: tuple[int, ...] = ()
    sweep_rate_rps: float = 0.0  # 0: the dpd scenario's capacity
    workload: str = "trace"  # or "synthetic", or "sessions" (multi-turn, shared prefixes)
    session_turns: int = 4  # sessions: turns per session (prompts from max/4, growing max/(2 x turns) per turn)
    burstiness: float = 1.0  # synthetic arrivals: gamma shape (1 = Poisson)
    workers_per_pool: int = 1  # replicas of each pool (colocated: 2x this many full workers)


def trace_at_rate(base: list[TraceRequest], spec: BenchSpec, rate_rps: float) -> tuple[list[TraceRequest], Scaling]:
    """``rate_rps * duration_s`` consecutive requests from ``TRACE_OFFSET`` (from the start of a
    trace too short for it, such as a request log), time-scaled so their mean rate is
    ``rate_rps``: the trace's own burstiness, at a rate this machine can serve."""
    num = max(2, round(rate_rps * spec.duration_s))
    offset = TRACE_OFFSET if len(base) >= TRACE_OFFSET + num else 0
    window = base[offset:offset + num]
    if len(window) < 2:
        raise ValueError(f"the trace has {len(base)} request(s); a run needs at least 2")
    t0 = window[0].arrival_s
    window = [replace(r, arrival_s=r.arrival_s - t0) for r in window]
    native_rps = (len(window) - 1) / max(window[-1].arrival_s, 1e-9)
    scaling = Scaling(
        rate_multiplier=rate_rps / native_rps,
        output_scale=spec.output_scale,
        max_output_tokens=spec.max_output_tokens,
        max_prompt_tokens=spec.max_prompt_tokens,
    )
    return scale(window, scaling), scaling


def workload_at_rate(base: list[TraceRequest], spec: BenchSpec, rate_rps: float) -> tuple[list[TraceRequest], str]:
    """The requests of one run and the description every report states."""
    if spec.workload == "sessions":
        turns = spec.session_turns
        growth = max(1, spec.max_prompt_tokens // (2 * turns))
        num_sessions = max(1, round(rate_rps * spec.duration_s / turns))
        trace = agent_sessions(num_sessions, rate_rps, turns=turns, first_prompt_tokens=spec.max_prompt_tokens // 4,
                               tokens_per_turn=growth, output_tokens=spec.max_output_tokens,
                               max_prompt_tokens=spec.max_prompt_tokens, seed=int(rate_rps * 1000))
        return trace, (f"agent sessions: {num_sessions} × {turns} turns 5 s apart, prompts from "
                       f"{spec.max_prompt_tokens // 4} growing {growth} per turn (shared prefixes), "
                       f"outputs {spec.max_output_tokens}, sessions at {rate_rps / turns:g}/s")
    if spec.workload == "synthetic":
        num = max(2, round(rate_rps * spec.duration_s))
        trace = synthetic(num, rate_rps, max_prompt_tokens=spec.max_prompt_tokens,
                          output_tokens=(max(1, spec.max_output_tokens // 4), spec.max_output_tokens),
                          burstiness=spec.burstiness, seed=int(rate_rps * 1000))
        return trace, (f"synthetic mix 70% chat / 25% retrieval / 5% long, prompts up to {spec.max_prompt_tokens}, "
                       f"outputs {max(1, spec.max_output_tokens // 4)}–{spec.max_output_tokens}, "
                       f"gamma arrivals (shape {spec.burstiness:g}) at {rate_rps:g} req/s")
    trace, scaling = trace_at_rate(base, spec, rate_rps)
    source = (f"Azure conv+code from request #{TRACE_OFFSET}" if Path(spec.trace_dir).is_dir()
              else f"{spec.trace_dir} (a request log) from its start")
    return trace, f"{source}: {scaling.describe()}"


def find_capacity(measure: Callable[[float], float], lo: float, hi: float, steps: int) -> float:
    """Bisect for the highest rate whose attainment (``measure(rate)``) is >= 90%, assuming
    attainment falls as the rate rises. Measures ``lo`` and ``hi`` first: 0.0 if even ``lo``
    fails, ``hi`` if ``hi`` passes; else ``steps`` halvings of [lo, hi]."""
    if measure(lo) < CAPACITY_ATTAINMENT:
        return 0.0
    if measure(hi) >= CAPACITY_ATTAINMENT:
        return hi
    for _ in range(steps):
        mid = round((lo + hi) / 2, 4)
        if measure(mid) >= CAPACITY_ATTAINMENT:
            lo = mid
        else:
            hi = mid
    return lo


def run_seed(label: str) -> int:
    """The prompt seed of one run, from its label (scenario, rate, purpose, threshold). Runs that
    share an endpoint must never send the same prompts: the workers' prefix caches would serve
    the later run's prefills from the earlier run's KV."""
    return zlib.crc32(label.encode())


def _by(records: list[RequestRecord], key: str) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(getattr(r, key) or "?", []).append(r)
    return groups


def _counters(serve: ServeProcess) -> dict[str, float]:
    return counter_totals(requests.get(serve.url + "/metrics", timeout=10).text, COUNTERS)


def set_threshold(serve: ServeProcess, tokens: int) -> None:
    """Change the live routing threshold (admin API, loopback: no admin key in bench configs)."""
    resp = requests.put(serve.url + "/admin/threshold", json={"threshold_tokens": tokens}, timeout=10)
    resp.raise_for_status()


def set_policy(serve: ServeProcess, policy: str, prefix_aware: bool = False) -> None:
    """Switch the live routing policy and prefix-aware routing (admin API)."""
    requests.put(serve.url + "/admin/policy", json={"policy": policy, "prefix_aware": prefix_aware},
                 timeout=10).raise_for_status()


@contextlib.contextmanager
def endpoint(colocated: bool, spec: BenchSpec, work_dir: Path):
    """A fresh endpoint on the benchmark's ports; stopped (Ctrl-C) and checked on exit."""
    work_dir.mkdir(parents=True, exist_ok=True)
    replicas = {"replicas": spec.workers_per_pool}
    config = write_config(work_dir / "endpoint.yaml", router_port=18400, worker_base_port=18500,
                          side_channel_base_port=16500, routingThreshold=spec.threshold_tokens, routingPolicy="threshold",
                          prefillSpec=replicas, decodingSpec=replicas)
    print(f"[bench] starting the {'colocated' if colocated else 'P/D'} endpoint (~2–3 min)", file=sys.stderr, flush=True)
    serve = ServeProcess(config, *(["--colocated"] if colocated else []), log_path=work_dir / "serve.log")
    try:
        serve.wait_ready()
        yield serve
    finally:
        survivors = serve.stop()
        if survivors:
            print(f"warning: {len(survivors)} process(es) survived the endpoint's stop", file=sys.stderr)


def offered_window_s(trace: list[TraceRequest]) -> float:
    """The arrival schedule's span, one mean gap added for the last request (n requests over
    n − 1 gaps): ``n ÷ rate`` for a schedule at a steady rate. Goodput is per this window."""
    if len(trace) < 2:
        return 1.0
    span = trace[-1].arrival_s - trace[0].arrival_s
    return span * len(trace) / (len(trace) - 1) if span > 0 else 1.0


class Runner:
    """Replays workloads against one target and records every run in ``results``."""

    def __init__(self, name: str, url: str, spec: BenchSpec, base: list[TraceRequest], results: dict):
        self.name, self.url, self.spec, self.base, self.results = name, url, spec, base, results

    def warm_up(self) -> None:
        warmup = [TraceRequest(0.0, 100, 4, "warmup"), TraceRequest(0.5, self.spec.threshold_tokens + 100, 4, "warmup")]
        asyncio.run(replay(self.url, self.spec.model, warmup, threshold_tokens=self.spec.threshold_tokens,
                           seed=run_seed(f"warm-up {self.name} {len(self.results.get('rates', []))}"), progress=False))

    def measure(self, rate: float, purpose: str, threshold: int | None = None) -> dict:
        trace, workload = workload_at_rate(self.base, self.spec, rate)
        label = f"{self.name} @ {rate:g} req/s ({purpose}{'' if threshold is None else f', threshold {threshold}'})"
        records, duration_s = asyncio.run(replay(self.url, self.spec.model, trace, threshold_tokens=self.spec.threshold_tokens,
                                                 seed=run_seed(label), label=label))
        window_s = offered_window_s(trace)
        entry: dict[str, Any] = {
            "rate_rps": rate,
            "purpose": purpose,
            "workload": workload,
            "all": summarize(records, window_s, self.spec.slo),
            "by_class": {k: summarize(v, window_s, self.spec.slo) for k, v in _by(records, "request_class").items()},
            "by_path": {k: summarize(v, window_s, self.spec.slo) for k, v in _by(records, "path").items()},
            "completion_window_s": duration_s,
            "records": [asdict(r) for r in records],
        }
        if threshold is not None:
            entry["threshold_tokens"] = threshold
        print(f"[bench] {label}: attainment {entry['all']['slo_attainment']:.0%}, "
              f"goodput {entry['all']['goodput_rps']:.3f} req/s", file=sys.stderr, flush=True)
        self.results.setdefault("rates", []).append(entry)
        return entry

    def capacity(self) -> float:
        spec = self.spec
        if spec.bisect_steps > 0:
            lo, hi = min(spec.rates_rps), max(spec.rates_rps)
            return find_capacity(lambda r: self.measure(r, "capacity")["all"]["slo_attainment"], lo, hi, spec.bisect_steps)
        # As the ladder counts it: a rate that meets the bar above one that missed it is noise, not capacity.
        return capacity({r: self.measure(r, "capacity")["all"]["slo_attainment"] for r in spec.rates_rps}, CAPACITY_ATTAINMENT)


def _run_scenario(name: str, url: str, spec: BenchSpec, base: list[TraceRequest], compare_rps: float | None,
                  serve: ServeProcess | None) -> dict:
    results: dict = {"scenario": name, "rates": []}
    runner = Runner(name, url, spec, base, results)
    before = _counters(serve) if serve and name != "vllm-router" else None
    runner.warm_up()
    results["capacity_rps"] = runner.capacity()
    if compare_rps:
        runner.measure(compare_rps, "compare")
    if before is not None:  # the router's own account of the P/D path during this scenario
        assert serve is not None  # ``before`` is only taken with a serve process
        after = _counters(serve)
        results["router_counters"] = {k: after[k] - before[k] for k in COUNTERS}
    return results


def run(spec: BenchSpec, out_dir: Path) -> dict:
    base = load_trace(spec.trace_dir) if spec.workload == "trace" else []
    for rate in spec.rates_rps:  # a workload that cannot be built fails here (ValueError), before any endpoint starts
        workload_at_rate(base, spec, rate)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results: dict = {"spec": {**asdict(spec), "slo": asdict(spec.slo)}, "scenarios": {}, "sweep": []}

    def save() -> None:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))

    compare_rps: float | None = None
    colocated_names = [n for n in spec.scenarios if n in COLOCATED_SCENARIOS]
    if colocated_names:
        with endpoint(True, spec, out_dir / "colocated") as serve:
            for name in colocated_names:
                set_policy(serve, "threshold", prefix_aware=name == "colocated-prefix")
                sc = _run_scenario(name, serve.url, spec, base, compare_rps, serve)
                if name == "colocated" and spec.compare_at > 0 and sc["capacity_rps"] > 0:
                    compare_rps = round(spec.compare_at * sc["capacity_rps"], 4)
                    Runner("colocated", serve.url, spec, base, sc).measure(compare_rps, "compare")
                results["scenarios"][name] = sc
                results["compare_rate_rps"] = compare_rps
                save()
    pd_names = [n for n in spec.scenarios if n in PD_SCENARIOS]
    if pd_names or spec.sweep_thresholds:
        with endpoint(False, spec, out_dir / "pd") as serve:
            for name in pd_names:
                set_policy(serve, "adaptive" if name in ("dpd-adaptive", "dpd-prefix") else "threshold",
                           prefix_aware=name == "dpd-prefix")
                set_threshold(serve, 0 if name in ("dpd-always", "dpd-adaptive", "dpd-prefix") else spec.threshold_tokens)
                if name == "vllm-router":
                    pool = serve.config.spec.pdSpec
                    base_port = pool.local.workerBasePort
                    with peer_router(f"http://127.0.0.1:{base_port + 1}", prefill_url=f"http://127.0.0.1:{base_port}",
                                     api_key=serve.worker_key) as url:
                        results["scenarios"][name] = _run_scenario(name, url, spec, base, compare_rps, None)
                else:
                    results["scenarios"][name] = _run_scenario(name, serve.url, spec, base, compare_rps, serve)
                save()
            if spec.sweep_thresholds:
                results["sweep"] = sweep(serve, spec, base, results)
            set_policy(serve, "threshold")
            set_threshold(serve, spec.threshold_tokens)
    results["wall_time_s"] = time.time() - started
    save()
    (out_dir / "report.md").write_text(report(results))
    return results


def sweep_rate(capacity_rps: float | None, rates_rps: tuple[float, ...]) -> float:
    """The threshold sweep's load: the dpd scenario's capacity; the lowest rate tried when it met
    the SLO at none (a capacity of 0 is a result, not "unmeasured"); the highest without a dpd run."""
    if capacity_rps is None:
        return max(rates_rps)
    return capacity_rps if capacity_rps > 0 else min(rates_rps)


def sweep(serve: ServeProcess, spec: BenchSpec, base: list[TraceRequest], results: dict) -> list[dict]:
    """Goodput versus threshold at one offered load, on the live P/D endpoint."""
    rate = spec.sweep_rate_rps or sweep_rate(results["scenarios"].get("dpd", {}).get("capacity_rps"), spec.rates_rps)
    holder: dict = {}
    runner = Runner("sweep", serve.url, spec, base, holder)
    entries = []
    for threshold in spec.sweep_thresholds:
        set_threshold(serve, threshold)
        before = _counters(serve)
        runner.warm_up()
        entry = runner.measure(rate, "sweep", threshold)
        after = _counters(serve)
        entry["router_counters"] = {k: after[k] - before[k] for k in COUNTERS}
        entries.append(entry)
    return entries


def _ms(x: float) -> str:
    return "—" if x != x else f"{x * 1000:.0f}"


def _ratio(x: float, base: float) -> str:
    return "—" if x != x or not base or base != base else f"{x / base:.2f}×"


def _ci(interval: tuple[float, float]) -> str:
    lo, hi = interval
    return "[—]" if lo != lo else f"[{lo:.2f}, {hi:.2f}]"


def paired_prefix_cis(mine: list[dict], base: list[dict], *, seed: int = 0) -> dict:
    """95% bootstrap intervals of two ratios of one scenario's run over another's on the same
    schedule — P50 TTFT (the ladder's ``paired_ratio``) and prefill tokens computed (prompt −
    cached) — resampling the requests present in both, paired by their position in the schedule."""
    by_index = {r["index"]: r for r in base}
    pairs = [(r, by_index[r["index"]]) for r in mine if r["index"] in by_index]

    def computed(r: dict) -> int:
        return r.get("num_prompt_tokens", 0) - r.get("num_cached_tokens", 0) if r.get("is_ok", True) else 0

    def computed_ratio(idx: list[int]) -> float:
        b = sum(computed(pairs[i][1]) for i in idx)
        return sum(computed(pairs[i][0]) for i in idx) / b if b else float("nan")

    ttft = paired_ratio([RequestRecord(**r) for r in mine], [RequestRecord(**r) for r in base], "ttft", 0.5, None,
                        Slo(float("inf"), float("inf")), seed=seed)
    return {"n": len(pairs), "ttft_p50": (ttft["lo"], ttft["hi"]),
            "prefill_tokens_computed": bootstrap_ci(computed_ratio, len(pairs), seed=seed)}


def _compare_entry(sc: dict) -> dict | None:
    return next((e for e in sc["rates"] if e.get("purpose") == "compare"), None)


def report(results: dict) -> str:
    spec = results["spec"]
    scenarios = results["scenarios"]
    rates = ", ".join(f"{r:g}" for r in spec["rates_rps"])
    lines = [
        f"SLO: TTFT ≤ {spec['slo']['ttft_s']} s and TPOT ≤ {spec['slo']['tpot_s']} s; capacity = highest rate with "
        f"≥ {CAPACITY_ATTAINMENT:.0%} attainment"
        + (f", bisected ({spec['bisect_steps']} steps) between {min(spec['rates_rps']):g} and {max(spec['rates_rps']):g} req/s."
           if spec["bisect_steps"] else f" there and at every lower one of the rates {rates} req/s."),
    ]
    workloads = sorted({e["workload"] for sc in scenarios.values() for e in sc["rates"]})
    lines += ["", "Workload: " + ("; ".join(workloads[:1]) + (" (rate varies per run)" if len(workloads) > 1 else "")), ""]
    if (per_pool := spec.get("workers_per_pool", 1)) > 1:
        lines += [f"Workers: {2 * per_pool} per endpoint ({per_pool} per pool), one core each, on the machine's cores "
                  "(shared when there are fewer).", ""]
    lines += [
        "| scenario | rate (req/s) | run | n | attainment | goodput (req/s) | "
        "P99 TTFT (ms) | P99 ITL (ms) | P99 TPOT (ms) | P99 ITL short (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, sc in scenarios.items():
        for e in sorted(sc["rates"], key=lambda e: (e["rate_rps"], e.get("purpose", ""))):
            a = e["all"]
            short = e["by_class"].get("short", {})
            lines.append(
                f"| {name} | {e['rate_rps']:g} | {e.get('purpose', '')} | {a['num_requests']:.0f} | {a['slo_attainment']:.0%} | "
                f"{a['goodput_rps']:.3f} | {_ms(a['ttft_p99_s'])} | {_ms(a['itl_p99_s'])} | {_ms(a['tpot_p99_s'])} | "
                f"{_ms(short.get('itl_p99_s', float('nan')))} |"
            )
    lines += ["", "| scenario | P/D stalls past the deadline | fallbacks to direct |", "|---|---|---|"]
    for name, sc in scenarios.items():
        c = sc.get("router_counters")
        lines.append(f"| {name} | n/a | n/a |" if c is None else
                     f"| {name} | {c.get('dpd_pd_stalls_total', 0):.0f} | {c.get('dpd_fallbacks_total', 0):.0f} |")
    base_sc = scenarios.get("colocated", {})
    base_cap = base_sc.get("capacity_rps") or float("nan")
    base_cmp = _compare_entry(base_sc) if base_sc else None
    lines += ["", f"Ratios to colocated; same offered load = {results.get('compare_rate_rps') or '—'} req/s "
                  f"({spec['compare_at']:.0%} of colocated capacity).", "",
              "| scenario | capacity (req/s) | capacity ÷ colocated | "
              "P99 ITL short | ÷ colocated | P99 TTFT | ÷ colocated | P99 TPOT | ÷ colocated |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, sc in scenarios.items():
        cmp = _compare_entry(sc)
        row = [name, f"{sc['capacity_rps']:g}", _ratio(sc["capacity_rps"], base_cap)]
        for key, cls in (("itl_p99_s", "short"), ("ttft_p99_s", None), ("tpot_p99_s", None)):
            mine = (cmp["by_class"].get(cls, {}) if cls else cmp["all"]).get(key, float("nan")) if cmp else float("nan")
            ref = (base_cmp["by_class"].get(cls, {}) if cls else base_cmp["all"]).get(key, float("nan")) if base_cmp else float("nan")
            row += [_ms(mine), _ratio(mine, ref)]
        lines.append("| " + " | ".join(row) + " |")
    if any(e["all"].get("prompt_tokens") for sc in scenarios.values() for e in sc["rates"]):
        lines += ["", "Prefix caching (the workers' own usage: cached_tokens of prompt_tokens):", "",
                  "| scenario | rate (req/s) | run | n | P50 TTFT (ms) | P99 TTFT (ms) | prefill tokens computed | "
                  "prefix hit rate |", "|---|---|---|---|---|---|---|---|"]
        for name, sc in scenarios.items():
            for e in sorted(sc["rates"], key=lambda e: (e["rate_rps"], e.get("purpose", ""))):
                a = e["all"]
                lines.append(f"| {name} | {e['rate_rps']:g} | {e.get('purpose', '')} | {a['num_requests']:.0f} | "
                             f"{_ms(a['ttft_p50_s'])} | {_ms(a['ttft_p99_s'])} | {a.get('prefill_tokens_computed', 0):.0f} | "
                             f"{a.get('prefix_hit_rate', float('nan')):.0%} |")
        for aware, blind in (("colocated-prefix", "colocated"), ("dpd-prefix", "dpd-adaptive")):
            if aware in scenarios and blind in scenarios:
                mine = {(e["rate_rps"], e.get("purpose")): e["all"] for e in scenarios[aware]["rates"]}
                records = {(e["rate_rps"], e.get("purpose")): e.get("records", []) for e in scenarios[aware]["rates"]}
                for e in scenarios[blind]["rates"]:
                    if (m := mine.get((e["rate_rps"], e.get("purpose")))) is not None:
                        nan = float("nan")
                        computed = _ratio(m.get("prefill_tokens_computed", nan), e["all"].get("prefill_tokens_computed", nan))
                        ci = paired_prefix_cis(records[(e["rate_rps"], e.get("purpose"))], e.get("records", []))
                        lines.append(f"\n{aware} ÷ {blind} @ {e['rate_rps']:g} req/s: P50 TTFT "
                                     f"{_ratio(m['ttft_p50_s'], e['all']['ttft_p50_s'])} {_ci(ci['ttft_p50'])}, "
                                     f"prefill tokens computed {computed} {_ci(ci['prefill_tokens_computed'])} "
                                     f"(95% bootstrap over the {ci['n']} requests, paired by position in the schedule)")
    if results.get("sweep"):
        lines += ["", f"Threshold sweep on the P/D endpoint at {results['sweep'][0]['rate_rps']:g} req/s:", "",
                  "| threshold (tokens) | attainment | goodput (req/s) | P99 TTFT (ms) | P99 ITL short (ms) | "
                  "P99 TTFT long (ms) | disaggregated | stalls |",
                  "|---|---|---|---|---|---|---|---|"]
        for e in results["sweep"]:
            a = e["all"]
            lines.append(
                f"| {e['threshold_tokens']} | {a['slo_attainment']:.0%} | {a['goodput_rps']:.3f} | {_ms(a['ttft_p99_s'])} | "
                f"{_ms(e['by_class'].get('short', {}).get('itl_p99_s', float('nan')))} | "
                f"{_ms(e['by_class'].get('long', {}).get('ttft_p99_s', float('nan')))} | "
                f"{e['by_path'].get('disaggregated', {}).get('num_requests', 0):.0f} | "
                f"{e.get('router_counters', {}).get('dpd_pd_stalls_total', 0):.0f} |"
            )
    return "\n".join(lines)

"""``dpd bench ladder``: colocated, static P/D and adaptive P/D on the same requests at every rate.

The method, built so that a ratio between scenarios means something on a noisy 2-core machine:

* **One request set per workload**: ``num_requests`` requests (an Azure trace window, or a
  synthetic mix), drawn once and time-compressed to each rate — every rate and every scenario
  serves the same requests with the same token ids. Prompts are capped (``max_prompt_tokens``)
  so that an isolated long prefill stays well inside the TTFT SLO on this machine.
* **Exact pairing**: prefix caching is off on every benchmark worker, so repeating the ids is
  no cache hit, and per-request results pair across scenarios.
* **Both endpoints up at once** (colocated, and one P/D endpoint whose policy is switched live:
  ``dpd`` = the static threshold split, ``dpd-adaptive`` = the adaptive policy); the idle one
  costs nothing while the other serves, so they alternate without restarts.
* **Rounds and order**: rates shuffled in every round; the scenario order rotated per (round,
  rate) — a Latin square over the scenarios. Every run is preceded by a warm-up that sends a
  maximum-length prompt to every worker.
* **Statistics**: 95% bootstrap intervals, resampling requests (never individual gaps), on
  attainment and on every paired ratio; failures count as +∞ in latency percentiles; a class
  with fewer than 100 requests reports its P90 instead of a P99; the client's own send lag is
  recorded and a run whose P99 lag exceeds ``MAX_CLIENT_LAG_S`` is flagged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import requests

from dpd.bench.client import replay
from dpd.bench.stats import (
    RequestRecord,
    Slo,
    bootstrap_ci,
    fitted_capacity,
    fitted_capacity_ci,
    isolated_latencies,
    percentile,
    scaled_attainment,
)
from dpd.bench.workloads import TraceRequest, load_trace, synthetic
from dpd.launch.child import ServeProcess, write_config

SCENARIOS = ("colocated", "dpd", "dpd-adaptive")
TRACE_OFFSET = 2000  # the trace's first minutes are sparser than the rest
WINDOW_STRIDE = 5000  # requests between the trace windows of ``LadderSpec.windows``
MAX_CLIENT_LAG_S = 0.005
MIN_REQUESTS_FOR_P99 = 100
ROUND_INDEX_STRIDE = 1_000_000  # pooled rounds: round r's request i is index i + r × this (another pair)
SLO_SCALES = (1.5, 2.0, 3.0, 5.0)  # the SLO scale's multiples of each request's best latency
WORKER_ARGS = ("--no-enable-prefix-caching",)


@dataclass(frozen=True)
class LadderSpec:
    trace_dir: str
    rates_rps: tuple[float, ...]
    slo: Slo
    workloads: tuple[str, ...] = ("trace", "synthetic")
    scenarios: tuple[str, ...] = SCENARIOS
    num_requests: int = 100
    rounds: int = 1
    windows: int = 1  # request sets: round r uses set r mod windows (trace windows WINDOW_STRIDE apart; synthetic seeds)
    threshold_tokens: int = 512  # the static split's threshold; also the short/long class boundary
    adaptive_floor_tokens: int = 0
    adaptive_max_stall_s: float | None = None  # pdSpec.router.adaptive.maxStallS (unset: none)
    adaptive_stall_weight: float | None = None  # pdSpec.router.adaptive.stallWeight (unset: the config's default)
    adaptive_ttft_target_s: float | None = None  # pdSpec.router.adaptive.ttftSloS (unset: the judged SLO's TTFT)
    max_prompt_tokens: int = 768
    max_output_tokens: int = 48
    model: str = "smollm2-135m"
    seed: int = 0
    burstiness: float = 1.0
    workload_rates: tuple[tuple[str, tuple[float, ...]], ...] = ()  # per-workload rates instead of ``rates_rps``

    def rates_for(self, workload: str) -> tuple[float, ...]:
        """A workload's rates: its own where given (its capacity may differ), else ``rates_rps``."""
        return dict(self.workload_rates).get(workload, self.rates_rps)


# -- the request sets -------------------------------------------------------------------------------

def request_set(spec: LadderSpec, workload: str, base: list[TraceRequest] | None = None,
                window: int = 0) -> tuple[list[TraceRequest], str]:
    """``num_requests`` requests at a mean rate of 1 req/s (``at_rate`` compresses them), and
    what the report states about them. ``window``: which of the spec's request sets — the trace
    ``window × WINDOW_STRIDE`` requests further on, or the synthetic mix drawn with seed + window."""
    n, cap, out_cap = spec.num_requests, spec.max_prompt_tokens, spec.max_output_tokens
    if workload == "synthetic":
        trace = synthetic(n, 1.0, max_prompt_tokens=cap, output_tokens=(max(1, out_cap // 4), out_cap),
                          burstiness=spec.burstiness, seed=spec.seed + window)
        # The draw's own mean rate differs from the nominal 1 req/s (±10% at 100 requests): stated,
        # so an absolute rate can be read as offered; ratios within one set are unaffected.
        actual = (len(trace) - 1) / max(trace[-1].arrival_s - trace[0].arrival_s, 1e-9) if len(trace) > 1 else 1.0
        return trace, (f"synthetic mix (70% chat / 25% retrieval / 5% long), {n} requests, prompts up to {cap} tokens, "
                       f"outputs {max(1, out_cap // 4)}–{out_cap}, gamma arrivals (shape {spec.burstiness:g}), "
                       f"seed {spec.seed + window}; its arrivals' own mean rate is {actual:.2f}× the nominal rate")
    if workload != "trace":
        raise ValueError(f"unknown workload {workload!r}; allowed: trace, synthetic")
    if base is None:
        base = load_trace(spec.trace_dir)
    offset = TRACE_OFFSET if len(base) >= TRACE_OFFSET + n else 0  # a short trace (a request log): from its start
    offset += window * (WINDOW_STRIDE if offset else n)  # a request log's windows follow one another
    if window and len(base) < offset + n:
        raise ValueError(f"the trace has {len(base)} requests: too few for window {window + 1} (requests #{offset}–"
                         f"#{offset + n - 1}); use fewer --windows or --requests")
    chosen = base[offset:offset + n]
    if len(chosen) < 2:
        raise ValueError(f"the trace has too few requests after #{offset}")
    t0 = chosen[0].arrival_s
    native_rps = (len(chosen) - 1) / max(chosen[-1].arrival_s - t0, 1e-9)
    trace = [replace(r, arrival_s=(r.arrival_s - t0) * native_rps, num_prompt_tokens=min(r.num_prompt_tokens, cap),
                     num_output_tokens=max(1, min(r.num_output_tokens, out_cap))) for r in chosen]
    num_capped = sum(r.num_prompt_tokens > cap for r in chosen)
    source = "Azure conv+code" if offset >= TRACE_OFFSET and len(base) >= TRACE_OFFSET + n else spec.trace_dir
    return trace, (f"{source}, requests #{offset}–#{offset + len(chosen) - 1} "
                   f"({native_rps:.2f} req/s natively), "
                   f"prompts capped at {cap} tokens ({num_capped} of {n} capped), outputs capped at {out_cap}")


def _describe_windows(descriptions: list[str]) -> str:
    if len(descriptions) == 1:
        return descriptions[0]
    k = len(descriptions)
    return " · ".join(f"set {i + 1} (rounds {i + 1}, {i + 1 + k}, …): {d}" for i, d in enumerate(descriptions))


def at_rate(trace: list[TraceRequest], rate_rps: float) -> list[TraceRequest]:
    """The same requests, arrivals compressed so that their mean rate is ``rate_rps``."""
    if rate_rps <= 0:
        raise ValueError("rate must be > 0")
    return [replace(r, arrival_s=r.arrival_s / rate_rps) for r in trace]


def schedule(spec: LadderSpec) -> list[tuple[int, str, float, str]]:
    """Every run as (round, workload, rate, scenario): per round and workload the rates
    shuffled, and the scenario order rotated by one at each step (a Latin square)."""
    rng = random.Random(spec.seed)
    runs, step = [], 0
    for round_index in range(spec.rounds):
        for workload in spec.workloads:
            rates = list(spec.rates_for(workload))
            rng.shuffle(rates)
            for rate in rates:
                k = step % len(spec.scenarios)
                for scenario in spec.scenarios[k:] + spec.scenarios[:k]:
                    runs.append((round_index, workload, rate, scenario))
                step += 1
    return runs


# -- statistics ------------------------------------------------------------------------------------

def _ttft(r: RequestRecord) -> float:
    return r.ttft_s if r.is_ok else math.inf


def _quantile_name(n: int) -> tuple[float, str]:
    return (0.99, "P99") if n >= MIN_REQUESTS_FOR_P99 else (0.9, "P90")


def class_figures(records: list[RequestRecord], slo: Slo) -> dict:
    """The figures of one run (or one class of it)."""
    q, name = _quantile_name(len(records))
    met = sum(slo.is_met(r) for r in records)
    return {
        "n": len(records),
        "quantile": name,
        "attainment": met / len(records) if records else math.nan,
        "ttft_q_s": percentile([_ttft(r) for r in records], q),
        "ttft_p50_s": percentile([_ttft(r) for r in records], 0.5),
        "itl_q_s": percentile([g for r in records if r.is_ok for g in r.itls_s], q),
        "num_failed": sum(not r.is_ok for r in records),
        "num_merged_chunks": sum(r.num_merged_chunks for r in records),
    }


def _ratio(a: float, b: float) -> float:
    """``a / b`` where a percentile may be +inf (failures count as +inf latency): inf over a
    finite value is inf, a finite value over inf is 0 — so a resample in which failures reach the
    percentile moves the interval instead of dropping out of it; inf / inf and x / 0 say nothing."""
    if a != a or b != b or (math.isinf(a) and math.isinf(b)) or b == 0:
        return math.nan
    if math.isinf(a):
        return math.inf
    return 0.0 if math.isinf(b) else a / b


def paired_ratio(mine: list[RequestRecord], base: list[RequestRecord], figure: str, q: float, cls: str | None,
                 slo: Slo, seed: int = 0) -> dict:
    """``figure`` (ttft / itl / met: requests meeting ``slo``) of ``mine`` over ``base``, the requests paired by index,
    with a bootstrap interval that resamples request indices once for both scenarios."""
    by_index = {r.index: r for r in base}
    pairs = [(r, by_index[r.index]) for r in mine if r.index in by_index and (cls is None or r.request_class == cls)]

    def value(records: list[RequestRecord]) -> float:
        if figure == "ttft":
            return percentile([_ttft(r) for r in records], q)
        if figure == "itl":
            return percentile([g for r in records if r.is_ok for g in r.itls_s], q)
        return float(sum(slo.is_met(r) for r in records))

    def ratio(idx: list[int]) -> float:
        return _ratio(value([pairs[i][0] for i in idx]), value([pairs[i][1] for i in idx]))

    point = ratio(list(range(len(pairs))))
    lo, hi = bootstrap_ci(ratio, len(pairs), seed=seed, groups=_rounds([mine for mine, _ in pairs]))
    return {"ratio": point, "lo": lo, "hi": hi, "n": len(pairs)}


def _rounds(records: list[RequestRecord]) -> list[list[int]]:
    """Positions of ``records`` by round (the report offsets a round's request indices by ROUND_INDEX_STRIDE)."""
    by_round: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        by_round.setdefault(r.index // ROUND_INDEX_STRIDE, []).append(i)
    return list(by_round.values())


def attainment_ci(records: list[RequestRecord], slo: Slo, seed: int = 0) -> tuple[float, float]:
    met = [slo.is_met(r) for r in records]
    return bootstrap_ci(lambda idx: sum(met[i] for i in idx) / len(idx), len(met), seed=seed, groups=_rounds(records))


def capacity(attainments: dict[float, float], bar: float = 0.9) -> float:
    """The highest rate at which this and every lower rate of the ladder meet ``bar``; 0 if none
    (a rate with nothing measured, NaN, meets nothing)."""
    best = 0.0
    for rate in sorted(attainments):
        if not attainments[rate] >= bar:
            break
        best = rate
    return best


# -- running ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def endpoints(spec: LadderSpec, work_dir: Path) -> Iterator[dict[str, ServeProcess]]:
    """The colocated and the P/D endpoint, both up (prefix caching off), stopped on exit."""
    wanted = {"colocated"} & set(spec.scenarios), {"dpd", "dpd-adaptive"} & set(spec.scenarios)
    serves: dict[str, ServeProcess] = {}
    try:
        for kind, ports, flag in (("pd", (18400, 18500, 16500), ()), ("colocated", (18600, 18700, 16700), ("--colocated",))):
            if not wanted[kind == "pd"]:
                continue
            config = endpoint_config(spec, work_dir, kind, ports)  # creates work_dir/kind
            serves[kind] = ServeProcess(config, *flag, log_path=work_dir / kind / "serve.log")
        for kind, serve in serves.items():
            print(f"[ladder] waiting for the {kind} endpoint (~3–5 min for both)", file=sys.stderr, flush=True)
            serve.wait_ready()
        yield serves
    finally:
        for serve in serves.values():
            if serve.stop():
                print("warning: processes survived an endpoint's stop", file=sys.stderr)


def endpoint_config(spec: LadderSpec, work_dir: Path, kind: str, ports: tuple[int, int, int]) -> Path:
    """One endpoint's config file (``work_dir/kind/endpoint.yaml``). Its router keeps a request
    log beside the results (``requests-{kind}.jsonl``: every request's plan, and under the
    adaptive policy its predicted TTFT beside the measured one — the cost model's audit)."""
    d = work_dir / kind
    d.mkdir(parents=True, exist_ok=True)
    return write_config(d / "endpoint.yaml", router_port=ports[0], worker_base_port=ports[1],
                        side_channel_base_port=ports[2], worker_args=WORKER_ARGS,
                        routingThreshold=spec.threshold_tokens, routingPolicy="threshold",
                        router={"adaptive": adaptive_settings(spec),
                                "requestLog": {"path": str((work_dir / f"requests-{kind}.jsonl").resolve())}})


def adaptive_settings(spec: LadderSpec) -> dict:
    """The P/D endpoint's ``router.adaptive``: the ladder's SLO, and the stall limit where given."""
    ttft = spec.slo.ttft_s if spec.adaptive_ttft_target_s is None else spec.adaptive_ttft_target_s
    settings: dict = {"ttftSloS": ttft, "tpotSloS": spec.slo.tpot_s}
    if spec.adaptive_max_stall_s is not None:
        settings["maxStallS"] = spec.adaptive_max_stall_s
    if spec.adaptive_stall_weight is not None:
        settings["stallWeight"] = spec.adaptive_stall_weight
    return settings


def configure(serve: ServeProcess, scenario: str, spec: LadderSpec) -> None:
    """Switch the P/D endpoint to a scenario's policy (admin API, loopback)."""
    if scenario == "colocated":
        return
    policy, threshold = ("adaptive", spec.adaptive_floor_tokens) if scenario == "dpd-adaptive" else ("threshold", spec.threshold_tokens)
    _set_policy(serve, policy, threshold)


def _set_policy(serve: ServeProcess, policy: str, threshold_tokens: int) -> None:
    for path, body in (("/admin/policy", {"policy": policy}), ("/admin/threshold", {"threshold_tokens": threshold_tokens})):
        requests.put(serve.url + path, json=body, timeout=10).raise_for_status()


# The warm-ups before every run, in order, as results.json records them (``dpd plan --check``
# replays them): ``warm_every_worker`` on the P/D endpoint, then ``settle`` on either.
WARM_UPS = ("every_worker", "settle")


def every_worker_steps(spec: LadderSpec) -> list[tuple[int, TraceRequest]]:
    """``warm_every_worker``'s steps: (the static policy's threshold, the request sent under it)."""
    return [(threshold, TraceRequest(0.0, spec.max_prompt_tokens, 4, "warmup")) for threshold in (spec.max_prompt_tokens + 1, 0)]


def warm_up_requests(spec: LadderSpec) -> list[TraceRequest]:
    """``warm_up``'s requests: a maximum-length prompt on every worker (two at once, so each
    worker gets one) and two short ones."""
    return [TraceRequest(0.0, spec.max_prompt_tokens, 4, "warmup"), TraceRequest(0.0, spec.max_prompt_tokens, 4, "warmup"),
            TraceRequest(0.2, 64, 4, "warmup"), TraceRequest(0.2, 64, 4, "warmup")]


def warm_every_worker(serve: ServeProcess, spec: LadderSpec, seed: int) -> None:
    """A maximum-length prompt prefilled on each worker of the P/D endpoint, whatever the
    scenario's policy would do with it: one run whole on the decode pool (threshold past the
    prompt), one split (threshold 0: the prefill pool prefills, the KV moves). The caller sets
    the scenario's policy afterwards (``configure``)."""
    for threshold, request in every_worker_steps(spec):
        _set_policy(serve, "threshold", threshold)
        asyncio.run(replay(serve.url, spec.model, [request],
                           threshold_tokens=spec.threshold_tokens, seed=seed + threshold, progress=False))


def warm_up(url: str, spec: LadderSpec, seed: int) -> None:
    """``warm_up_requests``, waited for."""
    asyncio.run(replay(url, spec.model, warm_up_requests(spec), threshold_tokens=spec.threshold_tokens, seed=seed,
                       progress=False))


def open_breakers(workers_state: dict) -> list[str]:
    """The breakers not closed in a ``GET /admin/workers`` answer (``*`` = a pool's)."""
    out = []
    for pool_name, pool in workers_state.get("pools", {}).items():
        if pool.get("breaker") not in (None, "closed"):
            out.append(f"{pool_name}:*")
        out += [f"{pool_name}:{w['name']}" for w in pool.get("workers", []) if w.get("breaker") != "closed"]
    return out


def router_state(url: str) -> dict | None:
    """The router's ``GET /admin/workers`` (each worker's learned rates, the split's overhead, the
    adaptive policy's TTFT errors), or None if it did not answer — a diagnostic, never fatal."""
    try:
        resp = requests.get(url + "/admin/workers", timeout=10)
        resp.raise_for_status()
        state = resp.json()
    except (requests.RequestException, ValueError):
        return None
    return state if isinstance(state, dict) else None


def settle(url: str, spec: LadderSpec, seed: int, attempts: int = 12) -> list[str]:
    """Warm up until every breaker is closed, so that no run inherits the one before it (an
    overloaded run can leave the prefill pool's breaker open, and the next run would then be
    served without a prefill pool). Returns the breakers still open after ``attempts``."""
    still_open: list[str] = []
    for attempt in range(attempts):
        if attempt:
            time.sleep(5.0)  # past the breakers' open period: the warm-up is their trial
        warm_up(url, spec, seed=seed + attempt)
        still_open = open_breakers(requests.get(url + "/admin/workers", timeout=10).json())
        if not still_open:
            break
    return still_open


def run(spec: LadderSpec, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    base = load_trace(spec.trace_dir) if "trace" in spec.workloads else None
    num_windows = max(1, min(spec.windows, spec.rounds))
    sets = {(w, k): request_set(spec, w, base, window=k) for w in spec.workloads for k in range(num_windows)}
    started = time.time()
    results: dict = {"spec": {**asdict(spec), "slo": asdict(spec.slo)}, "warm_ups": list(WARM_UPS),
                     "workloads": {w: _describe_windows([sets[(w, k)][1] for k in range(num_windows)]) for w in spec.workloads},
                     "runs": []}

    def save() -> None:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))

    plan = schedule(spec)
    with endpoints(spec, out_dir) as serves:
        for i, (round_index, workload, rate, scenario) in enumerate(plan):
            serve = serves["colocated" if scenario == "colocated" else "pd"]
            if scenario != "colocated":
                warm_every_worker(serve, spec, seed=20_000 + 100 * i)
            configure(serve, scenario, spec)
            still_open = settle(serve.url, spec, seed=10_000 + 100 * i)  # warm-up ids differ from the set's
            label = f"[{i + 1}/{len(plan)}] round {round_index + 1} {workload} {scenario} @ {rate:g} req/s"
            window = round_index % num_windows
            learned_before = router_state(serve.url)
            records, duration_s = asyncio.run(replay(serve.url, spec.model, at_rate(sets[(workload, window)][0], rate),
                                                     threshold_tokens=spec.threshold_tokens, seed=spec.seed, label=label))
            lag = percentile([r.send_lag_s for r in records], 0.99)
            results["runs"].append({"round": round_index, "window": window, "workload": workload, "rate_rps": rate, "scenario": scenario,
                                    "duration_s": duration_s, "client_lag_p99_s": lag, "breakers_open_at_start": still_open,
                                    # what the router had learned (rates, split overhead, TTFT errors) before and after
                                    "router_state": {"start": learned_before, "end": router_state(serve.url)},
                                    "records": [asdict(r) for r in records]})
            figures = class_figures(records, spec.slo)
            print(f"[ladder] {label}: attainment {figures['attainment']:.0%}, {figures['quantile']} TTFT "
                  f"{figures['ttft_q_s']:.2f} s, client lag P99 {lag * 1000:.1f} ms", file=sys.stderr, flush=True)
            save()
    results["wall_time_s"] = time.time() - started
    save()
    (out_dir / "report.md").write_text(report(results))
    return results


# -- the report ------------------------------------------------------------------------------------

def _records(run_entry: dict) -> list[RequestRecord]:
    return [RequestRecord(**r) for r in run_entry["records"]]


def _fmt_s(x: float) -> str:
    return "—" if x != x else ("∞" if math.isinf(x) else f"{x:.2f}")


def _fmt_ratio(r: dict) -> str:
    if r["ratio"] != r["ratio"]:
        return "—"
    return f"{_fmt_s(r['ratio'])}× [{_fmt_s(r['lo'])}, {_fmt_s(r['hi'])}]"


def _fmt_capacity(point: float, ci: tuple[float, float], met_by_rate: dict[float, list[bool]]) -> str:
    lo_rate, hi_rate = min(met_by_rate), max(met_by_rate)
    if point == 0:
        return f"< {lo_rate:g} req/s"
    if math.isinf(point):
        return f"> {hi_rate:g} req/s"
    lo, hi = ci
    show = lambda x: f"< {lo_rate:g}" if x == 0 else f"> {hi_rate:g}" if math.isinf(x) else f"{x:.2f}"  # noqa: E731
    return f"{point:.2f} req/s [{show(lo)}, {show(hi)}]"


def report(results: dict) -> str:
    spec = results["spec"]
    slo = Slo(**spec["slo"])
    lines = [f"SLO: TTFT ≤ {slo.ttft_s:g} s and TPOT ≤ {slo.tpot_s:g} s. Classes: long = prompt ≥ "
             f"{spec['threshold_tokens']} tokens (the static split's threshold). Intervals: 95% bootstrap over rounds "
             "(when there are several), then requests; "
             f"ratios paired by request. {spec['rounds']} round(s); P99 where a class has ≥ {MIN_REQUESTS_FOR_P99} "
             "requests, else P90."]
    if spec.get("adaptive_max_stall_s") is not None:
        lines[0] += f" dpd-adaptive ran with a stall limit (maxStallS) of {spec['adaptive_max_stall_s']:g} s."
    if spec.get("adaptive_stall_weight") is not None:
        lines[0] += f" dpd-adaptive ran with stallWeight {spec['adaptive_stall_weight']:g}."
    if spec.get("adaptive_ttft_target_s") is not None:
        lines[0] += (f" dpd-adaptive planned against a TTFT target of {spec['adaptive_ttft_target_s']:g} s "
                     "(router.adaptive.ttftSloS); requests are judged by the SLO above.")
    for workload, description in results["workloads"].items():
        runs = [r for r in results["runs"] if r["workload"] == workload]
        if not runs:
            continue
        lines += ["", f"### {workload}: {description}", "",
                  "| scenario | rate (req/s) | n | attainment [95% CI] | TTFT long P50 / Pq (s) | TTFT short Pq (s) | "
                  "ITL short Pq (ms) | failed | merged chunks | client lag P99, worst round (ms) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        pooled: dict[tuple[str, float], list[RequestRecord]] = {}
        for r in runs:
            recs = _records(r)
            for rec in recs:
                rec.index += ROUND_INDEX_STRIDE * r["round"]  # the same request in another round is another pair
            pooled.setdefault((r["scenario"], r["rate_rps"]), []).extend(recs)
        lags: dict[tuple[str, float], float] = {}  # the worst round's: one lagging round taints the pooled figures
        for r in runs:
            point = (r["scenario"], r["rate_rps"])
            lags[point] = max(lags.get(point, 0.0), r["client_lag_p99_s"])
        attainments: dict[str, dict[float, float]] = {}
        for (scenario, rate), recs in sorted(pooled.items(), key=lambda kv: (spec["scenarios"].index(kv[0][0]), kv[0][1])):
            all_f = class_figures(recs, slo)
            long_f = class_figures([r for r in recs if r.request_class == "long"], slo)
            short_f = class_figures([r for r in recs if r.request_class == "short"], slo)
            lo, hi = attainment_ci(recs, slo)
            attainments.setdefault(scenario, {})[rate] = all_f["attainment"]
            lag = lags[(scenario, rate)]
            lines.append(
                f"| {scenario} | {rate:g} | {all_f['n']} | {all_f['attainment']:.0%} [{lo:.0%}, {hi:.0%}] | "
                f"{_fmt_s(long_f['ttft_p50_s'])} / {_fmt_s(long_f['ttft_q_s'])} ({long_f['quantile']}, n={long_f['n']}) | "
                f"{_fmt_s(short_f['ttft_q_s'])} ({short_f['quantile']}) | "
                f"{short_f['itl_q_s'] * 1000:.0f} ({short_f['quantile']}) | {all_f['num_failed']} | {all_f['num_merged_chunks']} | "
                f"{lag * 1000:.1f}{' ⚠' if lag > MAX_CLIENT_LAG_S else ''} |")
        lines += ["", "Capacity at the SLO (highest ladder rate where it and every lower one reach 90%): "
                  + ", ".join(f"{s} {capacity(a):g} req/s" for s, a in attainments.items())]
        met_by_rate: dict[str, dict[float, list[bool]]] = {}
        rounds_by_rate: dict[str, dict[float, list[int]]] = {}
        for (scenario, rate), recs in pooled.items():
            met_by_rate.setdefault(scenario, {})[rate] = [slo.is_met(r) for r in recs]
            rounds_by_rate.setdefault(scenario, {})[rate] = [r.index // ROUND_INDEX_STRIDE for r in recs]
        lines += ["", "Capacity fitted (attainment made non-increasing in rate, linear between rates, where it crosses "
                  "90%; 95% bootstrap over rounds, then each rate's requests; > or < the ladder where it does not cross): "
                  + ", ".join(f"{s} {_fmt_capacity(fitted_capacity(m), fitted_capacity_ci(m, rounds_by_rate=rounds_by_rate[s]), m)}"
                              for s, m in met_by_rate.items())]
        isolated = isolated_latencies([r for recs in pooled.values() for r in recs])
        lines += ["", f"SLO scale: requests within k × their own best TTFT and TPOT in this workload's runs (a stand-in for "
                  f"the isolated latency), k = {', '.join(f'{k:g}' for k in SLO_SCALES)}:", "",
                  "| scenario | rate (req/s) | " + " | ".join(f"k = {k:g}" for k in SLO_SCALES) + " |",
                  "|---|---|" + "---|" * len(SLO_SCALES)]
        for (scenario, rate), recs in sorted(pooled.items(), key=lambda kv: (spec["scenarios"].index(kv[0][0]), kv[0][1])):
            lines.append(f"| {scenario} | {rate:g} | "
                         + " | ".join(f"{scaled_attainment(recs, isolated, k):.0%}" for k in SLO_SCALES) + " |")
        for base_name in ("colocated", "dpd"):
            if base_name not in spec["scenarios"] or "dpd-adaptive" not in spec["scenarios"]:
                continue
            lines += ["", f"dpd-adaptive ÷ {base_name}, paired by request (ratio [95% CI]; for met-SLO count > 1 is better, "
                          "for latencies < 1 is better):", "",
                      "| rate (req/s) | requests meeting the SLO | TTFT long Pq | ITL short Pq | TTFT all Pq |", "|---|---|---|---|---|"]
            for rate in sorted({r for (_, r) in pooled}):
                mine, base = pooled.get(("dpd-adaptive", rate)), pooled.get((base_name, rate))
                if not mine or not base:
                    continue
                n_long = sum(r.request_class == "long" for r in mine)
                n_short = len(mine) - n_long
                q_long, q_short, q_all = (_quantile_name(n)[0] for n in (n_long, n_short, len(mine)))
                cells = [_fmt_ratio(paired_ratio(mine, base, "met", 0, None, slo)),
                         _fmt_ratio(paired_ratio(mine, base, "ttft", q_long, "long", slo)),
                         _fmt_ratio(paired_ratio(mine, base, "itl", q_short, "short", slo)),
                         _fmt_ratio(paired_ratio(mine, base, "ttft", q_all, None, slo))]
                lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
        paths: dict[str, int] = {}
        for (scenario, _), recs in pooled.items():
            if scenario == "dpd-adaptive":
                for rec in recs:
                    key = f"{rec.path}/{rec.reason}" if rec.reason else rec.path
                    paths[key] = paths.get(key, 0) + 1
        if paths:
            lines += ["", "dpd-adaptive's plans (x-dpd-path / x-dpd-reason): "
                      + ", ".join(f"{k} {v}" for k, v in sorted(paths.items(), key=lambda kv: -kv[1]))]
    lines += ["", f"Wall time: {results.get('wall_time_s', 0) / 60:.0f} min."]
    return "\n".join(lines)

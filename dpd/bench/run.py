"""``dpd bench run``: scenarios side by side on the same cores, same trace, same rates.

Scenarios, each a fresh endpoint on the same workers' cores, warmed up, then replayed at every
rate of the sweep:
  colocated    ``dpd serve --colocated``: both workers as full servers behind dpd's router
  dpd          ``dpd serve`` with the routing threshold
  dpd-always   ``dpd serve`` with threshold 0 (every request disaggregated)
  vllm-router  the same P/D workers behind ``vllm-router`` in its P/D mode (the peer)
The trace is the Azure conv+code trace scaled to the machine (rate, output and prompt caps are
recorded in the results). Capacity is the highest swept rate with SLO attainment >= 90%.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import requests

from dpd.bench.client import replay
from dpd.bench.overhead import peer_router
from dpd.bench.stats import RequestRecord, Slo, counter_totals, summarize
from dpd.bench.workloads import Scaling, TraceRequest, load_azure_trace, scale
from dpd.launch.child import ServeProcess, write_config

SCENARIOS = ("colocated", "dpd", "dpd-always", "vllm-router")
CAPACITY_ATTAINMENT = 0.9
TRACE_OFFSET = 2000  # requests skipped: the trace's first minutes are sparser than the rest


@dataclass(frozen=True)
class BenchSpec:
    trace_dir: str
    rates_rps: tuple[float, ...]
    duration_s: float
    threshold_tokens: int
    slo: Slo
    max_prompt_tokens: int
    max_output_tokens: int
    output_scale: float
    scenarios: tuple[str, ...] = SCENARIOS
    model: str = "smollm2-135m"


def trace_at_rate(base: list[TraceRequest], spec: BenchSpec, rate_rps: float) -> tuple[list[TraceRequest], Scaling]:
    """``rate_rps * duration_s`` consecutive requests from ``TRACE_OFFSET``, time-scaled so their
    mean rate is ``rate_rps``: the trace's own burstiness, at a rate this machine can serve."""
    num = max(2, round(rate_rps * spec.duration_s))
    window = base[TRACE_OFFSET:TRACE_OFFSET + num]
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


def _by(records: list[RequestRecord], key: str) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(getattr(r, key) or "?", []).append(r)
    return groups


@contextlib.contextmanager
def scenario_endpoint(name: str, spec: BenchSpec, work_dir: Path):
    """Start the endpoint of one scenario; yield (target URL, the dpd endpoint)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    threshold = 0 if name == "dpd-always" else spec.threshold_tokens
    config = write_config(work_dir / "endpoint.yaml", router_port=18400, worker_base_port=18500,
                          side_channel_base_port=16500, routingThreshold=threshold)
    serve = ServeProcess(config, *(["--colocated"] if name == "colocated" else []), log_path=work_dir / "serve.log")
    try:
        serve.wait_ready()
        if name == "vllm-router":
            with peer_router("http://127.0.0.1:18501", prefill_url="http://127.0.0.1:18500") as url:
                yield url, serve
        else:
            yield serve.url, serve
    finally:
        survivors = serve.stop()
        if survivors:
            print(f"warning: {len(survivors)} process(es) survived the endpoint's stop", file=sys.stderr)


def run_scenario(name: str, spec: BenchSpec, base: list[TraceRequest], work_dir: Path) -> dict:
    results: dict = {"scenario": name, "rates": []}
    with scenario_endpoint(name, spec, work_dir) as (url, serve):
        warmup = [TraceRequest(0.0, 100, 4, "warmup"), TraceRequest(0.5, spec.threshold_tokens + 100, 4, "warmup")]
        asyncio.run(replay(url, spec.model, warmup, threshold_tokens=spec.threshold_tokens, seed=999, progress=False))
        for rate in spec.rates_rps:
            trace, scaling = trace_at_rate(base, spec, rate)
            print(f"[bench] {name} @ {rate:g} req/s: {len(trace)} requests over {spec.duration_s:.0f}s", file=sys.stderr)
            records, duration_s = asyncio.run(replay(url, spec.model, trace, threshold_tokens=spec.threshold_tokens, seed=int(rate * 1000)))
            entry = {
                "rate_rps": rate,
                "scaling": scaling.describe(),
                "all": summarize(records, duration_s, spec.slo),
                "by_class": {k: summarize(v, duration_s, spec.slo) for k, v in _by(records, "request_class").items()},
                "by_path": {k: summarize(v, duration_s, spec.slo) for k, v in _by(records, "path").items()},
                "records": [asdict(r) for r in records],
            }
            results["rates"].append(entry)
        # The router's own account of the P/D path: every stall past the deadline is counted.
        metrics = requests.get(serve.url + "/metrics", timeout=10).text
        results["router_counters"] = counter_totals(metrics, ("dpd_pd_stalls_total", "dpd_fallbacks_total"))
    ok = [e["rate_rps"] for e in results["rates"] if e["all"]["slo_attainment"] >= CAPACITY_ATTAINMENT]
    results["capacity_rps"] = max(ok) if ok else 0.0
    return results


def run(spec: BenchSpec, out_dir: Path) -> dict:
    base = load_azure_trace(spec.trace_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results = {"spec": {**asdict(spec), "slo": asdict(spec.slo)}, "scenarios": {}}
    for name in spec.scenarios:
        results["scenarios"][name] = run_scenario(name, spec, base, out_dir / name)
        (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    results["wall_time_s"] = time.time() - started
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out_dir / "report.md").write_text(report(results))
    return results


def _ms(x: float) -> str:
    return "—" if x != x else f"{x * 1000:.0f}"


def report(results: dict) -> str:
    spec = results["spec"]
    lines = [
        f"SLO: TTFT ≤ {spec['slo']['ttft_s']} s and TPOT ≤ {spec['slo']['tpot_s']} s; capacity = highest swept rate "
        f"with ≥ {CAPACITY_ATTAINMENT:.0%} attainment.",
        "",
        "| scenario | rate (req/s) | n | attainment | goodput (req/s) | P99 TTFT (ms) | P99 ITL (ms) | P99 TPOT (ms) | P99 ITL short (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, sc in results["scenarios"].items():
        for e in sc["rates"]:
            a = e["all"]
            short = e["by_class"].get("short", {})
            lines.append(
                f"| {name} | {e['rate_rps']:g} | {a['num_requests']:.0f} | {a['slo_attainment']:.0%} | {a['goodput_rps']:.3f} | "
                f"{_ms(a['ttft_p99_s'])} | {_ms(a['itl_p99_s'])} | {_ms(a['tpot_p99_s'])} | {_ms(short.get('itl_p99_s', float('nan')))} |"
            )
    lines += ["", "| scenario | P/D stalls past the deadline | fallbacks to direct |", "|---|---|---|"]
    for name, sc in results["scenarios"].items():
        c = sc.get("router_counters", {})
        if name == "vllm-router":  # its requests bypass dpd's router
            lines.append(f"| {name} | n/a | n/a |")
        else:
            lines.append(f"| {name} | {c.get('dpd_pd_stalls_total', 0):.0f} | {c.get('dpd_fallbacks_total', 0):.0f} |")
    lines += ["", "| scenario | capacity (req/s) | capacity ÷ colocated |", "|---|---|---|"]
    base = results["scenarios"].get("colocated", {}).get("capacity_rps") or float("nan")
    for name, sc in results["scenarios"].items():
        lines.append(f"| {name} | {sc['capacity_rps']:g} | {sc['capacity_rps'] / base:.2f} |")
    return "\n".join(lines)

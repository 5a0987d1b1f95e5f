"""``dpd bench correctness``: under mixed load, no P/D stall goes unrecorded and every answer is right.

One run, two endpoints, both float32 (greedy comparisons then test the KV transfer, not bf16
near-ties; see tests/integration/test_a_disaggregated.py):
  1. ``dpd serve`` (threshold 1,024): the Azure trace replayed open-loop as background load
     while probe requests — distinct text prompts of ~100 and ~1,500 tokens, greedy, ``ignore_eos`` —
     arrive at a fixed spacing across the same window. Per probe: output text, ``x-dpd-path``,
     ``x-dpd-fallback``, client TTFT. The router's counters are read before and after.
  2. ``dpd serve --colocated``: the same probes, sequentially, no load.
Correct means each probe's greedy text equals its colocated text. "No stall unrecorded" is
checked with what a client and the router's /metrics can see (``account_stalls``).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, cast

import aiohttp
import requests
from prometheus_client.parser import text_string_to_metric_families

from dpd.bench.client import replay
from dpd.bench.stats import RequestRecord, Slo, percentile
from dpd.bench.workloads import TraceRequest, load_azure_trace
from dpd.launch.child import ServeProcess, write_config

WORKER_ARGS = ("--dtype", "float32")
STALL_REASON = "decode_stall"  # x-dpd-fallback / dpd_fallbacks_total{reason} of a decode hop past the deadline
PROMPT_WORDS = (
    "river mountain engine quiet harbor lantern copper orbit meadow signal violet canyon ember garden "
    "pixel thunder willow marble falcon crystal summit breeze anchor velvet prism cedar glacier beacon "
    "saffron tundra cobalt meteor orchard quartz raven silver timber walnut zephyr"
).split()


@dataclass(frozen=True)
class CorrectnessSpec:
    trace_dir: str
    rate_rps: float = 0.15
    duration_s: float = 150.0
    threshold_tokens: int = 1024
    max_prompt_tokens: int = 2048  # fp32 prefill of the load stays a few seconds per request
    max_output_tokens: int = 64
    output_scale: float = 0.5
    num_short: int = 10
    num_long: int = 10
    short_tokens: int = 100
    long_tokens: int = 1500
    max_tokens: int = 24
    model: str = "smollm2-135m"


@dataclass(frozen=True)
class Probe:
    probe_id: int
    size: str  # "short" | "long"
    prompt: str


@dataclass
class ProbeResult:
    probe_id: int
    size: str
    text: str = ""
    path: str = ""
    fallback_reason: str = ""
    ttft_s: float = float("nan")
    num_output_tokens: int = 0
    error: str = ""

    @property
    def is_ok(self) -> bool:
        return not self.error


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


def make_prompt(tokenizer: Tokenizer, num_tokens: int, seed: int) -> str:
    """A distinct prompt of about ``num_tokens`` tokens (distinct: no prefix-cache hits)."""
    rng = random.Random(seed)
    words = [rng.choice(PROMPT_WORDS) for _ in range(num_tokens + 50)]
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[: max(1, num_tokens - 12)]
    return f"Request {seed}. " + tokenizer.decode(ids) + "\nSummarize the text above in one sentence:"


def make_probes(tokenizer: Tokenizer, spec: CorrectnessSpec) -> list[Probe]:
    """Short and long probes in a fixed interleaving; the same list for both endpoints."""
    sizes = ["short"] * spec.num_short + ["long"] * spec.num_long
    random.Random(6).shuffle(sizes)
    return [
        Probe(i, size, make_prompt(tokenizer, spec.short_tokens if size == "short" else spec.long_tokens, seed=60_000 + i))
        for i, size in enumerate(sizes)
    ]


# ---- sending ---------------------------------------------------------------------------------

async def send_probe(session: aiohttp.ClientSession, url: str, model: str, probe: Probe, max_tokens: int) -> ProbeResult:
    # ignore_eos: every probe compares all max_tokens tokens, not only those before an early EOS.
    body = {"model": model, "prompt": probe.prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = ProbeResult(probe.probe_id, probe.size)
    pieces: list[str] = []
    started = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            result.path = resp.headers.get("x-dpd-path", "")
            result.fallback_reason = resp.headers.get("x-dpd-fallback", "")
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"].get("completion_tokens") or 0
                for choice in chunk.get("choices") or ():
                    if choice.get("text"):
                        if not pieces:
                            result.ttft_s = time.perf_counter() - started
                        pieces.append(choice["text"])
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        result.error = f"{exc.__class__.__name__}: {exc}"[:300]
    result.text = "".join(pieces)
    return result


async def send_probes(url: str, model: str, probes: list[Probe], max_tokens: int, spacing_s: float) -> list[ProbeResult]:
    """Probe i is sent at ``i * spacing_s`` (open loop); spacing 0 = one after another."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        start = time.perf_counter()

        async def one(probe: Probe) -> ProbeResult:
            await asyncio.sleep(max(0.0, probe.probe_id * spacing_s - (time.perf_counter() - start)))
            r = await send_probe(session, url, model, probe, max_tokens)
            print(f"  probe {probe.probe_id:2d} {probe.size:5s} {r.path or '?':13s} {r.fallback_reason or '':12s} "
                  f"ttft {r.ttft_s:6.2f}s {r.error}", file=sys.stderr, flush=True)
            return r

        if spacing_s > 0:
            return list(await asyncio.gather(*(one(p) for p in probes)))
        return [await one(p) for p in probes]


# ---- the router's account ----------------------------------------------------------------------

def router_snapshot(metrics_text: str, deadline_s: float) -> dict[str, float]:
    """The counters the stall check compares, from the router's /metrics text.

    ``disagg_decode_hops_over_deadline``: decode hops on the disaggregated path that delivered a
    first token (so were *not* cut) later than the largest histogram bucket <= the deadline —
    exact when the deadline is a bucket bound (5 s is), conservative (counts more) otherwise.
    """
    out = {"pd_stalls": 0.0, "fallbacks": 0.0, "fallbacks_decode_stall": 0.0,
           "disagg_decode_hops": 0.0, "disagg_decode_hops_over_deadline": 0.0}
    within = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "dpd_pd_stalls_total":
                out["pd_stalls"] += s.value
            elif s.name == "dpd_fallbacks_total":
                out["fallbacks"] += s.value
                if s.labels.get("reason") == STALL_REASON:
                    out["fallbacks_decode_stall"] += s.value
            elif s.name.startswith("dpd_decode_hop_first_token_seconds") and s.labels.get("path") == "disaggregated":
                if s.name.endswith("_count"):
                    out["disagg_decode_hops"] += s.value
                elif s.name.endswith("_bucket") and float(s.labels["le"]) <= deadline_s:
                    within = max(within, s.value)
    out["disagg_decode_hops_over_deadline"] = out["disagg_decode_hops"] - within
    return out


def account_stalls(
    probes: list[ProbeResult], load_paths: list[str], before: dict[str, float], after: dict[str, float], deadline_s: float
) -> dict:
    """Compare what clients saw with what the router counted over the same window.

    Client side: a probe answered with ``x-dpd-fallback: decode_stall`` is a decode hop the
    router cut at the deadline; any response with ``x-dpd-path: fallback`` (probes and load) is
    a disaggregated request served direct. A probe on the disaggregated path with a client TTFT
    over the deadline is only a *suspect*: its TTFT includes the prefill hop, so its decode hop
    may or may not have been late (reported, not failed on).
    Checks (each must hold): counted stalls >= client-seen stalls; counted fallbacks >=
    client-seen fallbacks; every counted stall was served direct (stalls ==
    fallbacks{decode_stall}); no disaggregated decode hop delivered its first token past the
    deadline without being cut (the router's own decode-hop histogram; a pair's first transfer,
    whose deadline is longer — NIXL's handshake — is made by the warm-up, before ``before``).
    """
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    client_stalls = sum(p.fallback_reason == STALL_REASON for p in probes)
    client_fallbacks = sum(p.path == "fallback" for p in probes) + sum(p == "fallback" for p in load_paths)
    suspects = [p.probe_id for p in probes if p.path == "disaggregated" and p.ttft_s > deadline_s]
    checks = {
        "stalls_counted_ge_client_seen": delta["pd_stalls"] >= client_stalls,
        "fallbacks_counted_ge_client_seen": delta["fallbacks"] >= client_fallbacks,
        "every_stall_served_direct": delta["pd_stalls"] == delta["fallbacks_decode_stall"],
        "no_uncut_decode_hop_over_deadline": delta["disagg_decode_hops_over_deadline"] == 0,
    }
    unrecorded = (max(0.0, client_stalls - delta["pd_stalls"]) + max(0.0, client_fallbacks - delta["fallbacks"])
                  + delta["disagg_decode_hops_over_deadline"])
    return {
        "deadline_s": deadline_s, "counter_deltas": delta, "client_seen_stalls": client_stalls,
        "client_seen_fallbacks": client_fallbacks, "suspect_probe_ids": suspects,
        "num_unrecorded": unrecorded, "checks": checks, "is_ok": all(checks.values()),
    }


# ---- comparison --------------------------------------------------------------------------------

def compare_outputs(served: list[ProbeResult], reference: list[ProbeResult]) -> dict:
    """Per path seen on ``served``: how many probes' text equals the reference; every diff."""
    ref = {r.probe_id: r for r in reference}
    by_path: dict[str, dict[str, int]] = {}
    diffs = []
    for r in served:
        other = ref.get(r.probe_id)
        counts = by_path.setdefault(r.path or "?", {"n": 0, "identical": 0})
        counts["n"] += 1
        if other is not None and r.is_ok and other.is_ok and r.text == other.text:
            counts["identical"] += 1
            continue
        at = first_difference(r.text, other.text if other else "")
        diffs.append({"probe_id": r.probe_id, "size": r.size, "path": r.path, "at_char": at,
                      "served": r.text[at:at + 60], "colocated": (other.text if other else "")[at:at + 60],
                      "errors": [e for e in (r.error, other.error if other else "missing") if e]})
    return {"by_path": by_path, "num_identical": sum(c["identical"] for c in by_path.values()),
            "num_compared": len(served), "diffs": diffs, "is_ok": not diffs}


def first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---- the run -----------------------------------------------------------------------------------

def _load_window(spec: CorrectnessSpec) -> list[TraceRequest]:
    from dpd.bench.run import BenchSpec, trace_at_rate

    bench = BenchSpec(trace_dir=spec.trace_dir, rates_rps=(spec.rate_rps,), duration_s=spec.duration_s,
                      threshold_tokens=spec.threshold_tokens, slo=Slo(10.0, 0.2), max_prompt_tokens=spec.max_prompt_tokens,
                      max_output_tokens=spec.max_output_tokens, output_scale=spec.output_scale)
    return trace_at_rate(load_azure_trace(spec.trace_dir), bench, spec.rate_rps)[0]


def _start(config: Path, *args: str, log_path: Path) -> ServeProcess:
    serve = ServeProcess(config, *args, log_path=log_path)
    try:
        serve.wait_ready()
    except BaseException:
        _stop(serve)
        raise
    return serve


def _stop(serve: ServeProcess) -> int:
    survivors = serve.stop()
    if survivors:
        print(f"warning: {len(survivors)} process(es) survived the endpoint's stop: {[p.pid for p in survivors]}",
              file=sys.stderr)
    return len(survivors)


def _warm_up(url: str, spec: CorrectnessSpec, policy: str | None = None) -> None:
    """One short and one long request. On a P/D endpoint (``policy``: its configured routing
    policy) the long one is split — the threshold policy for it, then ``policy`` again — so the
    pair's first transfer (NIXL's handshake, a longer deadline) is made here, not in the window
    the stall check counts."""
    warmup = [TraceRequest(0.0, 100, 4, "warmup"), TraceRequest(0.5, spec.threshold_tokens + 100, 4, "warmup")]
    if policy is not None:
        requests.put(url + "/admin/policy", json={"policy": "threshold"}, timeout=30).raise_for_status()
    try:
        asyncio.run(replay(url, spec.model, warmup, threshold_tokens=spec.threshold_tokens, seed=999, progress=False))
    finally:
        if policy is not None:
            requests.put(url + "/admin/policy", json={"policy": policy}, timeout=30).raise_for_status()


def _load_summary(records: list[RequestRecord], duration_s: float) -> dict:
    paths: dict[str, int] = {}
    for r in records:
        paths[r.path or "?"] = paths.get(r.path or "?", 0) + 1
    ok = [r for r in records if r.is_ok]
    return {"num_requests": len(records), "num_failed": len(records) - len(ok), "duration_s": duration_s,
            "paths": paths, "ttft_p50_s": percentile([r.ttft_s for r in ok], 0.5),
            "ttft_p99_s": percentile([r.ttft_s for r in ok], 0.99),
            "num_over_threshold": [r.request_class for r in records].count("long")}


async def _under_load(url: str, spec: CorrectnessSpec, trace: list[TraceRequest], probes: list[Probe]):
    spacing_s = spec.duration_s / max(1, len(probes))
    load = replay(url, spec.model, trace, threshold_tokens=spec.threshold_tokens, seed=606, progress=False)
    (records, duration_s), results = await asyncio.gather(load, send_probes(url, spec.model, probes, spec.max_tokens, spacing_s))
    return records, duration_s, results


def run(spec: CorrectnessSpec, out_dir: Path) -> dict:
    from transformers import AutoTokenizer

    from dpd.models.bundled import prepare_bundled_model

    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    probes = make_probes(cast(Tokenizer, AutoTokenizer.from_pretrained(str(prepare_bundled_model()))), spec)
    trace = _load_window(spec)
    results: dict = {"spec": asdict(spec), "worker_args": list(WORKER_ARGS), "num_survivors": 0}

    (out_dir / "dpd").mkdir(parents=True, exist_ok=True)
    config = write_config(out_dir / "dpd" / "endpoint.yaml", router_port=18800, worker_base_port=18900,
                          side_channel_base_port=16900, worker_args=WORKER_ARGS, routingThreshold=spec.threshold_tokens)
    print(f"[correctness] starting dpd serve (float32, threshold {spec.threshold_tokens})", file=sys.stderr, flush=True)
    serve = _start(config, log_path=out_dir / "dpd" / "serve.log")
    try:
        deadline_s = serve.config.spec.pdSpec.router.decodeFirstTokenTimeoutS
        _warm_up(serve.url, spec, policy=serve.config.spec.pdSpec.routingPolicy)
        before = router_snapshot(requests.get(serve.url + "/metrics", timeout=10).text, deadline_s)
        print(f"[correctness] load: {len(trace)} trace requests at {spec.rate_rps:g} req/s + {len(probes)} probes "
              f"over {spec.duration_s:.0f}s", file=sys.stderr, flush=True)
        records, duration_s, served = asyncio.run(_under_load(serve.url, spec, trace, probes))
        after = router_snapshot(requests.get(serve.url + "/metrics", timeout=10).text, deadline_s)
    finally:
        results["num_survivors"] += _stop(serve)
    results["load"] = _load_summary(records, duration_s)
    results["stalls"] = account_stalls(served, [r.path for r in records], before, after, deadline_s)
    results["dpd_probes"] = [asdict(r) for r in served]

    (out_dir / "colocated").mkdir(parents=True, exist_ok=True)
    config = write_config(out_dir / "colocated" / "endpoint.yaml", router_port=18810, worker_base_port=18910,
                          side_channel_base_port=16910, worker_args=WORKER_ARGS, routingThreshold=spec.threshold_tokens)
    print("[correctness] starting dpd serve --colocated (float32)", file=sys.stderr, flush=True)
    serve = _start(config, "--colocated", log_path=out_dir / "colocated" / "serve.log")
    try:
        _warm_up(serve.url, spec)
        print(f"[correctness] colocated: {len(probes)} probes, one after another", file=sys.stderr, flush=True)
        reference = asyncio.run(send_probes(serve.url, spec.model, probes, spec.max_tokens, spacing_s=0))
    finally:
        results["num_survivors"] += _stop(serve)
    results["colocated_probes"] = [asdict(r) for r in reference]
    results["comparison"] = compare_outputs(served, reference)
    results["is_ok"] = (results["comparison"]["is_ok"] and results["stalls"]["is_ok"]
                        and results["load"]["num_failed"] == 0 and results["num_survivors"] == 0)
    results["wall_time_s"] = time.time() - started
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out_dir / "report.md").write_text(report(results))
    return results


def report(results: dict) -> str:
    spec, load, stalls, cmp = results["spec"], results["load"], results["stalls"], results["comparison"]
    d = stalls["counter_deltas"]
    lines = [
        f"**{'PASS' if results['is_ok'] else 'FAIL'}** — float32 workers; threshold {spec['threshold_tokens']} tokens; "
        f"first-token deadline {stalls['deadline_s']:g} s.",
        "",
        f"Load: {load['num_requests']} Azure-trace requests at {spec['rate_rps']:g} req/s over {load['duration_s']:.0f} s "
        f"(prompts capped at {spec['max_prompt_tokens']}, {load['num_over_threshold']} at or over the threshold), "
        f"paths {load['paths']}, {load['num_failed']} failed, TTFT p50 {load['ttft_p50_s']:.2f} s / p99 {load['ttft_p99_s']:.2f} s; "
        f"plus {spec['num_short']} short (~{spec['short_tokens']} tokens) and {spec['num_long']} long (~{spec['long_tokens']} tokens) "
        f"probes, `temperature: 0`, `max_tokens: {spec['max_tokens']}` with `ignore_eos` "
        f"({sum(p['num_output_tokens'] for p in results['dpd_probes'])} output tokens compared).",
        "",
        "| path seen under load | probes | identical to colocated |",
        "|---|---|---|",
    ]
    for path, c in sorted(cmp["by_path"].items()):
        lines.append(f"| {path} | {c['n']} | {c['identical']} |")
    lines += ["", "| stall accounting (over the load window) | value |", "|---|---|"]
    lines += [
        f"| `dpd_pd_stalls_total` delta | {d['pd_stalls']:.0f} |",
        f"| probes answered with `x-dpd-fallback: {STALL_REASON}` | {stalls['client_seen_stalls']} |",
        f"| `dpd_fallbacks_total` delta (of which `{STALL_REASON}`) | {d['fallbacks']:.0f} ({d['fallbacks_decode_stall']:.0f}) |",
        f"| responses with `x-dpd-path: fallback` (probes + load) | {stalls['client_seen_fallbacks']} |",
        f"| disaggregated decode hops (router histogram) | {d['disagg_decode_hops']:.0f} |",
        f"| of them first token past the deadline, not cut | {d['disagg_decode_hops_over_deadline']:.0f} |",
        f"| disaggregated probes with client TTFT over the deadline (suspects) | {len(stalls['suspect_probe_ids'])} |",
    ]
    lines += ["", "Checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in stalls["checks"].items()) + "."]
    for diff in cmp["diffs"]:
        lines.append(f"- probe {diff['probe_id']} ({diff['size']}, {diff['path']}) differs at char {diff['at_char']}: "
                     f"{diff['served']!r} vs colocated {diff['colocated']!r} {diff['errors'] or ''}")
    if results["num_survivors"]:
        lines.append(f"- {results['num_survivors']} process(es) survived an endpoint's stop")
    return "\n".join(lines) + "\n"

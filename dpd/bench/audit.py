"""``dpd bench audit``: what a trace asks of an endpoint, before running anything.

Token histograms of prompts and outputs, the share of requests (and of prompt tokens) at or
above the routing threshold — what the disaggregated path would carry — and the prefill and
decode token rates the trace demands on average and in its busiest minute. Comparing those
rates with a worker's measured prefill and decode throughput gives a first pool ratio.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dpd.bench.stats import percentile
from dpd.bench.workloads import TraceRequest

BUCKET_EDGES = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class Audit:
    num_requests: int
    duration_s: float
    prompt_pcts: dict[str, float]
    output_pcts: dict[str, float]
    prompt_histogram: dict[str, int]
    output_histogram: dict[str, int]
    threshold_tokens: int
    share_requests_above: float
    share_prompt_tokens_above: float
    mean_prefill_tokens_per_s: float
    mean_decode_tokens_per_s: float
    peak_minute_prefill_tokens_per_s: float
    peak_minute_decode_tokens_per_s: float


def _bucket(n: int) -> str:
    for edge in BUCKET_EDGES:
        if n < edge:
            return f"<{edge}"
    return f">={BUCKET_EDGES[-1]}"


def _histogram(values: list[int]) -> dict[str, int]:
    counts = Counter(_bucket(v) for v in values)
    labels = [f"<{e}" for e in BUCKET_EDGES] + [f">={BUCKET_EDGES[-1]}"]
    return {label: counts.get(label, 0) for label in labels}


def _pcts(values: list[int]) -> dict[str, float]:
    floats = [float(v) for v in values]
    return {"p50": percentile(floats, 0.5), "p90": percentile(floats, 0.9), "p99": percentile(floats, 0.99), "max": max(floats)}


def audit(trace: list[TraceRequest], threshold_tokens: int) -> Audit:
    if not trace:
        raise ValueError("empty trace")
    prompts = [r.num_prompt_tokens for r in trace]
    outputs = [r.num_output_tokens for r in trace]
    duration_s = max(trace[-1].arrival_s - trace[0].arrival_s, 1e-9)
    above = [r for r in trace if r.num_prompt_tokens >= threshold_tokens]
    per_minute_prefill: Counter[int] = Counter()
    per_minute_decode: Counter[int] = Counter()
    for r in trace:
        minute = int(r.arrival_s // 60)
        per_minute_prefill[minute] += r.num_prompt_tokens
        per_minute_decode[minute] += r.num_output_tokens
    return Audit(
        num_requests=len(trace),
        duration_s=duration_s,
        prompt_pcts=_pcts(prompts),
        output_pcts=_pcts(outputs),
        prompt_histogram=_histogram(prompts),
        output_histogram=_histogram(outputs),
        threshold_tokens=threshold_tokens,
        share_requests_above=len(above) / len(trace),
        share_prompt_tokens_above=sum(r.num_prompt_tokens for r in above) / sum(prompts),
        mean_prefill_tokens_per_s=sum(prompts) / duration_s,
        mean_decode_tokens_per_s=sum(outputs) / duration_s,
        # A trace shorter than a minute is its own busiest window (never a peak below the mean).
        peak_minute_prefill_tokens_per_s=max(per_minute_prefill.values()) / min(60.0, duration_s),
        peak_minute_decode_tokens_per_s=max(per_minute_decode.values()) / min(60.0, duration_s),
    )


def render(a: Audit, description: str) -> str:
    lines = [
        f"# Trace audit: {description}",
        "",
        f"{a.num_requests} requests over {a.duration_s:.0f} s ({a.num_requests / a.duration_s:.2f} req/s).",
        "",
        "| tokens | p50 | p90 | p99 | max |",
        "|---|---|---|---|---|",
        "| prompt | " + " | ".join(f"{a.prompt_pcts[k]:.0f}" for k in ("p50", "p90", "p99", "max")) + " |",
        "| output | " + " | ".join(f"{a.output_pcts[k]:.0f}" for k in ("p50", "p90", "p99", "max")) + " |",
        "",
        "| bucket | prompts | outputs |",
        "|---|---|---|",
    ]
    for label in a.prompt_histogram:
        lines.append(f"| {label} | {a.prompt_histogram[label]} | {a.output_histogram[label]} |")
    lines += [
        "",
        f"At a threshold of {a.threshold_tokens} tokens: {a.share_requests_above:.1%} of requests and "
        f"{a.share_prompt_tokens_above:.1%} of prompt tokens take the disaggregated path.",
        "",
        "| demand | mean | busiest minute |",
        "|---|---|---|",
        f"| prefill tokens/s | {a.mean_prefill_tokens_per_s:.0f} | {a.peak_minute_prefill_tokens_per_s:.0f} |",
        f"| decode tokens/s | {a.mean_decode_tokens_per_s:.0f} | {a.peak_minute_decode_tokens_per_s:.0f} |",
    ]
    return "\n".join(lines)

"""Workloads: the Azure LLM inference trace, scaled to the hardware.

A trace is a list of ``TraceRequest`` (arrival offset, prompt tokens, output tokens, source).
``load_azure_trace`` merges the conv and code traces by timestamp; ``scale`` applies what every
report must state: a rate multiplier (arrivals compressed or stretched in time), an output cap
and scale, and a prompt cap that fits requests into the model's context.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

AZURE_FILES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    source: str
    # Requests of one session share a prompt prefix: each turn's prompt extends the previous one
    # (the client derives a session's token ids from the session, not the request).
    session: int | None = None


@dataclass(frozen=True)
class Scaling:
    rate_multiplier: float = 1.0  # 2.0 = twice the trace's request rate
    output_scale: float = 1.0
    max_output_tokens: int | None = None
    max_prompt_tokens: int | None = None  # fit prompts into the model's context

    def describe(self) -> str:
        return (
            f"rate x{self.rate_multiplier:g}, output x{self.output_scale:g}"
            f"{f' capped at {self.max_output_tokens}' if self.max_output_tokens else ''}, "
            f"prompts {'capped at ' + str(self.max_prompt_tokens) if self.max_prompt_tokens else 'as recorded'}"
        )


def _parse_time(text: str) -> float:
    # "2023-11-16 18:17:03.9799600": 7 fractional digits, more than datetime parses.
    head, _, frac = text.partition(".")
    return datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp() + float(f"0.{frac or '0'}")


def load_azure_trace(directory: str | Path, sources: tuple[str, ...] = ("conv", "code")) -> list[TraceRequest]:
    rows: list[tuple[float, int, int, str]] = []
    for source in sources:
        if source not in AZURE_FILES:
            raise ValueError(f"unknown trace source {source!r}; allowed: {', '.join(AZURE_FILES)}")
        path = Path(directory) / AZURE_FILES[source]
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                try:
                    prompt, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
                    if prompt < 0 or output < 0:
                        raise ValueError(f"a negative token count: {prompt}, {output}")
                    rows.append((_parse_time(row["TIMESTAMP"]), prompt, output, source))
                except (KeyError, TypeError, ValueError) as exc:  # a missing column, a short row, not a number
                    problem = f"no {exc} column" if isinstance(exc, KeyError) else str(exc)
                    raise ValueError(f"{path}, line {reader.line_num}: not an Azure trace row ({problem})") from None
    if not rows:
        return []
    rows.sort(key=lambda r: r[0])
    start = rows[0][0]
    return [TraceRequest(t - start, p, o, s) for t, p, o, s in rows]


def scale(trace: list[TraceRequest], scaling: Scaling) -> list[TraceRequest]:
    if scaling.rate_multiplier <= 0:
        raise ValueError("rate_multiplier must be > 0")
    out = []
    for r in trace:
        num_output = max(1, round(r.num_output_tokens * scaling.output_scale))
        if scaling.max_output_tokens:
            num_output = min(num_output, scaling.max_output_tokens)
        num_prompt = r.num_prompt_tokens
        if scaling.max_prompt_tokens:
            num_prompt = min(num_prompt, scaling.max_prompt_tokens)
        out.append(replace(r, arrival_s=r.arrival_s / scaling.rate_multiplier, num_prompt_tokens=num_prompt, num_output_tokens=num_output))
    return out


@dataclass(frozen=True)
class MixClass:
    """One class of a synthetic mix: its share of requests and its prompt-length range as fractions
    of the longest prompt allowed (so a mix scales with the model's context)."""

    name: str
    share: float
    min_frac: float
    max_frac: float


# 70% chat under 1k tokens, 25% retrieval-sized, 5% long — for a 4,096-token prompt budget:
# chat 32–1,023 tokens, retrieval 1,024–3,071, long 3,072–4,096.
DEFAULT_MIX = (
    MixClass("chat", 0.70, 0.0078, 0.2497),
    MixClass("retrieval", 0.25, 0.25, 0.7497),
    MixClass("long", 0.05, 0.75, 1.0),
)


def arrival_times(num_requests: int, rate_rps: float, *, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival offsets of an open-loop process at mean ``rate_rps``: gaps drawn from a gamma
    distribution with shape ``burstiness`` (1.0 = Poisson; below 1 burstier, above 1 smoother),
    the same convention as ``vllm bench serve --burstiness``. The first request arrives at 0."""
    if rate_rps <= 0 or burstiness <= 0:
        raise ValueError("rate_rps and burstiness must be > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(num_requests):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (rate_rps * burstiness))
        out.append(t)
    return out


def synthetic(
    num_requests: int, rate_rps: float, *, max_prompt_tokens: int, output_tokens: tuple[int, int] = (16, 64),
    mix: tuple[MixClass, ...] = DEFAULT_MIX, burstiness: float = 1.0, seed: int = 0,
) -> list[TraceRequest]:
    """A synthetic mixed workload: each request's class drawn by share, its prompt length uniform
    in the class's range, its output length uniform in ``output_tokens``; arrivals from
    ``arrival_times``. ``source`` names the class. Deterministic for a seed."""
    total = sum(c.share for c in mix)
    if not mix or total <= 0:
        raise ValueError("a mix needs at least one class with a positive share")
    rng = random.Random(seed + 1)
    out = []
    for t in arrival_times(num_requests, rate_rps, burstiness=burstiness, seed=seed):
        pick, acc = rng.random() * total, 0.0
        cls = mix[-1]
        for c in mix:
            acc += c.share
            if pick < acc:
                cls = c
                break
        lo = max(1, round(cls.min_frac * max_prompt_tokens))
        hi = max(lo, round(cls.max_frac * max_prompt_tokens))
        out.append(TraceRequest(t, rng.randint(lo, hi), rng.randint(*output_tokens), cls.name))
    return out


def agent_sessions(
    num_sessions: int, rate_rps: float, *, turns: int = 4, first_prompt_tokens: int = 1024,
    tokens_per_turn: int = 256, output_tokens: int = 32, think_time_s: float = 5.0, max_prompt_tokens: int = 4096,
    seed: int = 0,
) -> list[TraceRequest]:
    """Multi-turn agent sessions, the workload that reuses prefixes: sessions start at a mean
    request rate of ``rate_rps`` (Poisson), each sends ``turns`` requests ``think_time_s`` apart,
    and every turn's prompt is the previous one plus ``tokens_per_turn`` (capped at
    ``max_prompt_tokens``). Sorted by arrival."""
    starts = arrival_times(num_sessions, rate_rps / max(1, turns), seed=seed)
    out = [
        TraceRequest(start + turn * think_time_s, min(max_prompt_tokens, first_prompt_tokens + turn * tokens_per_turn),
                     output_tokens, f"session-turn-{turn + 1}", session=i)
        for i, start in enumerate(starts) for turn in range(turns)
    ]
    return sorted(out, key=lambda r: r.arrival_s)


def load_request_log(path: str | Path) -> tuple[list[TraceRequest], int]:
    """A request log's served requests (router/requestlog.py) as a trace: arrivals from its
    times, prompt tokens as the router counted them, output tokens as served; the tenant (or
    the API) is the source. Requests that did not finish ``ok`` have no output count and are
    left out; returns the trace and how many lines were left out (unreadable ones included)."""
    rows: list[tuple[float, int, int, str]] = []
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                if entry.get("shadow"):  # a mirror's line (router.shadow), not a request served
                    continue
                if entry.get("outcome") != "ok" or not entry.get("output_tokens"):
                    skipped += 1
                    continue
                rows.append((float(entry["time"]), int(entry["prompt_tokens"]), int(entry["output_tokens"]),
                             str(entry.get("tenant") or entry.get("api") or "log")))
            except (ValueError, KeyError, TypeError, AttributeError):
                skipped += 1
    rows.sort(key=lambda r: r[0])
    start = rows[0][0] if rows else 0.0
    return [TraceRequest(t - start, p, o, s) for t, p, o, s in rows], skipped


def load_trace(path: str | Path, sources: tuple[str, ...] = ("conv", "code")) -> list[TraceRequest]:
    """A trace from ``path``: a directory of the Azure LLM trace's CSVs (``sources`` picks the
    files), or a file written by the router's request log (JSON lines)."""
    if Path(path).is_dir():
        return load_azure_trace(path, sources)
    if not Path(path).exists():
        raise FileNotFoundError(f"no trace at {path}: give a directory of the Azure trace's CSVs or a request log file")
    return load_request_log(path)[0]

"""Workloads: the Azure LLM inference trace, scaled to the hardware.

A trace is a list of ``TraceRequest`` (arrival offset, prompt tokens, output tokens, source).
``load_azure_trace`` merges the conv and code traces by timestamp; ``scale`` applies what every
report must state: a rate multiplier (arrivals compressed or stretched in time), an output cap
and scale, and a prompt cap that fits requests into the model's context.
"""

from __future__ import annotations

import csv
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
        with open(Path(directory) / AZURE_FILES[source], newline="") as f:
            for row in csv.DictReader(f):
                rows.append((_parse_time(row["TIMESTAMP"]), int(row["ContextTokens"]), int(row["GeneratedTokens"]), source))
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

"""Requests judged by the operator's SLO (``router.slo``): which class a request is in, and
whether it met its targets — the counters behind goodput.

A request's class is the first of ``slo.classes`` whose ``maxPromptTokens`` holds its prompt
(the router's token count). It met the TTFT target if its first token came within ``ttftS`` of
its arrival at the router, and the TPOT target if (last token − first) ÷ (tokens − 1) is
within ``tpotS`` (``vllm bench serve``'s formula; a one-token answer meets it). A request that
failed after it was tokenized — a worker's error, a broken stream, shed by admission (429/503)
— missed both; a client that went away is not judged, nor is a request refused for its own
input (4xx). ``dpd_slo_requests_total{path,class,slo,outcome}`` counts each judged request
once per ``slo`` (``ttft``, ``tpot``, and ``all`` = both): goodput is the rate of
``slo="all",outcome="met"``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpd.config.model import SloSpec
from dpd.router.metrics import RouterMetrics


@dataclass(frozen=True)
class SloClass:
    name: str
    ttft_s: float
    tpot_s: float


class SloJudge:
    def __init__(self, spec: SloSpec, metrics: RouterMetrics):
        self._metrics = metrics
        self._bounds = [(c.maxPromptTokens, SloClass(c.name, c.ttftS or spec.ttftS, c.tpotS or spec.tpotS))
                        for c in spec.classes]

    def classify(self, num_prompt_tokens: int) -> SloClass:
        for bound, cls in self._bounds:
            if bound is None or num_prompt_tokens <= bound:
                return cls
        return self._bounds[-1][1]  # unreachable: the last class is unbounded (SloSpec checks)

    def judge(self, cls: SloClass, path: str, ttft_s: float | None, tpot_s: float | None) -> tuple[bool, bool]:
        """Count one request; ``None`` for a target the request never reached (it failed).
        Returns (TTFT met, TPOT met)."""
        ttft_met = ttft_s is not None and ttft_s <= cls.ttft_s
        tpot_met = ttft_s is not None and tpot_s is not None and tpot_s <= cls.tpot_s
        for slo, met in (("ttft", ttft_met), ("tpot", tpot_met), ("all", ttft_met and tpot_met)):
            self._metrics.slo_requests.labels(path, cls.name, slo, "met" if met else "missed").inc()
        return ttft_met, tpot_met

    def failed(self, cls: SloClass, path: str) -> None:
        self.judge(cls, path, None, None)

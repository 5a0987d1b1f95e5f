"""The adaptive policy: every worker may take either phase; a cost model measured online decides.

For a request of ``n`` prompt tokens expecting ``m`` output tokens, every plan is scored:

* **whole on w** (any worker of either pool runs prefill and decode):
  ``ttft = (queued prefill tokens on w + n) / w's prefill rate``;
* **split p → d** (a prefill-pool worker prefills, a decode-pool worker pulls the KV and decodes):
  ``ttft = (queued on p + n) / p's rate + the split's measured overhead`` (the decode hop's
  first-token latency: KV pull, one step, one more HTTP hop).

and charged for the decode time it costs other streams, in seconds weighted by
``stallWeight``:

* **harm** — the streams decoding on the worker that prefills, each stalled for the prefill:
  ``streams(w) × n / rate(w)``;
* **exposure** — what the new stream itself will suffer where it decodes: the share of recent
  time that worker spent prefilling × the stream's expected duration (``m`` / its measured
  decode rate), plus, for a split, the prefills already queued on the decoder.

``score = ttft + stallWeight × (harm + exposure)``; the lowest score wins (ties: fewer streams,
then the preferred role — decode-pool workers for whole requests). Prompts below the floor
(``routingThreshold``) are never split, only placed. The reason names what decided
(``decide.Reason``). The policy splits only in the preferred direction (prefill pool →
decode pool): the KV flows producer → consumer as vLLM's roles say, so the design keeps working
if vLLM drops ``kv_both`` (docs/design.md); a worker of either role runs whole requests.

Every input is read through ``Worker.load`` and ``EndpointLoad`` — the interface a simulator
can also provide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dpd.router.decide import Decision, Path, Reason, checked_threshold
from dpd.router.load import EndpointLoad
from dpd.router.pools import Worker

TIE_BREAK_S = 1e-3  # per stream: equal plans go to the less crowded worker


@dataclass(frozen=True)
class Candidates:
    """Workers a request may use now (healthy, not draining, the tenant's own)."""

    prefillers: Sequence[Worker]  # the prefill side of a split; empty when the prefill pool is unavailable
    decoders: Sequence[Worker]  # the decode pool
    others: Sequence[Worker] = ()  # workers that may also run whole requests (the prefill pool)


@dataclass(frozen=True)
class Scored:
    decision: Decision
    ttft_s: float
    stall_s: float  # harm + exposure
    score: float


class AdaptiveDecider:
    def __init__(self, floor_tokens: int, endpoint: EndpointLoad, *, stall_weight: float = 1.0,
                 is_colocated: bool = False):
        self.set_threshold(floor_tokens)
        self.endpoint = endpoint
        self.stall_weight = stall_weight
        self.is_colocated = is_colocated

    @property
    def threshold_tokens(self) -> int:
        return self._floor_tokens

    def set_threshold(self, threshold_tokens: int) -> None:
        self._floor_tokens = checked_threshold(threshold_tokens)

    def plan(self, num_prompt_tokens: int, num_output_tokens: int | None, candidates: Candidates) -> Decision | None:
        """The best plan, or None when no decoder at all can take the request."""
        n = num_prompt_tokens
        m = num_output_tokens if num_output_tokens is not None else round(self.endpoint.output_tokens.value)
        wholes = [self._whole(w, n, m) for w in (*candidates.decoders, *candidates.others)]
        if not wholes:
            return None
        best_whole = min(wholes, key=lambda s: s.score)  # min is stable: decode-pool workers win ties
        if self.is_colocated:
            return _with_reason(best_whole, Reason.COLOCATED)
        if n < self._floor_tokens:
            return _with_reason(best_whole, Reason.SHORT_PROMPT)
        splits = [self._split(p, d, n, m) for p in candidates.prefillers for d in candidates.decoders if p is not d]
        if not splits:
            return _with_reason(best_whole, Reason.PREFILL_UNAVAILABLE)
        best_split = min(splits, key=lambda s: s.score)
        if best_split.score < best_whole.score:
            return _with_reason(best_split, Reason.DECODER_BUSY)
        assert best_split.decision.prefill is not None
        if best_split.decision.prefill.load.prefill_s(n) > best_whole.ttft_s + 1e-9:
            return _with_reason(best_whole, Reason.PREFILL_QUEUE_LONG)
        return _with_reason(best_whole, Reason.SPLIT_NO_GAIN)

    def score_whole(self, worker: Worker, num_prompt_tokens: int, num_output_tokens: int) -> Scored:
        return self._whole(worker, num_prompt_tokens, num_output_tokens)

    def _whole(self, w: Worker, n: int, m: int) -> Scored:
        load = w.load
        ttft = load.prefill_s(n)
        harm = load.num_streams * n / load.prefill_tokens_per_s
        exposure = load.prefill_utilization() * m / load.decode_tokens_per_s
        stall = harm + exposure
        score = ttft + self.stall_weight * stall + TIE_BREAK_S * load.num_streams
        return Scored(Decision(Path.DIRECT, Reason.SHORT_PROMPT, decode=w, predicted_ttft_s=ttft), ttft, stall, score)

    def _split(self, p: Worker, d: Worker, n: int, m: int) -> Scored:
        ttft = p.load.prefill_s(n) + self.endpoint.split_overhead.value
        harm = p.load.num_streams * n / p.load.prefill_tokens_per_s
        exposure = (d.load.prefill_utilization() * m / d.load.decode_tokens_per_s
                    + d.load.queued_prefill_tokens / d.load.prefill_tokens_per_s)
        stall = harm + exposure
        score = ttft + self.stall_weight * stall + TIE_BREAK_S * d.load.num_streams
        decision = Decision(Path.DISAGGREGATED, Reason.DECODER_BUSY, prefill=p, decode=d, predicted_ttft_s=ttft)
        return Scored(decision, ttft, stall, score)


def _with_reason(scored: Scored, reason: Reason) -> Decision:
    d = scored.decision
    return Decision(d.path, reason, prefill=d.prefill, decode=d.decode, predicted_ttft_s=d.predicted_ttft_s)


def recommended_threshold(endpoint: EndpointLoad, decoders: Sequence[Worker], *, stall_weight: float,
                          max_model_len: int) -> int:
    """The static threshold these measurements favour: the prompt length from which a split's
    overhead costs less than the stall a prefill on a typical decoder inflicts on its streams
    (``overhead = stallWeight × streams × n / rate``). With no streams to protect, no prompt is
    worth splitting (``max_model_len``)."""
    streams = endpoint.streams_per_decoder.value
    if not decoders or streams < 0.05:
        return max_model_len
    rate = sum(w.load.prefill_tokens_per_s for w in decoders) / len(decoders)
    n = endpoint.split_overhead.value * rate / (stall_weight * streams)
    return max(0, min(max_model_len, round(n)))

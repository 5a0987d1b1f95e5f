"""The routing policy in force: which decider runs, its threshold, and what it reads.

Two policies (``pdSpec.routingPolicy``), switchable at runtime (``PUT /admin/policy``):

* ``threshold`` — ``decide.ThresholdDecider`` over the static split: prompts of at least
  ``routingThreshold`` tokens are disaggregated, the flow picks the workers.
* ``adaptive`` — ``adaptive.AdaptiveDecider``: every worker may run a whole request, a cost
  model measured online chooses the plan and its workers; ``routingThreshold`` is its floor.

Under either policy the router measures the same things (``load.py``) and reports the static
threshold those measurements favour (``recommended_threshold``), so a user tuning the threshold
by hand sees the measured answer. ``set_threshold`` is the one place the threshold and its
gauge change (admin API, the cluster router's config reload).
"""

from __future__ import annotations

import math
from typing import get_args

from dpd.config.model import AdaptiveSpec, PdSpec, PrefixAwareSpec, SloSpec
from dpd.router.adaptive import AdaptiveDecider, Candidates, Slo, recommended_threshold
from dpd.router.decide import Decision, Path, Reason, ThresholdDecider
from dpd.router.load import EndpointLoad, LoadPriors
from dpd.router.metrics import RouterMetrics
from dpd.router.pools import Pool, Worker
from dpd.router.prefix import PrefixChoice, PrefixIndex

POLICIES: tuple[str, ...] = get_args(PdSpec.model_fields["routingPolicy"].annotation)


def priors_from(spec: AdaptiveSpec) -> LoadPriors:
    return LoadPriors(prefill_tokens_per_s=spec.priorPrefillTokensPerS, decode_tokens_per_s=spec.priorDecodeTokensPerS,
                      split_overhead_s=spec.priorSplitOverheadS)


class RoutingPolicy:
    def __init__(self, policy: str, threshold_tokens: int, spec: AdaptiveSpec, metrics: RouterMetrics, *,
                 is_colocated: bool = False, max_model_len: int = 8192, prefill_timeout_s: float = math.inf,
                 decode_first_token_timeout_s: float = math.inf, prefix_index: PrefixIndex | None = None,
                 min_cached_tokens: int = 1, slo: SloSpec = SloSpec()):
        self._metrics = metrics
        self.prefix_index = prefix_index  # prefix-aware routing while ``prefix_active``
        self.prefix_active = prefix_index is not None
        self.min_cached_tokens = min_cached_tokens
        self.is_colocated = is_colocated
        self.spec = spec
        self.max_model_len = max_model_len
        self.endpoint = EndpointLoad(priors_from(spec))
        self.threshold = ThresholdDecider(threshold_tokens, is_colocated=is_colocated)
        self.adaptive = AdaptiveDecider(threshold_tokens, self.endpoint, stall_weight=spec.stallWeight,
                                        is_colocated=is_colocated, slo=Slo(*spec.targets(slo)),
                                        # margins for the measured rates' error
                                        max_prefill_wait_s=0.8 * prefill_timeout_s,
                                        max_decode_wait_s=0.5 * decode_first_token_timeout_s,
                                        max_stall_s=spec.maxStallS)
        self.set_policy(policy)
        metrics.threshold.set(threshold_tokens)

    @property
    def policy(self) -> str:
        return self._policy

    def set_policy(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self._policy = policy

    @property
    def threshold_tokens(self) -> int:
        return self.threshold.threshold_tokens

    def set_threshold(self, threshold_tokens: int) -> None:
        self.threshold.set_threshold(threshold_tokens)  # validates
        self.adaptive.set_threshold(threshold_tokens)
        self._metrics.threshold.set(threshold_tokens)

    def decide(self, num_prompt_tokens: int, num_output_tokens: int | None, prefill: Pool, decode: Pool,
               tenant: str | None, prefix_hashes: list[bytes] | None = None) -> Decision:
        if decode.workers:  # the load a typical decoder carries, for the recommended threshold
            self.endpoint.streams_per_decoder.add(sum(w.load.num_streams for w in decode.workers) / len(decode.workers))
        hit = None
        if self._policy == "threshold" or self.is_colocated:
            # Placement by prefix, load counted: the static split's decoders, or a colocated endpoint's
            # workers (where the adaptive cost model, which only places, would send a session's next
            # turn to whichever worker prefilled least recently — the one without its prefix).
            hit = self._prefix_hit(num_prompt_tokens, prefill, decode, tenant, prefix_hashes)
            if hit is not None and (self.is_colocated or num_prompt_tokens - hit.cached_tokens < self.threshold_tokens):
                # Its uncached part is short: computed where the rest is cached, whatever the whole's length.
                return Decision(Path.DIRECT, Reason.PREFIX_HIT, decode=hit.worker, cached_tokens=hit.cached_tokens,
                                computed_tokens=num_prompt_tokens - hit.cached_tokens)
        if self._policy == "threshold":
            decision = self.threshold.decide(num_prompt_tokens, has_prefill_capacity=prefill.is_available(tenant))
            if hit is not None and hit.worker.pool == decode.name:  # the flow takes the decoder holding part of it
                return Decision(decision.path, decision.reason, decode=hit.worker, cached_tokens=hit.cached_tokens)
            return decision
        decoders = decode.available(tenant)
        others = prefill.available(tenant)
        prefillers = others if prefill.breaker is None or prefill.breaker.allows_request() else []
        # Prefix-aware: the cost model prices each worker's prefill at the tokens its cache lacks.
        cached = self._cached_tokens([*decoders, *others], num_prompt_tokens, prefix_hashes)
        plan = self.adaptive.plan(num_prompt_tokens, num_output_tokens, Candidates(prefillers, decoders, others), cached)
        if plan is None:  # no worker at all: the flow answers 503 naming the decode pool
            return self.threshold.decide(num_prompt_tokens, has_prefill_capacity=False)
        return plan

    def _cached_tokens(self, workers: list[Worker], num_prompt_tokens: int,
                       prefix_hashes: list[bytes] | None) -> dict[Worker, int]:
        """Per worker, the prompt's tokens the index says it holds (at least ``min_cached_tokens``),
        never the whole prompt (the last token is always computed, as vLLM does)."""
        if self.prefix_index is None or not self.prefix_active or not prefix_hashes:
            return {}
        out = {}
        for w in workers:
            cached = min(self.prefix_index.cached_tokens(w, prefix_hashes), num_prompt_tokens - 1)
            if cached >= min(self.min_cached_tokens, num_prompt_tokens):
                out[w] = cached
        return out

    def _prefix_hit(self, num_prompt_tokens: int, prefill: Pool, decode: Pool, tenant: str | None,
                    prefix_hashes: list[bytes] | None) -> PrefixChoice | None:
        """The worker that holds the most of the prompt, load counted, if it holds enough. Under
        the static split only decoders run whole requests; otherwise every worker may."""
        if self.prefix_index is None or not self.prefix_active or not prefix_hashes:
            return None
        candidates: list[Worker] = list(decode.available(tenant))
        if self._policy == "adaptive" and not self.is_colocated:
            candidates += prefill.available(tenant)
        hit = self.prefix_index.choose(candidates, prefix_hashes)
        if hit is None or hit.cached_tokens < min(self.min_cached_tokens, num_prompt_tokens):
            return None
        return hit

    def set_prefix_aware(self, active: bool, block_size: int = 16) -> None:
        """Prefix-aware routing on or off from now on (``PUT /admin/policy``); turned on, it starts
        from an empty index (what was routed while it was off is unknown)."""
        if active and (self.prefix_index is None or not self.prefix_active):
            old = self.prefix_index
            spec = PrefixAwareSpec()
            self.prefix_index = PrefixIndex(old.block_size if old else block_size,
                                            old.max_blocks if old else spec.maxBlocksPerWorker,
                                            old.load_weight_tokens if old else spec.loadWeightTokens)
        self.prefix_active = active

    def recommended_threshold(self, decode: Pool) -> int:
        return recommended_threshold(self.endpoint, decode.workers, stall_weight=self.spec.stallWeight,
                                     max_model_len=self.max_model_len)

    def state(self, decode: Pool) -> dict:
        return {
            "policy": self._policy,
            "prefix_aware": self.prefix_active,
            "prefix_index": self.prefix_index.kind if self.prefix_active and self.prefix_index else None,
            "threshold_tokens": self.threshold_tokens,
            "recommended_threshold_tokens": self.recommended_threshold(decode),
            "stall_weight": self.spec.stallWeight,
            "max_stall_s": self.spec.maxStallS,
            "slo": {"ttft_s": self.adaptive.slo.ttft_s, "tpot_s": self.adaptive.slo.tpot_s},
            "split_overhead_s": round(self.endpoint.split_overhead.value, 4),
            "split_overhead_samples": self.endpoint.split_overhead.num_samples,
            "mean_output_tokens": round(self.endpoint.output_tokens.value, 1),
            "streams_per_decoder": round(self.endpoint.streams_per_decoder.value, 3),
            # measured − predicted TTFT of the adaptive policy's recent plans, by path
            "ttft_errors": {path: {"samples": errors.num_samples, "p50_s": _rounded(errors.quantile(0.5)),
                                   "p90_s": _rounded(errors.quantile(0.9))}
                            for path, errors in self.endpoint.ttft_errors.items()},
        }


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)

"""The decider: does a request take the disaggregated path or go straight to a decoder?

A prompt of at least ``threshold_tokens`` tokens is disaggregated: its prefill runs on the
prefill pool and the decoder pulls the KV. Shorter prompts go direct, since moving their KV
costs more than it saves. The decision also falls back to direct when no prefill worker can
take the request (none healthy, or the endpoint runs colocated), so a degraded prefill pool
never loses a request. The threshold can change at runtime (``set_threshold``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Path(str, Enum):
    DISAGGREGATED = "disaggregated"
    DIRECT = "direct"


class Reason(str, Enum):
    ABOVE_THRESHOLD = "above_threshold"
    BELOW_THRESHOLD = "below_threshold"
    PREFILL_UNAVAILABLE = "prefill_unavailable"
    COLOCATED = "colocated"


@dataclass(frozen=True)
class Decision:
    path: Path
    reason: Reason


class ThresholdDecider:
    def __init__(self, threshold_tokens: int, *, is_colocated: bool = False):
        self.set_threshold(threshold_tokens)
        self.is_colocated = is_colocated

    @property
    def threshold_tokens(self) -> int:
        return self._threshold_tokens

    def set_threshold(self, threshold_tokens: int) -> None:
        if isinstance(threshold_tokens, bool) or not isinstance(threshold_tokens, int) or threshold_tokens < 0:
            raise ValueError(f"threshold must be an integer >= 0, got {threshold_tokens!r}")
        self._threshold_tokens = threshold_tokens

    def decide(self, num_prompt_tokens: int, *, has_prefill_capacity: bool) -> Decision:
        if self.is_colocated:
            return Decision(Path.DIRECT, Reason.COLOCATED)
        if num_prompt_tokens < self._threshold_tokens:
            return Decision(Path.DIRECT, Reason.BELOW_THRESHOLD)
        if not has_prefill_capacity:
            return Decision(Path.DIRECT, Reason.PREFILL_UNAVAILABLE)
        return Decision(Path.DISAGGREGATED, Reason.ABOVE_THRESHOLD)

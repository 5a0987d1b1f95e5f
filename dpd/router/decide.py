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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpd.router.pools import Worker


class Path(str, Enum):
    DISAGGREGATED = "disaggregated"
    DIRECT = "direct"
    FALLBACK = "fallback"  # planned disaggregated, served direct because a hop failed or stalled


class Reason(str, Enum):
    ABOVE_THRESHOLD = "above_threshold"
    BELOW_THRESHOLD = "below_threshold"
    PREFILL_UNAVAILABLE = "prefill_unavailable"
    COLOCATED = "colocated"
    # The adaptive policy's (adaptive.py): why this plan beat the others.
    SHORT_PROMPT = "short_prompt"  # below the floor (routingThreshold): never disaggregated
    DECODER_BUSY = "decoder_busy"  # prefilling where it decodes would stall its streams
    PREFILL_QUEUE_LONG = "prefill_queue_long"  # the prefill worker's queue makes the split slower
    SPLIT_NO_GAIN = "split_no_gain"  # a split would add its hop and protect no stream
    # Prefix-aware routing (prefix.py): a worker holds the prompt's prefix; its uncached part is short.
    PREFIX_HIT = "prefix_hit"


@dataclass(frozen=True)
class Decision:
    """A path, and for the adaptive policy the workers chosen (else the flow picks them).

    ``prefill`` is set only on the disaggregated path; ``decode`` is the worker that generates
    (on the direct path, the one that runs the whole request, from either pool)."""

    path: Path
    reason: Reason
    prefill: Worker | None = None
    decode: Worker | None = None
    predicted_ttft_s: float | None = None
    cached_tokens: int | None = None  # of the prompt on ``decode``, as the prefix index believes (prefix-aware routing)
    # The tokens the planned prefilling worker computes (the rest is in its prefix cache): what
    # its queue and its measured rate count, so a prompt served from cache is no absurdly fast sample.
    computed_tokens: int | None = None

    # The dataclass's own __init__, written out: the simulator's compiled build
    # (``dpd.sim.compiled``) runs this one natively (~0.1 µs), where the generated one of a frozen
    # dataclass stays interpreted Python (~0.9 µs), once per request. Keep it to the fields above.
    def __init__(self, path: Path, reason: Reason, prefill: Worker | None = None, decode: Worker | None = None,
                 predicted_ttft_s: float | None = None, cached_tokens: int | None = None,
                 computed_tokens: int | None = None):
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "prefill", prefill)
        object.__setattr__(self, "decode", decode)
        object.__setattr__(self, "predicted_ttft_s", predicted_ttft_s)
        object.__setattr__(self, "cached_tokens", cached_tokens)
        object.__setattr__(self, "computed_tokens", computed_tokens)

    def prefill_tokens(self, worker: Worker, num_prompt_tokens: int) -> int:
        """The tokens ``worker`` computes to prefill this request: the plan's count on the worker
        it planned for the prefill, else the whole prompt (no cache known there)."""
        planned = self.prefill if self.path is Path.DISAGGREGATED else self.decode
        return self.computed_tokens if self.computed_tokens is not None and worker is planned else num_prompt_tokens

    @property
    def workers_label(self) -> str:
        """``prefill-0>decode-0`` for a split, ``decode-0`` for a whole request, ``""`` if unpicked."""
        names = [w.name for w in (self.prefill, self.decode) if w is not None]
        return ">".join(names)


MAX_THRESHOLD_TOKENS = 10**9  # far past any context length ("never split"), and a float a gauge can hold


def checked_threshold(threshold_tokens: object) -> int:
    """A threshold (or floor) in tokens, validated: an integer within [0, 10⁹] (a bool is not one)."""
    if (isinstance(threshold_tokens, bool) or not isinstance(threshold_tokens, int)
            or not 0 <= threshold_tokens <= MAX_THRESHOLD_TOKENS):
        shown = repr(threshold_tokens) if len(repr(threshold_tokens)) <= 40 else repr(threshold_tokens)[:40] + "…"
        raise ValueError(f"threshold must be an integer from 0 to {MAX_THRESHOLD_TOKENS}, got {shown}")
    return threshold_tokens


class ThresholdDecider:
    def __init__(self, threshold_tokens: int, *, is_colocated: bool = False):
        self.set_threshold(threshold_tokens)
        self.is_colocated = is_colocated

    @property
    def threshold_tokens(self) -> int:
        return self._threshold_tokens

    def set_threshold(self, threshold_tokens: int) -> None:
        self._threshold_tokens = checked_threshold(threshold_tokens)

    def decide(self, num_prompt_tokens: int, *, has_prefill_capacity: bool) -> Decision:
        if self.is_colocated:
            return Decision(Path.DIRECT, Reason.COLOCATED)
        if num_prompt_tokens < self._threshold_tokens:
            return Decision(Path.DIRECT, Reason.BELOW_THRESHOLD)
        if not has_prefill_capacity:
            return Decision(Path.DIRECT, Reason.PREFILL_UNAVAILABLE)
        return Decision(Path.DISAGGREGATED, Reason.ABOVE_THRESHOLD)

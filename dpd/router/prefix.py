"""Where prompt prefixes live: an index of KV block hashes per worker, and the choice it informs.

A prompt's KV is cached by vLLM in blocks of ``block_size`` tokens, each named by a hash
chained over every block before it, so two prompts share cached blocks exactly as far as they
share whole leading blocks. ``block_hashes`` computes those names the way vLLM 0.32 does with
its default ``sha256`` algorithm (``vllm.v1.core.kv_cache_utils.hash_block_tokens``: SHA-256 of
the pickled ``(parent hash, block token ids, extra keys)``, the first parent derived from the
seed ``"vllm-none-hash"``, the request's ``cache_salt`` an extra key of the first block only), so
the index can take vLLM's own names; a unit test checks them against vLLM's function.

Which index is in use: ``approximate`` — the router records, for each request it routes, the
prompt's blocks on the workers that computed or received them (the decoder, and the prefiller of
a split), and forgets a worker's least recently used blocks past ``max_blocks`` (vLLM evicts
least recently used blocks as its cache fills). It is what the router routed, not what the engine
holds: a worker that evicted sooner, restarted, or runs without prefix caching is over-estimated.
An engine-fed index (vLLM's KV-cache events) is the next step (docs/design.md).

``PrefixIndex.choose`` scores each candidate by cached tokens minus ``load_weight_tokens`` per
request it already has in flight — a worker holding most of a prompt but with a queue may lose
— and returns the best worker with a hit, or None. Memory is bounded: ``max_blocks`` hashes per
worker (32 bytes each).
"""

from __future__ import annotations

import collections
import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass

from dpd.router.pools import Worker

VLLM_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's fixed seed for cryptographic hash algorithms


def _sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


NONE_HASH = _sha256(VLLM_NONE_HASH_SEED)


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """The chained hash of every full block of ``token_ids`` (a partial last block is not cached)."""
    hashes: list[bytes] = []
    parent = NONE_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        parent = _sha256((parent, tuple(token_ids[start:start + block_size]), extra))
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class PrefixChoice:
    worker: Worker
    cached_tokens: int  # of the prompt, as the index believes the worker holds them


class PrefixIndex:
    kind = "approximate"

    def __init__(self, block_size: int, max_blocks: int, load_weight_tokens: float):
        if block_size < 1 or max_blocks < 1 or load_weight_tokens < 0:
            raise ValueError("block_size >= 1, max_blocks >= 1 and load_weight_tokens >= 0 are required")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.load_weight_tokens = load_weight_tokens
        self._blocks: dict[str, collections.OrderedDict[bytes, None]] = {}  # worker url -> LRU of hashes

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        return block_hashes(token_ids, self.block_size, cache_salt)

    def record(self, worker: Worker, hashes: Sequence[bytes]) -> None:
        """``worker`` now holds these blocks (most recently used); the least recent past ``max_blocks`` go."""
        blocks = self._blocks.setdefault(worker.url, collections.OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def cached_tokens(self, worker: Worker, hashes: Sequence[bytes]) -> int:
        """Tokens of the prompt's leading blocks ``worker`` holds (a chain: the first miss ends it)."""
        blocks = self._blocks.get(worker.url)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n * self.block_size

    def choose(self, candidates: Sequence[Worker], hashes: Sequence[bytes]) -> PrefixChoice | None:
        """The candidate with the best score (cached tokens − load), if it holds any of the prompt."""
        best: tuple[float, int, PrefixChoice] | None = None
        for worker in candidates:
            cached = self.cached_tokens(worker, hashes)
            score = cached - self.load_weight_tokens * worker.num_in_flight
            key = (score, -worker.num_in_flight)
            if best is None or key > best[:2]:
                best = (score, -worker.num_in_flight, PrefixChoice(worker, cached))
        if best is None or best[2].cached_tokens == 0:
            return None
        return best[2]

    def forget(self, known_urls: set[str]) -> None:
        """Drop the blocks of workers that are gone."""
        for url in list(self._blocks):
            if url not in known_urls:
                del self._blocks[url]

    def num_blocks(self, worker: Worker) -> int:
        return len(self._blocks.get(worker.url, ()))

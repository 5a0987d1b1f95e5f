"""Where prompt prefixes live: an index of KV block hashes per worker, and the choice it informs.

A prompt's KV is cached by vLLM in blocks of ``block_size`` tokens, each named by a hash
chained over every block before it, so two prompts share cached blocks exactly as far as they
share whole leading blocks. ``block_hashes`` computes those names the way vLLM 0.32 does with
its default ``sha256`` algorithm (``vllm.v1.core.kv_cache_utils.hash_block_tokens``: SHA-256 of
the pickled ``(parent hash, block token ids, extra keys)``, the first parent derived from the
seed ``"vllm-none-hash"``, the request's ``cache_salt`` an extra key of the first block only), so
the index can take vLLM's own names; a unit test checks them against vLLM's function.

Two sources feed the index, per worker. **Approximate**: the router records, for each request
it routes, the prompt's blocks on the workers that computed or received them (the decoder, and
the prefiller of a split), and forgets a worker's least recently used blocks past ``max_blocks``
(vLLM evicts least recently used blocks as its cache fills) — what the router routed, not what
the engine holds. **Events**: the workers publish vLLM's KV-cache events (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``; kvevents.py subscribes), which add and remove blocks as
the engine itself does — evictions, restarts, and requests the router did not route included.
A worker counts as ``events`` once its first batch arrived; the router still records what it
routes there (the engine publishes a block only once its prefill step ended, and the next turn
of a session may come sooner). ``kind`` says which source the index runs on. Blocks are keyed
by the low 64 bits of their hash, as vLLM publishes them (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).

``PrefixIndex.choose`` scores each candidate by cached tokens minus ``load_weight_tokens`` per
request it already has in flight — a worker holding most of a prompt but with a queue may lose
— and returns the best worker with a hit, or None. Memory is bounded: ``max_blocks`` hashes per
worker.
"""

from __future__ import annotations

import collections
import hashlib
import pickle
from collections.abc import Iterable, Sequence
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


def block_key(block_hash: bytes | int) -> int:
    """A block's key in the index: the low 64 bits of its hash, the form vLLM's events carry."""
    if isinstance(block_hash, int):
        return block_hash & MASK_64
    return int.from_bytes(block_hash[-8:], "big")


MASK_64 = (1 << 64) - 1


class PrefixIndex:
    def __init__(self, block_size: int, max_blocks: int, load_weight_tokens: float):
        if block_size < 1 or max_blocks < 1 or load_weight_tokens < 0:
            raise ValueError("block_size >= 1, max_blocks >= 1 and load_weight_tokens >= 0 are required")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.load_weight_tokens = load_weight_tokens
        self._blocks: dict[str, collections.OrderedDict[int, None]] = {}  # worker url -> LRU of block keys
        self._live: set[str] = set()  # workers whose engine events feed the index

    @property
    def kind(self) -> str:
        """``events`` (every known worker's engine feeds it), ``approximate`` (none), or ``mixed``."""
        if not self._live:
            return "approximate"
        return "events" if self._live >= set(self._blocks) else "mixed"

    def source(self, url: str) -> str:
        return "events" if url in self._live else "approximate"

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        return block_hashes(token_ids, self.block_size, cache_salt)

    def record(self, worker: Worker, hashes: Sequence[bytes]) -> None:
        """``worker`` now holds these blocks (most recently used); the least recent past ``max_blocks`` go."""
        self._store(worker.url, (block_key(h) for h in hashes))

    def _store(self, url: str, keys: Iterable[int]) -> None:
        blocks = self._blocks.setdefault(url, collections.OrderedDict())
        for key in keys:
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    # -- the engine's events (kvevents.py) ---------------------------------------------------------
    def stored(self, url: str, block_hashes: Iterable[bytes | int]) -> None:
        self._live.add(url)
        self._store(url, (block_key(h) for h in block_hashes))

    def removed(self, url: str, block_hashes: Iterable[bytes | int]) -> None:
        self._live.add(url)
        blocks = self._blocks.get(url)
        if blocks:
            for h in block_hashes:
                blocks.pop(block_key(h), None)

    def cleared(self, url: str) -> None:
        """The engine dropped every block (``AllBlocksCleared``, or it restarted)."""
        self._live.add(url)
        self._blocks.pop(url, None)

    def cached_tokens(self, worker: Worker, hashes: Sequence[bytes]) -> int:
        """Tokens of the prompt's leading blocks ``worker`` holds (a chain: the first miss ends it)."""
        blocks = self._blocks.get(worker.url)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if block_key(h) not in blocks:
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
        self._live &= known_urls

    def num_blocks(self, worker: Worker) -> int:
        return len(self._blocks.get(worker.url, ()))

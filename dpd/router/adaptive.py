"""The adaptive policy: every worker may take either phase; a cost model measured online decides.

For a request of ``n`` prompt tokens expecting ``m`` output tokens, every plan is predicted:

* **whole on w** (any worker of either pool runs prefill and decode):
  ``ttft = (queued prefill tokens on w + n) / w's prefill rate``;
* **split p → d** (a prefill-pool worker prefills, a decode-pool worker pulls the KV and decodes):
  ``ttft = (queued on p + n) / p's rate + the split's measured overhead`` (the decode hop's
  first-token latency: KV pull, one step, one more HTTP hop).

Each plan also stalls decoding, in seconds:

* **harm** — the streams decoding on the worker that prefills each stall for ``n / rate``
  (vLLM runs a prefill chunk and the running streams' next tokens in one step);
* **exposure** — what the new stream itself will suffer where it decodes: the prefills already
  queued there (for a split; a whole request's queue runs before its first token) plus the
  prefills to come, predicted from the share ``u`` of recent time that worker spent
  prefilling: a stream that needs ``D = m / decode rate`` seconds of decoding is stretched by
  ``D × u / (1 − u)``.

The plan is scored by the SLO (``ttftSloS``, ``tpotSloS``) first: each **miss** it would cause
counts — its own TTFT past the target (a chance: the share of that kind of plan's recent
prediction errors, ``EndpointLoad.ttft_errors``, that would carry the prediction past it), its
own TPOT past the target (exposure beyond its slack),
and every stream on the prefilling worker whose remaining TPOT slack
(``WorkerLoad.stream_slacks_s``) the prefill would use up — then by **risk**, the share of each
budget it spends (its TTFT of the target, its exposure of its slack, ``stallWeight`` × each other
stream's stall of its slack): ``score = MISS_COST × misses + risk``. So below saturation,
where no plan misses, the plan that leaves every budget the most room wins; near and past it,
the plan that loses the fewest requests. Rules see past one request: when
the prefill pool is overloaded (its best split is late, or no split can meet the hops'
deadlines) a decoder takes a large prompt whole only if it can start it at once, so no queue
builds in front of the short requests it serves (and in front of later splits' decode hops);
a large request late on every plan goes where it costs the others least — usually the prefill
pool's queue, as a static split would; a small one late everywhere is served soonest. The lowest score wins
(ties: fewer streams, then the preferred role — decode-pool workers for whole requests).
Prompts below the floor (``routingThreshold``) are never split, only placed. The reason names
what decided (``decide.Reason``). The policy splits only in the preferred direction (prefill
pool → decode pool): the KV flows producer → consumer as vLLM's roles say, so the design keeps
working if vLLM drops ``kv_both`` (docs/design.md); a worker of either role runs whole requests.

Every input is read through ``Worker.load`` and ``EndpointLoad`` — the interface the simulator
(``dpd/sim``) also provides.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, ClassVar

from dpd.router.decide import Decision, Path, Reason, checked_threshold
from dpd.router.load import EndpointLoad, WorkerLoad, share_above
from dpd.router.pools import Worker

TTFT_WEIGHT = 0.1
TIE_BREAK = 1e-3  # per stream: equal plans go to the less crowded worker
MAX_CANDIDATES = 8  # workers scored per role in one decision (the least loaded; _shortlist)
MISS_COST = 4.0  # one predicted SLO miss outweighs any risk short of one (a risk term is at most 1 per budget)
SMALL_PREFILL = 0.1  # share of the TTFT target: a prefill this short may queue on a decoder in overload
MAX_UTILIZATION = 0.9  # the exposure model's cap: a worker always prefilling would stretch a stream forever


@dataclass(frozen=True)
class Candidates:
    """Workers a request may use now (healthy, not draining, the tenant's own)."""

    prefillers: Sequence[Worker]  # the prefill side of a split; empty when the prefill pool is unavailable
    decoders: Sequence[Worker]  # the decode pool
    others: Sequence[Worker] = ()  # workers that may also run whole requests (the prefill pool)
    # The shortlist's keys kept as loads change, for pools whose members never change (the
    # simulator's): each sequence above must then be one of its pools, or no longer than the
    # decider's ``max_candidates`` (else ValueError).
    index: ShortlistIndex | None = None


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 10.0
    tpot_s: float = 0.2


class Scored:
    """One plan, scored: for every plan of every decision, and never changed.

    A plain class, not a dataclass: with its explicit ``__init__`` the simulator's compiled build
    (``dpd.sim.compiled``) constructs it natively, where a dataclass's generated ``__init__``
    stays interpreted Python (a decision scores several plans). The same for the two below.
    The plan: a Decision is made only for the one chosen (``_with_reason``), not for each of
    the P × D plans scored."""

    # its fields, for repr (a class compiled with mypyc has no __slots__ attribute: mypyc drops it)
    FIELDS: ClassVar[tuple[str, ...]] = ("path", "decode", "prefill", "computed_tokens", "cached_tokens", "ttft_s",
                                         "misses", "score", "harm_misses", "harm_s", "decode_wait_s")
    __slots__ = FIELDS

    def __init__(self, path: Path, decode: Worker, prefill: Worker | None, computed_tokens: int,
                 cached_tokens: int | None, ttft_s: float, misses: float, score: float, harm_misses: float = 0,
                 harm_s: float = 0.0, decode_wait_s: float = 0.0):
        self.path = path
        self.decode = decode
        self.prefill = prefill
        self.computed_tokens = computed_tokens
        self.cached_tokens = cached_tokens
        self.ttft_s = ttft_s
        self.misses = misses  # SLO misses predicted (expected): its own TTFT and TPOT, the streams its prefill pushes past theirs
        self.score = score
        self.harm_misses = harm_misses  # of ``misses``, the other streams'
        self.harm_s = harm_s  # the stall the prefill inflicts on the other streams, summed
        self.decode_wait_s = decode_wait_s  # a split's decode hop: the decoder's queued prefills it waits for

    def __repr__(self) -> str:
        return f"Scored({', '.join(f'{name}={getattr(self, name)!r}' for name in Scored.FIELDS)})"


class _Prefilling:
    """What a plan's prefill on one worker costs, wherever it decodes (``_prefilling``)."""

    __slots__ = ("ttft_miss", "ttft_risk", "pushed", "harm_risk", "harm_s")

    def __init__(self, ttft_miss: float, ttft_risk: float, pushed: int, harm_risk: float, harm_s: float):
        self.ttft_miss = ttft_miss  # the chance its TTFT misses the target
        self.ttft_risk = ttft_risk  # the share of the TTFT target it uses, weighted
        self.pushed = pushed  # streams on the prefilling worker pushed past their TPOT
        self.harm_risk = harm_risk  # the share of the other streams' slack it uses up, summed
        self.harm_s = harm_s  # the stall it inflicts on them, summed


class _Decoding:
    """What a plan's new stream on one worker starts from, whatever stall it is exposed to."""

    __slots__ = ("worker", "rate", "slack", "tie_break")

    def __init__(self, worker: Worker, rate: float, slack: float, tie_break: float):
        self.worker = worker
        self.rate = rate  # the worker's decode rate, tokens/s
        self.slack = slack  # the stream's TPOT budget beyond decoding at that rate, seconds
        self.tie_break = tie_break  # equal plans go to the less crowded worker


class AdaptiveDecider:
    def __init__(self, floor_tokens: int, endpoint: EndpointLoad, *, stall_weight: float = 1.0,
                 is_colocated: bool = False, slo: Slo = Slo(), max_prefill_wait_s: float = math.inf,
                 max_decode_wait_s: float = math.inf, max_candidates: int = MAX_CANDIDATES,
                 max_stall_s: float | None = None):
        self.set_threshold(floor_tokens)
        # the longest pause a prefill may impose on a stream (pdSpec…maxStallS); None: no limit
        self.max_stall_s = math.inf if max_stall_s is None else max_stall_s
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be at least 1, not {max_candidates}")
        self.max_candidates = max_candidates
        self.endpoint = endpoint
        self.stall_weight = stall_weight
        self.is_colocated = is_colocated
        self.slo = slo
        self.max_prefill_wait_s = max_prefill_wait_s  # the prefill hop's deadline (router.prefillTimeoutS)
        self.max_decode_wait_s = max_decode_wait_s  # the decode hop's first-token deadline (decodeFirstTokenTimeoutS)
        # Per-worker figures of one decision, by worker (a Worker is hashed by identity).
        self._slacks: dict[Worker, tuple[list[float], list[float]]] = {}
        self._services: dict[Worker, list[float]] = {}
        self._decodings: dict[Worker, tuple[_Decoding, float, tuple[float, float]]] = {}
        self._decodings_m = 0  # the output tokens _decodings are for
        self._ttft_errors: dict[Path, list[float] | None] = {}

    @property
    def threshold_tokens(self) -> int:
        return self._floor_tokens

    def set_threshold(self, threshold_tokens: int) -> None:
        self._floor_tokens = checked_threshold(threshold_tokens)

    def plan(self, num_prompt_tokens: int, num_output_tokens: int | None, candidates: Candidates,
             cached: Mapping[Worker, int] | None = None) -> Decision | None:
        """The best plan, or None when no decoder at all can take the request. ``cached``: the
        prompt's tokens each worker's prefix cache holds (prefix-aware routing): a worker
        prefills only the rest, whole or as a split's prefiller. A whole plan chosen for its
        cache says so (``prefix_hit``)."""
        decision = self._plan(num_prompt_tokens, num_output_tokens, candidates, cached or _NOTHING_CACHED)
        if decision is not None and decision.path is Path.DIRECT and decision.cached_tokens:
            return replace(decision, reason=Reason.PREFIX_HIT)
        return decision

    def _plan(self, num_prompt_tokens: int, num_output_tokens: int | None, candidates: Candidates,
              cached: Mapping[Worker, int]) -> Decision | None:
        # Per-worker figures every plan through that worker reads (a pool of P prefillers and D
        # decoders has P × D splits): computed once per decision, the same values as uncached.
        self._slacks.clear()
        self._services.clear()
        self._decodings.clear()
        errors = self.endpoint.ttft_errors
        self._ttft_errors[Path.DIRECT] = errors["direct"].measured_errors()
        self._ttft_errors[Path.DISAGGREGATED] = errors["disaggregated"].measured_errors()
        candidates = self._shortlist(candidates, num_prompt_tokens, cached)
        n = num_prompt_tokens
        m = num_output_tokens if num_output_tokens is not None else round(self.endpoint.output_tokens.value)
        wholes = [self._whole(w, n, m, cached.get(w, 0)) for w in (*candidates.decoders, *candidates.others)]
        if not wholes:
            return None
        best_whole = _least_score(wholes)  # the first of equal scores: decode-pool workers win ties
        if self.is_colocated:
            return _with_reason(best_whole, Reason.COLOCATED)
        if n < self._floor_tokens:
            return _with_reason(best_whole, Reason.SHORT_PROMPT)
        # A split whose prefill would wait past the prefill hop's deadline, or whose decode hop
        # would wait for the decoder's own queued prefills past its first-token deadline, would
        # time out, fall back and count against the breakers (a flapping prefill-pool breaker
        # then takes every split away): not a plan.
        if not any(p is not d for p in candidates.prefillers for d in candidates.decoders):
            return _with_reason(best_whole, Reason.PREFILL_UNAVAILABLE)
        # The best split, and each prefiller's first: what the rules below read of the P × D splits
        # (a prefiller's splits share their TTFT and the harm they do, so its first stands for all).
        best_split, splits = self._splits(candidates, n, m, cached)
        if best_split is None:
            # No split is possible because the prefill pool, or the decoder's own prefills, are
            # backed up: a large prompt then queues whole where it does not lengthen a decoder's
            # queue (which is what blocks the splits, and what the short requests wait behind).
            wholes = [s for s in wholes if self._may_queue_whole(s, n, candidates)] or wholes
            return _with_reason(_least_score(wholes), Reason.PREFILL_QUEUE_LONG)
        if best_split.ttft_s > self.slo.ttft_s:
            # The prefill pool is overloaded: a decoder takes a large prompt whole only if it
            # can start it at once; queued behind other prefills it would build a queue in
            # front of the short requests the decode pool serves. A small one (its prefill
            # within SMALL_PREFILL of the TTFT target) may queue.
            wholes = [s for s in wholes if self._may_queue_whole(s, n, candidates)] or wholes
            best_whole = _least_score(wholes)
        if all(s.ttft_s > self.slo.ttft_s for s in (*wholes, *splits)):
            if self._is_small(best_whole, n):
                # A small prompt late everywhere is served soonest: its prefill harms no one, and
                # the prefill pool's queue (late by assumption) would make it later still.
                return _with_reason(min(wholes, key=lambda s: (s.ttft_s, s.score)), Reason.PREFILL_QUEUE_LONG)
            # Late on every plan: served where it costs the others least (streams pushed past
            # their TPOT, then seconds of stall), the split on a tie, where it holds up no stream.
            least = min((*splits, *wholes), key=lambda s: (s.harm_misses, round(s.harm_s, 3)))
            if least.path is Path.DISAGGREGATED:
                return _with_reason(least, Reason.DECODER_BUSY)
            return _with_reason(least, Reason.PREFILL_QUEUE_LONG)
        if best_split.score < best_whole.score:
            return _with_reason(best_split, Reason.DECODER_BUSY)
        assert best_split.prefill is not None
        if best_split.prefill.load.prefill_s(n) > best_whole.ttft_s + 1e-9:
            return _with_reason(best_whole, Reason.PREFILL_QUEUE_LONG)
        return _with_reason(best_whole, Reason.SPLIT_NO_GAIN)

    def _shortlist(self, candidates: Candidates, n: int, cached: Mapping[Worker, int]) -> Candidates:
        """At most ``max_candidates`` workers per role, so a decision costs the same in a pool of
        8 and of 800 (every pair of a P × D pool would be scored otherwise): those holding most
        of the prompt in cache, then the least loaded — prefillers by their queue's wait,
        decoders by queued prefill tokens, then streams. Pools within the limit are unchanged."""
        k = self.max_candidates
        if len(candidates.prefillers) <= k and len(candidates.decoders) <= k and len(candidates.others) <= k:
            return candidates  # every pool within the limit: nothing to leave out
        index = candidates.index
        if index is not None and not cached:
            return Candidates(index.least_prefill_s(candidates.prefillers, n, k), index.least_loaded(candidates.decoders, k),
                              index.least_loaded(candidates.others, k))
        held = cached.get

        # One pass of attribute reads (a pool of hundreds is read on every decision); with nothing
        # cached anywhere the cache term is left out of the keys (0 for all: the same order).
        def prefiller_keys(workers: Sequence[Worker]) -> list[Any]:
            if not cached:  # w.load.prefill_s(n), inlined
                return [((load := w.load).queued_prefill_tokens + n) / load.prefill_tokens_per_s for w in workers]
            return [(-held(w, 0), w.load.prefill_s(n)) for w in workers]

        def decoder_keys(workers: Sequence[Worker]) -> list[Any]:
            if not cached:
                return [(w.load.queued_prefill_tokens, len(w.load.streams)) for w in workers]
            return [(-held(w, 0), w.load.queued_prefill_tokens, len(w.load.streams)) for w in workers]

        def keep(workers: Sequence[Worker], keys: Callable[[Sequence[Worker]], list[Any]]) -> Sequence[Worker]:
            return workers if len(workers) <= k else _k_smallest(workers, keys(workers), k)

        return Candidates(keep(candidates.prefillers, prefiller_keys), keep(candidates.decoders, decoder_keys),
                          keep(candidates.others, decoder_keys))

    def _is_small(self, scored: Scored, n: int) -> bool:
        """A prompt whose prefill takes at most SMALL_PREFILL of the TTFT target where it would run whole."""
        w = scored.decode
        return n / w.load.prefill_tokens_per_s <= SMALL_PREFILL * self.slo.ttft_s

    def _may_queue_whole(self, scored: Scored, n: int, candidates: Candidates) -> bool:
        w = scored.decode
        if w not in candidates.decoders or w.load.queued_prefill_tokens == 0:
            return True
        return n / w.load.prefill_tokens_per_s <= SMALL_PREFILL * self.slo.ttft_s

    def _whole(self, w: Worker, n: int, m: int, cached: int = 0) -> Scored:
        load = w.load
        ttft = load.prefill_s(n - cached)
        prefill_s = (n - cached) / load.prefill_tokens_per_s
        prefilling = self._prefilling(Path.DIRECT, ttft, prefill_s, w)
        decoding, _, at_rest = self._decoding(w, m)
        return self._scored(Path.DIRECT, None, decoding, n - cached, cached or None, ttft, prefilling, at_rest)

    def _splits(self, candidates: Candidates, n: int, m: int,
                cached: Mapping[Worker, int]) -> tuple[Scored | None, list[Scored]]:
        """Of every split p → d but those whose prefill would wait past the prefill hop's deadline
        or whose decode hop would wait past its first-token deadline: the best (the first of equal
        scores, p-major, as ``min`` over a list of pairs), and each prefiller's first. What depends
        on one worker alone is computed once per worker, not once per pair (and a decoder's cost to
        the new stream, once per decoder while nothing queued there outlasts the split's prefill);
        a pair is scored in place, and a ``Scored`` built only for those returned."""
        overhead = self.endpoint.split_overhead.value
        decoders = [(d, d.load.queued_prefill_tokens / d.load.prefill_tokens_per_s, *self._decoding(d, m))
                    for d in candidates.decoders]
        max_decode_wait_s = self.max_decode_wait_s
        firsts: list[Scored] = []
        best: tuple[float, Worker, int, float, _Prefilling, _Decoding, tuple[float, float], float] | None = None
        for p in candidates.prefillers:
            computed = n - cached.get(p, 0)  # what p does not hold
            queue_s = p.load.prefill_s(computed)  # read once per prefiller: the pairs share it
            if not queue_s <= self.max_prefill_wait_s:
                continue
            ttft = queue_s + overhead
            prefilling = self._prefilling(Path.DISAGGREGATED, ttft, computed / p.load.prefill_tokens_per_s, p)
            is_first = True
            for d, decoder_queue_s, decoding, future_stall_s, at_rest in decoders:
                if d is p:
                    continue
                # The decoder's queued prefills stall the stream only as far as they outlast the
                # split's own prefill and KV pull.
                queued_after_s = max(0.0, decoder_queue_s - ttft)
                if not queued_after_s <= max_decode_wait_s:
                    continue
                own_stream = at_rest if queued_after_s == 0.0 else self._own_stream(decoding, future_stall_s + queued_after_s, m)
                score = self._score(prefilling, own_stream, decoding.tie_break)[1]
                if is_first:
                    is_first = False
                    firsts.append(self._scored(Path.DISAGGREGATED, p, decoding, computed, None, ttft, prefilling, own_stream,
                                               decode_wait_s=queued_after_s))
                if best is None or score < best[0]:
                    best = (score, p, computed, ttft, prefilling, decoding, own_stream, queued_after_s)
        if best is None:
            return None, firsts
        _, p, computed, ttft, prefilling, decoding, own_stream, queued_after_s = best
        return self._scored(Path.DISAGGREGATED, p, decoding, computed, None, ttft, prefilling, own_stream,
                            decode_wait_s=queued_after_s), firsts

    def _prefilling(self, path: Path, ttft: float, prefill_s: float, prefiller: Worker) -> _Prefilling:
        """The part of a plan's score that depends on where it prefills, not where it decodes."""
        # The TTFT miss is a chance: the share of this kind of plan's recent prediction errors
        # that would carry it past the target (exactly 0 or 1 until enough were measured).
        ttft_miss = share_above(self._ttft_errors.get(path), self.slo.ttft_s - ttft)
        slacks, inverse_sums = self._sorted_slacks(prefiller)
        # The streams whose slack the prefill exceeds are pushed past their TPOT; each other one
        # (with slack left) loses prefill_s / slack of it: in O(log streams) from the sorted slacks.
        pushed = bisect.bisect_left(slacks, prefill_s)
        if prefill_s > self.max_stall_s:
            pushed = len(slacks)  # every stream there pauses longer than the operator allows: a miss each
        harm_risk = prefill_s * inverse_sums[pushed if prefill_s > 0 else bisect.bisect_right(slacks, 0.0)]
        return _Prefilling(ttft_miss, TTFT_WEIGHT * min(1.0, ttft / self.slo.ttft_s), pushed, harm_risk,
                           prefill_s * len(slacks))

    def _decoding(self, d: Worker, m: int) -> tuple[_Decoding, float, tuple[float, float]]:
        """A new stream on ``d``: where it starts from, the stall it can expect from prefills to
        come there, and its cost with that stall alone (``_own_stream``); once per decision."""
        if m != self._decodings_m:  # one m a decision: a caller asking for another starts afresh
            self._decodings.clear()
            self._decodings_m = m
        found = self._decodings.get(d)
        if found is None:
            rate = d.load.decode_tokens_per_s
            decoding = _Decoding(d, rate, (self.slo.tpot_s - 1 / rate) * max(m - 1, 0), TIE_BREAK * len(d.load.streams))
            future_stall_s = self._future_stall_s(d, m)
            found = self._decodings[d] = (decoding, future_stall_s, self._own_stream(decoding, future_stall_s, m))
        return found

    def _own_stream(self, decoding: _Decoding, exposure: float, m: int) -> tuple[float, float]:
        """The new stream's chance of missing its TPOT target, exposed to ``exposure`` seconds of
        stall where it decodes, and the share of its slack that stall uses."""
        slack = decoding.slack
        return (self._tpot_miss(exposure, slack, decoding.worker, m, decoding.rate),
                min(1.0, exposure / slack) if slack > 0 else 1.0)

    def _scored(self, path: Path, p: Worker | None, decoding: _Decoding, computed: int, cached: int | None, ttft: float,
                prefilling: _Prefilling, own_stream: tuple[float, float], decode_wait_s: float = 0.0) -> Scored:
        misses, score = self._score(prefilling, own_stream, decoding.tie_break)
        return Scored(path, decoding.worker, p, computed, cached, ttft, misses, score, prefilling.pushed, prefilling.harm_s,
                      decode_wait_s)

    def _score(self, prefilling: _Prefilling, own_stream: tuple[float, float], tie_break: float) -> tuple[float, float]:
        """A plan's (misses, score). Misses first, then risk: the share of each SLO budget the plan
        uses up (its own TTFT and TPOT slack, and each running stream's TPOT slack on the worker
        that prefills)."""
        tpot_miss, exposure_risk = own_stream
        misses = prefilling.ttft_miss + tpot_miss + prefilling.pushed
        return misses, (MISS_COST * misses + (prefilling.ttft_risk + exposure_risk)
                        + self.stall_weight * prefilling.harm_risk + tie_break)

    def _sorted_slacks(self, w: Worker) -> tuple[list[float], list[float]]:
        """The stream slacks on ``w``, sorted, and for each position the sum of 1 / slack from
        there on (positive slacks only); once per decision."""
        found = self._slacks.get(w)
        if found is None:
            slacks = sorted(w.load.stream_slacks_s(self.slo.tpot_s))
            inverse_sums = [0.0] * (len(slacks) + 1)
            for i in range(len(slacks) - 1, -1, -1):
                inverse_sums[i] = inverse_sums[i + 1] + (1 / slacks[i] if slacks[i] > 0 else 0.0)
            found = self._slacks[w] = (slacks, inverse_sums)
        return found

    def _tpot_miss(self, exposure: float, slack: float, d: Worker, m: int, decode_rate: float) -> float:
        """The chance the new stream misses its TPOT target on ``d``: certain when the stall
        already predicted exceeds its slack; else the chance that, while it decodes, ``d`` runs
        at least one prefill longer than its slack, or than the stall limit where one is set (at
        the rate such prefills ran there lately)."""
        if m <= 1:
            return 0.0
        if exposure > slack:
            return 1.0
        decode_s = (m - 1) / decode_rate
        services = self._services.get(d)
        if services is None:
            services = self._services[d] = d.load.recent_services_s()
        limit = min(slack - exposure, self.max_stall_s)
        return 1.0 - math.exp(-d.load.stalls_longer_than_per_s(limit, services) * decode_s)

    def _future_stall_s(self, w: Worker, m: int) -> float:
        """The stall a new stream of ``m`` tokens can expect from prefills to come on ``w``."""
        u = min(w.load.prefill_utilization(), MAX_UTILIZATION)
        return (m / w.load.decode_tokens_per_s) * u / (1 - u)


class ShortlistIndex:
    """``_shortlist``'s keys for pools whose members never change — the simulator's, where a
    thousand workers' loads would otherwise be read on every decision: each worker's ``WorkerLoad``
    marks itself changed (``WorkerLoad.watch``) and a decision re-reads only the workers changed
    since the last. The workers it selects are exactly those of the pass over the pools (the same
    keys, of equal keys the earlier worker). The live router does not use it: its candidates are
    filtered per request (health, draining, tenants), so it reads them."""

    def __init__(self, *pools: Sequence[Worker]):
        self._pools = {id(workers): _PoolKeys(workers) for workers in pools}

    def _keys(self, workers: Sequence[Worker]) -> _PoolKeys:
        keys = self._pools.get(id(workers))
        if keys is None or keys.workers is not workers or len(workers) != len(keys.position):
            raise ValueError("candidates not among the index's pools, or a pool changed (ShortlistIndex needs the pools' "
                             "own sequences, unchanged)")
        return keys

    def least_prefill_s(self, workers: Sequence[Worker], n: int, k: int) -> Sequence[Worker]:
        """The ``k`` workers (in their order) whose prefill of ``n`` tokens sent now ends first:
        the smallest (``Worker.load.prefill_s(n)``, position), looking at few more than ``k``."""
        if len(workers) <= k:
            return workers
        if n < 0:  # the walk's bounds hold for a non-negative prompt only
            raise ValueError(f"a prompt of {n} tokens")
        keys = self._keys(workers)
        keys.refresh()
        best: list[tuple[float, int]] = []  # the k smallest (key, position) so far, negated: a max-heap

        def offer(key: float, i: int) -> None:
            if len(best) < k:
                heapq.heappush(best, (-key, -i))
            elif (key, i) < (-best[0][0], -best[0][1]):
                heapq.heapreplace(best, (-key, -i))

        for i in keys.unmeasured:  # their rate is their peers', which changes with the peers' samples
            load = workers[i].load
            offer((load.queued_prefill_tokens + n) / load.prefill_tokens_per_s, i)
        # The measured ones by queue, then rate (fastest first), then position. No worker after a
        # group's first with queue q prefills sooner than (q + n) / the fastest rate; within a group
        # the keys only grow (a correctly rounded division is monotonic): stop, or skip the
        # group's rest, once past the k-th smallest key.
        order, size, fastest = keys.by_queue, len(keys.by_queue), keys.fastest()
        j = 0
        while j < size:
            queued = order[j][0]
            if len(best) == k and (queued + n) / fastest > -best[0][0]:
                break
            end = bisect.bisect_right(order, (queued, math.inf, math.inf), lo=j)
            while j < end:
                _, negative_rate, i = order[j]
                key = (queued + n) / -negative_rate
                if len(best) == k and key > -best[0][0]:
                    break
                offer(key, i)
                j += 1
            j = end
        return [workers[i] for i in sorted(-negative_i for _, negative_i in best)]

    def least_loaded(self, workers: Sequence[Worker], k: int) -> Sequence[Worker]:
        """The ``k`` workers (in their order) of the fewest queued prefill tokens, then streams."""
        if len(workers) <= k:
            return workers
        keys = self._keys(workers)
        keys.refresh()
        return [workers[i] for i in sorted(position for _, _, position in keys.order[:k])]


class _PoolKeys:
    """One pool's keys, each kept sorted: (queued prefill tokens, streams, position) per worker,
    and for the workers whose prefill rate is their own (measured), (queued prefill tokens,
    −rate, position) and their rates; the others' positions (``unmeasured``)."""

    def __init__(self, workers: Sequence[Worker]):
        self.workers = workers
        self.position = {w.load: i for i, w in enumerate(workers)}
        self.loaded: list[tuple[int, int, int]] = [(-1, -1, i) for i in range(len(workers))]
        self.order = sorted(self.loaded)
        self.filed: list[tuple[int, float, int] | None] = [None] * len(workers)  # each worker's entry in by_queue
        self.by_queue: list[tuple[int, float, int]] = []
        self.rates: list[float] = []  # of the measured workers, sorted
        self.unmeasured: set[int] = set()
        self.changed: set[WorkerLoad] = set()
        for w in workers:
            w.load.watch(self.changed)

    def fastest(self) -> float:
        return self.rates[-1] if self.rates else math.inf

    def refresh(self) -> None:
        for load in self.changed:
            i = self.position[load]
            queued = load.queued_prefill_tokens
            key = (queued, len(load.streams), i)
            old = self.loaded[i]
            if key != old:
                del self.order[bisect.bisect_left(self.order, old)]
                bisect.insort(self.order, key)
                self.loaded[i] = key
            was = self.filed[i]
            if was is not None:
                del self.by_queue[bisect.bisect_left(self.by_queue, was)]
                del self.rates[bisect.bisect_left(self.rates, -was[1])]
            if load.prefill_rate.is_measured:
                rate = load.prefill_tokens_per_s
                self.filed[i] = entry = (queued, -rate, i)
                bisect.insort(self.by_queue, entry)
                bisect.insort(self.rates, rate)
                self.unmeasured.discard(i)
            else:
                self.filed[i] = None
                self.unmeasured.add(i)
        self.changed.clear()


def _k_smallest(workers: Sequence[Worker], keys: list[Any], k: int) -> list[Worker]:
    """The ``k`` workers of the smallest keys, in their order — what a stable sort's first ``k``
    would hold (of equal keys, the earlier: ``nsmallest`` is stable) — in O(workers × log k)."""
    return [workers[i] for i in sorted(heapq.nsmallest(k, range(len(keys)), key=keys.__getitem__))]


def _least_score(plans: list[Scored]) -> Scored:
    """``min(plans, key=score)``, the first of equal scores; a loop, which the compiled build runs
    natively (``min`` calls its key function through CPython once a plan)."""
    best = plans[0]
    for scored in plans:
        if scored.score < best.score:
            best = scored
    return best


_NOTHING_CACHED: Mapping[Worker, int] = MappingProxyType({})


def _with_reason(scored: Scored, reason: Reason) -> Decision:
    return Decision(scored.path, reason, prefill=scored.prefill, decode=scored.decode, predicted_ttft_s=scored.ttft_s,
                    cached_tokens=scored.cached_tokens, computed_tokens=scored.computed_tokens)


def recommended_threshold(endpoint: EndpointLoad, decoders: Sequence[Worker], *, stall_weight: float,
                          max_model_len: int) -> int:
    """The static threshold these measurements favour: the prompt length from which a split's
    overhead costs less than the stall a prefill on a typical decoder inflicts on its streams
    (``overhead = stallWeight × streams × n / rate``). With no streams to protect, no prompt is
    worth splitting (``max_model_len``)."""
    streams = endpoint.streams_per_decoder.value
    if not decoders or streams < 0.05 or stall_weight <= 0:  # weight 0: stalls cost nothing, so never split
        return max_model_len
    rate = sum(w.load.prefill_tokens_per_s for w in decoders) / len(decoders)
    n = endpoint.split_overhead.value * rate / (stall_weight * streams)
    return max(0, min(max_model_len, round(n)))

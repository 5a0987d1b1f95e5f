"""Pickers: which worker of a pool serves a request.

Both pickers are load-aware, reading each worker's outstanding (in-flight) request count that
the router itself maintains; neither is round-robin. ``LeastOutstandingPicker`` scans the pool
(exact, O(n)); ``PowerOfTwoPicker`` compares two random workers (O(1), avoids herding when many
routers share a pool). Ties break at random so equal workers share load. A picker never sees an
unavailable worker: the pool filters those out first, and an empty candidate list returns None.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from dpd.router.pools import Worker


class Picker(Protocol):
    def pick(self, candidates: Sequence[Worker], *, exclude: frozenset[str] = frozenset()) -> Worker | None: ...


def _eligible(candidates: Sequence[Worker], exclude: frozenset[str]) -> list[Worker]:
    eligible = [w for w in candidates if w.name not in exclude]
    return eligible or list(candidates)  # a retry may reuse a worker when it is the only one


class LeastOutstandingPicker:
    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[Worker], *, exclude: frozenset[str] = frozenset()) -> Worker | None:
        if not candidates:
            return None
        eligible = _eligible(candidates, exclude)
        least = min(w.num_in_flight for w in eligible)
        return self._rng.choice([w for w in eligible if w.num_in_flight == least])


class PowerOfTwoPicker:
    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[Worker], *, exclude: frozenset[str] = frozenset()) -> Worker | None:
        if not candidates:
            return None
        eligible = _eligible(candidates, exclude)
        if len(eligible) == 1:
            return eligible[0]
        a, b = self._rng.sample(eligible, 2)
        if a.num_in_flight == b.num_in_flight:
            return self._rng.choice((a, b))
        return a if a.num_in_flight < b.num_in_flight else b


class RoundRobinPicker:
    """Each pool's workers in turn, whatever their load (the reference's ``roundrobin``)."""

    def __init__(self, rng: random.Random | None = None):
        self._next = 0

    def pick(self, candidates: Sequence[Worker], *, exclude: frozenset[str] = frozenset()) -> Worker | None:
        if not candidates:
            return None
        eligible = sorted(_eligible(candidates, exclude), key=lambda w: w.name)
        worker = eligible[self._next % len(eligible)]
        self._next += 1
        return worker


# The one registry of pickers: the config's allowed values (router.picker) must equal its keys
# (tests/unit/test_pick.py checks), and the CLI's choices read the config's.
PICKERS: dict[str, type[LeastOutstandingPicker] | type[PowerOfTwoPicker] | type[RoundRobinPicker]] = {
    "least-outstanding": LeastOutstandingPicker,
    "power-of-two": PowerOfTwoPicker,
    "round-robin": RoundRobinPicker,
}


def make_picker(name: str, rng: random.Random | None = None) -> Picker:
    if name not in PICKERS:
        raise ValueError(f"unknown picker {name!r}; allowed: {', '.join(PICKERS)}")
    return PICKERS[name](rng)

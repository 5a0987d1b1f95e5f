"""Pickers: load-aware choice of a worker, with seeded randomness for tie-breaks."""

import random
from collections import Counter

import pytest

from dpd.router.pick import LeastOutstandingPicker, PowerOfTwoPicker, make_picker
from dpd.router.pools import Worker

PICKERS = [LeastOutstandingPicker, PowerOfTwoPicker]
N = 2000


def workers(*loads: int) -> list[Worker]:
    return [Worker(f"w{i}", f"http://127.0.0.1:{9000 + i}", "decode", num_in_flight=load) for i, load in enumerate(loads)]


def picks(picker, candidates, n=N, **kwargs) -> Counter:
    return Counter(picker.pick(candidates, **kwargs).name for _ in range(n))


@pytest.mark.parametrize("cls", PICKERS)
@pytest.mark.parametrize("exclude", [frozenset(), frozenset({"w0"})])
def test_empty_candidates_give_none(cls, exclude):
    assert cls(random.Random(0)).pick([], exclude=exclude) is None


@pytest.mark.parametrize("cls", PICKERS)
def test_single_candidate_is_always_picked(cls):
    only = workers(7)
    picker = cls(random.Random(0))
    assert all(picker.pick(only) is only[0] for _ in range(50))


@pytest.mark.parametrize(
    "loads, expected",
    [
        ([0, 1], "w0"),
        ([1, 0], "w1"),
        ([3, 2, 1, 5], "w2"),
        ([9, 9, 9, 0], "w3"),
        ([4, 0, 4, 4, 4, 4, 4, 4], "w1"),
        ([100, 50, 51], "w1"),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_least_outstanding_picks_the_unique_least_loaded(loads, expected, seed):
    picker = LeastOutstandingPicker(random.Random(seed))
    assert set(picks(picker, workers(*loads), n=200)) == {expected}


@pytest.mark.parametrize(
    "loads, tied",
    [
        ([0, 0], {"w0", "w1"}),
        ([2, 2, 2], {"w0", "w1", "w2"}),
        ([1, 3, 1, 3], {"w0", "w2"}),
        ([5, 0, 0, 0, 9], {"w1", "w2", "w3"}),
    ],
)
def test_least_outstanding_spreads_ties(loads, tied):
    counts = picks(LeastOutstandingPicker(random.Random(42)), workers(*loads))
    assert set(counts) == tied
    fair = N / len(tied)
    assert all(0.8 * fair < counts[name] < 1.2 * fair for name in tied), counts


@pytest.mark.parametrize("loads", [[0, 1], [1, 0], [3, 10], [10, 3], [0, 100]])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_power_of_two_never_picks_the_more_loaded_of_two(loads, seed):
    candidates = workers(*loads)
    busiest = max(candidates, key=lambda w: w.num_in_flight).name
    counts = picks(PowerOfTwoPicker(random.Random(seed)), candidates, n=300)
    assert busiest not in counts
    assert sum(counts.values()) == 300


def test_power_of_two_spreads_a_tie_of_two():
    counts = picks(PowerOfTwoPicker(random.Random(3)), workers(4, 4))
    assert 0.4 * N < counts["w0"] < 0.6 * N, counts


def test_power_of_two_favours_the_least_loaded():
    counts = picks(PowerOfTwoPicker(random.Random(7)), workers(0, 5, 5, 5))
    (most_common, _), *_ = counts.most_common()
    assert most_common == "w0", counts
    # w0 is picked whenever it is sampled: half of all picks; each other worker gets ~1/6.
    assert 0.4 * N < counts["w0"] < 0.6 * N, counts
    assert all(counts[name] < counts["w0"] / 2 for name in ("w1", "w2", "w3")), counts


def test_power_of_two_never_picks_the_strict_maximum_of_many():
    # The strictly busiest worker loses every comparison it takes part in.
    counts = picks(PowerOfTwoPicker(random.Random(11)), workers(1, 2, 3, 50))
    assert "w3" not in counts
    assert set(counts) == {"w0", "w1", "w2"}


@pytest.mark.parametrize("cls", PICKERS)
@pytest.mark.parametrize(
    "loads, exclude, allowed",
    [
        # the least-loaded worker is excluded (a retry): the next one is used
        ([0, 1], {"w0"}, {"w1"}),
        ([0, 5, 9], {"w0", "w1"}, {"w2"}),
        ([0, 0, 0], {"w1"}, {"w0", "w2"}),
        # excluding a name that is not a candidate changes nothing
        ([0, 3], {"nope"}, None),
        # excluding everyone falls back to all candidates
        ([0, 1], {"w0", "w1"}, None),
        ([2], {"w0"}, {"w0"}),
    ],
)
def test_exclude_skips_names_unless_nothing_is_left(cls, loads, exclude, allowed):
    candidates = workers(*loads)
    counts = picks(cls(random.Random(5)), candidates, n=300, exclude=frozenset(exclude))
    if allowed is None:  # behaves exactly as without exclude
        allowed = set(picks(cls(random.Random(5)), candidates, n=300))
    assert set(counts) == allowed


@pytest.mark.parametrize("cls", PICKERS)
def test_pick_does_not_change_loads(cls):
    candidates = workers(3, 1, 2)
    cls(random.Random(0)).pick(candidates)
    assert [w.num_in_flight for w in candidates] == [3, 1, 2]


@pytest.mark.parametrize("cls", PICKERS)
def test_same_seed_same_picks(cls):
    candidates = workers(1, 1, 1, 1)

    def sequence(seed):
        picker = cls(random.Random(seed))
        return [picker.pick(candidates).name for _ in range(50)]

    assert sequence(9) == sequence(9)
    assert len(set(sequence(9))) > 1  # the seeded sequence does break ties more than one way


@pytest.mark.parametrize("name, cls", [("least-outstanding", LeastOutstandingPicker), ("power-of-two", PowerOfTwoPicker)])
def test_make_picker_known_names(name, cls):
    picker = make_picker(name, random.Random(0))
    assert isinstance(picker, cls)
    assert picker.pick(workers(1, 0)).name == "w1"


@pytest.mark.parametrize("name", ["random", "", "Least-Outstanding", "least_outstanding", "power-of-2"])
def test_make_picker_rejects_unknown_names(name):
    with pytest.raises(ValueError, match="unknown picker") as info:
        make_picker(name)
    assert "least-outstanding, power-of-two" in str(info.value)


def test_the_config_allows_exactly_the_registered_pickers():
    from typing import get_args

    from dpd.config.model import RouterSpec
    from dpd.router.pick import PICKERS

    assert set(get_args(RouterSpec.model_fields["picker"].annotation)) == set(PICKERS)

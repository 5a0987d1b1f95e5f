"""ThresholdDecider: which path a request takes, and why."""

import pytest

from dpd.router.decide import Decision, Path, Reason, ThresholdDecider

DIS, DIR = Path.DISAGGREGATED, Path.DIRECT


@pytest.mark.parametrize(
    "threshold, num_prompt_tokens, has_prefill_capacity, is_colocated, path, reason",
    [
        # threshold 0: every prompt is disaggregated, even an empty one
        (0, 0, True, False, DIS, Reason.ABOVE_THRESHOLD),
        (0, 1, True, False, DIS, Reason.ABOVE_THRESHOLD),
        (0, 100_000, True, False, DIS, Reason.ABOVE_THRESHOLD),
        # around the boundary: equal to the threshold is disaggregated
        (2048, 2047, True, False, DIR, Reason.BELOW_THRESHOLD),
        (2048, 2048, True, False, DIS, Reason.ABOVE_THRESHOLD),
        (2048, 2049, True, False, DIS, Reason.ABOVE_THRESHOLD),
        (1, 0, True, False, DIR, Reason.BELOW_THRESHOLD),
        (1, 1, True, False, DIS, Reason.ABOVE_THRESHOLD),
        (2048, 0, True, False, DIR, Reason.BELOW_THRESHOLD),
        # no prefill worker can take it: direct, never lost
        (2048, 2048, False, False, DIR, Reason.PREFILL_UNAVAILABLE),
        (2048, 9000, False, False, DIR, Reason.PREFILL_UNAVAILABLE),
        (0, 0, False, False, DIR, Reason.PREFILL_UNAVAILABLE),
        # a short prompt is direct for being short, whatever the prefill pool's state
        (2048, 10, False, False, DIR, Reason.BELOW_THRESHOLD),
        # colocated wins over everything
        (0, 5000, True, True, DIR, Reason.COLOCATED),
        (2048, 10, True, True, DIR, Reason.COLOCATED),
        (2048, 9000, False, True, DIR, Reason.COLOCATED),
    ],
)
def test_decide_table(threshold, num_prompt_tokens, has_prefill_capacity, is_colocated, path, reason):
    decider = ThresholdDecider(threshold, is_colocated=is_colocated)
    decision = decider.decide(num_prompt_tokens, has_prefill_capacity=has_prefill_capacity)
    assert decision == Decision(path, reason)


def test_path_and_reason_values_are_the_metric_labels():
    assert [p.value for p in Path] == ["disaggregated", "direct", "fallback"]
    assert {r.value for r in Reason} == {"above_threshold", "below_threshold", "prefill_unavailable", "colocated",
                                         "short_prompt", "decoder_busy", "prefill_queue_long", "split_no_gain",
                                         "prefix_hit"}


@pytest.mark.parametrize("new_threshold, expected_path", [(0, DIS), (100, DIS), (101, DIR), (10_000, DIR)])
def test_set_threshold_changes_later_decisions(new_threshold, expected_path):
    decider = ThresholdDecider(2048)
    assert decider.decide(100, has_prefill_capacity=True).path is DIR
    decider.set_threshold(new_threshold)
    assert decider.threshold_tokens == new_threshold
    assert decider.decide(100, has_prefill_capacity=True).path is expected_path


BAD_THRESHOLDS = [-1, -2048, True, False, 1.0, 2048.5, float("nan"), "2048", "", None, [2048], 10**9 + 1, 10**400]


@pytest.mark.parametrize("bad", BAD_THRESHOLDS, ids=repr)
def test_set_threshold_rejects_non_integers_and_negatives(bad):
    decider = ThresholdDecider(512)
    with pytest.raises(ValueError, match="threshold must be an integer from 0 to 1000000000"):
        decider.set_threshold(bad)
    # a rejected update leaves the old threshold in force
    assert decider.threshold_tokens == 512
    assert decider.decide(511, has_prefill_capacity=True).reason is Reason.BELOW_THRESHOLD
    assert decider.decide(512, has_prefill_capacity=True).reason is Reason.ABOVE_THRESHOLD


@pytest.mark.parametrize("bad", BAD_THRESHOLDS, ids=repr)
def test_constructor_rejects_what_set_threshold_rejects(bad):
    with pytest.raises(ValueError):
        ThresholdDecider(bad)


def test_colocated_flag_can_be_toggled():
    decider = ThresholdDecider(0)
    decider.is_colocated = True
    assert decider.decide(10, has_prefill_capacity=True).reason is Reason.COLOCATED
    decider.is_colocated = False
    assert decider.decide(10, has_prefill_capacity=True).path is DIS


def test_decisions_written_out_init_takes_every_field_in_order_with_its_default():
    """``Decision.__init__`` is written out (the compiled simulator runs it natively): it must
    stay the dataclass's own — every field, in order, with its default — and stay frozen."""
    import dataclasses
    import inspect

    params = list(inspect.signature(Decision.__init__).parameters.values())[1:]
    fields = dataclasses.fields(Decision)
    assert [p.name for p in params] == [f.name for f in fields]
    assert [p.default for p in params] == [inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
                                           for f in fields]
    decision = Decision(Path.DIRECT, Reason.SHORT_PROMPT, computed_tokens=5)
    assert decision == Decision(Path.DIRECT, Reason.SHORT_PROMPT, None, None, None, None, 5)
    assert dataclasses.replace(decision, reason=Reason.PREFIX_HIT).reason is Reason.PREFIX_HIT
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.path = Path.DISAGGREGATED  # type: ignore[misc]

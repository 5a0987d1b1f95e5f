"""The adaptive policy's decision on hand-made worker states, and the load it measures.

Each row builds workers whose measured state (queued prefill tokens, streams, prefill rate,
utilization) is set by hand, and checks the plan and its reason: every reason is reached.
"""

from __future__ import annotations

import math

import pytest

from dpd.router.adaptive import AdaptiveDecider, Candidates, Scored, recommended_threshold
from dpd.router.decide import Path, Reason
from dpd.router.load import EndpointLoad, LoadPriors, RecentMedian, RecentRate, Residuals, WorkerLoad
from dpd.router.pools import Worker


def field_values(obj, names):
    """An object's fields, for comparing plain classes (no field-wise ==) field by field."""
    return tuple(getattr(obj, name) for name in names)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def worker(name: str, *, queued: int = 0, streams: int = 0, rate: float = 500.0, busy_s: float = 0.0,
           stream_tokens: int = 64) -> Worker:
    """A worker with ``streams`` streams that have just started, each expecting
    ``stream_tokens`` tokens (at the prior 30 tokens/s and a 0.2 s TPOT target: 10.5 s of slack
    for 64 tokens)."""
    clock = FakeClock()
    load = WorkerLoad(LoadPriors(prefill_tokens_per_s=rate), clock)
    load.queued_prefill_tokens = queued
    for _ in range(streams):
        load.begin_stream(stream_tokens)
    if busy_s:
        load._add_busy(busy_s, clock.now)  # the share of the last minute it spent prefilling
    return Worker(name, f"http://{name}", name.split("-")[0], load=load)


def decider(floor: int = 0, *, overhead_s: float = 0.3, stall_weight: float = 1.0, colocated: bool = False) -> AdaptiveDecider:
    return AdaptiveDecider(floor, EndpointLoad(LoadPriors(split_overhead_s=overhead_s)), stall_weight=stall_weight,
                           is_colocated=colocated)


# (case, prefill worker state, decode worker state, prompt tokens, floor, expected path, reason, workers)
CASES = [
    ("idle endpoint: nothing to protect, whole on the decoder", {}, {}, 3000, 0,
     Path.DIRECT, Reason.SPLIT_NO_GAIN, "decode-0"),
    ("decoder streaming, prefill worker busy prefilling: split protects the streams", {"busy_s": 30}, {"streams": 4},
     3000, 0, Path.DISAGGREGATED, Reason.DECODER_BUSY, "prefill-0>decode-0"),
    ("decoder streaming, prefill worker idle: the idle prefill worker takes the whole request", {}, {"streams": 4},
     3000, 0, Path.DIRECT, Reason.SPLIT_NO_GAIN, "prefill-0"),
    ("prefill worker queued: whole on the idle decoder, not behind the queue", {"queued": 6000}, {"streams": 1}, 3000, 0,
     Path.DIRECT, Reason.PREFILL_QUEUE_LONG, "decode-0"),
    ("below the floor: never split, placed on the less loaded worker", {}, {"streams": 4}, 100, 512,
     Path.DIRECT, Reason.SHORT_PROMPT, "prefill-0"),
    ("below the floor, idle: the decoder (preferred role) wins the tie", {}, {}, 100, 512,
     Path.DIRECT, Reason.SHORT_PROMPT, "decode-0"),
    ("both stream: the one with fewer streams prefills (split)", {"streams": 1, "busy_s": 30}, {"streams": 6}, 3000, 0,
     Path.DISAGGREGATED, Reason.DECODER_BUSY, "prefill-0>decode-0"),
    ("decoder busy with streams and a queue: whole on the prefill worker", {"queued": 500}, {"streams": 8, "queued": 4000},
     3000, 0, Path.DIRECT, Reason.SPLIT_NO_GAIN, "prefill-0"),
]


@pytest.mark.parametrize("case, p_state, d_state, n, floor, path, reason, workers", CASES, ids=[c[0] for c in CASES])
def test_plan_and_reason(case, p_state, d_state, n, floor, path, reason, workers):
    p, d = worker("prefill-0", **p_state), worker("decode-0", **d_state)
    plan = decider(floor).plan(n, 64, Candidates(prefillers=[p], decoders=[d], others=[p]))
    assert (plan.path, plan.reason, plan.workers_label) == (path, reason, workers)
    assert plan.predicted_ttft_s is not None and plan.predicted_ttft_s > 0


def test_prefill_pool_unavailable_means_whole_requests_only():
    p, d = worker("prefill-0"), worker("decode-0", streams=6)
    plan = decider().plan(3000, 64, Candidates(prefillers=[], decoders=[d], others=[p]))
    assert (plan.path, plan.reason, plan.workers_label) == (Path.DIRECT, Reason.PREFILL_UNAVAILABLE, "prefill-0")


def test_colocated_places_whole_requests_only():
    a, b = worker("decode-0", streams=2), worker("decode-1")
    plan = decider(colocated=True).plan(3000, 64, Candidates(prefillers=[], decoders=[a, b]))
    assert (plan.path, plan.reason, plan.workers_label) == (Path.DIRECT, Reason.COLOCATED, "decode-1")


def test_no_worker_at_all_is_no_plan():
    assert decider().plan(100, 10, Candidates(prefillers=[], decoders=[])) is None


def test_stall_weight_zero_minimises_ttft_only():
    """With no weight on stalls the policy is colocated-like: the split's overhead never pays."""
    p, d = worker("prefill-0"), worker("decode-0", streams=8)
    plan = decider(stall_weight=0).plan(3000, 64, Candidates(prefillers=[p], decoders=[d], others=[p]))
    assert plan.path is Path.DIRECT


def test_a_decoder_that_prefills_a_lot_repels_new_streams():
    """Exposure: a stream placed where prefills keep running will be stalled by them."""
    busy = worker("decode-0", busy_s=45.0)  # 75% of the last minute prefilling
    calm = worker("decode-1")
    plan = decider().plan(50, 256, Candidates(prefillers=[], decoders=[busy, calm]))
    assert plan.workers_label == "decode-1"


def test_predicted_ttft_counts_the_queue_ahead():
    p = worker("prefill-0", queued=1000, rate=500)
    d = worker("decode-0", streams=10)
    plan = decider(overhead_s=0.5).plan(1000, 64, Candidates(prefillers=[p], decoders=[d]))
    assert plan.path is Path.DISAGGREGATED and plan.predicted_ttft_s == pytest.approx(2000 / 500 + 0.5)


def test_a_prefill_that_would_push_a_stream_past_its_tpot_target_is_split():
    """The decoder runs one short stream (8 tokens: 1.2 s of slack); a 3,000-token prefill there
    (6 s) would make it miss its TPOT target. The idle prefill worker takes the prefill."""
    p, d = worker("prefill-0"), worker("decode-0", streams=1, stream_tokens=8)
    plan = decider().plan(3000, 64, Candidates(prefillers=[p], decoders=[d]))
    assert (plan.path, plan.reason, plan.workers_label) == (Path.DISAGGREGATED, Reason.DECODER_BUSY, "prefill-0>decode-0")


def test_a_request_late_on_every_plan_is_queued_where_it_stalls_no_one():
    """Both queues exceed the 10 s TTFT target: the prompt goes to the prefill pool's queue
    rather than stall the decoder's streams."""
    p, d = worker("prefill-0", queued=20_000), worker("decode-0", queued=6000, streams=2)
    plan = decider().plan(3000, 64, Candidates(prefillers=[p], decoders=[d], others=[p]))
    assert (plan.path, plan.workers_label) == (Path.DISAGGREGATED, "prefill-0>decode-0")
    assert plan.predicted_ttft_s > 10


@pytest.mark.parametrize("late_s, path", [(0.1, Path.DISAGGREGATED), (8.0, Path.DIRECT)])
def test_a_split_is_charged_the_misses_its_recent_predictions_imply(late_s, path):
    """The streaming decoder is protected by a split (predicted 6.3 s, within the 10 s target)
    while recent splits ran about as predicted; when they ran 8 s late, the same split would miss
    its target and a whole request (predicted accurately) is planned instead."""
    p, d = worker("prefill-0", busy_s=30), worker("decode-0", streams=4)
    policy = decider()
    for _ in range(16):
        policy.endpoint.ttft_errors["disaggregated"].add(late_s)
        policy.endpoint.ttft_errors["direct"].add(0.1)
    plan = policy.plan(3000, 64, Candidates(prefillers=[p], decoders=[d], others=[p]))
    assert plan.path is path


def test_prediction_errors_give_the_chance_of_a_miss():
    errors = Residuals(window=4, min_samples=2)
    assert errors.share_above(-0.5) == 1 and errors.share_above(0.5) == 0  # too few: the prediction is exact
    for sample in (0.0, 1.0, 2.0, 3.0, float("nan"), 4.0):  # the window keeps the last four
        errors.add(sample)
    assert errors.share_above(2.5) == 0.5 and errors.share_above(4.0) == 0 and errors.share_above(0.5) == 1
    assert errors.quantile(0.5) == 3.0 and errors.num_samples == 5


def test_a_split_that_would_outwait_the_prefill_deadline_is_not_planned():
    """60 s of queue on the prefill worker against a 30 s prefill hop deadline: the split would
    time out and trip the worker's breaker, so the request runs whole."""
    p, d = worker("prefill-0", queued=30_000), worker("decode-0", streams=2)
    decider_ = AdaptiveDecider(0, EndpointLoad(LoadPriors()), max_prefill_wait_s=30.0)
    plan = decider_.plan(3000, 64, Candidates(prefillers=[p], decoders=[d], others=[p]))
    assert (plan.path, plan.reason, plan.workers_label) == (Path.DIRECT, Reason.PREFILL_QUEUE_LONG, "decode-0")


def test_a_split_whose_decode_hop_would_wait_past_its_deadline_is_not_planned():
    """The decoder has 12 s of prefill queued; the split's prefill takes 6 s, so its decode hop
    would wait ~6 s for the decoder against a 5 s first-token deadline: it would fall back and
    open the prefill pool's breaker. The prompt runs whole on the idle prefill worker."""
    p, d = worker("prefill-0"), worker("decode-0", queued=6000)
    decider_ = AdaptiveDecider(0, EndpointLoad(LoadPriors()), max_decode_wait_s=5.0)
    plan = decider_.plan(3000, 64, Candidates(prefillers=[p], decoders=[d], others=[p]))
    assert (plan.path, plan.reason, plan.workers_label) == (Path.DIRECT, Reason.PREFILL_QUEUE_LONG, "prefill-0")


def test_with_no_split_possible_a_large_prompt_does_not_queue_on_a_decoder():
    """The prefill worker's queue outlasts the prefill hop's deadline, so no split; the decoder
    has 2 s of prefill queued. A 3,000-token prompt whole there would lengthen the queue the
    short requests (and every later split's decode hop) wait behind: it queues whole on the
    prefill worker instead, as a static split would."""
    p, d = worker("prefill-0", queued=30_000), worker("decode-0", queued=1000, streams=2)
    decider_ = AdaptiveDecider(0, EndpointLoad(LoadPriors()), max_prefill_wait_s=30.0)
    plan = decider_.plan(3000, 64, Candidates(prefillers=[p], decoders=[d], others=[p]))
    assert (plan.path, plan.reason, plan.workers_label) == (Path.DIRECT, Reason.PREFILL_QUEUE_LONG, "prefill-0")
    # A small prompt still goes to the decoder.
    plan = decider_.plan(100, 64, Candidates(prefillers=[p], decoders=[d], others=[p]))
    assert plan.workers_label == "decode-0"


def test_a_small_prompt_late_on_every_plan_is_served_soonest():
    """Both queues exceed the TTFT target; a 100-token prompt (0.2 s of prefill) harms no one
    anywhere, so it takes the earliest first token (the decoder's 12 s) rather than the prefill
    pool's 40 s queue."""
    p, d = worker("prefill-0", queued=20_000), worker("decode-0", queued=6000, streams=2)
    plan = decider().plan(100, 16, Candidates(prefillers=[p], decoders=[d], others=[p]))
    assert (plan.path, plan.reason, plan.workers_label) == (Path.DIRECT, Reason.PREFILL_QUEUE_LONG, "decode-0")


@pytest.mark.parametrize("bad", [-1, 1.5, "512", None, True])
def test_floor_is_validated(bad):
    with pytest.raises(ValueError):
        decider().set_threshold(bad)


# -- the measurements ----------------------------------------------------------------------------

def test_prefill_rate_is_measured_from_service_times_in_order():
    clock = FakeClock()
    load = WorkerLoad(LoadPriors(prefill_tokens_per_s=100.0), clock)
    a = load.begin_prefill(1000)
    b = load.begin_prefill(2000)  # sent together: b waits for a on the worker
    c = load.begin_prefill(500)
    assert load.queued_prefill_tokens == 3500 and load.prefill_s(0) == pytest.approx(35.0)  # the prior
    clock.now += 2.0
    load.end_prefill(a, is_ok=True)  # 1000 tokens in 2 s
    clock.now += 4.0
    load.end_prefill(b, is_ok=True)  # its service began when a ended: 2000 tokens in 4 s
    assert load.prefill_tokens_per_s == 100.0  # two samples: still the prior
    clock.now += 1.0
    load.end_prefill(c, is_ok=True)
    assert load.prefill_tokens_per_s == pytest.approx(500.0)
    assert load.queued_prefill_tokens == 0 and load.num_prefills == 0
    assert load.prefill_utilization() == pytest.approx(7.0 / 60.0, rel=0.1)  # decayed a little


def test_a_cold_start_sample_is_forgotten():
    """vLLM compiles on a worker's first requests: one very slow sample must not steer the
    router away from the worker for long."""
    rate = RecentMedian(500.0, window=8, min_samples=3)
    for sample in (40.0, 480.0, 520.0):  # the first one cold
        rate.add(sample)
    assert rate.value == 480.0
    for sample in (500.0,) * 8:
        rate.add(sample)
    assert rate.value == 500.0 and rate.num_samples == 11


def test_a_cold_start_prefill_is_left_out_of_the_rate():
    rate = RecentRate(500.0, window=8, min_samples=3)
    rate.add(2000, 50.0)  # vLLM compiling: 40 tokens/s
    rate.add(480, 1.0)
    rate.add(520, 1.0)
    assert rate.value == pytest.approx(500.0)  # under an eighth of the others' rate: left out
    rate.add(1000, 0.0)  # no time: not a sample
    assert rate.num_samples == 3


def test_the_rate_sums_a_batch_whose_ends_were_seen_apart():
    """Each 3 s step finished three 600-token prefills; the first end carried the step's time,
    the other two 0.2 s between them (too far apart to be merged as one step). Tokens over
    time: ~590 tokens/s, where the samples' median rate was 3,000."""
    rate = RecentRate(100.0, window=9)
    for _ in range(3):
        rate.add(600, 3.0)
        rate.add(600, 0.2)
        rate.add(600, 0.2)
    assert rate.value == pytest.approx(5400 / 10.2)


def test_prefills_of_one_step_seen_apart_give_the_steps_rate():
    """Three 600-token prefills end in one 3 s engine step, and the router, busy relaying
    streams, sees their ends 20 ms apart: the first carries the step's time, the others almost
    none (30,000 tokens/s each). The rate is still the step's, 600 tokens/s — a median of the
    samples' own rates was 30,000 and predicted a 600-token split at 0.1 s."""
    clock = FakeClock()
    load = WorkerLoad(LoadPriors(prefill_tokens_per_s=100.0), clock)
    for _ in range(3):
        tickets = [load.begin_prefill(600) for _ in range(3)]
        clock.now += 3.0
        for ticket in tickets:
            load.end_prefill(ticket, is_ok=True)
            clock.now += 0.02
        clock.now += 5.0
    assert load.prefill_tokens_per_s == pytest.approx(1800 / 3.04, rel=0.01)


def test_prediction_errors_are_forgotten_after_a_minute():
    """A plan judged late stops being chosen and measured: its errors expire, and it is tried again."""
    clock = FakeClock()
    errors = Residuals(min_samples=2, max_age_s=60.0, clock=clock)
    errors.add(9.0)
    clock.now += 30
    errors.add(9.0)
    assert errors.share_above(5.0) == 1
    clock.now += 31  # the first is 61 s old
    assert not errors.is_measured and errors.share_above(5.0) == 0 and errors.quantile(0.5) == 9.0


def test_failed_or_short_prefills_are_not_sampled_and_tickets_close_once():
    clock = FakeClock()
    load = WorkerLoad(LoadPriors(prefill_tokens_per_s=100.0), clock)
    failed, short = load.begin_prefill(1000), load.begin_prefill(10)
    clock.now += 1.0
    load.end_prefill(failed, is_ok=False)
    load.end_prefill(failed, is_ok=True)  # a second end is a no-op
    load.end_prefill(short, is_ok=True)
    assert load.prefill_rate.num_samples == 0 and load.prefill_tokens_per_s == 100.0
    assert load.queued_prefill_tokens == 0


def test_utilization_decays_with_idle_time():
    clock = FakeClock()
    load = WorkerLoad(LoadPriors(), clock, window_s=60.0)
    ticket = load.begin_prefill(3000)
    clock.now += 30.0
    load.end_prefill(ticket, is_ok=True)
    assert load.prefill_utilization() == pytest.approx(0.5)
    clock.now += 60.0
    assert load.prefill_utilization() == pytest.approx(0.5 * 2.718281828 ** -1, rel=1e-6)


def test_a_measured_rate_read_between_samples_follows_each_new_sample():
    """The rate a measured worker is read at (kept between reads: a large pool reads it on every
    decision) changes with its next sample, and with a sample its step's next prefill grows."""
    clock = FakeClock()
    load = WorkerLoad(LoadPriors(prefill_tokens_per_s=100.0), clock)
    for _ in range(3):
        ticket = load.begin_prefill(1000)
        clock.now += 2.0
        load.end_prefill(ticket, is_ok=True)
        clock.now += 5.0
    assert load.prefill_tokens_per_s == pytest.approx(500.0)
    assert load.prefill_tokens_per_s == pytest.approx(500.0)  # read again: the same
    slow, same_step = load.begin_prefill(1000), load.begin_prefill(1000)
    clock.now += 10.0
    load.end_prefill(slow, is_ok=True)  # 1000 tokens in 10 s
    assert load.prefill_tokens_per_s == pytest.approx(4000 / 16.0)
    load.end_prefill(same_step, is_ok=True)  # ended in the same step: that sample is 2000 tokens
    assert load.prefill_tokens_per_s == pytest.approx(5000 / 16.0)


def test_decode_rate_is_the_rate_between_stalls():
    """The median gap between tokens: a stream stalled once by another request's prefill still
    measures the worker's undisturbed decode rate."""
    clock = FakeClock()
    load = WorkerLoad(LoadPriors(decode_tokens_per_s=30.0), clock)
    for _ in range(3):
        ticket = load.begin_stream(41)
        for i in range(2, 42):
            clock.now += 3.0 if i == 10 else 0.05  # one 3 s stall, else 20 tokens/s
            ticket.add_tokens(i, clock.now)
        load.end_stream(ticket)
    assert load.num_streams == 0 and load.decode_tokens_per_s == pytest.approx(20.0)


def test_an_unmeasured_worker_is_predicted_at_its_peers_rate():
    """The config's prior (500 tokens/s) stands in only until some worker is measured."""
    clock = FakeClock()
    measured = WorkerLoad(LoadPriors(prefill_tokens_per_s=500.0), clock)
    fresh = WorkerLoad(LoadPriors(prefill_tokens_per_s=500.0), clock, shared=measured.shared)
    for _ in range(3):
        ticket = measured.begin_prefill(1000)
        clock.now += 4.0
        measured.end_prefill(ticket, is_ok=True)
    assert measured.prefill_tokens_per_s == pytest.approx(250.0)
    assert fresh.prefill_tokens_per_s == pytest.approx(250.0)


def test_a_batch_on_one_worker_never_overwrites_another_workers_shared_sample():
    """Worker A's sample, then B's; A's next prefill ends in A's step: A's own sample grows, and
    B's sample in the shared window stays B's."""
    clock = FakeClock()
    a = WorkerLoad(LoadPriors(prefill_tokens_per_s=500.0), clock)
    b = WorkerLoad(LoadPriors(prefill_tokens_per_s=500.0), clock, shared=a.shared)
    a1, a2 = a.begin_prefill(1000), a.begin_prefill(1000)
    b1 = b.begin_prefill(300)
    clock.now += 2.0
    a.end_prefill(a1, is_ok=True)  # A: 1000 tokens in 2 s
    b.end_prefill(b1, is_ok=True)  # B: 300 tokens in 2 s
    a.end_prefill(a2, is_ok=True)  # in A's step: A's sample becomes 2000 tokens
    assert list(a.shared.prefill_rate._samples) == [(1000, 2.0), (300, 2.0)]
    assert list(a.prefill_rate._samples)[-1][0] == 2000


def test_prefills_ending_in_one_step_make_one_sample():
    """vLLM batches several prefills into one engine step: they end together, and the second
    one's service time is ~0. One sample for the batch, not an absurd rate."""
    clock = FakeClock()
    load = WorkerLoad(LoadPriors(prefill_tokens_per_s=100.0), clock)
    for _ in range(3):
        a, b = load.begin_prefill(1000), load.begin_prefill(1000)
        clock.now += 8.0
        load.end_prefill(a, is_ok=True)
        clock.now += 0.001
        load.end_prefill(b, is_ok=True)
        clock.now += 1.0
    assert load.prefill_tokens_per_s == pytest.approx(2000 / 8.001)


def test_stream_slack_counts_running_streams_and_queued_whole_requests():
    clock = FakeClock()
    load = WorkerLoad(LoadPriors(decode_tokens_per_s=20.0), clock)
    ticket = load.begin_stream(21)  # budget 0.2 × 20 = 4 s, needs 20 / 20 = 1 s
    clock.now += 0.5
    ticket.add_tokens(6, clock.now)
    load.begin_prefill(500, expected_tokens=11)  # will decode here: (0.2 − 0.05) × 10 = 1.5 s
    load.begin_prefill(500)  # a split's prefill: decodes elsewhere
    assert load.stream_slacks_s(0.2) == pytest.approx([4.0 - 0.5 - 15 / 20, 1.5])


@pytest.mark.parametrize("streams, expected", [(0.0, 8192), (1.0, 150), (2.0, 75)])
def test_recommended_threshold(streams, expected):
    """A split costs 0.3 s; a decoder prefilling at 500 tokens/s stalls each stream n/500 s."""
    endpoint = EndpointLoad(LoadPriors(split_overhead_s=0.3))
    endpoint.streams_per_decoder.value = streams
    assert recommended_threshold(endpoint, [worker("decode-0")], stall_weight=1.0, max_model_len=8192) == expected


def test_a_stall_weight_of_zero_never_recommends_a_split():
    """stallWeight 0 is allowed (only misses protect streams): the recommendation is "never", not
    a division by zero on every /metrics scrape and admin call."""
    endpoint = EndpointLoad(LoadPriors(split_overhead_s=0.3))
    endpoint.streams_per_decoder.value = 2.0
    assert recommended_threshold(endpoint, [worker("decode-0")], stall_weight=0.0, max_model_len=8192) == 8192


def test_a_large_pool_is_shortlisted_to_the_least_loaded_workers():
    """A decision scores at most max_candidates workers per role (the least loaded, and those
    holding the prompt in cache), so its cost does not grow with the pool; within the limit
    every worker is scored."""
    prefill = [worker(f"prefill-{i}", queued=1000 * (i + 1)) for i in range(20)]
    decode = [worker(f"decode-{i}", streams=2 + i % 3, queued=100 * (20 - i)) for i in range(20)]
    d = decider()
    shortlist = d._shortlist(Candidates(prefill, decode, prefill), 3000, {})
    assert [w.name for w in shortlist.prefillers] == [f"prefill-{i}" for i in range(8)]  # the shortest queues
    assert {w.name for w in shortlist.decoders} == {f"decode-{i}" for i in range(12, 20)}
    cached = {decode[0]: 2048}  # the busiest decoder holds the prompt: it stays a candidate
    assert decode[0] in d._shortlist(Candidates(prefill, decode, prefill), 3000, cached).decoders
    small = Candidates(prefill[:3], decode[:5], prefill[:3])
    assert d._shortlist(small, 3000, {}) == small
    plan = d.plan(3000, 16, Candidates(prefill, decode, prefill))
    assert plan is not None and plan.decode in shortlist.decoders + shortlist.prefillers


@pytest.mark.parametrize("seed", range(20))
def test_the_shortlist_holds_what_a_stable_sort_would_keep(seed):
    """The shortlist reads each worker once and keeps the k smallest keys in O(n log k): the same
    workers, in the same order, as the first k of a stable sort — ties (many idle workers in a
    large pool) go to the earlier worker, as they did."""
    import random

    from dpd.router.adaptive import _k_smallest

    rng = random.Random(seed)
    n, k = rng.randint(1, 60), rng.randint(1, 10)
    workers = [worker(f"w-{i}") for i in range(n)]
    keys = [(rng.choice([0, 0, -128]), rng.randint(0, 3), rng.randint(0, 2)) for _ in range(n)]
    by_name = dict(zip((w.name for w in workers), keys))
    expected = {w.name for w in sorted(workers, key=lambda w: by_name[w.name])[:k]}
    chosen = _k_smallest(workers, keys, k)
    assert {w.name for w in chosen} == expected
    assert [w.name for w in chosen] == [w.name for w in workers if w.name in expected]  # in their order



@pytest.mark.parametrize("seed", range(20))
def test_the_index_shortlists_the_workers_the_pass_over_the_pools_would(seed):
    """``ShortlistIndex`` (the simulator's fixed pools) re-reads only the workers whose load
    changed since the last decision: after every kind of change (prefills sent and finished —
    which measure a worker's rate, or its peers' for one not yet measured — and streams begun and
    ended), it keeps the same workers, in the same order, as ``_shortlist``'s pass over the pools."""
    import random

    from dpd.router.adaptive import ShortlistIndex
    from dpd.router.load import SharedRates

    rng = random.Random(seed)
    clock = FakeClock()
    shared = SharedRates(LoadPriors())

    def pool(name: str, size: int) -> list[Worker]:
        return [Worker(f"{name}-{i}", f"http://{name}-{i}", name, load=WorkerLoad(LoadPriors(), clock, shared=shared))
                for i in range(size)]

    prefill, decode = pool("prefill", rng.randint(9, 30)), pool("decode", rng.randint(1, 30))
    index = ShortlistIndex(prefill, decode)
    d = decider()
    d.max_candidates = rng.randint(1, 8)
    prefills: list = []
    streams: list = []
    for _ in range(400):
        w = rng.choice(prefill[:3] if rng.random() < 0.3 else prefill + decode)  # a few measured soon
        action = rng.random()
        clock.now += rng.choice([0.0, 0.05, 0.7])
        if action < 0.35:
            prefills.append((w, w.load.begin_prefill(rng.choice([100, 200, 600, 2000]))))
        elif action < 0.6 and prefills:
            owner, ticket = prefills.pop(rng.randrange(len(prefills)))
            owner.load.end_prefill(ticket, is_ok=rng.random() < 0.9)
        elif action < 0.8:
            streams.append((w, w.load.begin_stream(64)))
        elif streams:
            owner, stream = streams.pop(rng.randrange(len(streams)))
            owner.load.end_stream(stream, rng.randint(1, 64))
        if rng.random() < 0.3:
            n = rng.choice([50, 300, 3000])
            by_pass = d._shortlist(Candidates(prefill, decode, prefill), n, {})
            by_index = d._shortlist(Candidates(prefill, decode, prefill, index=index), n, {})
            assert by_index == by_pass
    assert any(w.load.prefill_rate.is_measured for w in prefill)  # the measured-rate branch ran


def test_the_index_breaks_ties_across_queue_lengths_as_the_pass_does():
    """Equal keys from different queues and rates (0 + 300 tokens at 300/s and 100 + 300 at 400/s:
    1 s each): the earlier worker wins, as in the pass over the pool, though the index reaches
    it after the later one."""
    from dpd.router.adaptive import ShortlistIndex

    clock = FakeClock()

    def measured(name: str, rate: int) -> Worker:
        load = WorkerLoad(LoadPriors(), clock)
        for _ in range(3):  # three prefills of `rate` tokens, a second each
            ticket = load.begin_prefill(rate)
            clock.now += 1.0
            load.end_prefill(ticket, is_ok=True)
            clock.now += 5.0
        return Worker(name, f"http://{name}", "prefill", load=load)

    prefill = [measured(f"prefill-{i}", rate) for i, rate in enumerate([200, 400, 200, 300, 200])]
    prefill[1].load.begin_prefill(100)
    for w in (prefill[0], prefill[2], prefill[4]):
        w.load.begin_prefill(1000)
    assert prefill[1].load.prefill_s(300) == prefill[3].load.prefill_s(300) == 1.0
    d = decider()
    d.max_candidates = 1
    index = ShortlistIndex(prefill, prefill[:1])
    chosen = d._shortlist(Candidates(prefill, prefill[:1], prefill, index=index), 300, {}).prefillers
    assert chosen == d._shortlist(Candidates(prefill, prefill[:1], prefill), 300, {}).prefillers == [prefill[1]]


def test_the_index_refuses_candidates_outside_its_pools():
    from dpd.router.adaptive import ShortlistIndex

    prefill = [worker(f"prefill-{i}") for i in range(10)]
    decode = [worker(f"decode-{i}") for i in range(10)]
    index = ShortlistIndex(prefill, decode)
    with pytest.raises(ValueError, match="not among the index's pools"):
        decider()._shortlist(Candidates(prefill[1:], decode, prefill, index=index), 300, {})
    cached = {decode[3]: 256}  # prefix-aware: the pass over the pools, which keys by what is cached
    assert decode[3] in decider()._shortlist(Candidates(prefill, decode, prefill, index=index), 300, cached).decoders



@pytest.mark.parametrize("seed", range(25))
def test_splits_scored_in_place_match_every_pair_scored(seed):
    """``_splits`` scores each pair in place and builds a ``Scored`` only for the best and each
    prefiller's first: the same plans, bit for bit, as scoring every pair with ``_scored`` and
    taking the first of the lowest scores (p-major), and each prefiller's first pair."""
    import random

    rng = random.Random(seed)
    prefill = [worker(f"prefill-{i}", queued=rng.choice([0, 0, 400, 3000]), streams=rng.randint(0, 3),
                      rate=rng.choice([400.0, 500.0]), busy_s=rng.choice([0.0, 20.0])) for i in range(rng.randint(1, 4))]
    decode = [worker(f"decode-{i}", queued=rng.choice([0, 0, 200, 2500]), streams=rng.randint(0, 5),
                     busy_s=rng.choice([0.0, 30.0])) for i in range(rng.randint(1, 4))]
    d = AdaptiveDecider(0, EndpointLoad(LoadPriors(split_overhead_s=0.3)), stall_weight=rng.choice([0.5, 1.0]),
                        max_decode_wait_s=rng.choice([math.inf, 2.0]), max_prefill_wait_s=rng.choice([math.inf, 6.0]))
    n, m = rng.choice([300, 1500, 4000]), rng.choice([1, 16, 64])
    candidates = Candidates(prefill, decode, prefill)
    d.plan(n, m, candidates)  # sets the per-decision caches the helpers read
    best, firsts = d._splits(candidates, n, m, {})
    overhead = d.endpoint.split_overhead.value
    every, expected_firsts = [], []
    for p in prefill:
        queue_s = p.load.prefill_s(n)
        if not queue_s <= d.max_prefill_wait_s:
            continue
        ttft = queue_s + overhead
        prefilling = d._prefilling(Path.DISAGGREGATED, ttft, n / p.load.prefill_tokens_per_s, p)
        pairs = []
        for w in decode:
            decoding, future_stall_s, at_rest = d._decoding(w, m)
            queued_after_s = max(0.0, w.load.queued_prefill_tokens / w.load.prefill_tokens_per_s - ttft)
            if queued_after_s <= d.max_decode_wait_s:
                own = at_rest if queued_after_s == 0.0 else d._own_stream(decoding, future_stall_s + queued_after_s, m)
                pairs.append(d._scored(Path.DISAGGREGATED, p, decoding, n, None, ttft, prefilling, own,
                                       decode_wait_s=queued_after_s))
        every += pairs
        expected_firsts += pairs[:1]
    def plain(scored):
        return None if scored is None else field_values(scored, Scored.FIELDS)

    assert [plain(s) for s in firsts] == [plain(s) for s in expected_firsts]
    assert plain(best) == plain(min(every, key=lambda s: s.score) if every else None)

def test_max_candidates_below_one_is_refused():
    with pytest.raises(ValueError, match="max_candidates"):
        AdaptiveDecider(0, EndpointLoad(LoadPriors()), max_candidates=0)

def test_a_stall_limit_counts_each_stream_a_prefill_would_pause_past_it():
    # 300 tokens at 500 tokens/s pause a worker's streams 0.6 s, within a 64-token stream's TPOT
    # slack: unlimited, no stream is pushed past its target; with a 0.2 s limit each stream on
    # the worker that prefills counts a miss, and the plan prefers the worker with fewer.
    def decider_(**kw):
        return AdaptiveDecider(0, EndpointLoad(LoadPriors(split_overhead_s=0.3)), **kw)
    assert decider_()._whole(worker("decode-0", streams=3), 300, 64).harm_misses == 0
    limited = decider_(max_stall_s=0.2)
    assert limited._whole(worker("prefill-0", streams=1), 300, 64).harm_misses == 1
    assert limited._whole(worker("decode-0", streams=3), 300, 64).harm_misses == 3
    assert limited._whole(worker("decode-0", streams=3), 50, 64).harm_misses == 0  # 0.1 s: within the limit
    p, d = worker("prefill-0", streams=1), worker("decode-0", streams=3)
    plan = limited.plan(300, 64, Candidates(prefillers=[p], decoders=[d], others=[p]))
    assert plan.workers_label.startswith("prefill-0")  # the one stream there, not the three


def test_two_alike_streams_are_two_tickets():
    clock = FakeClock()
    load = WorkerLoad(LoadPriors(), clock)
    first, second = load.begin_stream(8), load.begin_stream(8)  # same clock, same length: alike in every field
    load.end_stream(second)
    assert len(load.streams) == 1 and load.streams[0] is first


def test_a_ticket_given_runs_of_tokens_counts_them_as_one_event_each():
    """``add_token_runs`` (the simulator's several engine steps at once) leaves a ticket as
    ``add_tokens`` called for each run would: the same gaps, count and last token's time."""
    from dpd.router.load import StreamTicket

    runs = [(3, 0.2, 0.7), (1, 0.05, 0.75), (0, 0.0, 0.8), (5, 0.1, 1.3)]  # (new, the engine's step time: unread, time)
    one_by_one, at_once = StreamTicket(0.1, 20), StreamTicket(0.1, 20)
    total = 1
    for new, _, now in runs:
        total += new
        one_by_one.add_tokens(total, now)
    at_once.add_token_runs(runs)

    assert field_values(at_once, StreamTicket.__slots__) == field_values(one_by_one, StreamTicket.__slots__)
    assert at_once.num_tokens == 10 and sum(n for _, n in at_once.gap_runs) == 9
    empty = StreamTicket(0.1, 20)
    empty.add_token_runs([(0, 0.0, 0.5)])
    assert empty.last_token_at is None and empty.num_tokens == 1


def test_a_streams_median_gap_is_the_middle_of_its_gaps_one_by_one():
    """Run-length coded gaps (an event of several tokens is one run) give the median of the
    gaps listed one by one: the upper middle of an even count, as the decode rate has used."""
    import random

    from dpd.router.load import StreamTicket

    rng = random.Random(11)
    for _ in range(200):
        ticket, t, total, one_by_one = StreamTicket(0.0, 50), 0.0, 1, []
        for _ in range(rng.randint(1, 12)):
            new, t = rng.randint(1, 4), t + rng.choice([0.1, 0.2, 0.25, 1.0])
            last = ticket.last_token_at if ticket.last_token_at is not None else ticket.started_at
            one_by_one += [(t - last) / new] * new
            total += new
            ticket.add_tokens(total, t)
        assert ticket.median_gap_s() == sorted(one_by_one)[len(one_by_one) // 2]
    assert StreamTicket(0.0, 5).median_gap_s() != StreamTicket(0.0, 5).median_gap_s()  # NaN: no gap yet


@pytest.mark.parametrize("seed", range(10))
def test_the_windows_kept_sorted_in_place_hold_what_sorting_them_would(seed):
    """``Residuals`` and ``WorkerLoad.recent_services_s`` keep their sorted lists in place as
    samples come, the window evicts and age expires them: after any mix of those, the list read
    is the window's values sorted, as sorting on every read gave (ties and repeats included)."""
    import random

    rng = random.Random(seed)
    clock = FakeClock()
    errors = Residuals(window=rng.choice([1, 4, 64]), min_samples=1, max_age_s=rng.choice([5.0, 60.0]), clock=clock)
    load = WorkerLoad(clock=clock, window_s=rng.choice([5.0, 60.0]), min_sample_tokens=1)
    load._recent = type(load._recent)(maxlen=rng.choice([1, 3, 256]))  # a short window evicts often
    for _ in range(400):
        action = rng.random()
        if action < 0.4:
            errors.add(rng.choice([0.0, -0.0, 0.5, -1.25, rng.uniform(-3, 3)]))
        elif action < 0.7:
            ticket = load.begin_prefill(rng.randint(1, 500))
            clock.now += rng.choice([0.0, 0.001, 0.3])
            load.end_prefill(ticket, is_ok=True)
        elif action < 0.85:
            clock.now += rng.choice([0.5, 3.0, 20.0])
        else:
            assert errors._ordered() == sorted(error for _, error in errors._samples)
            since = clock.now - load.window_s
            assert load.recent_services_s() == sorted(s for end, s in load._recent if end >= since)
    assert errors._ordered() == sorted(error for _, error in errors._samples)
    assert load.recent_services_s() == sorted(s for end, s in load._recent if end >= clock.now - load.window_s)

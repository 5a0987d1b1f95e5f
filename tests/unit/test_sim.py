"""The simulator on cases with answers computed by hand, and the router's deciders inside it."""

from __future__ import annotations

import pytest

from dpd.bench.stats import percentile, weighted_percentile
from dpd.router.adaptive import Slo
from dpd.sim.engine import Engine, EngineProfile, Job, Sim, SimEndpoint

PROFILE = EngineProfile(prefill_tokens_per_s=100.0, step_overhead_s=0.1, decode_s_per_stream=0.0,
                        max_batched_tokens=500, kv_transfer_s=0.5)


def test_one_request_alone():
    """Prefill in one step (0.1 + 300/100 s), then one token per 0.1 s step."""
    [o] = SimEndpoint("colocated", num_prefill=0, num_decode=1, profile=PROFILE).replay([(0.0, 300, 5)])
    assert o.ttft_s == pytest.approx(3.1) and o.tpot_s == pytest.approx(0.1)


def test_a_long_prefill_stalls_the_stream_beside_it():
    """A stream decoding when a 400-token prompt arrives waits out its 4.1 s step."""
    a, b = SimEndpoint("colocated", num_prefill=0, num_decode=1, profile=PROFILE).replay(
        [(0.0, 10, 4), (0.25, 400, 2)])
    assert a.ttft_s == pytest.approx(0.2)
    # a's tokens: 0.2 (first), 0.3, then the step started at 0.3 runs b's prefill with a's token: 4.4, 4.5
    assert a.token_times == pytest.approx([0.2, 0.3, 4.4, 4.5])
    assert b.ttft_s == pytest.approx(4.4 - 0.25)


def test_fifo_chunks_under_the_token_budget():
    """Three 300-token prompts queued behind a running step: the next step's budget (500) takes
    all of the first and 200 of the second (0.1 + 5 s); the next, the rest of both (0.1 + 4 s)."""
    outs = SimEndpoint("colocated", num_prefill=0, num_decode=1, profile=PROFILE).replay(
        [(0.0, 10, 1), (0.05, 300, 1), (0.05, 300, 1), (0.05, 300, 1)])
    assert [o.ttft_s + o.arrival_s for o in outs] == pytest.approx([0.2, 5.3, 9.4, 9.4])


def test_the_static_split_prefills_long_prompts_on_the_prefill_worker():
    outs = SimEndpoint("threshold", threshold_tokens=100, profile=PROFILE).replay([(0.0, 300, 3), (0.0, 20, 3)])
    assert [o.path for o in outs] == ["disaggregated", "direct"]
    # prefill 3.1 s, the KV pull 0.5 s, then the decoder's next step gives the first token
    assert outs[0].ttft_s == pytest.approx(3.1 + 0.5 + 0.1, abs=0.11)


def test_a_pulled_kv_costs_the_decoders_step_that_admits_it():
    """A 300-token split lands on a decoder streaming a short request. Prefilled at 3.15 s; with
    0.001 s a pulled token the decoder's admitting step is 0.1 + 0.3 s, and the request waits the
    measured 0.5 s less those 0.3 s for it: submitted at 3.35, it waits for the step ending at
    3.4, and its first token comes at 3.8 either way; the stream beside it gets a 0.4 s gap."""
    from dataclasses import replace

    requests = [(0.0, 20, 60), (0.05, 300, 3)]
    plain = SimEndpoint("threshold", threshold_tokens=100, profile=PROFILE).replay(requests)
    pulled = SimEndpoint("threshold", threshold_tokens=100,
                         profile=replace(PROFILE, kv_pull_s_per_token=0.001)).replay(requests)
    assert [o.path for o in pulled] == ["direct", "disaggregated"]
    assert pulled[1].first_s == pytest.approx(3.8) and plain[1].first_s == pytest.approx(3.8)
    assert max(g for g, _ in plain[0].gaps) == pytest.approx(0.1)
    assert max(g for g, _ in pulled[0].gaps) == pytest.approx(0.4)
    assert any(t == pytest.approx(3.8) for t in pulled[0].token_times)


def test_a_prefill_beside_a_decoding_worker_of_its_machine_is_slower():
    """prefill_slowdown 2 on a machine of two: the split's 300 tokens, its step starting at 0.35 while
    the decoder streams, take 0.1 + 2 × 3 s (prefilled 6.45); the KV pull 0.5 s, then the idle
    decoder's step: 7.05. On machines of one worker each: prefilled 3.45, handed over at 3.95, its
    first token at the end of the step after the one under way (4.0): 4.1."""
    from dataclasses import replace

    requests = [(0.0, 20, 60), (0.35, 300, 3)]
    shared = SimEndpoint("threshold", threshold_tokens=100,
                         profile=replace(PROFILE, prefill_slowdown=2.0, machine_workers=2)).replay(requests)
    apart = SimEndpoint("threshold", threshold_tokens=100,
                        profile=replace(PROFILE, prefill_slowdown=2.0, machine_workers=1)).replay(requests)
    assert shared[1].path == "disaggregated"
    assert shared[1].first_s == pytest.approx(7.05) and apart[1].first_s == pytest.approx(4.1)
    assert shared[0].token_times == apart[0].token_times  # the decoder's own pace unchanged


def test_a_stream_beside_a_prefill_of_its_machine_is_slower_for_the_steps_it_lasts():
    """decode_slowdown 2: the stream's stretch of 0.1 s steps is cut when the prefill worker starts
    (0.35) and runs 0.2 s steps from the end of the step under way (0.4) until the one under way
    when the prefill ends (3.45) ends (3.6): sixteen gaps of 0.2 s, the others 0.1 s."""
    from dataclasses import replace

    profile = replace(PROFILE, decode_slowdown=2.0, machine_workers=2)
    stream, split = SimEndpoint("threshold", threshold_tokens=100, profile=profile).replay(
        [(0.0, 20, 60), (0.35, 300, 3)])
    assert split.path == "disaggregated" and split.first_s == pytest.approx(3.45 + 0.5 + 0.1, abs=0.11)
    slow = sum(n for g, n in stream.gaps if g == pytest.approx(0.2))
    fast = sum(n for g, n in stream.gaps if g == pytest.approx(0.1))
    assert (slow, fast) == (16, 59 - 16)
    times = stream.token_times
    assert times[1] == pytest.approx(0.4) and times[17] == pytest.approx(3.6)


def test_workers_on_machines_of_their_own_are_undisturbed():
    """Slowdowns with machine_workers 1 (or both 1.0) change no outcome."""
    from dataclasses import replace

    requests = [(0.1 * i, 50 + 37 * i % 400, 2 + i % 9) for i in range(60)]
    base = SimEndpoint("colocated", num_prefill=0, num_decode=2, profile=PROFILE).replay(requests)
    for profile in (replace(PROFILE, prefill_slowdown=3.0, decode_slowdown=3.0),
                    replace(PROFILE, machine_workers=2)):
        again = SimEndpoint("colocated", num_prefill=0, num_decode=2, profile=profile).replay(requests)
        assert [o.token_times for o in again] == [o.token_times for o in base]
    slowed = SimEndpoint("colocated", num_prefill=0, num_decode=2,
                         profile=replace(PROFILE, prefill_slowdown=3.0, machine_workers=2)).replay(requests)
    assert sum(o.ttft_s for o in slowed) > sum(o.ttft_s for o in base)


@pytest.mark.parametrize("field", ["prefill_slowdown", "decode_slowdown"])
def test_a_slowdown_below_one_is_refused(field):
    with pytest.raises(ValueError, match=field):
        EngineProfile(**{field: 0.5})


def test_the_adaptive_policy_runs_inside_the_simulator():
    requests = [(i * 0.5, 300 if i % 3 == 0 else 20, 8) for i in range(30)]
    outs = SimEndpoint("adaptive", profile=PROFILE, slo=Slo(10.0, 0.5)).replay(requests)
    assert all(o.first_s == o.first_s for o in outs)  # every request served (no NaN)
    assert {o.reason for o in outs} <= {"short_prompt", "decoder_busy", "prefill_queue_long", "split_no_gain"}


def test_the_shortlist_index_changes_no_outcome_of_a_large_endpoint():
    """Pools larger than the decider's shortlist (12 + 12 workers, 8 per role scored): with the
    index the simulator keeps (``ShortlistIndex``) and with a pass over the pools on every
    decision, the same paths, reasons, workers' token times and predicted TTFTs."""
    import dataclasses
    import random

    rng = random.Random(7)
    requests, t = [], 0.0
    for _ in range(400):
        t += rng.expovariate(30.0)
        requests.append((t, rng.choice([40, 300, 900, 2500]), rng.choice([1, 8, 40])))
    profile = EngineProfile(prefill_tokens_per_s=2000.0, step_overhead_s=0.02, decode_s_per_stream=0.002, kv_transfer_s=0.1)

    def outcomes(with_index: bool) -> list[tuple]:
        endpoint = SimEndpoint("adaptive", num_prefill=12, num_decode=12, profile=profile)
        assert endpoint.candidates.index is not None
        if not with_index:
            endpoint.candidates = dataclasses.replace(endpoint.candidates, index=None)
        return [(o.path, o.reason, o.token_times, o.predicted_ttft_s) for o in endpoint.replay(requests)]

    indexed = outcomes(True)
    assert indexed == outcomes(False)
    assert {path for path, *_ in indexed} == {"direct", "disaggregated"}


def test_an_arrival_cuts_a_decode_only_stretch_at_the_step_under_way():
    """a decodes alone in 0.1 s steps (one event for the stretch); b arrives at 0.55, inside the
    step ending at 0.6, and its 100-token prefill runs in the next step (0.1 + 1 s) beside a's token."""
    a, b = SimEndpoint("colocated", num_prefill=0, num_decode=1, profile=PROFILE).replay([(0.0, 10, 20), (0.55, 100, 3)])
    assert a.token_times[:8] == pytest.approx([0.2, 0.3, 0.4, 0.5, 0.6, 1.7, 1.8, 1.9])
    assert b.ttft_s == pytest.approx(1.7 - 0.55) and b.token_times == pytest.approx([1.7, 1.8, 1.9])
    assert a.num_tokens == 20 and a.tpot_s == pytest.approx((a.token_times[-1] - 0.2) / 19)


def test_the_router_sees_the_tokens_of_a_stretch_made_so_far():
    sim, seen = Sim(), []
    engine = Engine(sim, PROFILE)
    job = Job(10, 50, lambda t: None, lambda deliveries: seen.append([(n, round(gap, 9), round(t, 9))
                                                                      for n, gap, t in deliveries]), lambda t: None)
    sim.at(0.0, lambda: engine.submit(job))
    sim.at(0.65, engine.sync)  # first token at 0.2, then steps end at 0.3 … 0.6: four done by 0.65
    sim.run()
    assert seen[0] == [(4, 0.1, 0.6)] and job.generated == 50
    assert sum(n for hand in seen for n, _, _ in hand) == 49 and seen[-1][-1][2] == pytest.approx(0.2 + 49 * 0.1)


def _mixed_requests(seed: int, num: int = 600) -> list[tuple[float, int, int]]:
    import random

    rng = random.Random(seed)
    requests, t = [], 0.0
    for _ in range(num):
        t += rng.expovariate(8.0)
        requests.append((t, rng.choice([20, 150, 600]), rng.choice([1, 2, 12, 60, 400])))
    return requests


@pytest.mark.parametrize("policy", ["colocated", "threshold", "adaptive"])
def test_dropping_the_delivery_log_changes_no_outcome(policy, monkeypatch):
    """The engine logs each delivery once and hands a stream those it has not seen (at its end,
    or when the router looks); the log's head, seen by every running stream, is dropped. Kept
    short (a few deliveries) or whole, every token time and decision is the same — a stream
    handed a delivery twice, or one dropped before it saw it, would change them."""
    profile = EngineProfile(prefill_tokens_per_s=3000.0, step_overhead_s=0.02, decode_s_per_stream=0.001, kv_transfer_s=0.05)
    requests = _mixed_requests(3)

    def outcomes(keep: int) -> list[tuple]:
        monkeypatch.setattr(Engine, "LOG_KEEP", keep)
        endpoint = SimEndpoint(policy, num_prefill=1, num_decode=2, threshold_tokens=100, profile=profile)
        return [(o.path, o.reason, o.num_tokens, o.token_times, o.predicted_ttft_s) for o in endpoint.replay(requests)]

    whole = outcomes(10**9)
    assert outcomes(2) == whole
    assert all(n == m for (_, _, n, *_), (_, _, m) in zip(whole, requests))  # every token made


# what the compiled build (tests/integration/test_sim_compiled.py) must reproduce too
PINNED_DIGESTS = [("colocated", "063f5a42a40ddf55"), ("threshold", "f1db009fbc3eab7d"), ("adaptive", "49bbcf7ed740f096")]


@pytest.mark.parametrize("policy,digest", PINNED_DIGESTS)
def test_the_simulators_outcomes_are_pinned(policy, digest):
    """Every path, reason, token time and predicted TTFT of a mixed workload, hashed: the digests
    were taken before the engine's token bookkeeping was rewritten (b4c3030) and must not move
    with a speed-up; a change that is meant to move them updates them and says why."""
    import hashlib

    profile = EngineProfile(prefill_tokens_per_s=3000.0, step_overhead_s=0.02, decode_s_per_stream=0.001, kv_transfer_s=0.05)
    outs = SimEndpoint(policy, num_prefill=1, num_decode=2, threshold_tokens=100, profile=profile).replay(_mixed_requests(3))
    seen = repr([(o.path, o.reason, o.token_times, o.predicted_ttft_s) for o in outs])
    assert hashlib.sha256(seen.encode()).hexdigest()[:16] == digest


# the same workload with its three workers on one machine, slowing one another (taken when the
# interference was modelled, 2026-12-07; a speed-up must not move them either)
MACHINE_DIGESTS = [("colocated", "aa2702170afda74e"), ("threshold", "6fe584e2e6a1ca06"), ("adaptive", "68a86b65288c15d8")]


@pytest.mark.parametrize("policy,digest", MACHINE_DIGESTS)
def test_the_simulators_outcomes_on_one_machine_are_pinned(policy, digest):
    import hashlib
    from dataclasses import replace

    profile = EngineProfile(prefill_tokens_per_s=3000.0, step_overhead_s=0.02, decode_s_per_stream=0.001, kv_transfer_s=0.05)
    profile = replace(profile, prefill_slowdown=1.6, decode_slowdown=1.3, machine_workers=3)
    outs = SimEndpoint(policy, num_prefill=1, num_decode=2, threshold_tokens=100, profile=profile).replay(_mixed_requests(3))
    seen = repr([(o.path, o.reason, o.token_times, o.predicted_ttft_s) for o in outs])
    assert hashlib.sha256(seen.encode()).hexdigest()[:16] == digest


def test_arrivals_given_out_of_order_are_served_in_time_order():
    requests = _mixed_requests(5, 200)
    shuffled = list(reversed(requests))
    forward = SimEndpoint("colocated", num_prefill=0, num_decode=2, profile=PROFILE).replay(requests)
    backward = SimEndpoint("colocated", num_prefill=0, num_decode=2, profile=PROFILE).replay(shuffled)
    assert [(o.first_s, o.token_times) for o in forward] == [(o.first_s, o.token_times) for o in reversed(backward)]


def test_an_event_scheduled_before_the_run_goes_before_an_arrival_at_the_same_time():
    sim, order = Sim(), []
    sim.at(1.0, lambda: order.append("scheduled"))
    sim.run([(0.5, lambda: order.append("early")), (1.0, lambda: (order.append("arrival"),
                                                                  sim.at(1.0, lambda: order.append("later"))))])
    assert order == ["early", "scheduled", "arrival", "later"]


@pytest.mark.parametrize("q", [0.0, 0.5, 0.9, 0.99, 1.0])
def test_a_weighted_percentile_is_the_percentile_of_the_expanded_list(q):
    counted = [(0.3, 5), (0.1, 1), (2.0, 2), (0.1, 3), (0.7, 0), (float("inf"), 1)]
    expanded = [v for v, n in counted for _ in range(n)]
    assert weighted_percentile(counted, q) == pytest.approx(percentile(expanded, q))
    assert weighted_percentile([(0.5, 4)], q) == 0.5
    assert weighted_percentile([], q) != weighted_percentile([], q)  # NaN, as percentile


def test_no_more_than_max_num_seqs_requests_share_a_step():
    """Two sequences at most: the third prompt waits until the first stream ends (vLLM's
    max_num_seqs), although the token budget would take it."""
    from dataclasses import replace

    profile = replace(PROFILE, max_num_seqs=2)
    outs = SimEndpoint("colocated", num_prefill=0, num_decode=1, profile=profile).replay(
        [(0.0, 10, 3), (0.0, 10, 5), (0.0, 10, 2)])
    # a's prefill alone (0.1 + 0.1 s, it arrived first), then b's beside a's token (→ 0.4); c waits;
    # a decode step with a and b (→ 0.5) ends a; then c's prefill beside b's token (→ 0.7).
    assert [o.first_s for o in outs[:2]] == pytest.approx([0.2, 0.4])
    assert outs[0].last_s == pytest.approx(0.5)
    assert outs[2].first_s == pytest.approx(0.5 + 0.2)  # admitted in the step after a's last: 0.1 + 10/100 s

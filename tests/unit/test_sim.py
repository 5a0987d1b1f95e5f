"""The simulator on cases with answers computed by hand, and the router's deciders inside it."""

from __future__ import annotations

import pytest

from dpd.router.adaptive import Slo
from dpd.sim.engine import EngineProfile, SimEndpoint

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


def test_the_adaptive_policy_runs_inside_the_simulator():
    requests = [(i * 0.5, 300 if i % 3 == 0 else 20, 8) for i in range(30)]
    outs = SimEndpoint("adaptive", profile=PROFILE, slo=Slo(10.0, 0.5)).replay(requests)
    assert all(o.first_s == o.first_s for o in outs)  # every request served (no NaN)
    assert {o.reason for o in outs} <= {"short_prompt", "decoder_busy", "prefill_queue_long", "split_no_gain"}

"""``dpd bench ladder``'s method: the same requests at every rate, the run order, the statistics."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from dpd.bench.client import add_token_gaps
from dpd.bench.ladder import (
    LadderSpec,
    _fmt_ratio,
    adaptive_settings,
    at_rate,
    capacity,
    class_figures,
    open_breakers,
    paired_ratio,
    report,
    request_set,
    schedule,
)
from dpd.bench.stats import RequestRecord, Slo, bootstrap_ci
from dpd.cli import DEFAULT_TRACE_DIR

SLO = Slo(ttft_s=10, tpot_s=0.2)


def spec(**kw) -> LadderSpec:
    return LadderSpec(trace_dir=str(DEFAULT_TRACE_DIR), rates_rps=(0.3, 0.6, 0.9), slo=SLO, **kw)


@pytest.mark.parametrize("workload", ["trace", "synthetic"])
def test_same_requests_at_every_rate(workload):
    requests, description = request_set(spec(num_requests=120), workload)
    assert len(requests) == 120 and description
    mean_rate = (len(requests) - 1) / requests[-1].arrival_s
    assert mean_rate == pytest.approx(1.0, rel=0.2 if workload == "synthetic" else 1e-9)
    slow, fast = at_rate(requests, 0.3), at_rate(requests, 0.9)
    strip = [(r.num_prompt_tokens, r.num_output_tokens, r.source) for r in requests]
    assert [(r.num_prompt_tokens, r.num_output_tokens, r.source) for r in slow] == strip
    assert [(r.num_prompt_tokens, r.num_output_tokens, r.source) for r in fast] == strip
    assert [round(a.arrival_s / b.arrival_s, 9) for a, b in zip(slow[1:], fast[1:])] == [3.0] * 119
    assert max(r.num_prompt_tokens for r in requests) <= 768 and max(r.num_output_tokens for r in requests) <= 48


def test_trace_ships_with_the_package():
    assert (DEFAULT_TRACE_DIR / "AzureLLMInferenceTrace_conv.csv").is_file()
    assert "CC BY 4.0" in (DEFAULT_TRACE_DIR / "README.md").read_text()


def test_schedule_shuffles_rates_and_rotates_scenarios():
    runs = schedule(spec(rounds=2, workloads=("trace",)))
    assert len(runs) == 2 * 3 * 3
    steps = [runs[i:i + 3] for i in range(0, len(runs), 3)]
    firsts = [step[0][3] for step in steps]
    for scenario in ("colocated", "dpd", "dpd-adaptive"):
        assert firsts.count(scenario) == 2  # each scenario leads equally often
    for round_index in (0, 1):
        rates = [step[0][2] for step in steps if step[0][0] == round_index]
        assert sorted(rates) == [0.3, 0.6, 0.9]
    assert all({r[3] for r in step} == {"colocated", "dpd", "dpd-adaptive"} for step in steps)


def test_a_workload_may_have_its_own_rates():
    runs = schedule(spec(workloads=("trace", "synthetic"), workload_rates=(("trace", (0.1, 0.2)),)))
    assert sorted({r[2] for r in runs if r[1] == "trace"}) == [0.1, 0.2]
    assert sorted({r[2] for r in runs if r[1] == "synthetic"}) == [0.3, 0.6, 0.9]


def test_open_breakers_names_pool_and_worker_breakers():
    state = {"pools": {"prefill": {"breaker": "half_open", "workers": [{"name": "prefill-0", "breaker": "open"}]},
                       "decode": {"breaker": None, "workers": [{"name": "decode-0", "breaker": "closed"}]}}}
    assert open_breakers(state) == ["prefill:*", "prefill:prefill-0"]
    assert open_breakers({"pools": {"decode": {"breaker": None, "workers": [{"name": "d", "breaker": "closed"}]}}}) == []


def test_bootstrap_of_a_mean_has_the_textbook_interval():
    rng = random.Random(1)
    values = [rng.gauss(10.0, 2.0) for _ in range(400)]
    lo, hi = bootstrap_ci(lambda idx: sum(values[i] for i in idx) / len(idx), len(values), num_resamples=2000, seed=3)
    half = 1.96 * 2.0 / 400 ** 0.5  # 0.196
    mean = sum(values) / len(values)
    assert lo == pytest.approx(mean - half, abs=0.05) and hi == pytest.approx(mean + half, abs=0.05)


def test_rounds_that_disagree_widen_the_interval_to_span_them():
    """Two rounds of 200 requests: every request met the SLO in round 1, 60% in round 2. Resampling
    requests alone gives about 0.80 ± 0.04; resampling rounds first reaches both rounds' values."""
    met = [1.0] * 200 + [1.0 if i % 5 < 3 else 0.0 for i in range(200)]
    mean = lambda idx: sum(met[i] for i in idx) / len(idx)  # noqa: E731
    flat = bootstrap_ci(mean, len(met), seed=1)
    by_round = bootstrap_ci(mean, len(met), seed=1, groups=[range(200), range(200, 400)])
    assert 0.74 < flat[0] < 0.8 < flat[1] < 0.86
    assert by_round[0] == pytest.approx(0.6, abs=0.05) and by_round[1] == pytest.approx(1.0, abs=0.01)
    # one round: the same as no groups
    assert bootstrap_ci(mean, len(met), seed=1, groups=[range(400)]) == flat


def test_per_token_gaps_from_multi_token_chunks():
    record = RequestRecord(ttft_s=1.0, e2e_s=2.0, num_output_tokens=6)
    add_token_gaps(record, None, 2)  # the first chunk carried 2 tokens
    add_token_gaps(record, 0.3, 1)
    add_token_gaps(record, 0.6, 3)  # a merged chunk: three gaps of 0.2
    assert record.itls_s == pytest.approx([0.0, 0.3, 0.2, 0.2, 0.2])
    assert len(record.itls_s) == record.num_output_tokens - 1 and record.num_merged_chunks == 2


def _usage(n: int) -> dict:
    return {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}



async def _completions_server(serve):
    """An aiohttp server answering POST /v1/completions with ``serve``, started."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    app = web.Application()
    app.router.add_post("/v1/completions", serve)
    server = TestServer(app)
    await server.start_server()
    return server


@pytest.mark.parametrize("chunks, gaps, ttft, tokens", [
    # an empty-text chunk carrying a token (a special token skipped, a held-back UTF-8 byte) is a token
    ([(0.0, "a", 1), (0.1, "", 2), (0.2, "b", 3)], [0.1, 0.1], 0.0, 3),
    ([(1.0, "", 1), (1.1, "a", 2), (1.2, "b", 3)], [0.1, 0.1], 1.0, 3),
    # without usage (a peer that strips it): a chunk with text is one token, and they are counted
    ([(0.0, "a", None), (0.5, "b", None), (1.5, "c", None)], [0.5, 1.0], 0.0, 3),
])
async def test_the_client_counts_every_token_a_chunk_brings(monkeypatch, chunks, gaps, ttft, tokens):
    """The stream a worker sends, replayed with its timing: gaps per token, TTFT at the first
    token even in an empty-text chunk, and tokens counted where the stream has no usage."""
    import aiohttp
    from aiohttp import web

    import dpd.bench.client as client
    from dpd.bench.workloads import TraceRequest

    clock = {"now": 0.0}

    async def serve(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for at, text, n in chunks:
            clock["now"] = at
            body = {"choices": [{"index": 0, "text": text}], **({"usage": _usage(n)} if n is not None else {})}
            await resp.write(b"data: " + json.dumps(body).encode() + b"\n\n")
            await asyncio.sleep(0.01)  # one chunk per read
        clock["now"] = chunks[-1][0]
        if chunks[-1][2] is not None:
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": _usage(chunks[-1][2])}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    server = await _completions_server(serve)
    reads = iter([-1.0])  # the send time, then each chunk's own time

    def perf_counter() -> float:
        return next(reads, clock["now"])

    monkeypatch.setattr(client, "time", SimpleNamespace(perf_counter=perf_counter))
    try:
        async with aiohttp.ClientSession() as session:
            record = await client.send(session, str(server.make_url("")).rstrip("/"), "m",
                                       TraceRequest(0.0, 8, 3, "test"), seed=1, threshold_tokens=100)
    finally:
        await server.close()
    assert record.is_ok and record.num_output_tokens == tokens
    assert record.itls_s == pytest.approx(gaps)
    assert record.ttft_s == pytest.approx(ttft + 1.0)


async def test_the_client_keeps_what_it_held_before_a_run_out_of_full_collections_during_it():
    """The client's own collector pauses would be measured as the server's gaps."""
    import gc

    from aiohttp import web

    import dpd.bench.client as client
    from dpd.bench.workloads import TraceRequest

    frozen_during: list[int] = []

    async def serve(request: web.Request) -> web.StreamResponse:
        frozen_during.append(gc.get_freeze_count())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": "a"}], "usage": _usage(1)}).encode()
                         + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    server = await _completions_server(serve)
    try:
        records, _ = await client.replay(str(server.make_url("")).rstrip("/"), "m", [TraceRequest(0.0, 8, 1, "test")],
                                         threshold_tokens=100, progress=False)
    finally:
        await server.close()
    assert [r.is_ok for r in records] == [True]
    assert frozen_during and frozen_during[0] > 0  # frozen while the run went on
    assert gc.get_freeze_count() == 0  # and not after it


def _records(ttfts: list[float], cls: str = "short", failed: tuple[int, ...] = ()) -> list[RequestRecord]:
    return [RequestRecord(ttft_s=t, e2e_s=t + 1.0, num_output_tokens=11, itls_s=[0.1] * 10, request_class=cls,
                          is_ok=i not in failed, index=i) for i, t in enumerate(ttfts)]


def test_failures_count_as_infinite_latency_and_small_classes_report_p90():
    figures = class_figures(_records([1.0] * 9 + [2.0], failed=(9,)), SLO)
    assert figures["quantile"] == "P90" and figures["num_failed"] == 1
    assert figures["ttft_q_s"] == float("inf")  # the P90 of ten reaches the failed one
    assert class_figures(_records([1.0] * 100), SLO)["quantile"] == "P99"


def test_paired_ratio_and_its_interval():
    base = _records([float(i % 10 + 1) for i in range(200)])
    halved = _records([float(i % 10 + 1) / 2 for i in range(200)])
    r = paired_ratio(halved, base, "ttft", 0.9, None, SLO)
    assert r["ratio"] == pytest.approx(0.5) and r["lo"] <= 0.5 <= r["hi"] and r["n"] == 200
    met = paired_ratio(halved, base, "met", 0, None, SLO)
    assert met["ratio"] == pytest.approx(1.0)


def test_failures_that_reach_the_percentile_widen_the_interval_to_infinity():
    """77 requests, 5 failed (+inf latency): P90 is finite, but resamples that draw the failures
    often enough put it at inf — those resamples count (an upper bound of ∞), not drop out."""
    base = _records([1.0 + i / 100 for i in range(77)])
    mine = _records([1.0 + i / 100 for i in range(77)], failed=(72, 73, 74, 75, 76))
    r = paired_ratio(mine, base, "ttft", 0.9, None, SLO)
    assert r["ratio"] == r["ratio"] and r["ratio"] < 2 and r["hi"] == float("inf")
    assert "∞" in _fmt_ratio(r)
    flipped = paired_ratio(base, mine, "ttft", 0.9, None, SLO)
    assert flipped["lo"] == 0.0  # a finite P90 over an infinite one


@pytest.mark.parametrize("attainments, expected", [
    ({0.3: 1.0, 0.6: 0.95, 0.9: 0.5}, 0.6),
    ({0.3: 0.8, 0.6: 0.95}, 0.0),  # a pass above a failure does not count
    ({0.3: 0.9}, 0.3),
    ({0.3: 1.0, 0.6: float("nan"), 0.9: 1.0}, 0.3),  # a rate with nothing measured meets nothing
])
def test_capacity_from_the_ladder(attainments, expected):
    assert capacity(attainments) == expected


def test_report_renders_every_table():
    s = spec(workloads=("synthetic",))
    runs = []
    for scenario, scale in (("colocated", 1.0), ("dpd", 1.2), ("dpd-adaptive", 0.8)):
        recs = _records([scale * (i % 7 + 1) for i in range(100)])
        runs.append({"round": 0, "workload": "synthetic", "rate_rps": 0.3, "scenario": scenario, "duration_s": 300,
                     "client_lag_p99_s": 0.001, "records": [asdict(r) for r in recs]})
    text = report({"spec": {**asdict(s), "slo": asdict(SLO)}, "workloads": {"synthetic": "a mix"}, "runs": runs})
    assert "dpd-adaptive ÷ colocated" in text and "dpd-adaptive ÷ dpd" in text
    assert "0.80× [" in text and "Capacity at the SLO" in text


def test_the_fitted_capacity_crosses_the_bar_between_rates():
    """Issue 20: capacity from the attainment curve, not the last rung that passed."""
    from dpd.bench.stats import fitted_capacity, fitted_capacity_ci

    def flags(share: float, n: int = 100) -> list[bool]:
        return [i < round(share * n) for i in range(n)]

    # 100% at 0.2, 95% at 0.4, 70% at 0.6: the 90% bar is crossed a fifth of the way to 0.6.
    met = {0.2: flags(1.0), 0.4: flags(0.95), 0.6: flags(0.70)}
    assert fitted_capacity(met) == pytest.approx(0.44)
    lo, hi = fitted_capacity_ci(met)
    assert 0.2 < lo < 0.44 < hi < 0.6
    # Where a resample of the top rate may pass the bar, the interval says "above the ladder".
    assert fitted_capacity_ci({0.2: flags(1.0), 0.4: flags(0.95), 0.6: flags(0.88)})[1] == float("inf")
    # A rise with load is noise: the curve is made non-increasing first.
    assert fitted_capacity({0.2: flags(0.95), 0.4: flags(0.8), 0.6: flags(0.99)}) == pytest.approx(0.2 + 0.2 * 0.05 / 0.15)
    assert fitted_capacity({0.2: flags(0.5), 0.4: flags(0.1)}) == 0  # below the ladder
    assert fitted_capacity({0.2: flags(1.0), 0.4: flags(0.95)}) == float("inf")  # above it


def test_the_capacity_interval_carries_the_spread_between_rounds():
    """Rate 1 met by all in both rounds; at rate 2 round 0 met 100/100, round 1 60/100: the point
    is 1.5, and a resample of round 1 twice (1.25) or round 0 twice (above the ladder) is as
    likely as any — resampling the pooled requests alone would hide it."""
    from dpd.bench.stats import fitted_capacity, fitted_capacity_ci

    met = {1.0: [True] * 200, 2.0: [True] * 100 + [i < 60 for i in range(100)]}
    rounds = {1.0: [0] * 100 + [1] * 100, 2.0: [0] * 100 + [1] * 100}
    assert fitted_capacity(met) == pytest.approx(1.5)
    pooled_lo, pooled_hi = fitted_capacity_ci(met)
    lo, hi = fitted_capacity_ci(met, rounds_by_rate=rounds)
    assert 1.3 < pooled_lo and pooled_hi < 2.0
    assert lo <= 1.3 and hi == float("inf")


def test_the_slo_scale_multiplies_each_requests_own_best_latency():
    from dpd.bench.stats import RequestRecord, isolated_latencies, scaled_attainment

    def rec(index: int, ttft: float, e2e: float) -> RequestRecord:
        return RequestRecord(ttft_s=ttft, e2e_s=e2e, num_output_tokens=11, index=index)

    calm = [rec(0, 1.0, 2.0), rec(1, 2.0, 3.0)]  # TPOT 0.1 s each
    busy = [rec(0, 1.9, 2.9), rec(1, 6.5, 7.5)]  # request 1 waited 3.25× its best
    isolated = isolated_latencies(calm + busy)
    assert isolated == {0: (1.0, pytest.approx(0.1)), 1: (2.0, pytest.approx(0.1))}
    assert scaled_attainment(busy, isolated, 2.0) == 0.5
    assert scaled_attainment(busy, isolated, 5.0) == 1.0
    assert scaled_attainment(busy + [RequestRecord(ttft_s=0, e2e_s=0, num_output_tokens=0, is_ok=False, index=0)],
                             isolated, 5.0) == pytest.approx(2 / 3)  # a failure never meets it


def test_the_stall_limit_reaches_the_endpoint_config_only_when_given():
    from dpd.config.model import AdaptiveSpec
    assert "maxStallS" not in adaptive_settings(spec())
    settings = adaptive_settings(spec(adaptive_max_stall_s=0.2))
    assert settings == {"ttftSloS": 10, "tpotSloS": 0.2, "maxStallS": 0.2}
    assert AdaptiveSpec(**settings).maxStallS == 0.2  # a valid config
    settings = adaptive_settings(spec(adaptive_stall_weight=0.25))
    assert settings == {"ttftSloS": 10, "tpotSloS": 0.2, "stallWeight": 0.25}
    assert AdaptiveSpec(**settings).stallWeight == 0.25
    assert adaptive_settings(spec(adaptive_ttft_target_s=6.0))["ttftSloS"] == 6.0  # planned against; judged by SLO


def test_every_worker_of_the_pd_endpoint_prefills_a_maximum_length_prompt(monkeypatch):
    """Warm-up: one max-length prompt whole on the decode pool, one split through the prefill
    pool, whatever the scenario's policy would choose (it is set afterwards)."""
    import types

    from dpd.bench import ladder

    calls: list = []
    monkeypatch.setattr(ladder.requests, "put", lambda url, json, timeout: calls.append((url.rsplit("/", 1)[-1], json))
                        or types.SimpleNamespace(raise_for_status=lambda: None))

    async def replay(url, model, trace, **kw):
        calls.append(("sent", [r.num_prompt_tokens for r in trace]))
        return [], 0.0

    monkeypatch.setattr(ladder, "replay", replay)
    ladder.warm_every_worker(types.SimpleNamespace(url="http://router"), spec(max_prompt_tokens=768), seed=1)  # type: ignore[arg-type]
    assert calls == [("policy", {"policy": "threshold"}), ("threshold", {"threshold_tokens": 769}), ("sent", [768]),
                     ("policy", {"policy": "threshold"}), ("threshold", {"threshold_tokens": 0}), ("sent", [768])]


@pytest.mark.parametrize("workload", ["trace", "synthetic"])
def test_windows_are_other_request_sets_of_the_same_size(workload):
    first, _ = request_set(spec(windows=2), workload, window=0)
    second, described = request_set(spec(windows=2), workload, window=1)
    assert len(first) == len(second) == 100
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in first] != [(r.num_prompt_tokens, r.num_output_tokens) for r in second]
    assert second[0].arrival_s == 0 or workload == "synthetic"
    if workload == "trace":
        assert "#7000–#7099" in described


def test_a_window_past_the_trace_is_a_clear_error():
    with pytest.raises(ValueError, match="too few for window"):
        request_set(spec(num_requests=100), "trace", window=10)


def test_the_ladders_endpoints_keep_a_request_log_beside_the_results(tmp_path):
    from dpd.bench.ladder import endpoint_config
    from dpd.config.load import load_config

    config = load_config(endpoint_config(spec(adaptive_max_stall_s=0.1), tmp_path, "pd", (18400, 18500, 16500)))
    router = config.spec.pdSpec.router
    assert router.requestLog.path == str((tmp_path / "requests-pd.jsonl").resolve())
    assert router.adaptive.maxStallS == 0.1 and router.port == 18400


@pytest.mark.parametrize("argv, message", [
    (["--scenarios", "colocated,nope"], "unknown scenario"),
    (["--workloads", "trace,other"], "unknown workload"),
    (["--requests", "1"], "--requests must be >= 2"),
    (["--burstiness", "0"], "--burstiness must be > 0"),
    (["--adaptive-max-stall", "0"], "--adaptive-max-stall must be > 0"),
    (["--workloads", "trace", "--rounds", "7", "--windows", "7"], "too few for window"),
])
def test_bench_ladder_refuses_bad_input_before_starting_anything(argv, message, capsys, tmp_path, monkeypatch):
    """One line and exit 2, never a traceback, and no endpoint started."""
    import dpd.bench.ladder as ladder
    from dpd.cli import main

    def no_endpoint(*args, **kwargs):
        raise AssertionError("an endpoint was started")

    monkeypatch.setattr(ladder, "endpoints", no_endpoint)
    assert main(["bench", "ladder", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert "dpd bench ladder: " in err and message in err and "Traceback" not in err

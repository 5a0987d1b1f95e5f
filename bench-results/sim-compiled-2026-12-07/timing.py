"""Throwaway timings of the compiled simulator (session 25): the two scripts run, merged into one.
  python timing.py adaptive   — three runs of one policy as shipped (what perf-adaptive.txt profiled)
  python timing.py --gc       — the collector on / off / frozen during a run (gc-experiment.txt)
Run with PYTHONPATH=<a clone> and DPD_CACHE_DIR=<its build>."""
import gc
import sys

from dpd.sim import compiled

print(compiled.use())
import dpd.cli as cli  # noqa: E402
from dpd.bench.workloads import load_trace  # noqa: E402
from dpd.router.adaptive import Slo  # noqa: E402
from dpd.sim import speed  # noqa: E402
from dpd.sim.engine import SimEndpoint  # noqa: E402
from dpd.sim.profile import Profile  # noqa: E402

profile = Profile.load("/work/main/bench-results/remeasure-2026-12-06/profile.json").engine
trace = [(r.arrival_s, min(r.num_prompt_tokens, 8192), max(1, min(r.num_output_tokens, 512)))
         for r in load_trace(str(cli.DEFAULT_TRACE_DIR))]
span = trace[-1][0] - trace[0][0]
factor = sum(speed.work_s(r, profile) for r in trace) / (0.7 * 2 * span)
two = [((t - trace[0][0]) * factor, p, o) for t, p, o in trace]


def timed(policy: str) -> float:
    return speed.timed("x", SimEndpoint(policy, profile=profile, slo=Slo()), two, Slo(), 2).requests_per_s


if sys.argv[1] != "--gc":
    for _ in range(3):
        print(timed(sys.argv[1]))
else:
    for mode in ["on", "off", "freeze", "on", "off", "freeze"]:
        for policy in ["colocated", "adaptive"]:
            gc.collect()
            if mode == "off":
                gc.disable()
            if mode == "freeze":
                gc.freeze()
            rate = timed(policy)
            found = gc.collect() if mode == "off" else -1
            gc.enable()
            gc.unfreeze()
            print(mode, policy, round(rate), "cyclic garbage after the run:", found)

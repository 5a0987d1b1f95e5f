from dpd.sim import compiled
print(compiled.use())
import gc, sys, time
from dpd.bench.workloads import load_trace
from dpd.router.adaptive import Slo
from dpd.sim import speed
from dpd.sim.engine import SimEndpoint
from dpd.sim.profile import Profile
import dpd.cli as cli
profile = Profile.load("/work/main/bench-results/remeasure-2026-12-06/profile.json").engine
trace = [(r.arrival_s, min(r.num_prompt_tokens, 8192), max(1, min(r.num_output_tokens, 512))) for r in load_trace(str(cli.DEFAULT_TRACE_DIR))]
span = trace[-1][0]-trace[0][0]
factor = sum(speed.work_s(r, profile) for r in trace)/(0.7*2*span)
two = [((t-trace[0][0])*factor,p,o) for t,p,o in trace]
for mode in ["on", "off", "freeze", "on", "off", "freeze"]:
    for policy in ["colocated", "adaptive"]:
        gc.collect()
        if mode == "off": gc.disable()
        if mode == "freeze": gc.freeze()
        ep = SimEndpoint(policy, profile=profile, slo=Slo())
        r = speed.timed("x", ep, two, Slo(), 2).requests_per_s
        found = gc.collect() if mode == "off" else -1
        gc.enable(); gc.unfreeze()
        print(mode, policy, round(r), "cyclic garbage after the run:", found)

from dpd.sim import compiled
print(compiled.use())
from dpd.bench.workloads import load_trace
from dpd.router.adaptive import Slo
from dpd.sim import speed
from dpd.sim.engine import SimEndpoint
from dpd.sim.profile import Profile
import dpd.cli as cli, sys
profile = Profile.load("/work/main/bench-results/remeasure-2026-12-06/profile.json").engine
trace = [(r.arrival_s, min(r.num_prompt_tokens, 8192), max(1, min(r.num_output_tokens, 512))) for r in load_trace(str(cli.DEFAULT_TRACE_DIR))]
span = trace[-1][0]-trace[0][0]
factor = sum(speed.work_s(r, profile) for r in trace)/(0.7*2*span)
two = [((t-trace[0][0])*factor,p,o) for t,p,o in trace]
for i in range(3):
    ep = SimEndpoint(sys.argv[1], profile=profile, slo=Slo())
    print(speed.timed("x", ep, two, Slo(), 2).requests_per_s)

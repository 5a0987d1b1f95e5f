"""The adaptive policy's stallWeight swept in the simulator (a prediction, not a measurement):
the synthetic mix (600 requests, prompts <= 768, outputs 12-48, Poisson), the 2026-12-05 CPU
profile, colocated x 2 vs a 1P:1D static split (threshold 512) vs adaptive at each weight.
Run from the repository root: PYTHONPATH=. .venv/bin/python bench-results/2026-12-06/stall-weight-sim.py 0.6 1.0"""
import sys
from dpd.bench.workloads import synthetic
from dpd.bench.stats import percentile
from dpd.router.adaptive import Slo
from dpd.sim.engine import SimEndpoint
from dpd.sim.profile import Profile
profile = Profile.load("bench-results/profile-cpu-2026-12-05.json").engine
slo = Slo(10, 0.2)
def figures(out):
    longs = [o for o in out if o.prompt_tokens >= 512]
    shorts = [o for o in out if o.prompt_tokens < 512]
    gaps = [b - a for o in shorts for a, b in zip(o.token_times, o.token_times[1:])]
    return (percentile([o.ttft_s for o in longs], 0.9), percentile(gaps, 0.99), percentile([o.ttft_s for o in out], 0.99),
            sum(o.meets(slo) for o in out) / len(out))
for rate in [float(x) for x in sys.argv[1:]]:
    reqs = [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in
            synthetic(600, rate, max_prompt_tokens=768, output_tokens=(12, 48), burstiness=1.0, seed=0)]
    base = figures(SimEndpoint("colocated", profile=profile, slo=slo).replay(reqs))
    rows = [("colocated", base), ("threshold", figures(SimEndpoint("threshold", threshold_tokens=512, profile=profile, slo=slo).replay(reqs)))]
    for w in (1.0, 0.5, 0.25, 0.1, 0.0):
        rows.append((f"adaptive w={w}", figures(SimEndpoint("adaptive", profile=profile, slo=slo, stall_weight=w).replay(reqs))))
    for name, f in rows:
        print(f"rate {rate}: {name:18s} longTTFT90 {f[0]:6.2f} ({f[0]/base[0]:.2f}x) shortITL99 {f[1]*1000:6.0f} ({f[1]/base[1]:.2f}x) TTFT99 {f[2]:6.2f} ({f[2]/base[2]:.2f}x) att {f[3]:.0%}")

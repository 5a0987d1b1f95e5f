"""The adaptive policy as shipped ("counted": a plan is charged a miss for every stream on its
prefilling worker whose slack is below the prefill's time, streams already past their TPOT target
included) against a variant charging only new misses ("new only": streams with slack left) — a
prediction, not a measurement: the simulator replays a ladder's own request set at its rates with
the 2026-12-06 CPU profile. Run from the repository root:
  PYTHONPATH=. .venv/bin/python bench-results/lost-streams-1206/sim.py RESULTS.json [RESULTS.json ...]"""
import bisect
import json
import sys

import dpd.router.adaptive as adaptive
from dpd.bench.stats import percentile, weighted_percentile
from dpd.router.adaptive import Slo
from dpd.sim.check import _spec, at_rate, request_set
from dpd.sim.engine import SimEndpoint
from dpd.sim.profile import Profile

profile = Profile.load("bench-results/profile-cpu-2026-12-06.json").engine
shipped = adaptive.AdaptiveDecider._scored


def new_only(self, decision, ttft, exposure, d, m, prefill_s, prefiller, decode_wait_s=0.0):
    scored = shipped(self, decision, ttft, exposure, d, m, prefill_s, prefiller, decode_wait_s)
    slacks, _ = self._sorted_slacks(prefiller)
    lost = bisect.bisect_right(slacks, 0.0) if prefill_s > 0 else 0
    scored.misses -= lost
    scored.harm_misses -= lost
    scored.score -= adaptive.MISS_COST * lost
    return scored


def figures(out, boundary):
    longs = [o for o in out if o.prompt_tokens >= boundary]
    shorts = [o for o in out if o.prompt_tokens < boundary]
    gaps = [g for o in shorts for g in o.gaps]
    return (sum(o.meets(slo) for o in out) / len(out), percentile([o.ttft_s for o in longs], 0.9),
            percentile([o.ttft_s for o in shorts], 0.9), weighted_percentile(gaps, 0.99))


for path in sys.argv[1:]:
    results = json.load(open(path))
    spec = _spec(results)
    slo = Slo(spec.slo.ttft_s, spec.slo.tpot_s)
    for workload in spec.workloads:
        base = request_set(spec, workload)[0]
        rates = dict(spec.workload_rates).get(workload, spec.rates_rps)
        for rate in rates:
            reqs = [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in at_rate(base, rate)]
            rows = {}
            for name, scored in (("counted", shipped), ("new only", new_only)):
                adaptive.AdaptiveDecider._scored = scored
                rows[name] = figures(SimEndpoint("adaptive", profile=profile, slo=slo).replay(reqs), spec.threshold_tokens)
            adaptive.AdaptiveDecider._scored = shipped
            for name in ("colocated", "threshold"):
                rows[name] = figures(SimEndpoint(name, profile=profile, slo=slo, threshold_tokens=spec.threshold_tokens).replay(reqs),
                                     spec.threshold_tokens)
            for name, f in rows.items():
                print(f"{path.split('/')[-2]} {workload} {rate:g} req/s {name:9s} attainment {f[0]:.0%}  long TTFT P90 {f[1]:6.2f} s"
                      f"  short TTFT P90 {f[2]:6.2f} s  short gap P99 {f[3] * 1000:5.0f} ms")

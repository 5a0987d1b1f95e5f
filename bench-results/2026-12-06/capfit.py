"""Capacity fitted over several ladder invocations: attainment pooled per (scenario, rate).
Run from the repository root: PYTHONPATH=. .venv/bin/python bench-results/2026-12-06/capfit.py RESULTS.json..."""
import json, sys
from dpd.bench.stats import RequestRecord, Slo, fitted_capacity, fitted_capacity_ci
slo = Slo(10, 0.2)
met = {}
for path in sys.argv[1:]:
    d = json.load(open(path))
    for run in d["runs"]:
        recs = [RequestRecord(**r) for r in run["records"]]
        met.setdefault(run["scenario"], {}).setdefault(run["rate_rps"], []).extend(slo.is_met(r) for r in recs)
for s, m in met.items():
    att = {r: f"{sum(v)/len(v):.0%} (n={len(v)})" for r, v in sorted(m.items())}
    print(s, att, "fitted", round(fitted_capacity(m), 2), [round(x, 2) for x in fitted_capacity_ci(m)])

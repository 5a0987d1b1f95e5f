"""What the longest inter-token gaps of a ladder's P/D runs coincide with (session 26).

For each P/D run of a `dpd bench ladder` results.json: the top 1% of its measured inter-token
gaps, each put in the first class that holds — the decoder ran a whole request's prefill during
it (a short prompt served direct), a split request's first token came on the decoder during it
(its KV admitted), the prefill worker was computing (a split's send → first token) with nothing
of the decoder's own, or nothing else in flight. Request times are the schedule's arrival plus
the client's send lag; token times the first token plus the gaps.

    .venv/bin/python bench-results/itl-tail-2026-12-07/classify.py bench-results/check-learned-2026-12-07/results.json
"""
import collections
import sys

from dpd.sim.check import _load

ladder = _load(sys.argv[1])
for run in ladder.runs:
    if run.scenario not in ("dpd", "dpd-adaptive"):
        continue
    own, admitted, prefilling, gaps = [], [], [], []
    for (arrival, _, _), record in zip(run.requests, run.records):
        if not record.is_ok:
            continue
        sent = arrival + record.send_lag_s
        first = sent + record.ttft_s
        if record.path == "disaggregated":
            admitted.append(first)
            prefilling.append((sent, first))
        else:
            own.append((sent, first))
        t = first
        for gap in record.itls_s:
            gaps.append((t, t + gap, gap))
            t += gap
    gaps.sort(key=lambda g: -g[2])
    top = gaps[:max(1, len(gaps) // 100)]
    classes: collections.Counter[str] = collections.Counter()
    for start, end, _ in top:
        if any(s < end and e > start for s, e in own):
            classes["the decoder's own prefill"] += 1
        elif any(start - 0.01 <= f <= end + 0.01 for f in admitted):
            classes["a split's KV admitted"] += 1
        elif any(s < end and e > start for s, e in prefilling):
            classes["the prefill worker computing, nothing on the decoder"] += 1
        else:
            classes["nothing else in flight"] += 1
    print(f"{run.scenario} {run.rate_rps} req/s: top 1% = {len(top)} of {len(gaps)} gaps, "
          f"{top[-1][2] * 1000:.0f}–{top[0][2] * 1000:.0f} ms: {dict(classes)}")

#!/bin/bash
# The check of each ladder with its own profile, then with the pull cost measured today added.
OUT=/work/main/bench-results/pull-cost-2026-12-07
PULL=${PULL:-$(python3 -c "import json;print(json.load(open('$OUT/profile.json'))['engine']['kv_pull_s_per_token'])")}
for L in check-learned-2026-12-07 ladder-trace-2r-1206 ladder-synth-3rates-1206 ladder-synth-070-2r-1206 ladder-trace-1206 ladder-trace-hi-1206 ladder-trace-290-1206; do
  if [ $L = check-learned-2026-12-07 ]; then P=/work/main/bench-results/check-learned-2026-12-07/profile.json; else P=/work/main/bench-results/remeasure-2026-12-06/profile.json; fi
  python3 -c "import json,sys;d=json.load(open('$P'));d['engine']['kv_pull_s_per_token']=$PULL;json.dump(d,open('$OUT/profile-$L-with-pull$SUFFIX.json','w'),indent=1)"
  for V in without with; do
    PP=$P; [ $V = with ] && PP=$OUT/profile-$L-with-pull$SUFFIX.json
    echo "== $L $V pull"
    PYTHONPATH=/tmp/benchrepo /work/main/.venv/bin/python -m dpd plan --check /work/main/bench-results/$L/results.json --profile $PP --speed-under-load 0.85 > $OUT/check-$L-$V$SUFFIX.md 2>&1
    tail -5 $OUT/check-$L-$V$SUFFIX.md
  done
done

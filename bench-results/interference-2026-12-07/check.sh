#!/bin/bash
# The check of each ladder with its own profile, as is and with the interference between the two
# workers that profile-d.json measured (prefill ×1.33 beside a decoding worker, a decode step
# ×1.247 beside a prefill, 2 workers a machine) added, at speeds under load 1.0 and 0.85.
# Usage: bash check.sh TREE   (a snapshot of the repository to run)
TREE=$1
OUT=/work/main/bench-results/interference-2026-12-07
for L in check-learned-2026-12-07 ladder-trace-2r-1206 ladder-synth-3rates-1206 ladder-synth-070-2r-1206 ladder-trace-1206 ladder-trace-hi-1206 ladder-trace-290-1206; do
  if [ $L = check-learned-2026-12-07 ]; then P=/work/main/bench-results/check-learned-2026-12-07/profile.json; else P=/work/main/bench-results/remeasure-2026-12-06/profile.json; fi
  python3 -c "
import json; d = json.load(open('$P')); m = json.load(open('$OUT/profile-d.json'))['engine']
for k in ('prefill_slowdown', 'decode_slowdown', 'machine_workers'): d['engine'][k] = m[k]
json.dump(d, open('$OUT/profile-$L-interference.json', 'w'), indent=1)"
  for S in ${SPEEDS:-1.0 0.85}; do
    for V in without with; do
      PP=$P; [ $V = with ] && PP=$OUT/profile-$L-interference.json
      (cd /tmp && PYTHONPATH=$TREE /work/main/.venv/bin/python -m dpd plan --check /work/main/bench-results/$L/results.json --profile $PP --speed-under-load $S > $OUT/check-$L-$V-$S.md 2>&1)
    done
  done
done
for S in ${SPEEDS:-1.0 0.85}; do for V in without with; do
  echo "== interference $V, speed under load $S"
  for k in "Attainment within 10" "TTFT P50 within" "TTFT P99 within" "ITL P99 within"; do
    cat $OUT/check-*-$V-$S.md | grep "^$k" | sed -E 's/.* in ([0-9]+) of ([0-9]+) runs.*/\1 \2/' | awk -v k="$k" '{a+=$1;b+=$2} END {print k": "a" of "b}'
  done
  cat $OUT/check-*-$V-$S.md | grep "^The adaptive policy split" | sed -E 's/.* in ([0-9]+) of ([0-9]+) runs.*/\1 \2/' | awk '{a+=$1;b+=$2} END {print "adaptive split share > 20 pts off: "a" of "b}'
done; done

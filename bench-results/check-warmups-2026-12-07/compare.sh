#!/bin/bash
# The check of each ladder with its own profile, at the commit before the warm-ups were replayed
# (/tmp/snap-before) and after (/tmp/snap-after), one snapshot clone each.
OUT=/work/main/bench-results/check-warmups-2026-12-07
for L in check-learned-2026-12-07 ladder-trace-2r-1206 ladder-synth-3rates-1206 ladder-synth-070-2r-1206 ladder-trace-1206 ladder-trace-hi-1206 ladder-trace-290-1206; do
  if [ $L = check-learned-2026-12-07 ]; then P=/work/main/bench-results/check-learned-2026-12-07/profile.json; else P=/work/main/bench-results/remeasure-2026-12-06/profile.json; fi
  for V in before after; do
    (cd /tmp && PYTHONPATH=/tmp/snap-$V /work/main/.venv/bin/python -m dpd plan --check /work/main/bench-results/$L/results.json --profile $P --speed-under-load 0.85 > $OUT/check-$L-$V.md 2>&1)
  done
done
for V in before after; do
  echo "== $V"
  for k in "Attainment within 10" "TTFT P50 within" "TTFT P99 within" "ITL P99 within"; do
    cat $OUT/check-*-$V.md | grep "^$k" | sed -E 's/.* in ([0-9]+) of ([0-9]+) runs.*/\1 \2/' | awk -v k="$k" '{a+=$1;b+=$2} END {print k": "a" of "b}'
  done
  cat $OUT/check-*-$V.md | grep "^The adaptive policy split" | sed -E 's/.* in ([0-9]+) of ([0-9]+) runs.*/\1 \2/' | awk '{a+=$1;b+=$2} END {print "adaptive split share > 20 pts off: "a" of "b}'
done

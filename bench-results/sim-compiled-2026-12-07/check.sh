#!/bin/bash
# `dpd plan --check` of the 7 ladders (58 runs) from the source and compiled, on one snapshot clone
# (/tmp/snap, its build in /tmp/snapcache): the outputs must be identical. Each output goes to check/
# (git-ignored scratch); which are identical, and how long each took, to check-same.txt and check-times.txt.
HERE=/work/main/bench-results/sim-compiled-2026-12-07
OUT=$HERE/check
mkdir -p $OUT
export PYTHONPATH=/tmp/snap DPD_CACHE_DIR=/tmp/snapcache
cd /tmp && /work/main/.venv/bin/python -m dpd plan --compile 2> $OUT/compile.log
for L in check-learned-2026-12-07 ladder-trace-2r-1206 ladder-synth-3rates-1206 ladder-synth-070-2r-1206 ladder-trace-1206 ladder-trace-hi-1206 ladder-trace-290-1206; do
  if [ $L = check-learned-2026-12-07 ]; then P=/work/main/bench-results/check-learned-2026-12-07/profile.json; else P=/work/main/bench-results/remeasure-2026-12-06/profile.json; fi
  for V in source compiled; do
    if [ $V = source ]; then export DPD_SIM_COMPILED=0; else unset DPD_SIM_COMPILED; fi
    start=$(date +%s.%N)
    /work/main/.venv/bin/python -m dpd plan --check /work/main/bench-results/$L/results.json --profile $P --speed-under-load 0.85 > $OUT/check-$L-$V.md 2> $OUT/check-$L-$V.err
    echo "$L $V $(echo "$(date +%s.%N) - $start" | bc) s" >> $HERE/check-times.txt
  done
  if cmp -s $OUT/check-$L-source.md $OUT/check-$L-compiled.md; then echo "$L identical" >> $HERE/check-same.txt; else echo "$L DIFFERENT" >> $HERE/check-same.txt; fi
done

#!/bin/bash
# The simulator's speed, source vs compiled (mypyc), on one snapshot of the repo; nothing else running.
# Usage: bash run.sh REPO OUT   (REPO: a clone of the commit measured; OUT: where logs go)
set -u
REPO=$1; OUT=$2; PY=/work/main/.venv/bin/python
export PYTHONPATH=$REPO DPD_CACHE_DIR=${DPD_CACHE_DIR:-/tmp/benchcache}
P=$REPO/bench-results/remeasure-2026-12-06/profile.json
cd /tmp
/usr/bin/time -v $PY -m dpd plan --compile > $OUT/compile.log 2>&1
for round in 1 2 3; do
  for mode in source compiled; do
    if [ $mode = source ]; then export DPD_SIM_COMPILED=0; else unset DPD_SIM_COMPILED; fi
    echo "== round $round $mode" >> $OUT/per-policy.log
    $PY -m dpd plan --speed --profile $P >> $OUT/per-policy.log 2>&1
  done
done
for mode in source compiled; do
  if [ $mode = source ]; then export DPD_SIM_COMPILED=0; else unset DPD_SIM_COMPILED; fi
  echo "== $mode" >> $OUT/plan16.log
  $PY -m dpd plan --profile $P --max-workers 16 --out /tmp/planned-$mode.yaml >> $OUT/plan16.log 2>&1
done
unset DPD_SIM_COMPILED
for policy in threshold adaptive; do
  /usr/bin/time -v $PY -m dpd plan --speed --profile $P --cluster-workers 1000 --cluster-hours 1 \
      --cluster-policy $policy > $OUT/cluster-$policy-compiled.log 2>&1
done
echo done > $OUT/DONE

#!/bin/bash
# The simulator's speed before and after session 26's changes, each compiled and as source; nothing else running.
# Usage: bash run.sh OLD_TREE NEW_TREE OUT   (trees: copies of the two commits; their builds made first with
#        DPD_CACHE_DIR=$DPD_CACHE_DIR python -m dpd plan --compile, PYTHONPATH=the tree)
set -u
OLD=$1; NEW=$2; OUT=$3; PY=/work/main/.venv/bin/python
export DPD_CACHE_DIR=${DPD_CACHE_DIR:-/tmp/benchcache}
P=$NEW/bench-results/remeasure-2026-12-06/profile.json
cd /tmp
for round in 1 2 3; do
  # the order rotated each round
  case $round in 1) order="old new";; 2) order="new old";; 3) order="old new";; esac
  for which in $order; do
    tree=$OLD; [ $which = new ] && tree=$NEW
    for mode in compiled source; do
      if [ $mode = source ]; then export DPD_SIM_COMPILED=0; else unset DPD_SIM_COMPILED; fi
      echo "== round $round $which $mode" >> $OUT/per-policy.log
      PYTHONPATH=$tree $PY -m dpd plan --speed --profile $P >> $OUT/per-policy.log 2>&1
    done
  done
done
unset DPD_SIM_COMPILED
PYTHONPATH=$NEW /usr/bin/time -v $PY -m dpd plan --speed --profile $P --cluster-workers 1000 --cluster-hours 1 \
    --cluster-policy adaptive > $OUT/cluster-adaptive-compiled.log 2>&1
for which in old new; do
  tree=$OLD; [ $which = new ] && tree=$NEW
  echo "== $which" >> $OUT/plan16.log
  PYTHONPATH=$tree $PY -m dpd plan --profile $P --max-workers 16 --out /tmp/planned-$which.yaml >> $OUT/plan16.log 2>&1
done
cmp /tmp/planned-old.yaml /tmp/planned-new.yaml && echo "the two plans' configs: identical" >> $OUT/plan16.log
echo "run.sh: done" >&2

#!/bin/bash
# Compiled simulator speed, before (ef1b1c5, the tree OLD) and after (the tree NEW), each built
# once (`dpd plan --compile` with DPD_CACHE_DIR), alternated 3 rounds: the 2026-12-06 profile
# (no interference) on both, and on NEW the fresh profile of 2026-12-07 (two workers a machine
# slowing each other). Usage: bash run.sh OLD OLD_CACHE NEW NEW_CACHE OUT
OLD=$1; OLDC=$2; NEW=$3; NEWC=$4; OUT=$5
P0=/work/main/bench-results/remeasure-2026-12-06/profile.json
P1=/work/main/bench-results/interference-2026-12-07/fresh/profile.json
cd /tmp
for round in 1 2 3; do
  for v in old new new-interference; do
    case $v in
      old) T=$OLD; C=$OLDC; P=$P0;; new) T=$NEW; C=$NEWC; P=$P0;; new-interference) T=$NEW; C=$NEWC; P=$P1;;
    esac
    echo "== round $round $v"
    DPD_CACHE_DIR=$C PYTHONPATH=$T /work/main/.venv/bin/python -m dpd plan --speed --profile $P 2>&1 | grep -v "^$"
  done
done

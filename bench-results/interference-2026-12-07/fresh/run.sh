#!/bin/bash
# A fresh trace ladder and synthetic ladder, right after `dpd profile` took profile.json on the
# same machine (2026-12-07, session 27). Run from outside the checkout: bash run.sh TREE OUT
TREE=$1; OUT=$2
cd /tmp && PYTHONPATH=$TREE /work/main/.venv/bin/python -m dpd bench ladder --workloads trace --max-prompt-tokens 384 \
    --threshold 256 --trace-rates 0.9,1.5,2.25 --rounds 1 --out $OUT/ladder-trace > $OUT/ladder-trace.log 2>&1
cd /tmp && PYTHONPATH=$TREE /work/main/.venv/bin/python -m dpd bench ladder --workloads synthetic \
    --synthetic-rates 1.25,2.5,3.75 --requests 300 --out $OUT/ladder-synth > $OUT/ladder-synth.log 2>&1
echo finished > $OUT/FINISHED

#!/bin/bash
# The two fresh ladders checked with the profile taken just before them, as measured (interference
# included) and with its interference removed (profile-no-interference.json), at three speeds
# under load; then the factor fitted on the synthetic ladder. Usage: bash check.sh TREE
TREE=$1
O=/work/main/bench-results/interference-2026-12-07/fresh
python3 -c "
import json; d = json.load(open('$O/profile.json'))
d['engine'].update(prefill_slowdown=1.0, decode_slowdown=1.0, machine_workers=1)
json.dump(d, open('$O/profile-no-interference.json', 'w'), indent=1)"
cd /tmp
for L in trace synth; do for V in with without; do for S in 1.0 0.9 0.85; do
  P=$O/profile.json; [ $V = without ] && P=$O/profile-no-interference.json
  PYTHONPATH=$TREE /work/main/.venv/bin/python -m dpd plan --check $O/results-$L.json --profile $P --speed-under-load $S > $O/check-$L-$V-$S.md 2>&1
done; done; done
for L in synth trace; do for V in with without; do
  P=$O/profile.json; [ $V = without ] && P=$O/profile-no-interference.json
  PYTHONPATH=$TREE /work/main/.venv/bin/python -m dpd plan --check $O/results-$L.json --profile $P --fit-speed 2>&1 | tail -14 > $O/fit-speed-$L-$V.txt
done; done
for V in with without; do for S in 1.0 0.9 0.85; do
  echo "== interference $V, speed under load $S (18 runs: trace 9, synthetic 9)"
  for k in "Attainment within 10" "TTFT P50 within" "TTFT P99 within" "ITL P99 within"; do
    echo "$k: $(grep -h "^$k" $O/check-trace-$V-$S.md $O/check-synth-$V-$S.md | sed -E 's/.* in ([0-9]+) of ([0-9]+) runs.*/\1/' | paste -sd' ')"
  done
done; done

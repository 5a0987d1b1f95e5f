#!/usr/bin/env bash
# Re-measure every figure of BENCHMARKS.md in one background run (~2 h 15 min on the project's 2-core
# machine; each step's time is in README.md). Run it on a quiet machine: anything else on the
# cores shows up as client lag (flagged in the ladder's report) and in every latency.
#
#   scripts/remeasure.sh [OUT]        # default OUT: bench-results/remeasure-<date>
#
# Each step writes under OUT/<step>/ and its log to OUT/<step>.log; a failed step is reported and
# the next one runs. Every endpoint a step starts is stopped by that step (the ladder, run,
# crosscheck and correctness modes start and stop their own); the one started here for overhead
# and pd-tail is stopped on exit, Ctrl-C included.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results/remeasure-$(date +%Y-%m-%d)}
DPD=${DPD_VENV:-$PWD/.venv}/bin/dpd
mkdir -p "$OUT"
[ -x "$DPD" ] || make install
failed=()
serve_pid=""
step_pid=""
stop() {  # stop PID: SIGTERM (dpd serve and dpd bench stop what they started, as on Ctrl-C), then wait
    # (not SIGINT: a script's background jobs start with SIGINT ignored)
    if [ -n "$1" ] && kill -0 "$1" 2>/dev/null; then
        kill -TERM "$1"
        wait "$1"
    fi
}
cleanup() {
    stop "$step_pid"
    stop "$serve_pid"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step() {  # step NAME command...: run it, log it, note a failure
    local name=$1
    shift
    echo "[remeasure] $(date +%H:%M) $name: $*" >&2
    # In the background and waited for, so that a TERM or Ctrl-C reaches the script at once and
    # its trap stops the step (bash runs a trap only after a foreground command has finished).
    "$@" >"$OUT/$name.log" 2>&1 &
    step_pid=$!
    if ! wait "$step_pid"; then
        echo "[remeasure] $name FAILED (see $OUT/$name.log)" >&2
        failed+=("$name")
    fi
    step_pid=""
}

# 1. Colocated vs static vs adaptive on the same requests, from ~45% to ~140% of colocated's
#    capacity: two rounds (rates shuffled, order rotated) on two request sets, each workload at
#    the prompt cap and threshold BENCHMARKS.md reports it with.
step ladder-trace "$DPD" bench ladder --workloads trace --max-prompt-tokens 384 --threshold 256 \
    --trace-rates 0.9,1.5,2.9 --rounds 2 --windows 2 --out "$OUT/ladder-trace"
step ladder-synthetic "$DPD" bench ladder --workloads synthetic --synthetic-rates 1.25,2.5,3.75 \
    --rounds 2 --windows 2 --out "$OUT/ladder-synthetic"
# 2. Prefix-aware routing on agent sessions, four workers per endpoint.
step prefix "$DPD" bench run --workload sessions --session-turns 16 --workers-per-pool 2 \
    --scenarios colocated,colocated-prefix,dpd-adaptive,dpd-prefix --rates 0.25 --compare-at 0 \
    --duration 420 --max-prompt-tokens 2048 --max-output-tokens 32 --out "$OUT/prefix"
# 3. Our client against `vllm bench serve` on the same schedules.
step crosscheck "$DPD" bench crosscheck --out "$OUT/crosscheck"
# 4. Greedy outputs under mixed load on both paths, every stall counted.
step correctness "$DPD" bench correctness --out "$OUT/correctness"
# 5. Router overhead and the P/D tail, against the default endpoint.
echo "[remeasure] $(date +%H:%M) starting the default endpoint for overhead and pd-tail" >&2
# The workers' key, known to both the endpoint and the benchmarks (they call a worker directly).
export DPD_WORKER_API_KEY=${DPD_WORKER_API_KEY:-$(head -c 24 /dev/urandom | base64 | tr -d '/+=')}
"$DPD" serve >"$OUT/serve.log" 2>&1 &
serve_pid=$!
ready() {  # our endpoint is up: the process we started is alive and answers (not another on the port)
    kill -0 "$serve_pid" 2>/dev/null && curl -sf localhost:8000/health >/dev/null 2>&1
}
for _ in $(seq 600); do
    ready && break
    kill -0 "$serve_pid" 2>/dev/null || break
    sleep 1
done
if ready; then
    step profile "$DPD" profile --worker http://127.0.0.1:8101 --router http://127.0.0.1:8000 --out "$OUT/profile.json"
    step overhead "$DPD" bench overhead --rounds 100 --json "$OUT/overhead.json"
    step pd-tail "$DPD" bench pd-tail
else
    echo "[remeasure] the endpoint did not become ready (see $OUT/serve.log)" >&2
    failed+=(profile overhead pd-tail)
fi
stop "$serve_pid"
serve_pid=""
# 6. The simulator against this run's ladders, with this run's profile (calibrated as in
#    docs/planning.md), then its speed: an hour of a 1,000-worker cluster under each policy.
profile=$OUT/profile.json
[ -f "$profile" ] || profile=bench-results/profile-cpu-2026-12-06.json
for workload in trace synthetic; do
    if [ -f "$OUT/ladder-$workload/results.json" ]; then
        step "sim-check-$workload" "$DPD" plan --check "$OUT/ladder-$workload/results.json" --profile "$profile" \
            --speed-under-load 0.85
    fi
done
# The hour of a 1,000-worker cluster under the static policy (~3½ min), then under the adaptive
# policy (~9 min: BENCHMARKS.md).
step sim-speed "$DPD" plan --speed --profile "$profile" --cluster-workers 1000 --cluster-hours 1 --cluster-policy threshold
step sim-speed-adaptive "$DPD" plan --speed --profile "$profile" --cluster-workers 1000 --cluster-hours 1 \
    --cluster-policy adaptive

if [ ${#failed[@]} -gt 0 ]; then
    echo "[remeasure] done; failed: ${failed[*]}" >&2
    exit 1
fi
echo "[remeasure] done: $OUT" >&2

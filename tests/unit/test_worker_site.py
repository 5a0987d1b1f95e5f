"""The worker shim keeps a pinned worker's threads on its cores (vLLM's NixlConnector would move
the compute thread to the machine's last core). Run in a real subprocess with the shim loaded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dpd.launch.plan import WORKER_SITE_DIR

PROBE = """
import os
os.sched_setaffinity(0, {other})      # what vLLM's NixlConnector does on CPU
moved_outside = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {mine})       # a move within the worker's cores stands
print(moved_outside, sorted(os.sched_getaffinity(0)))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
@pytest.mark.parametrize("is_pinned", [True, False])
def test_worker_threads_stay_on_their_cores(is_pinned):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    env = {**os.environ, "PYTHONPATH": str(WORKER_SITE_DIR)}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if is_pinned:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(first)
    probe = PROBE.format(other={second}, mine={first})
    out = subprocess.run([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{first}}})\n" + probe],
                         env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    moved, final = out.strip().splitlines()[-1].split("] [")
    expected = f"[{first}]" if is_pinned else f"[{second}]"
    assert moved + "]" == expected, out  # refused with the shim, done without it
    assert "[" + final == f"[{first}]"
    if is_pinned:
        assert "kept this thread on cores" in out

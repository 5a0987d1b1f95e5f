"""What a benchmark or a test starts dies with it: real subprocesses, no mocks."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from dpd.launch.process import child_setup
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=child_setup)
    print(child.pid, flush=True)
    time.sleep(120)
""")


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_a_child_started_with_child_setup_dies_with_its_parent():
    """Even when the parent is killed outright (no cleanup code runs), the child gets SIGTERM."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait(10)
    try:
        assert _gone(child_pid)
    finally:
        if not _gone(child_pid, 0):
            psutil.Process(child_pid).kill()


def test_sigterm_stops_a_bench_command_like_ctrl_c():
    """`dpd bench …` turns SIGTERM into KeyboardInterrupt, so its cleanup (stopping the endpoints
    it started) runs; exit status 130."""
    script = textwrap.dedent("""
        import sys, time
        import dpd.cli as cli
        def slow(args):
            try:
                print("ready", flush=True)
                time.sleep(60)
            finally:
                print("cleaned up", flush=True)
            return 0
        cli._cmd_bench_ladder = slow  # bound when main() builds the parser: nothing real starts
        sys.exit(cli.main(["bench", "ladder"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.terminate()
        out = proc.stdout.read()  # through the same buffer as readline; EOF when it exits
        assert proc.wait(20) == 130
    finally:
        proc.kill()
    assert "cleaned up" in out

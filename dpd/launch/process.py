"""One supervised vLLM worker process: start, wait healthy, restart, stop.

Each worker runs in its own session (process group) with its log in the run directory, pinned
to its cores, and with ``PR_SET_PDEATHSIG`` so it dies with the launcher even if the launcher
is killed with SIGKILL. The engine's compute threads are pinned through
``VLLM_CPU_OMP_THREADS_BIND``; the rest of the worker (API server, engine-core loop) floats.

NOTE: pinning the whole process tree to the worker's core (``pin_process``) was measured slower:
a 2,900-token prefill took 13.7 s against 8.4 s, because vLLM's busy API-server and scheduler
loops then compete with the compute thread for the same core.

Stopping sends SIGTERM to the whole group (vLLM's engine-core child
included), then SIGKILL after a grace period: no process outlives ``stop()``.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import time
from collections import deque
from pathlib import Path

import aiohttp

from dpd.launch.plan import WorkerPlan

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Loaded once here: dlopen between fork and exec of a multi-threaded parent can deadlock.
_LIBC: ctypes.CDLL | None
try:
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not glibc: workers then only die with the launcher through stop()
    _LIBC = None


def child_setup(cores: tuple[int, ...] = ()) -> None:
    """Runs in the child between fork and exec (async-signal-safe calls only): the child gets
    SIGTERM when its parent dies, and is pinned to ``cores`` if given."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if cores:
        os.sched_setaffinity(0, cores)


class WorkerProcess:
    def __init__(self, plan: WorkerPlan, run_dir: Path, *, pin_process: bool = False,
                 secret_env: dict[str, str] | None = None):
        self.plan = plan
        self._secret_env = secret_env or {}  # e.g. VLLM_API_KEY: in the environment, never on the command line
        self.log_path = run_dir / f"{plan.name}.log"
        self._pin_process = pin_process
        self._proc: asyncio.subprocess.Process | None = None
        self.num_starts = 0
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        env = {**os.environ, **dict(self.plan.env), **self._secret_env}
        cores = self.plan.cores if self._pin_process else ()
        log_file = open(self.log_path, "ab")
        try:
            log_file.write(f"\n=== dpd: starting {self.plan.name} (start #{self.num_starts + 1}) ===\n".encode())
            log_file.flush()
            self._proc = await asyncio.create_subprocess_exec(
                *self.plan.command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=lambda: child_setup(cores),
            )
        finally:
            log_file.close()
        self.num_starts += 1
        self.started_at = time.monotonic()

    async def wait(self) -> int:
        assert self._proc is not None
        return await self._proc.wait()

    async def is_healthy(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(f"{self.plan.url}/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    def last_lines(self, n: int = 30) -> list[str]:
        try:
            with open(self.log_path, "rb") as f:
                return [line.decode(errors="replace").rstrip() for line in deque(f, maxlen=n)]
        except OSError:
            return []

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the worker's whole process group (leftover engine-core children included)."""
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    async def stop(self, grace_s: float = 15.0) -> None:
        if self._proc is None:
            return
        if self._proc.returncode is None:
            self.kill_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._proc.wait(), grace_s)
            except TimeoutError:
                log.warning("%s did not stop in %.0fs; killing it", self.plan.name, grace_s)
        # Whatever the leader did, nothing of its group may survive it.
        self.kill_group(signal.SIGKILL)
        if self._proc.returncode is None:
            await self._proc.wait()

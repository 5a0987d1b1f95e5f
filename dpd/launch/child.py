"""A real `dpd serve` in a subprocess, as a user runs it: start, wait ready, Ctrl-C, check.

Used by the integration tests and the benchmarks, which need whole endpoints they can start
and stop. `stop()` sends SIGINT — what Ctrl-C sends — and returns the descendant processes
still alive afterwards, which must be none (any that are get SIGKILL).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests
import yaml

from dpd.config import load_config
from dpd.launch.process import child_setup
from dpd.router.app import WORKER_KEY_ENV


def _merge(base: dict, overrides: dict) -> dict:
    for key, value in overrides.items():
        base[key] = _merge(dict(base.get(key) or {}), value) if isinstance(value, dict) else value
    return base


def write_config(
    path: Path, *, router_port: int, worker_base_port: int, side_channel_base_port: int,
    worker_args: tuple[str, ...] = (), spec_overrides: dict | None = None, **pd_overrides,
) -> Path:
    """The embedded default config on other ports, with ``pdSpec`` fields (and, with
    ``spec_overrides``, ``spec`` fields) merged in: nested dicts merge, other values replace."""
    data = load_config().model_dump(exclude_none=True)
    pd = data["spec"]["pdSpec"]
    for pool in ("prefillSpec", "decodingSpec"):
        pd[pool]["args"] = list(worker_args)
    pd["router"]["port"] = router_port
    pd["local"]["workerBasePort"] = worker_base_port
    pd["local"]["sideChannelBasePort"] = side_channel_base_port
    pd["local"]["runDir"] = str(path.parent / "run")
    _merge(pd, pd_overrides)
    _merge(data["spec"], spec_overrides or {})
    path.write_text(yaml.safe_dump(data))
    return path


class ServeProcess:
    def __init__(self, config_path: Path, *extra_args: str, log_path: Path):
        self.config = load_config(config_path)
        self.url = f"http://127.0.0.1:{self.config.spec.pdSpec.router.port}"
        self.log_path = log_path
        # The key the workers require (dpd serve takes it from the environment): so benchmarks and
        # tests can reach a worker directly, as the router does.
        self.worker_key = secrets.token_urlsafe(32)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dpd", "serve", str(config_path), *extra_args],
            env={**os.environ, WORKER_KEY_ENV: self.worker_key},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=child_setup,  # stops (SIGTERM) if this process dies without stop()
        )

    @property
    def worker_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.worker_key}"}

    def wait_ready(self, timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        last_print = 0.0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dpd serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() - last_print > 30:
                last_print = time.monotonic()
                print(f"waiting for {self.url}: {self.log_tail(1)}", file=sys.stderr, flush=True)
            time.sleep(2)
        raise TimeoutError(f"dpd serve not ready after {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def worker_pid(self, name: str) -> int:
        """PID of the vLLM API server of worker `name` (e.g. "prefill-0")."""
        plan_ports = {"prefill": self.config.spec.pdSpec.local.workerBasePort}
        index = int(name.split("-")[1])
        if name.startswith("decode"):
            index += self.config.spec.pdSpec.prefillSpec.replicas
        port = plan_ports["prefill"] + index
        for child in psutil.Process(self.proc.pid).children():
            if f"--port {port} " in " ".join(child.cmdline()) + " ":
                return child.pid
        raise LookupError(name)

    def stop(self, timeout_s: float = 60) -> list[psutil.Process]:
        """Ctrl-C the launcher; return whatever of its process tree survived. Idempotent."""
        if self._log.closed:
            return []
        tree = [*self.descendants()]
        try:
            tree.append(psutil.Process(self.proc.pid))
        except psutil.NoSuchProcess:
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        gone, alive = psutil.wait_procs(tree, timeout=10)
        for p in alive:  # never leave anything behind, even when the test fails
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()
        return alive

"""``dpd serve``: run a whole endpoint — workers plus router — on this machine.

Lifecycle:
  1. Resolve the model (prepare the bundled one on first use) and plan the workers.
  2. Check every port is free, then start all workers at once; show each one's progress
     (elapsed time and its latest log line) until ``/health`` answers.
  3. Start the router in this process once every worker is healthy.
  4. Supervise: a worker that exits is restarted after a back-off; the router stops sending it
     requests on its first failure and resumes once its health probe passes again.
  5. On SIGINT/SIGTERM: stop the router, then every worker's process group; exit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

import aiohttp

from dpd.config.model import InferenceEndpointConfig, RouterSpec, tls_files
from dpd.launch.plan import (
    Devices,
    WorkerPlan,
    choose_devices,
    detect_gpus,
    installed_engine,
    kv_block_size,
    oversubscribed,
    plan_workers,
)
from dpd.launch.process import WorkerProcess
from dpd.models.bundled import bundled_model_dir, cache_root, resolve_model
from dpd.router import WORKER_KEY_ENV, Router, RouterSettings, make_server

log = logging.getLogger("dpd.serve")


class LaunchError(RuntimeError):
    pass


def planned_ports(plans: list[WorkerPlan], router_spec: RouterSpec, *, is_colocated: bool) -> dict[int, str]:
    """Every port the endpoint will listen on and who uses it; two users of one port (a worker
    base port that runs into the router's, a side channel on a worker's HTTP port) are an error
    now rather than a failed bind after the workers have loaded."""
    users = [(p.port, f"{p.name} HTTP") for p in plans]
    if not is_colocated:
        users += [(p.side_channel_port, f"{p.name} NIXL side channel") for p in plans]
    users.append((router_spec.port, "router"))
    if router_spec.metricsPort is not None:
        users.append((router_spec.metricsPort, "router metrics"))
    ports: dict[int, str] = {}
    for port, what in users:
        if port in ports:
            raise LaunchError(f"port {port} is planned for both {ports[port]} and {what}; change "
                              "pdSpec.local.workerBasePort / sideChannelBasePort or router.port in the config")
        ports[port] = what
    return ports


def _check_ports_free(host: str, ports: dict[int, str]) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port, what in ports.items():
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                raise LaunchError(f"port {port} ({what}) is already in use; change it in the config") from None


MAX_SOCKET_DIR_LEN = 80  # a Unix socket's path is at most 107 bytes; "/kv-events-PORT" takes 16 of them


def make_run_dir(config: InferenceEndpointConfig) -> Path:
    if config.spec.pdSpec.local.runDir:
        run_dir = Path(config.spec.pdSpec.local.runDir)
    else:
        run_dir = cache_root() / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # private when created here: logs and event sockets carry prompts
    return run_dir


class Endpoint:
    """The workers and router of one ``dpd serve``."""

    def __init__(self, config: InferenceEndpointConfig, *, is_colocated: bool = False, out=sys.stderr):
        self.config = config
        self.is_colocated = is_colocated
        self._out = out
        self._stop = asyncio.Event()
        self._stop_now = asyncio.Event()
        self._workers: list[WorkerProcess] = []
        self._supervisors: list[asyncio.Task] = []
        self._announcers: set[asyncio.Task] = set()
        self._router: Router | None = None
        self.worker_key: str | None = None  # set when the workers start
        # Drain support (the admin API's WorkerControl): parked workers stay stopped until resumed.
        self._parked: dict[str, asyncio.Event] = {}
        self._temp_socket_dir: Path | None = None  # the KV-event sockets' directory when the run dir's path is too long
        self._restart_now: set[str] = set()

    def say(self, message: str) -> None:
        print(f"[dpd] {message}", file=self._out, flush=True)

    def request_stop(self) -> None:
        """First Ctrl-C/SIGTERM: stop gracefully (drain in-flight requests); second: stop now."""
        if self._stop.is_set():
            self._stop_now.set()
        self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            return await self._run()
        finally:
            await self._shutdown()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    async def _run(self) -> int:
        spec = self.config.spec
        router_spec = spec.pdSpec.router
        devices = choose_devices(self.config, gpus=await asyncio.to_thread(detect_gpus), engine=installed_engine())
        self.say(f"devices: {'GPUs' if devices.kind == 'gpu' else 'CPU cores'} ({devices.why})")
        self.say(f"model: {spec.modelSourceConfig.modelSourceType} {spec.modelSourceConfig.modelLocation or ''}".rstrip())
        model_path = await asyncio.to_thread(resolve_model, spec.modelSourceConfig)
        if self._stop.is_set():  # Ctrl-C while the model was being prepared
            return 130
        run_dir = make_run_dir(self.config)
        plans = plan_workers(self.config, model_path, is_colocated=self.is_colocated, devices=devices,
                             events_dir=str(self._socket_dir(run_dir)))
        ports = planned_ports(plans, router_spec, is_colocated=self.is_colocated)
        router_ports = {router_spec.port, router_spec.metricsPort}  # the router binds its own host
        _check_ports_free("127.0.0.1", {port: what for port, what in ports.items() if port not in router_ports})
        _check_ports_free(router_spec.host, {port: what for port, what in ports.items() if port in router_ports})
        tls = tls_files(spec)
        for path in tls or ():  # before any worker starts: minutes of loading lost otherwise
            if not os.access(path, os.R_OK):
                raise LaunchError(f"spec.tlsConfig: cannot read {path}")
        if oversubscribed(plans):
            self.say("warning: more worker cores requested than this machine has; workers share cores")
        self.say(f"mode: {'colocated' if self.is_colocated else 'disaggregated'}; worker logs in {run_dir}")
        pd = self.config.spec.pdSpec
        if any("float32" in plan.command for plan in plans) and "float32" not in pd.prefillSpec.args + pd.decodingSpec.args:
            self.say("this CPU has no native bf16 (AVX512_BF16/AMX): workers run float32, several times faster here "
                     "(set --dtype in a pool's args to override)")
        for plan in plans:
            self.say(f"  {plan.name}: port {plan.port}, {plan.devices}, role {plan.kv_role or 'colocated'}")
        # Workers serve their API only to the holder of this key (the router): nothing else on the
        # machine can send them requests, kv_transfer_params included. Kept in the run directory
        # (0600) for tools that talk to a worker directly.
        self.worker_key = os.environ.get(WORKER_KEY_ENV) or secrets.token_urlsafe(32)
        key_path = run_dir / "worker-key"
        key_path.touch(mode=0o600)
        key_path.chmod(0o600)
        key_path.write_text(self.worker_key + "\n")
        self.say(f"workers require an API key (only the router has it; also in {key_path})")
        self._workers = [WorkerProcess(plan, run_dir, secret_env={"VLLM_API_KEY": self.worker_key}) for plan in plans]
        for worker in self._workers:
            await worker.start()
        if not await self._wait_healthy(spec.pdSpec.local.startupTimeoutS):
            return 1
        for worker in self._workers:
            self._supervisors.append(asyncio.create_task(self._supervise(worker), name=f"supervise-{worker.plan.name}"))
        settings = self.router_settings(plans, model_path)
        router = Router(settings)
        router.worker_control = self
        self._router = router
        server = make_server(router, router_spec.host, router_spec.port, is_embedded=True, tls=tls)
        server_task = asyncio.create_task(server.serve(), name="router")
        while not server.started and not server_task.done():
            await asyncio.sleep(0.05)
        if server_task.done():
            self.say("router failed to start")
            return 1
        self.say(f"ready: http{'s' if tls else ''}://{router_spec.host}:{router_spec.port}/v1 (model {spec.modelName!r}, "
                 f"{settings.routing_policy} routing, threshold {settings.threshold_tokens} tokens)")
        stop_wait = asyncio.create_task(self._stop.wait())
        await asyncio.wait({stop_wait, server_task}, return_when=asyncio.FIRST_COMPLETED)
        is_router_crash = not self._stop.is_set()
        if not is_router_crash and router.num_active:
            timeout_s = router_spec.drainTimeoutS
            self.say(f"stopping: finishing {router.num_active} request(s) in flight (at most {timeout_s:.0f}s; "
                     "Ctrl-C again to stop now); new requests get 503")
            left = await router.shut_down_gracefully(timeout_s, self._stop_now)
            if left:
                self.say(f"{left} request(s) cut short")
        self.say("router exited unexpectedly; stopping" if is_router_crash else "stopping")
        server.should_exit = True
        await asyncio.gather(server_task, return_exceptions=True)
        stop_wait.cancel()
        return 1 if is_router_crash else 0

    def router_settings(self, plans: list[WorkerPlan], model_path: str) -> RouterSettings:
        spec = self.config.spec
        prefill = [p for p in plans if p.pool == "prefill" and not self.is_colocated]
        decode = [p for p in plans if p.pool == "decode" or self.is_colocated]
        return RouterSettings.for_endpoint(
            spec, tokenizer_path=model_path,
            prefill_urls=tuple(p.url for p in prefill), decode_urls=tuple(p.url for p in decode),
            prefill_names=tuple(p.name for p in prefill), decode_names=tuple(p.name for p in decode),
            is_colocated=self.is_colocated, worker_api_key=self.worker_key,
            kv_block_size=kv_block_size(self.config, any(p.gpus for p in plans)),
            kv_events_endpoints=tuple((p.url, p.events_endpoint) for p in plans if p.events_endpoint),
        )

    def _socket_dir(self, run_dir: Path) -> Path:
        """Where the workers' KV-event sockets go: the run directory, or a private temporary one
        when its path is too long for a Unix socket (removed at shutdown)."""
        if len(str(run_dir.resolve())) <= MAX_SOCKET_DIR_LEN:
            return run_dir.resolve()
        self._temp_socket_dir = Path(tempfile.mkdtemp(prefix="dpd-"))  # 0700
        return self._temp_socket_dir

    async def _wait_healthy(self, timeout_s: float) -> bool:
        started = time.monotonic()
        pending = {w.plan.name: w for w in self._workers}
        last_report = 0.0
        async with aiohttp.ClientSession() as session:
            while pending:
                if self._stop.is_set():
                    return False
                for name, worker in list(pending.items()):
                    if not worker.is_running:
                        self.say(f"{name} exited during start-up; last lines of {worker.log_path}:")
                        for line in worker.last_lines():
                            print(f"    {line}", file=self._out)
                        return False
                    if await worker.is_healthy(session):
                        self.say(f"{name} healthy after {time.monotonic() - started:.0f}s")
                        del pending[name]
                elapsed = time.monotonic() - started
                if elapsed > timeout_s:
                    self.say(f"timed out after {timeout_s:.0f}s waiting for {', '.join(pending)}")
                    return False
                if pending and elapsed - last_report >= 10:
                    last_report = elapsed
                    for name, worker in pending.items():
                        tail = next((ln for ln in reversed(worker.last_lines(5)) if ln.strip()), "")
                        self.say(f"  {name} loading ({elapsed:.0f}s): {tail[-110:]}")
                await asyncio.sleep(1)
        return True

    async def _supervise(self, worker: WorkerProcess) -> None:
        """Restart ``worker`` whenever it exits; back off exponentially while it keeps crashing."""
        base_s = self.config.spec.pdSpec.local.restartBackoffS
        num_quick_crashes = 0
        while not self._stop.is_set():
            code = await worker.wait()
            if self._stop.is_set():
                return
            worker.kill_group()  # leftover children of the dead worker
            name = worker.plan.name
            if name in self._parked:  # stopped on purpose (drain): wait to be resumed
                self.say(f"{name} stopped after a drain; resume it with POST /admin/workers/{name}/resume")
                await self._parked[name].wait()
                self._parked.pop(name, None)
                if self._stop.is_set():
                    return
                await self._start_again(worker)
                continue
            if name in self._restart_now:  # a drained restart: no crash, no back-off
                self._restart_now.discard(name)
                self.say(f"{name} drained; restarting")
                await self._start_again(worker)
                continue
            # A worker that ran for 10 minutes crashed for a new reason: start over at the base delay.
            num_quick_crashes = num_quick_crashes + 1 if time.monotonic() - worker.started_at < 600 else 1
            backoff_s = min(base_s * 2 ** (num_quick_crashes - 1), 300.0)
            self.say(f"{worker.plan.name} exited with code {code}; restarting in {backoff_s:.0f}s (log: {worker.log_path})")
            await asyncio.sleep(backoff_s)
            if self._stop.is_set():
                return
            await self._start_again(worker)

    async def _start_again(self, worker: WorkerProcess) -> None:
        try:
            await worker.start()
        except OSError as exc:
            self.say(f"{worker.plan.name} could not be restarted: {exc}; retrying")
            return  # its exit is seen by the supervisor, which tries again
        self._announcers.add(task := asyncio.create_task(self._announce_healthy(worker)))
        task.add_done_callback(self._announcers.discard)

    async def _announce_healthy(self, worker: WorkerProcess) -> None:
        async with aiohttp.ClientSession() as session:
            while worker.is_running and not self._stop.is_set():
                if await worker.is_healthy(session):
                    self.say(f"{worker.plan.name} healthy again after {time.monotonic() - worker.started_at:.0f}s")
                    self._router_worker_resumed(worker.plan.name)
                    return
                await asyncio.sleep(1)

    def _router_worker_resumed(self, name: str) -> None:
        if self._router is None:
            return
        routed = self._router.find_worker(name)
        if routed is not None:
            routed.is_draining = False

    # -- WorkerControl (the admin API's drain / resume) -----------------------------------------
    def _process(self, name: str) -> WorkerProcess:
        return next(w for w in self._workers if w.plan.name == name)

    async def stop_worker(self, name: str) -> None:
        self._parked.setdefault(name, asyncio.Event())
        await self._process(name).stop()
        self.say(f"{name} stopped (drained)")

    async def restart_worker(self, name: str) -> None:
        self._restart_now.add(name)
        await self._process(name).stop()

    async def start_worker(self, name: str) -> None:
        if (event := self._parked.get(name)) is not None:
            event.set()

    async def _shutdown(self) -> None:
        self._stop.set()
        for event in self._parked.values():
            event.set()
        for task in self._supervisors:
            task.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        if self._workers:
            self.say(f"stopping {len(self._workers)} worker(s)")
            await asyncio.gather(*(w.stop() for w in self._workers))
            self.say("all workers stopped")
        if self._temp_socket_dir is not None:
            shutil.rmtree(self._temp_socket_dir, ignore_errors=True)


def serve(config: InferenceEndpointConfig, *, is_colocated: bool = False) -> int:
    return asyncio.run(Endpoint(config, is_colocated=is_colocated).run())


def planned_model_path(config: InferenceEndpointConfig) -> str:
    """Where ``--model`` will point, without preparing or checking anything (for ``--dry-run``)."""
    source = config.spec.modelSourceConfig
    if source.modelSourceType == "bundled":
        return str(bundled_model_dir())
    return str(Path(source.modelLocation or "").expanduser()) if source.modelSourceType == "local" else source.modelLocation or ""


def dry_run(config: InferenceEndpointConfig, *, is_colocated: bool = False, gpus: list[str] | None = None,
            as_json: bool = False, out: TextIO = sys.stdout) -> int:
    """``dpd serve --dry-run``: print every worker's command line, environment, ports and devices,
    and the router's address, starting nothing. ``gpus`` plans for a node with those GPUs (and the
    CUDA engine) instead of this one."""
    if gpus is None:
        devices = choose_devices(config, gpus=detect_gpus(), engine=installed_engine())
    else:
        devices = choose_devices(config, gpus=gpus, engine="vllm" if gpus else None)
        devices = Devices(devices.kind, devices.gpus, f"{devices.why}; from --gpus, not this machine")
    plans = plan_workers(config, planned_model_path(config), is_colocated=is_colocated, devices=devices)
    router = config.spec.pdSpec.router
    mode = "colocated" if is_colocated else "disaggregated"
    secret_env = {"VLLM_API_KEY": "<generated per run: only the router holds it>"}
    if as_json:
        json.dump({"name": config.metadata.name, "mode": mode, "devices": {"kind": devices.kind, "gpus": list(devices.gpus),
                   "why": devices.why}, "router": {"host": router.host, "port": router.port,
                   "policy": config.spec.pdSpec.routingPolicy},
                   "workers": [{"name": p.name, "pool": p.pool, "kv_role": p.kv_role, "port": p.port,
                                "side_channel_port": None if p.kv_role is None else p.side_channel_port,
                                "cores": list(p.cores), "gpus": list(p.gpus), "command": list(p.command),
                                "env": {**dict(p.env), **secret_env}} for p in plans]}, out, indent=1)
        print(file=out)
        return 0
    print(f"# dpd serve --dry-run: the plan for {config.metadata.name!r} ({mode}, {config.spec.pdSpec.routingPolicy} "
          "routing); nothing was started", file=out)
    print(f"# devices: {'GPUs' if devices.kind == 'gpu' else 'CPU cores'} ({devices.why})", file=out)
    print(f"# router: http://{router.host}:{router.port}/v1", file=out)
    for p in plans:
        side = "" if p.kv_role is None else f", NIXL side channel {p.side_channel_port}"
        print(f"\n# {p.name}: {p.kv_role or 'colocated'}, port {p.port}{side}, {p.devices}", file=out)
        for key, value in sorted({**dict(p.env), **secret_env}.items()):
            print(f"{key}={shlex.quote(value)} \\", file=out)
        print(shlex.join(p.command), file=out)
    return 0

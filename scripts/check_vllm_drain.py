"""Check the drain `dpd render` relies on, on a real vLLM worker: SIGTERM mid-stream.

A rendered worker pod runs vLLM with `--shutdown-timeout` (= router.drainTimeoutS); when the
pod is deleted the kubelet sends SIGTERM to the container's main process after the preStop
pause. This starts one worker of the bundled model the way the launcher would, streams a
completion, sends SIGTERM to the API server process only (as the kubelet does) after a few
tokens, tries a new request during the shutdown, and reports whether the stream ran to its end.

    .venv/bin/python scripts/check_vllm_drain.py                    # --shutdown-timeout 30
    .venv/bin/python scripts/check_vllm_drain.py --shutdown-timeout 0   # vLLM's default: abort

Takes ~1.5 min (model load). Exit status 0 when the outcome is the one the timeout promises
(drain: every token and finish_reason "length"; 0: the stream cut short).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from dpd.config import load_config
from dpd.launch.plan import plan_workers
from dpd.models.bundled import resolve_model

PORT = 18990
MAX_TOKENS = 120


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shutdown-timeout", type=int, default=30)
    args = parser.parse_args()
    config = load_config(None)
    plan = plan_workers(config, resolve_model(config.spec.modelSourceConfig), is_colocated=True)[1]
    command = [*plan.command, "--shutdown-timeout", str(args.shutdown_timeout)]
    command[command.index("--port") + 1] = str(PORT)
    url = f"http://127.0.0.1:{PORT}"
    log = Path(tempfile.mkdtemp(prefix="dpd-drain-")) / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env={**os.environ, **dict(plan.env)}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                print(f"worker did not start; log: {log}", file=sys.stderr)
                return 1
            time.sleep(1)
        body = {"model": config.spec.modelName, "prompt": "Tell me a long story about a lighthouse.",
                "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, "temperature": 0}
        tokens, finish, sent_at, refused = 0, None, None, None
        exit_at: list[float] = []
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=30) as resp:
            try:
                for line in resp.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    tokens += 1
                    finish = choice.get("finish_reason") or finish
                    if tokens == 10 and sent_at is None:
                        proc.send_signal(signal.SIGTERM)  # the main process only, as the kubelet does
                        sent_at = time.monotonic()
                        threading.Thread(target=lambda: exit_at.append((proc.wait(), time.monotonic())[1]), daemon=True).start()
                        time.sleep(0.5)
                        try:
                            refused = requests.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4},
                                                    timeout=30).status_code
                        except requests.RequestException as exc:
                            refused = exc.__class__.__name__
            except requests.RequestException as exc:
                finish = f"stream broken ({exc.__class__.__name__})"
        try:
            proc.wait(timeout=args.shutdown_timeout + 60)
        except subprocess.TimeoutExpired:
            pass
        exited = f"{exit_at[0] - sent_at:.1f} s after SIGTERM" if exit_at and sent_at else "still running"
        print(f"[drain] --shutdown-timeout {args.shutdown_timeout}: stream got {tokens}/{MAX_TOKENS} tokens, "
              f"finish_reason {finish!r}; a new request during shutdown: {refused}; worker exited {exited}; log {log}")
        drained = tokens == MAX_TOKENS and finish == "length"
        return 0 if drained == (args.shutdown_timeout > 0) else 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # engine-core children of a leader that exited
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    sys.exit(main())

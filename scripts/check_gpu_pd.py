#!/usr/bin/env python3
"""Check the whole P/D path on a GPU node, end to end, and print a short report.

    .venv/bin/python scripts/check_gpu_pd.py [CONFIG]      # default: examples/gpu-node.yaml

What it does: starts `dpd serve CONFIG` (the CUDA engine must be installed: `make install`
picks it where `nvidia-smi` lists a GPU), sends one long prompt on the disaggregated path and
one short one, reads the NIXL transfer figures from every decode worker's /metrics (bytes,
transfer time, failures), sends the long prompt again on the direct path and checks that the
greedy outputs of both paths are equal; stops the endpoint and checks nothing was left running.
Exit status 0 when every check passed.

Written without a GPU at hand (the project's machines have none): it has not been run on one.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dpd.config import load_config  # noqa: E402
from dpd.launch.child import ServeProcess  # noqa: E402
from dpd.launch.plan import CUDA_ENGINE, detect_gpus, installed_engine  # noqa: E402

LONG_WORDS = 1500  # ~2,000 tokens: long enough that the threshold policy disaggregates it


def chat(url: str, model: str, prompt: str, max_tokens: int = 32) -> tuple[str, str, str, float]:
    """(text, x-dpd-path, x-dpd-workers, seconds) of one greedy completion."""
    started = time.monotonic()
    r = requests.post(f"{url}/v1/completions", timeout=600, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": 0})
    r.raise_for_status()
    return (r.json()["choices"][0]["text"], r.headers.get("x-dpd-path", "?"), r.headers.get("x-dpd-workers", "?"),
            time.monotonic() - started)


def nixl_figures(metrics_text: str) -> dict[str, float]:
    """Totals of vLLM's NIXL metrics on one worker (bytes moved, transfer seconds, failures)."""
    totals: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = re.match(r"^(vllm:nixl_[a-z_]+?)(_sum|_count|_total)?(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            key = m.group(1) + (m.group(2) or "")
            totals[key] = totals.get(key, 0.0) + float(m.group(4))
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "examples" / "gpu-node.yaml"))
    args = parser.parse_args()
    checks: list[tuple[str, bool, str]] = []
    gpus, engine = detect_gpus(), installed_engine()
    print(f"GPUs: {', '.join(gpus) or 'none'}; engine: {engine}")
    if not gpus or engine != CUDA_ENGINE:
        print("needs an NVIDIA GPU and the CUDA engine (`DPD_ENGINE=gpu make install`)", file=sys.stderr)
        return 2
    config = load_config(args.config)
    pd = config.spec.pdSpec
    model = config.spec.modelName
    with tempfile.TemporaryDirectory(prefix="dpd-gpu-check-") as tmp:
        serve = ServeProcess(Path(args.config), log_path=Path(tmp) / "serve.log")
        try:
            print("starting dpd serve (a first start downloads and compiles: minutes)")
            serve.wait_ready(1800)
            url = serve.url
            requests.put(f"{url}/admin/policy", json={"policy": "threshold"}, timeout=10).raise_for_status()
            requests.put(f"{url}/admin/threshold", json={"threshold_tokens": 256}, timeout=10).raise_for_status()
            long_prompt = "Summarise the following notes. " + " ".join(f"note {i} says item {i % 97}." for i in range(LONG_WORDS // 5))
            chat(url, model, "warm up", 4)
            text_pd, path_pd, workers_pd, s_pd = chat(url, model, long_prompt)
            checks.append(("long prompt disaggregated", path_pd == "disaggregated", f"{path_pd} via {workers_pd}, {s_pd:.2f} s"))
            _, path_short, workers_short, s_short = chat(url, model, "Say hello.")
            checks.append(("short prompt direct", path_short == "direct", f"{path_short} via {workers_short}, {s_short:.2f} s"))
            first_decoder = pd.local.workerBasePort + pd.prefillSpec.replicas
            moved: dict[str, float] = {}
            for i in range(pd.decodingSpec.replicas):
                text = requests.get(f"http://127.0.0.1:{first_decoder + i}/metrics", headers=serve.worker_headers,
                                    timeout=10).text
                for key, value in nixl_figures(text).items():
                    moved[key] = moved.get(key, 0.0) + value
            num_bytes = moved.get("vllm:nixl_bytes_transferred_sum", 0.0)
            xfer_s = moved.get("vllm:nixl_xfer_time_seconds_sum", 0.0)
            failed = moved.get("vllm:nixl_num_failed_transfers_total", moved.get("vllm:nixl_num_failed_transfers", 0.0))
            rate = f", {num_bytes / xfer_s / 1e9:.1f} GB/s" if xfer_s > 0 else ""
            checks.append(("NIXL moved the KV", num_bytes > 0 and not failed,
                           f"{num_bytes / 1e6:.1f} MB in {xfer_s * 1000:.1f} ms{rate}, {failed:g} failed "
                           "(NVLink moves tens to hundreds of GB/s, PCIe peer-to-peer ~10-50, TCP ~1)"))
            requests.put(f"{url}/admin/threshold", json={"threshold_tokens": 10**9}, timeout=10).raise_for_status()
            text_direct, path_direct, workers_direct, s_direct = chat(url, model, long_prompt)
            checks.append(("same prompt direct", path_direct == "direct", f"{path_direct} via {workers_direct}, {s_direct:.2f} s"))
            checks.append(("greedy outputs equal across paths", text_pd == text_direct, repr(text_pd[:60])))
        except Exception as exc:  # report what was reached, then stop everything
            checks.append(("endpoint", False, f"{type(exc).__name__}: {exc}\n{serve.log_tail(20)}"))
        finally:
            left = serve.stop()
            checks.append(("nothing left running", not left, f"{len(left)} process(es)"))
    print("\n== dpd GPU P/D check ==")
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

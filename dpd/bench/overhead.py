"""Router overhead, side by side: the same short request direct to a worker, through dpd's
router, and through the peer router (``vllm-router``), interleaved in one run.

Each round sends one request to every target in a shuffled order, so drift in the machine's
load hits all targets alike; every prompt is distinct (no prefix-cache hits). TTFT is measured
on a streaming request; with ``max_tokens=1`` it is the whole request.

Targets are plain base URLs; ``run_overhead`` starts and stops the peer router itself when
asked to (``peer_decode_url``), pointing it at the same worker as the "direct" target.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp

from dpd.bench.stats import bootstrap_ci, percentile

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def distinct_prompt(seed: int, num_words: int) -> str:
    rng = random.Random(seed)
    return f"[{seed}] " + " ".join(rng.choice(WORDS) for _ in range(num_words))


async def measure_ttft(
    session: aiohttp.ClientSession, base_url: str, model: str, prompt: str, max_tokens: int = 1
) -> tuple[float, dict[str, str]]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started = time.perf_counter()
    async with session.post(base_url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{base_url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"text"' in line:
                ttft = time.perf_counter() - started
                break
        else:
            raise RuntimeError(f"{base_url}: no token in the stream")
        async for _ in resp.content:  # drain to [DONE]
            pass
    return ttft, dict(resp.headers)


@dataclass
class TargetResult:
    name: str
    ttfts_s: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ttfts_s) * 1000

    @property
    def p99_ms(self) -> float:
        return percentile(self.ttfts_s, 0.99) * 1000


async def compare(targets: dict[str, str], model: str, num_rounds: int, prompt_words: int, warmup: int = 3,
                  worker_key: str | None = None) -> list[TargetResult]:
    results = {name: TargetResult(name, []) for name in targets}
    timeout = aiohttp.ClientTimeout(total=120)
    # The workers' key (a direct target is a worker; dpd without tenants ignores the header).
    headers = {"Authorization": f"Bearer {worker_key}"} if worker_key else None
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        rng = random.Random(0)
        for round_index in range(-warmup, num_rounds):
            order = list(targets.items())
            rng.shuffle(order)
            for name, url in order:
                seed = hash((round_index, name)) & 0xFFFFFFF
                ttft, _ = await measure_ttft(session, url, model, distinct_prompt(seed, prompt_words))
                if round_index >= 0:
                    results[name].ttfts_s.append(ttft)
            if round_index >= 0 and (round_index + 1) % 20 == 0:
                print(f"  round {round_index + 1}/{num_rounds}", file=sys.stderr, flush=True)
    return list(results.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def peer_router(decode_url: str, prefill_url: str | None = None, api_key: str | None = None) -> Iterator[str]:
    """Run ``vllm-router``: plain proxy to ``decode_url``, or P/D mode with ``prefill_url``;
    ``api_key``: the key dpd's workers require (``dpd serve`` keeps it in its run directory)."""
    exe = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable), "vllm-router")
    if not os.path.exists(exe):
        raise RuntimeError("vllm-router is not installed (pip install vllm-router)")
    port, metrics_port = free_port(), free_port()
    if prefill_url:
        args = ["--vllm-pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url, "--kv-connector", "nixl"]
    else:
        args = ["--worker-urls", decode_url]
    cmd = [exe, *args, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port),
           "--policy", "round_robin", "--worker-startup-check-interval", "1", *(["--api-key", api_key] if api_key else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {proc.returncode}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def difference_ci_ms(target: TargetResult, base: TargetResult, q: float, *, num_resamples: int = 1000,
                     seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of ``target``'s TTFT quantile ``q`` less ``base``'s, in ms. The
    samples are paired by round (each round sent one request to every target, in a shuffled
    order): a resample draws rounds, the same ones for both targets."""
    n = min(len(target.ttfts_s), len(base.ttfts_s))

    def statistic(rounds: list[int]) -> float:
        return (percentile([target.ttfts_s[i] for i in rounds], q) - percentile([base.ttfts_s[i] for i in rounds], q)) * 1000

    return bootstrap_ci(statistic, n, num_resamples=num_resamples, seed=seed)


def report(results: list[TargetResult], baseline: str) -> str:
    base = next(r for r in results if r.name == baseline)
    lines = [
        f"| target | n | median TTFT (ms) | p99 TTFT (ms) | median − {baseline} (ms) [95% CI] | p99 − {baseline} (ms) [95% CI] |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        cells = []
        for q, value in ((0.5, r.median_ms - base.median_ms), (0.99, r.p99_ms - base.p99_ms)):
            low, high = difference_ci_ms(r, base, q) if r is not base else (0.0, 0.0)
            cells.append(f"{value:+.1f} [{low:+.1f}, {high:+.1f}]")
        lines.append(f"| {r.name} | {len(r.ttfts_s)} | {r.median_ms:.1f} | {r.p99_ms:.1f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def run_overhead(
    router_url: str, decode_url: str, model: str, num_rounds: int, prompt_words: int, with_peer: bool, out_json: str | None,
    worker_key: str | None = None,
) -> int:
    targets = {"direct": decode_url, "dpd": router_url}
    with contextlib.ExitStack() as stack:
        if with_peer:
            targets["vllm-router"] = stack.enter_context(peer_router(decode_url, api_key=worker_key))
        print(f"measuring {num_rounds} rounds over {', '.join(targets)}", file=sys.stderr)
        results = asyncio.run(compare(targets, model, num_rounds, prompt_words, worker_key=worker_key))
    print(report(results, "direct"))
    if out_json:
        with open(out_json, "w") as f:
            base = next(r for r in results if r.name == "direct")
            json.dump({r.name: {"ttft_s": r.ttfts_s, "median_ms": r.median_ms, "p99_ms": r.p99_ms,
                                "median_minus_direct_ci95_ms": difference_ci_ms(r, base, 0.5),
                                "p99_minus_direct_ci95_ms": difference_ci_ms(r, base, 0.99)} for r in results}, f, indent=1)
    return 0

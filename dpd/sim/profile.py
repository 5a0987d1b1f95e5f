"""``dpd profile``: what the simulator needs to know of a worker, measured on the user's own.

A profile is an ``EngineProfile`` (prefill rate, a step's fixed cost, each running stream's
cost per step, the step's token budget, the KV pull) with where it came from: hardware, model,
engine version, date, and whether it was *measured* here or *modelled* from published figures
(``modelled``, for hardware the user does not have; docs/planning.md gives its expected error).

Measuring, on one worker that serves nothing else:

* **prefill** — single requests with one output token at several prompt lengths, each timed
  end to end after a warm-up: time = step cost + tokens ÷ rate, fitted by least squares;
* **decode** — b concurrent streams of one-token prompts for b in a few batch sizes, the mean
  gap between a stream's tokens: gap = step cost + b × per-stream cost, fitted likewise;
* **the KV pull** — the split's own cost as a P/D router measures it (``/admin/workers``,
  ``split_overhead_s``), when a router is given; else the default, and the profile says so;
  and what a pull costs the decoder's other streams (``measure_pull``: a stream on the decoder
  while splits are made by hand, its delay counted from each decode hop's start to its end, per
  prompt token pulled; the hop's own tokens in the batch are part of it);
* **workers of one machine** — two of the router's workers on one host: a prefill on one alone
  and beside the other's stream, the stream alone and beside the prefills (``measure_interference``).

Quick mode takes about a minute and a half on this project's CPU workers; ``full`` adds longer
prompts, larger batches and more rounds.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import requests

from dpd.router.flow import decode_body, prefill_body
from dpd.sim.engine import EngineProfile


@dataclass(frozen=True)
class Plan:
    prompts: tuple[int, ...]  # prompt lengths of the prefill points
    batches: tuple[int, ...]  # concurrent streams of the decode points
    repeats: int  # requests per prefill point
    decode_tokens: int  # tokens per decode stream


QUICK = Plan(prompts=(64, 256, 512), batches=(1, 4, 8), repeats=2, decode_tokens=32)
FULL = Plan(prompts=(64, 256, 512, 1024, 2048), batches=(1, 2, 4, 8, 16, 32), repeats=3, decode_tokens=64)


@dataclass(frozen=True)
class Profile:
    engine: EngineProfile
    source: str  # "measured" or "modelled"
    hardware: str = ""
    model: str = ""
    engine_version: str = ""
    date: str = ""
    notes: tuple[str, ...] = ()
    samples: dict[str, Any] = field(default_factory=dict)  # what was measured, for review

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        text = Path(path).read_text()
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or not isinstance(data.get("engine"), dict):
                raise ValueError("no \"engine\" object")
            return cls(engine=EngineProfile(**data.pop("engine")), **{**data, "notes": tuple(data.get("notes", ()))})
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"{path} is not a dpd profile: {exc}") from None


def under_load(engine: EngineProfile, speed: float) -> EngineProfile:
    """``engine`` at ``speed`` × its measured speed: prefill that much slower or faster, each
    decode step's costs divided by it (the KV pull unchanged). A profile times one worker
    alone; serving, it shares the machine with its peers, the router and their threads: on this
    project's 2-core machine 0.85 fitted the synthetic ladder of 2026-12-06 and, checked on the
    trace's ladders, cut their mean attainment error from 10 to 4 points; with the workers'
    interference measured (``prefill_slowdown``, ``decode_slowdown``) a ladder run right after its
    profile fitted 0.95–1.0 (BENCHMARKS.md).
    ``dpd plan --check LADDER --fit-speed`` finds it for a machine."""
    if not speed > 0:
        raise ValueError("the speed under load must be positive")
    return replace(engine, prefill_tokens_per_s=engine.prefill_tokens_per_s * speed,
                   step_overhead_s=engine.step_overhead_s / speed, decode_s_per_stream=engine.decode_s_per_stream / speed)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over xs."""
    if len(set(xs)) < 2:
        raise ValueError("a fit needs at least two distinct x values")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def hardware_description() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {platform.machine()}"
    except OSError:
        pass
    return platform.processor() or platform.machine()


class WorkerClient:
    def __init__(self, url: str, model: str | None = None, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model or self._get("/v1/models")["data"][0]["id"]

    def _get(self, path: str) -> Any:
        resp = requests.get(self.url + path, headers=self.headers, timeout=30)
        resp.raise_for_status()
        return resp.json()

    def version(self) -> str:
        try:
            return "vllm " + str(self._get("/version").get("version", "?"))
        except (requests.RequestException, ValueError):
            return "unknown"

    def prompt(self, num_tokens: int, seed: int) -> list[int]:
        # Token ids, not text, so the length is exact; distinct per call so no prefix is cached.
        return [1000 + (seed * 7919 + i * 104729) % 20000 for i in range(num_tokens)]

    def complete(self, prompt: list[int], max_tokens: int) -> float:
        started = time.monotonic()
        resp = requests.post(self.url + "/v1/completions", headers=self.headers, timeout=600, json={
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        resp.raise_for_status()
        return time.monotonic() - started

    def open_stream(self, prompt: list[int], max_tokens: int, **extra: Any) -> requests.Response:
        """A streamed greedy completion of exactly ``max_tokens`` tokens, its response open."""
        resp = requests.post(self.url + "/v1/completions", headers=self.headers, timeout=600, stream=True, json={
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, **extra})
        resp.raise_for_status()
        return resp

    def stream_gaps(self, prompt: list[int], max_tokens: int) -> list[float]:
        """The gaps between a stream's tokens (one per token: usage counts them)."""
        resp = self.open_stream(prompt, max_tokens,
                                stream_options={"include_usage": True, "continuous_usage_stats": True})
        gaps, last, seen = [], None, 0
        for line in resp.iter_lines(chunk_size=None):  # as each chunk arrives, not 512 bytes at a time
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            tokens = (chunk.get("usage") or {}).get("completion_tokens", seen)
            if tokens <= seen:
                continue
            now = time.monotonic()
            if last is not None:
                gaps += [(now - last) / (tokens - seen)] * (tokens - seen)
            last, seen = now, tokens
        return gaps


def measure(worker_url: str, *, mode: str = "quick", router_url: str | None = None, api_key: str | None = None,
            max_batched_tokens: int = 2048, progress: Any = print) -> Profile:
    plan = QUICK if mode == "quick" else FULL
    client = WorkerClient(worker_url, api_key=api_key)
    notes = []
    seed = int(time.time())
    progress(f"profile: warming up {client.url} ({client.model})")
    client.complete(client.prompt(max(plan.prompts), seed), 1)
    xs, ys = [], []
    for n in plan.prompts:
        for _ in range(plan.repeats):
            seed += 1
            ys.append(client.complete(client.prompt(n, seed), 1))
            xs.append(float(n))
        progress(f"profile: prefill {n} tokens: {statistics.fmean(ys[-plan.repeats:]):.3f} s")
    intercept, slope = fit_line(xs, ys)
    prefill_rate = 1 / slope if slope > 0 else float("inf")
    batch_x, gap_y = [], []
    for b in plan.batches:
        seed += 1
        prompts = [client.prompt(8, seed * 100 + i) for i in range(b)]
        with ThreadPoolExecutor(b) as pool:
            results = list(pool.map(lambda p: client.stream_gaps(p, plan.decode_tokens), prompts))
        gaps = sorted(g for r in results for g in r)
        mid = gaps[len(gaps) // 4: 3 * len(gaps) // 4] or gaps  # the middle half: ramp-up and tail out
        batch_x.append(float(b))
        gap_y.append(statistics.fmean(mid))
        progress(f"profile: decode batch {b}: {gap_y[-1] * 1000:.1f} ms/token")
    step_s, per_stream_s = fit_line(batch_x, gap_y)
    engine = EngineProfile(prefill_tokens_per_s=round(prefill_rate, 1), step_overhead_s=round(max(step_s, 0.001), 4),
                           decode_s_per_stream=round(max(per_stream_s, 0.0), 5), max_batched_tokens=max_batched_tokens)
    if router_url:
        split_s = measure_split(router_url, client.model, seed, progress)
        if split_s is not None:
            engine = replace(engine, kv_transfer_s=round(split_s, 4))
            pull = measure_pull(router_url, client.model, seed, api_key, progress)
            if pull is not None:
                engine = replace(engine, kv_pull_s_per_token=round(pull, 8))
        else:
            notes.append("the router measured no split (is it a P/D endpoint?): KV pull left at the default")
        try:
            interference = measure_interference(router_url, client.model, seed, api_key, progress,
                                                rounds=4 if mode == "quick" else 8, fixed_s=max(intercept, 0.0))
        except (RuntimeError, statistics.StatisticsError, requests.RequestException) as exc:
            notes.append(f"the workers' interference could not be measured ({exc}): none modelled")
        else:
            if interference is None:
                notes.append("no two of the router's workers share a host, or no round could be measured: "
                             "their interference not measured (none modelled)")
            else:
                prefill_slowdown, decode_slowdown, machine_workers = interference
                engine = replace(engine, prefill_slowdown=prefill_slowdown, decode_slowdown=decode_slowdown,
                                 machine_workers=machine_workers)
                notes.append(f"machine_workers {machine_workers}: the router's workers on one host, taken as one "
                             "machine" if engine.has_interference else "the workers measured no interference: none modelled")
    else:
        notes.append("no P/D router given: KV pull left at the default, the workers' interference not measured")
    notes.append(f"max_batched_tokens {max_batched_tokens} as given (the engine does not report it)")
    return Profile(engine=engine, source="measured", hardware=hardware_description(), model=client.model,
                   engine_version=client.version(), date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                   notes=tuple(notes), samples={"prefill": [[x, y] for x, y in zip(xs, ys)],
                                                     "decode": [[x, y] for x, y in zip(batch_x, gap_y)]})


@contextlib.contextmanager
def _every_prompt_split(url: str) -> Iterator[None]:
    """The router's static split at threshold 0 (the adaptive policy may run a prompt whole),
    then its policy and threshold restored."""
    before = requests.get(url + "/admin/workers", timeout=10).json().get("routing", {})
    threshold, policy = before.get("threshold_tokens"), before.get("policy")
    requests.put(url + "/admin/threshold", json={"threshold_tokens": 0}, timeout=10).raise_for_status()
    if policy not in (None, "threshold"):
        requests.put(url + "/admin/policy", json={"policy": "threshold"}, timeout=10).raise_for_status()
    try:
        yield
    finally:
        if threshold is not None:
            requests.put(url + "/admin/threshold", json={"threshold_tokens": threshold}, timeout=10)
        if policy not in (None, "threshold"):
            requests.put(url + "/admin/policy", json={"policy": policy}, timeout=10)


def measure_split(router_url: str, model: str, seed: int, progress: Any = print, num: int = 4) -> float | None:
    """The split's own cost (KV pull, the decode hop's first step) as the router measures it:
    a few disaggregated requests."""
    url = router_url.rstrip("/")
    with _every_prompt_split(url):
        for i in range(num):
            prompt = [1000 + ((seed + i) * 7919 + k * 104729) % 20000 for k in range(256)]
            requests.post(url + "/v1/completions", timeout=600, json={
                "model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}).raise_for_status()
    routing = requests.get(url + "/admin/workers", timeout=10).json().get("routing", {})
    if not routing.get("split_overhead_samples"):
        return None
    progress(f"profile: the split's own cost (KV pull + first decode step): {routing['split_overhead_s']:.3f} s")
    return float(routing["split_overhead_s"])


Windows = list[tuple[float, float]]
T = TypeVar("T")


def _stream_beside(decoder: WorkerClient, load: Callable[[], T], seed: int,
                   quiet_tokens: int = 16) -> tuple[list[float], tuple[float, float], T]:
    """A stream on ``decoder`` that runs alone for ``quiet_tokens`` tokens, then while ``load``
    runs, then alone again for as many: its tokens' arrival times, the load's (start, end) and
    what it returned."""
    times: list[float] = []
    span: list[float] = []
    started, stop = threading.Event(), threading.Event()

    def stream() -> None:
        with decoder.open_stream(decoder.prompt(8, seed), 4000) as resp:
            for line in resp.iter_lines(chunk_size=None):
                if line.startswith(b"data: {"):
                    times.append(time.monotonic())
                    if len(times) == quiet_tokens:
                        started.set()
                    if len(span) == 2 and sum(1 for t in times if t > span[1]) > quiet_tokens:
                        return  # closing the connection aborts the request on the worker
                if stop.is_set():
                    return

    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream)
        while not started.wait(0.1):
            if streaming.done():
                streaming.result()  # raises what ended it
                raise RuntimeError(f"the decoder's stream ended before {quiet_tokens} tokens")
        span.append(time.monotonic())
        try:
            result = load()
        except BaseException:
            stop.set()
            raise
        finally:
            span.append(time.monotonic())
        streaming.result(timeout=600)
    t0, t1 = span
    if sum(1 for t in times if t > t1) < quiet_tokens:
        raise RuntimeError("the decoder's stream ended before the load did: no pace after it to compare")
    return times, (t0, t1), result


def _stream_delay_s(decoder: WorkerClient, load: Callable[[], Windows], seed: int, quiet_tokens: int = 16) -> float:
    """How much ``load`` delayed a stream on ``decoder`` (``_stream_beside``). Its pace is the
    median gap outside the load; the delay, summed over the windows ``load`` returns (its
    moments of interest), is each window's length less the time the tokens made in it take at
    that pace."""
    times, (t0, t1), windows = _stream_beside(decoder, load, seed, quiet_tokens)
    pace = statistics.median(b - a for a, b in zip(times, times[1:]) if b <= t0 or a > t1)
    # Summed before clamping: a window's own count is ± a token, and clamping each at 0 would
    # turn that noise into delay.
    return max(0.0, sum((end - start) - sum(1 for t in times if start < t <= end) * pace for start, end in windows))


def _split_by_hand(prefiller: WorkerClient, decoder: WorkerClient, prompt: list[int]) -> tuple[float, float]:
    """One split as the router makes it (its own request bodies): the prefill, then the decode
    hop that pulls the KV and makes two tokens; the decode hop's (start, end)."""
    body = {"model": decoder.model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    resp = requests.post(prefiller.url + "/v1/completions", headers=prefiller.headers, timeout=600,
                         json=prefill_body(body))
    resp.raise_for_status()
    kv_params = resp.json().get("kv_transfer_params")
    if not kv_params:
        raise RuntimeError(f"{prefiller.url} answered a prefill without kv_transfer_params (is it a P/D prefill worker?)")
    started = time.monotonic()
    with requests.post(decoder.url + "/v1/completions", headers=decoder.headers, timeout=600, stream=True,
                       json=decode_body(body, kv_params)) as hop:
        hop.raise_for_status()
        for _ in hop.iter_lines(chunk_size=None):
            pass
    return started, time.monotonic()


def measure_pull(router_url: str, model: str, seed: int, api_key: str | None = None, progress: Any = print,
                 num: int = 4, prompt_tokens: int = 768, rounds: int = 3) -> float | None:
    """What taking in a split's KV costs the decoder's other streams, per prompt token: a stream
    on the decoder while ``num`` splits of ``prompt_tokens``-token prompts are made by hand (the
    router's request bodies, sent to the workers the router names), its delay counted from each
    decode hop's start to its end — the prefills before, on the other worker, are not counted —
    divided by the tokens pulled; the median of ``rounds``. None if the router names no prefill
    and decode worker."""
    pools = requests.get(router_url.rstrip("/") + "/admin/workers", timeout=10).json().get("pools", {})
    try:
        prefiller = WorkerClient(pools["prefill"]["workers"][0]["url"], model, api_key)
        decoder = WorkerClient(pools["decode"]["workers"][0]["url"], model, api_key)
    except (KeyError, IndexError, TypeError):
        return None

    def splits(base: int) -> Windows:
        return [_split_by_hand(prefiller, decoder, prefiller.prompt(prompt_tokens, base + i)) for i in range(num)]

    costs = []
    for i in range(rounds):
        delay = _stream_delay_s(decoder, functools.partial(splits, seed + 1000 * (i + 1)), seed + 300 + i)
        costs.append(delay / (num * prompt_tokens))
        progress(f"profile: a stream on the decoder delayed {delay:.3f} s by the pulls of {num} splits of "
                 f"{prompt_tokens} tokens: {costs[-1] * 1e6:.1f} µs a token pulled")
    per_token = statistics.median(costs)
    progress(f"profile: a KV pull costs the decoder's streams {per_token * 1e6:.1f} µs a token (median of {rounds})")
    return per_token


def _same_machine_pair(router_url: str, model: str, api_key: str | None) -> tuple[WorkerClient, WorkerClient, int] | None:
    """Two of the router's workers on one machine — the same host in their URLs, the host the
    most workers share: its first prefill and first decode worker where it has both, else its
    first two — and how many of the router's workers that host has. None if no two share a host.
    (Hosts are compared as written: ``localhost`` and ``127.0.0.1`` are two.)"""
    pools = requests.get(router_url.rstrip("/") + "/admin/workers", timeout=10).json().get("pools", {})
    by_host: dict[str, dict[str, str]] = {}  # host -> url -> its pool (the first that lists it)
    for role in ("prefill", "decode"):
        for w in (pools.get(role) or {}).get("workers", []):
            by_host.setdefault(urlsplit(str(w["url"])).hostname or "", {}).setdefault(str(w["url"]), role)
    if not by_host or max(len(urls) for urls in by_host.values()) < 2:
        return None
    urls = max(by_host.values(), key=len)
    prefill = [u for u, role in urls.items() if role == "prefill"]
    decode = [u for u, role in urls.items() if role == "decode"]
    first, second = (prefill[0], decode[0]) if prefill and decode else list(urls)[:2]
    return WorkerClient(first, model, api_key), WorkerClient(second, model, api_key), len(urls)


NOISE = 1.05  # a mean slowdown below this is the rounds' noise: written as 1.0


def _slowdown(ratios: list[float]) -> float:
    mean = statistics.fmean(ratios)
    return round(mean, 3) if mean >= NOISE else 1.0


def measure_interference(router_url: str, model: str, seed: int, api_key: str | None = None,
                         progress: Any = print, rounds: int = 4, prompt_tokens: int = 512,
                         fixed_s: float = 0.0) -> tuple[float, float, int] | None:
    """How much two workers of one machine slow each other: (prefill_slowdown, decode_slowdown,
    the workers on that machine). A ``prompt_tokens`` prefill on one, timed alone and while the
    other decodes a stream (the median of three each, per round; ``fixed_s``, a request's time
    that is not its prefill — the prefill fit's intercept — taken off both); the other's stream,
    its median gap alone (before and after) and while the first computes three prefills back to
    back (a round with fewer than three gaps inside them is skipped). Each the mean of the
    rounds' ratios, 1.0 below ``NOISE``: the rounds differ, as the OS places each worker's threads
    that are not pinned (its API server, its engine loop) on one core or the other — on this
    project's machine one profile measured a prefill ×1.89 and a step ×1.00, the next ×1.04 and
    ×1.34. None where no two workers share a host or no round could be measured."""
    pair = _same_machine_pair(router_url, model, api_key)
    if pair is None:
        return None
    a, b, machine_workers = pair
    a.complete(a.prompt(prompt_tokens, seed + 5000), 1)  # warm
    prefill_ratios, decode_ratios = [], []

    def prefills(first: int) -> list[float]:
        return [a.complete(a.prompt(prompt_tokens, first + i), 1) for i in range(3)]

    for r in range(rounds):
        base = seed + 6000 + 100 * r
        alone = statistics.median(prefills(base))
        times, (t0, t1), beside_s = _stream_beside(b, functools.partial(prefills, base + 10), base + 20)
        beside = statistics.median(beside_s)
        gaps_alone = [y - x for x, y in zip(times, times[1:]) if y <= t0 or x > t1]
        gaps_beside = [y - x for x, y in zip(times, times[1:]) if x >= t0 and y <= t1]
        if len(gaps_beside) < 3 or not gaps_alone:
            progress(f"profile: round {r + 1}: {len(gaps_beside)} of the stream's gaps inside the prefills: skipped")
            continue
        fixed = min(max(fixed_s, 0.0), alone / 2)
        gap_alone, gap_beside = statistics.median(gaps_alone), statistics.median(gaps_beside)
        prefill_ratios.append((beside - fixed) / (alone - fixed))
        decode_ratios.append(gap_beside / gap_alone)
        progress(f"profile: a {prompt_tokens}-token prefill {alone:.3f} s alone, {beside:.3f} s beside a stream on "
                 f"{b.url}; the stream's gap {gap_alone * 1000:.1f} ms alone, {gap_beside * 1000:.1f} ms beside the prefills")
    if not prefill_ratios:
        return None
    prefill_slowdown, decode_slowdown = _slowdown(prefill_ratios), _slowdown(decode_ratios)
    progress(f"profile: workers of one machine slow each other: a prefill ×{prefill_slowdown} beside a decoding "
             f"worker, a decode step ×{decode_slowdown} beside a prefill ({machine_workers} workers on {a.url}'s host; "
             f"means of {len(prefill_ratios)} rounds, below ×{NOISE} taken as 1)")
    return prefill_slowdown, decode_slowdown, machine_workers


# -- what-if hardware -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    name: str
    tflops: float  # dense bf16/fp16 tensor TFLOP/s
    memory_gbps: float  # HBM bandwidth, GB/s
    interconnect_gbps: float  # what a KV pull between two workers gets, GB/s


HARDWARE = {  # published datasheet figures (dense, no sparsity)
    "h100-sxm": Hardware("NVIDIA H100 SXM", 989.0, 3350.0, 50.0),
    "h200": Hardware("NVIDIA H200", 989.0, 4800.0, 50.0),
    "a100-80g": Hardware("NVIDIA A100 80GB SXM", 312.0, 2039.0, 25.0),
    "l4": Hardware("NVIDIA L4", 121.0, 300.0, 6.0),
}
MFU_PREFILL = 0.5  # share of peak FLOP/s a prefill reaches
MBU_DECODE = 0.6  # share of peak bandwidth a decode step reaches


def modelled(hardware: str, params_billion: float, *, kv_bytes_per_token: float, bytes_per_param: float = 2.0,
             context_tokens: int = 2048, max_batched_tokens: int = 8192) -> Profile:
    """A profile from datasheet figures and the model's size (a roofline): prefill at
    ``MFU_PREFILL`` of peak FLOP/s (2 × params FLOPs per token), a decode step reading the
    weights at ``MBU_DECODE`` of peak bandwidth, each stream adding its KV cache
    (``context_tokens`` × ``kv_bytes_per_token``), the KV pull at the interconnect's rate.
    Marked modelled: its error against measurement is stated in docs/planning.md."""
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(sorted(HARDWARE))}")
    hw = HARDWARE[hardware]
    params = params_billion * 1e9
    prefill_rate = hw.tflops * 1e12 * MFU_PREFILL / (2 * params)
    step_s = params * bytes_per_param / (hw.memory_gbps * 1e9 * MBU_DECODE)
    per_stream_s = context_tokens * kv_bytes_per_token / (hw.memory_gbps * 1e9 * MBU_DECODE)
    kv_s = context_tokens * kv_bytes_per_token / (hw.interconnect_gbps * 1e9)
    engine = EngineProfile(prefill_tokens_per_s=round(prefill_rate, 1), step_overhead_s=step_s,
                           decode_s_per_stream=per_stream_s, max_batched_tokens=max_batched_tokens, kv_transfer_s=kv_s)
    return Profile(engine=engine, source="modelled", hardware=hw.name, model=f"{params_billion:g}B parameters",
                   date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                   notes=("modelled from datasheet figures, not measured: see docs/planning.md for its expected error",))

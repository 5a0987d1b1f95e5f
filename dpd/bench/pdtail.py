"""The P/D tail: sequential requests on the disaggregated path against the same-size prompts
served direct, side by side in one run — the reproduction and acceptance check of the NIXL
stall (docs/pd-stall.md).

Two modes:
  * through dpd's router (default): each request's path is forced with the runtime threshold
    (0 = disaggregate, huge = direct); the router's own stall/fallback counters are reported.
  * ``raw``: the two hops done here, straight to the workers with no dpd code in between —
    what reproduces the upstream stall without any of dpd's mitigations.
Every prompt is distinct (no prefix-cache hits); sizes alternate so both paths see the same mix.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import uuid
from dataclasses import dataclass, field

import aiohttp

from dpd.bench.overhead import distinct_prompt, measure_ttft
from dpd.bench.stats import bootstrap_ci, counter_totals, percentile

HUGE_THRESHOLD = 1_000_000


@dataclass
class PathSamples:
    ttfts_s: list[float] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {
            "n": len(self.ttfts_s),
            "p50_s": percentile(self.ttfts_s, 0.5),
            "p99_s": percentile(self.ttfts_s, 0.99),
            "max_s": max(self.ttfts_s, default=float("nan")),
            "over_5s": sum(t > 5 for t in self.ttfts_s),
        }


async def _raw_pd(session: aiohttp.ClientSession, prefill_url: str, decode_url: str, model: str, prompt: str) -> float:
    """The P/D flow without dpd (docs/structure.md, steps 6–7): prefill hop, then a streaming decode hop."""
    request_id = uuid.uuid4().hex
    started = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": False, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    async with session.post(prefill_url + "/v1/completions", json=body, headers={"X-Request-Id": request_id}) as resp:
        kv = (await resp.json())["kv_transfer_params"]
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "kv_transfer_params": kv}
    async with session.post(decode_url + "/v1/completions", json=body, headers={"X-Request-Id": request_id}) as resp:
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"text"' in line:
                ttft = time.perf_counter() - started
                break
        async for _ in resp.content:
            pass
    return ttft


async def _set_threshold(session: aiohttp.ClientSession, router_url: str, value: int) -> None:
    async with session.put(router_url + "/admin/threshold", json={"threshold_tokens": value}) as resp:
        resp.raise_for_status()


async def _router_counters(session: aiohttp.ClientSession, router_url: str) -> dict[str, float]:
    async with session.get(router_url + "/metrics") as resp:
        return counter_totals(await resp.text(), ("dpd_pd_stalls_total", "dpd_fallbacks_total"))


async def run(
    *, router_url: str | None, prefill_url: str | None, decode_url: str, model: str,
    num_short: int, num_long: int, short_words: int, long_words: int, worker_key: str | None = None,
) -> dict:
    samples = {f"{path}/{size}": PathSamples() for path in ("disaggregated", "direct") for size in ("short", "long")}
    jobs = [short_words] * num_short + [long_words] * num_long
    random.Random(0).shuffle(jobs)  # a fixed interleaving of sizes
    timeout = aiohttp.ClientTimeout(total=600)
    headers = {"Authorization": f"Bearer {worker_key}"} if worker_key else None  # raw mode talks to the workers
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        before = await _router_counters(session, router_url) if router_url else {}
        for i, words in enumerate(jobs):
            for path in ("disaggregated", "direct"):
                prompt = distinct_prompt(hash((i, path, words)) & 0xFFFFFFF, words)
                if router_url is None and path == "disaggregated":
                    assert prefill_url
                    ttft, taken = await _raw_pd(session, prefill_url, decode_url, model, prompt), "raw-pd"
                elif router_url is None:
                    ttft, taken = (await measure_ttft(session, decode_url, model, prompt, max_tokens=4))[0], "direct"
                else:
                    await _set_threshold(session, router_url, 0 if path == "disaggregated" else HUGE_THRESHOLD)
                    ttft, headers = await measure_ttft(session, router_url, model, prompt, max_tokens=4)
                    taken = headers.get("x-dpd-path", "?")
                key = f"{path}/{'short' if words == short_words else 'long'}"
                samples[key].ttfts_s.append(ttft)
                samples[key].paths.append(taken)
            if (i + 1) % 25 == 0:
                print(f"  {i + 1}/{len(jobs)} prompts", file=sys.stderr, flush=True)
        after = await _router_counters(session, router_url) if router_url else {}
        if router_url:
            await _set_threshold(session, router_url, 2048)
    result: dict = {key: s.summary() for key, s in samples.items()}
    for path in ("disaggregated", "direct"):
        merged = PathSamples(samples[f"{path}/short"].ttfts_s + samples[f"{path}/long"].ttfts_s)
        result[path] = merged.summary()
    result["p99_ratio"] = result["disaggregated"]["p99_s"] / result["direct"]["p99_s"]
    result["p99_ratio_ci95"] = p99_ratio_ci(samples)
    result["fallbacks"] = sum(p == "fallback" for size in ("short", "long") for p in samples[f"disaggregated/{size}"].paths)
    result["router_counter_deltas"] = {k: after[k] - before.get(k, 0) for k in after}
    return result


def p99_ratio_ci(samples: dict[str, PathSamples], *, num_resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of P99 TTFT disaggregated ÷ direct. Each prompt was sent once on
    each path (distinct text, the same size): a resample draws prompts, and both of a prompt's
    answers with it."""
    pairs = [(d, c) for size in ("short", "long")
             for d, c in zip(samples[f"disaggregated/{size}"].ttfts_s, samples[f"direct/{size}"].ttfts_s)]

    def statistic(chosen: list[int]) -> float:
        direct = percentile([pairs[i][1] for i in chosen], 0.99)
        return percentile([pairs[i][0] for i in chosen], 0.99) / direct if direct > 0 else float("nan")

    return bootstrap_ci(statistic, len(pairs), num_resamples=num_resamples, seed=seed)


def main(args) -> int:
    result = asyncio.run(run(
        router_url=None if args.raw else args.router.rstrip("/"),
        prefill_url=args.prefill.rstrip("/") if args.prefill else None,
        decode_url=args.decode.rstrip("/"), model=args.model_name,
        num_short=args.short, num_long=args.long, short_words=args.short_words, long_words=args.long_words,
        worker_key=args.worker_key,
    ))
    print(json.dumps(result, indent=1))
    return 0

"""Open-loop, streaming load client: replays a trace against an OpenAI-compatible endpoint.

Each request is sent at its trace arrival time whatever the state of earlier ones (open loop:
a slow server faces a queue, as in production). Prompts are token-id lists of exactly the
trace's length, random and so distinct per request (no prefix-cache hits) — except within a
session (``TraceRequest.session``), whose turns extend one another; outputs are forced
to the trace's length with ``ignore_eos``. Per request it records TTFT, every inter-chunk gap,
E2E, token counts and the path the router reports (``x-dpd-path``).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import aiohttp
from tqdm import tqdm

from dpd.bench.stats import RequestRecord
from dpd.bench.workloads import TraceRequest
from dpd.router.server import freeze_startup_objects, thaw_startup_objects

# Token ids drawn from the middle of the vocabulary: ordinary word pieces, no special tokens.
TOKEN_ID_RANGE = (1000, 40000)


def prompt_token_ids(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(num_tokens)]


def request_class(num_prompt_tokens: int, threshold_tokens: int) -> str:
    return "long" if num_prompt_tokens >= threshold_tokens else "short"


async def send(
    session: aiohttp.ClientSession, url: str, model: str, request: TraceRequest, seed: int, threshold_tokens: int
) -> RequestRecord:
    body = {
        "model": model,
        "prompt": prompt_token_ids(request.num_prompt_tokens, seed),
        "max_tokens": request.num_output_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        # usage on every chunk: how many tokens each chunk carries, so ITL is per token on every path
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    record = RequestRecord(ttft_s=float("nan"), e2e_s=float("nan"), num_output_tokens=0,
                           request_class=request_class(request.num_prompt_tokens, threshold_tokens))
    started = time.perf_counter()
    last = None
    num_counted = 0  # tokens the chunks brought, as counted here
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            record.path = resp.headers.get("x-dpd-path", "")
            record.reason = resp.headers.get("x-dpd-reason", "")
            if resp.status != 200:
                record.is_ok = False
                await resp.read()
                return record
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.is_ok = False
                    continue
                tokens_before = record.num_output_tokens
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    record.num_output_tokens = usage.get("completion_tokens") or 0
                    record.num_prompt_tokens = usage.get("prompt_tokens") or 0
                    record.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                num_new = token_arrivals(chunk, record.num_output_tokens - tokens_before)
                if num_new:
                    now = time.perf_counter()
                    if last is None:
                        record.ttft_s = now - started
                    add_token_gaps(record, None if last is None else now - last, num_new)
                    num_counted += num_new
                    last = now
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError):
        record.is_ok = False
    record.e2e_s = time.perf_counter() - started
    if last is None:
        record.is_ok = False
    if not record.num_output_tokens:  # a stream without usage (a peer that strips it): its chunks, counted
        record.num_output_tokens = num_counted
    return record


def token_arrivals(chunk: dict, usage_growth: int) -> int:
    """How many generated tokens ``chunk`` brings: with a usage count, what it grew by (a chunk of
    empty text can carry tokens — a special token skipped, a partial UTF-8 character held back —
    and the usage-only chunk at the end brings none); without one, a chunk with text is one token."""
    if not chunk.get("choices"):
        return 0
    if chunk.get("usage"):
        return max(usage_growth, 0)
    return 1 if any(c.get("text") for c in chunk["choices"]) else 0


def add_token_gaps(record: RequestRecord, gap_s: float | None, num_tokens: int) -> None:
    """Record one text chunk's inter-token gaps, per token: a chunk of k tokens that arrived
    ``gap_s`` after the previous one is k gaps of gap_s / k (the first chunk: its k − 1 extra
    tokens arrived with the first, gaps of 0). Chunks without a usage count are one token."""
    k = max(1, num_tokens)
    if k > 1:
        record.num_merged_chunks += 1
    if gap_s is None:
        record.itls_s.extend([0.0] * (k - 1))
    else:
        record.itls_s.extend([gap_s / k] * k)


async def replay(
    url: str, model: str, trace: list[TraceRequest], *, threshold_tokens: int, seed: int = 0,
    timeout_s: float = 900, progress: bool = True, label: str = "requests",
) -> tuple[list[RequestRecord], float]:
    """Send every request of ``trace`` at its arrival offset; return the records and the run time.
    With ``progress``, a progress bar on stderr counts finished requests and failures."""
    # The client's own pauses would be measured as the server's gaps: what this process holds
    # before the run (tokenizer, earlier runs' records) stays out of its collector's full passes.
    freeze_startup_objects()
    try:
        return await _replay(url, model, trace, threshold_tokens, seed, timeout_s, progress, label)
    finally:
        thaw_startup_objects()


async def _replay(url: str, model: str, trace: list[TraceRequest], threshold_tokens: int, seed: int, timeout_s: float,
                  progress: bool, label: str) -> tuple[list[RequestRecord], float]:
    records: list[RequestRecord | None] = [None] * len(trace)
    bar = tqdm(total=len(trace), desc=label, unit="req", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    failed = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        start = time.perf_counter()

        async def one(i: int, request: TraceRequest) -> None:
            nonlocal failed
            delay = request.arrival_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            lag_s = (time.perf_counter() - start) - request.arrival_s
            # A session's turns draw from one seed, so each prompt extends the previous turn's.
            key = i if request.session is None else 10_000_000 + request.session
            record = records[i] = await send(session, url, model, request, seed * 1_000_003 + key, threshold_tokens)
            record.send_lag_s = lag_s
            record.index = i
            failed += not record.is_ok
            bar.set_postfix(failed=failed, refresh=False)
            bar.update()

        try:
            await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))
        finally:
            bar.close()
        duration_s = time.perf_counter() - start
    return [r for r in records if r is not None], duration_s

"""Helpers of the router's HTTP layer: watching for client disconnects, a streaming response
that always cleans up, and the per-request token timer behind the TTFT/ITL metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from dpd.router.aggregate import has_finish, num_content_tokens
from dpd.router.errors import ApiError
from dpd.router.metrics import RouterMetrics
from dpd.router.slo import SloClass, SloJudge

BODY_READ_SLICE_BYTES = 4 * 1024 * 1024  # each slice of a body gets the read timeout anew


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request's body, bounded while it is read: a declared ``Content-Length`` over
    ``max_bytes`` is refused before reading (413), a body that grows past it is cut off at the
    limit (413, never buffered whole), and one whose first 4 MiB does not arrive within
    ``timeout_s``, or any 4 MiB after within ``timeout_s`` of the one before, is a 408 (a slow
    client holds a connection and its memory at most ceil(max_bytes ÷ 4 MiB) × ``timeout_s``; a
    large body that a long context allows is not cut off for its size alone). Raises
    ``ClientDisconnect`` if the client leaves."""
    too_large = ApiError(413, f"Request body is larger than {max_bytes} bytes.", code="body_too_large")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "Content-Length must be a non-negative integer.", code="invalid_content_length")
        if int(declared) > max_bytes:
            raise too_large
    parts: list[bytes] = []
    size = 0
    next_slice = BODY_READ_SLICE_BYTES
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            async for part in request.stream():
                size += len(part)
                if size > max_bytes:
                    raise too_large
                parts.append(part)
                if size >= next_slice:  # a slice arrived in time: the next gets timeout_s from now
                    next_slice += BODY_READ_SLICE_BYTES * ((size - next_slice) // BODY_READ_SLICE_BYTES + 1)
                    deadline.reschedule(asyncio.get_running_loop().time() + timeout_s)
    except TimeoutError:
        raise ApiError(408, f"The request body did not arrive in time ({timeout_s:g}s for each 4 MiB).",
                       type="invalid_request_error", code="body_timeout") from None
    return b"".join(parts)


class ClientGone(Exception):
    """The client disconnected; its upstream requests were cancelled."""


def noop() -> None:
    pass


class RelayResponse(StreamingResponse):
    """A streaming response that runs its cleanups however it ends — even if the client left
    before the first byte and the relay generator never started (its ``finally`` then never runs)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: tuple[Callable[[], None], ...], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for close in self._on_close:
                close()


class TokenTimer:
    """Records TTFT, inter-token gaps, E2E and output tokens of one relayed stream, and judges
    it by its SLO class (slo.py) when it ends."""

    def __init__(self, metrics: RouterMetrics, path: str, started_at: float,
                 on_output: Callable[[int], None] | None = None, slo: tuple[SloJudge, SloClass] | None = None,
                 on_end: Callable[[dict[str, Any]], None] | None = None,
                 on_first_token: Callable[[float], None] | None = None):
        self._on_output = on_output  # the tenant's metering of generated tokens
        self._on_first_token = on_first_token  # given the TTFT: the cost model's audit of its prediction
        self._on_end = on_end  # the request log's line, given what was measured
        self._metrics = metrics
        self._path = path
        self._slo = slo
        self._class = slo[1].name if slo is not None else "none"
        self._started_at = started_at
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._num_output_tokens: int | None = None
        self._num_cached_tokens: int | None = None

    def observe(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._num_output_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self._num_cached_tokens = details["cached_tokens"]
        # A request whose first token is EOS streams only a finish chunk: that is its first token.
        is_first_finish = self._last_token_at is None and has_finish(chunk)
        if not num_content_tokens(chunk) and not is_first_finish:
            return
        now = time.monotonic()
        if self._last_token_at is None:
            self._first_token_at = now
            self._metrics.ttft.labels(self._path, self._class).observe(now - self._started_at)
            if self._on_first_token is not None:
                self._on_first_token(now - self._started_at)
        else:
            self._metrics.itl.labels(self._path, self._class).observe(now - self._last_token_at)
        self._last_token_at = now

    def timings(self) -> tuple[float | None, float | None]:
        """(TTFT, TPOT) so far; None where the stream never got there."""
        first, last = self._first_token_at, self._last_token_at
        if first is None or last is None:
            return None, None
        n = self._num_output_tokens or 1
        return first - self._started_at, (last - first) / (n - 1) if n > 1 else 0.0

    def judge(self, outcome: str) -> bool | None:
        """Count the request against its SLO: an ``ok`` one by its timings, a failed one as missed
        (a client that went away is not judged: None). Returns whether it met both targets."""
        if self._slo is None or outcome == "client_gone":
            return None
        judge, cls = self._slo
        ttft_s, tpot_s = self.timings()
        if outcome != "ok" or ttft_s is None:
            judge.failed(cls, self._path)
            return False
        return all(judge.judge(cls, self._path, ttft_s, tpot_s))

    def finish(self, outcome: str, count_request: bool = True) -> None:
        if self._num_output_tokens:
            self._metrics.output_tokens_total.labels(self._path).inc(self._num_output_tokens)
            if self._on_output is not None:
                self._on_output(self._num_output_tokens)
        self._metrics.e2e.labels(self._path).observe(time.monotonic() - self._started_at)
        if count_request:
            self._metrics.requests.labels(self._path, outcome).inc()
            met = self.judge(outcome)
            if self._on_end is not None:
                ttft_s, tpot_s = self.timings()
                self._on_end({"output_tokens": self._num_output_tokens, "cached_tokens": self._num_cached_tokens,
                              "ttft_s": _rounded(ttft_s), "tpot_s": _rounded(tpot_s),
                              "e2e_s": _rounded(time.monotonic() - self._started_at), "slo_met": met, "outcome": outcome})


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


async def until_disconnect(request: Request, coro: Any) -> Any:
    """Run ``coro``; cancel it (and so abort its upstream requests) if the client goes away."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # we are being cancelled (shutdown): not a client disconnect
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientGone()
    return task.result()

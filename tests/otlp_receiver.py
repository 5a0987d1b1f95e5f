"""An in-process OTLP/HTTP trace receiver for tests: what the router and vLLM workers export."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class Span:
    def __init__(self, service: str, raw):
        self.service = service
        self.name = raw.name
        self.trace_id = raw.trace_id.hex()
        self.span_id = raw.span_id.hex()
        self.parent_id = raw.parent_span_id.hex()
        self.attributes = {a.key: a.value for a in raw.attributes}

    def __repr__(self) -> str:
        return f"Span({self.service}:{self.name} trace={self.trace_id[:8]} id={self.span_id[:8]} parent={self.parent_id[:8]})"


class OtlpReceiver:
    """``with OtlpReceiver() as r:`` — ``r.url`` takes OTLP/HTTP protobuf exports; ``r.spans``."""

    def __init__(self, port: int = 0):
        self.spans: list[Span] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource_spans in request.resource_spans:
                    attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    service = attrs.get("service.name", "?")
                    for scope in resource_spans.scope_spans:
                        receiver.spans.extend(Span(service, s) for s in scope.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]

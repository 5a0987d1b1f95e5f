"""Run a ``Router`` under uvicorn, standalone (``dpd route``) or inside the launcher's loop.

With ``router.metricsPort`` set, the server also serves ``/metrics`` — and nothing else — on
that port, started and stopped with the API's (``RouterServer.serve``)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from dpd.router.app import Router, build_app
from dpd.router.errors import ApiError

log = logging.getLogger(__name__)


class ConnectionLimit:
    """``router.maxConnections``: past that many open connections, or requests in progress, a
    new request gets a 503 at once — with an OpenAI error body and ``Retry-After``, where
    uvicorn's own limit answers plain text. The open connections are the server's own count
    (``connections``, set once the server exists), the one asking included. Refusals are counted
    (``dpd_connection_limit_refusals_total``) and logged at most every 10 s."""

    LOG_EVERY_S = 10.0

    def __init__(self, app: ASGIApp, limit: int, on_refusal: Callable[[], None] = lambda: None):
        self.app = app
        self.limit = limit
        self.num_requests = 0
        self.connections: Callable[[], int] = lambda: 0
        self._on_refusal = on_refusal
        self._logged_at = -math.inf

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        num_connections = self.connections()
        if num_connections > self.limit or self.num_requests >= self.limit:
            self._on_refusal()
            if time.monotonic() - self._logged_at >= self.LOG_EVERY_S:
                self._logged_at = time.monotonic()
                log.warning("maxConnections (%d) reached: %d connections open, %d requests in progress; new "
                            "requests get a 503", self.limit, num_connections, self.num_requests)
            error = ApiError(503, f"The router is serving its limit of {self.limit} connections; retry shortly.",
                             type="service_unavailable_error", code="too_many_connections", retry_after_s=1)
            await error.response({"Connection": "close"})(scope, receive, send)
            return
        self.num_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_requests -= 1


def head_deadline_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with a deadline for each request's head: a connection must
    complete one within ``timeout_s`` of connecting, and the next within ``timeout_s`` of the
    last response, or it is closed. uvicorn arms no timer before a connection's first request
    (its keep-alive timer starts after a response), so a client could hold sockets — up to
    ``maxConnections``, refusing everyone else — by connecting and sending nothing, or half a head."""

    class HeadDeadline(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._await_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()  # nothing of a closed connection is kept for the timer's sake
            super().connection_lost(exc)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _await_head(self) -> None:
            # One deadline at a time: the latest response's (a pipelined request's included).
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(timeout_s, self._head_overdue, self.cycle)

        def _head_overdue(self, cycle_then: Any) -> None:
            self._head_timer = None
            # Still no request since the timer was armed (a request in flight was begun by its
            # head; a pipelined one began when the response before it completed), and the
            # connection still this protocol's (not upgraded): closed.
            if (self.cycle is cycle_then and (cycle_then is None or cycle_then.response_complete)
                    and not self.transport.is_closing() and self.transport.get_protocol() is self):
                self.transport.close()

    return HeadDeadline


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to its owner (the launcher handles Ctrl-C)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


_num_freezes = 0  # freeze_startup_objects() calls not yet undone by thaw_startup_objects()


def freeze_startup_objects() -> None:
    """Leave what exists now out of every later garbage collection (``gc.freeze``): a process
    that has loaded a tokenizer holds hundreds of thousands of long-lived objects (modules,
    vocabularies, transformers' and torch's), and each full collection walked them all — a
    ~0.24 s pause of every stream on this machine, measured in the router (docs/design.md, "The
    router's startup heap frozen"). Garbage made so far is collected first. Paired with
    ``thaw_startup_objects``: the objects are collectable again when every freeze (a server's, a
    benchmark run's, in one process) has been undone."""
    global _num_freezes
    _num_freezes += 1
    gc.collect()
    gc.freeze()


def thaw_startup_objects() -> None:
    global _num_freezes
    _num_freezes = max(_num_freezes - 1, 0)
    if _num_freezes == 0:
        gc.unfreeze()


class RouterServer(uvicorn.Server):
    """The API server; ``metrics`` (when set) runs beside it for as long as it runs. Once it
    has started (the router's lifespan run: tokenizer, pools, watchers), the objects of its
    start are frozen out of the collector's full passes (``freeze_startup_objects``) until it
    stops."""

    metrics: uvicorn.Server | None = None

    _frozen = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self._frozen:
            self._frozen = True
            freeze_startup_objects()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().shutdown(sockets)
        finally:
            if self._frozen:
                self._frozen = False
                thaw_startup_objects()  # collectable again (a process that goes on, as the tests' does)

    async def serve(self, sockets: Any = None) -> None:
        if self.metrics is None:
            return await super().serve(sockets)
        metrics_task = asyncio.create_task(self.metrics.serve(), name="router-metrics")
        try:
            await super().serve(sockets)
        finally:
            self.metrics.should_exit = True
            await asyncio.gather(metrics_task, return_exceptions=True)


class _EmbeddedServer(RouterServer):
    """A router server that leaves signals to its owner (the launcher handles Ctrl-C)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def metrics_server(router: Router, host: str, port: int) -> uvicorn.Server:
    """``/metrics`` alone, on its own port (no lifespan: the API server runs the router's)."""
    app = Starlette(routes=[Route("/metrics", lambda request: router.metrics_response(), methods=["GET"])])
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                            proxy_headers=False, limit_concurrency=64,
                            http=head_deadline_protocol(router.settings.spec.bodyReadTimeoutS))
    return _QuietServer(config)


def make_server(router: Router, host: str, port: int, *, is_embedded: bool, graceful_s: float = 5.0,
                tls: tuple[str, str] | None = None) -> uvicorn.Server:
    """``graceful_s``: on shutdown, how long open requests (streams) may finish before they are
    cancelled (the Kubernetes router drains for ``drainTimeoutS``). ``tls``: (certificate file,
    key file) to serve HTTPS instead of HTTP."""
    limited = ConnectionLimit(build_app(router), router.settings.spec.maxConnections,
                              on_refusal=router.metrics.connection_refusals.inc)
    config = uvicorn.Config(
        limited,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=math.ceil(graceful_s),
        # The client address is the peer's own: X-Forwarded-For is never trusted (the admin API's
        # loopback check reads it).
        proxy_headers=False,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
        http=head_deadline_protocol(router.settings.spec.bodyReadTimeoutS),
    )
    server = _EmbeddedServer(config) if is_embedded else RouterServer(config)
    limited.connections = lambda: len(server.server_state.connections)
    metrics_port = router.settings.spec.metricsPort
    if metrics_port is not None:
        server.metrics = metrics_server(router, host, metrics_port)
    return server

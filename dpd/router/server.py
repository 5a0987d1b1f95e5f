"""Run a ``Router`` under uvicorn, standalone (``dpd route``) or inside the launcher's loop."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import uvicorn

from dpd.router.app import Router, build_app


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signals to its owner (the launcher handles Ctrl-C)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_server(router: Router, host: str, port: int, *, is_embedded: bool, graceful_s: float = 5.0,
                tls: tuple[str, str] | None = None) -> uvicorn.Server:
    """``graceful_s``: on shutdown, how long open requests (streams) may finish before they are
    cancelled (the Kubernetes router drains for ``drainTimeoutS``). ``tls``: (certificate file,
    key file) to serve HTTPS instead of HTTP."""
    config = uvicorn.Config(
        build_app(router),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=math.ceil(graceful_s),
        # The client address is the peer's own: X-Forwarded-For is never trusted (the admin API's
        # loopback check reads it).
        proxy_headers=False,
        limit_concurrency=router.settings.spec.maxConnections,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    return _EmbeddedServer(config) if is_embedded else uvicorn.Server(config)

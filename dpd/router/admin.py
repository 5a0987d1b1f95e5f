"""The admin API: routing threshold and policy, worker states, drain and resume.

Every call needs the admin key (``router.adminKeySha256``, checked against the SHA-256 of the
bearer key); with none configured the admin API is served to loopback clients only. Tenant
keys never grant admin rights.

Drain (``POST /admin/workers/{name}/drain``): the worker gets no new request; the call waits
until its in-flight requests have finished (at most ``timeout_s``, default
``router.drainTimeoutS``), then optionally stops or restarts it through the launcher
(``then: stop | restart``). Restarts and scale-down use it so no request is cut. ``resume``
undoes a drain (starting a stopped worker again).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dpd.router.errors import ApiError, bad_request
from dpd.router.pools import Worker
from dpd.router.streaming import read_body
from dpd.router.tenants import bearer_key, hash_key

if TYPE_CHECKING:
    from dpd.router.app import Router

log = logging.getLogger(__name__)
LOOPBACK_PEERS = ("127.0.0.1", "::1")  # peer addresses only: no names, no forwarded headers (server.py)
LOOPBACK_BINDS = ("127.0.0.1", "::1", "localhost")
MAX_ADMIN_BODY_BYTES = 64 * 1024
THEN_ACTIONS = ("none", "stop", "restart")


class WorkerControl(Protocol):
    """What the launcher offers the admin API: stop / restart / start one worker by name."""

    async def stop_worker(self, name: str) -> None: ...
    async def restart_worker(self, name: str) -> None: ...
    async def start_worker(self, name: str) -> None: ...


async def _json_body(request: Request, timeout_s: float) -> dict[str, Any]:
    try:
        raw = await read_body(request, MAX_ADMIN_BODY_BYTES, timeout_s)
    except ClientDisconnect:  # nobody to answer; no change made
        raise ApiError(499, "The client left before its body arrived.", code="client_closed") from None
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, an integer too long, nesting too deep
        raise bad_request("The body must be a JSON object.") from None
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.")
    return body


class AdminApi:
    def __init__(self, router: Router):
        self.router = router

    def routes(self) -> list[Route]:
        return [
            Route("/admin/threshold", self.threshold, methods=["GET", "PUT"]),
            Route("/admin/policy", self.policy, methods=["GET", "PUT"]),
            Route("/admin/workers", self.workers, methods=["GET"]),
            Route("/admin/workers/{name}/drain", self.drain, methods=["POST"]),
            Route("/admin/workers/{name}/resume", self.resume, methods=["POST"]),
        ]

    def authorize(self, request: Request) -> None:
        spec = self.router.settings.spec
        digest = spec.adminKeySha256
        if digest is None:
            if spec.host not in LOOPBACK_BINDS:
                # Bound beyond loopback (a cluster, a proxy in front): any peer may be a proxy's
                # loopback, so without a key the admin API is off.
                raise ApiError(403, f"The router listens on {spec.host}: the admin API needs router.adminKeySha256 "
                               "(`dpd keys new`).", type="permission_error")
            client = request.client.host if request.client else ""
            if client not in LOOPBACK_PEERS:
                raise ApiError(403, "The admin API is only served to loopback clients when no admin key is set.", type="permission_error")
            return
        try:
            key = bearer_key(request.headers.get("authorization"))
        except ApiError:
            key = None
        if key is None or not hmac.compare_digest(hash_key(key), digest):
            raise ApiError(401, "A valid admin key is required.", type="authentication_error", code="invalid_api_key")

    async def threshold(self, request: Request) -> Response:
        self.authorize(request)
        router = self.router
        if request.method == "PUT":
            body = await _json_body(request, self.router.settings.spec.bodyReadTimeoutS)
            value: Any = body.get("threshold_tokens")  # unchecked JSON: set_threshold validates it
            try:
                router.routing.set_threshold(value)
            except (TypeError, ValueError) as exc:
                raise bad_request(f'Body must be {{"threshold_tokens": <int >= 0>}}: {exc}', param="threshold_tokens") from None
            log.info("routing threshold set to %d tokens", value)
        routing = router.routing
        return JSONResponse({"threshold_tokens": routing.threshold_tokens, "policy": routing.policy,
                             "recommended_threshold_tokens": routing.recommended_threshold(router.decode)})

    async def policy(self, request: Request) -> Response:
        """``GET`` the routing policy and the cost model's endpoint-wide measurements; ``PUT
        {"policy": "adaptive" | "threshold", "prefix_aware": true | false}`` (either or both)
        switches them for requests that arrive from now on."""
        self.authorize(request)
        routing = self.router.routing
        if request.method == "PUT":
            body = await _json_body(request, self.router.settings.spec.bodyReadTimeoutS)
            if not ({"policy", "prefix_aware"} & body.keys()) or body.keys() - {"policy", "prefix_aware"}:
                raise bad_request("Send {\"policy\": \"adaptive\" | \"threshold\"} and/or {\"prefix_aware\": true | false}.")
            if "prefix_aware" in body and not isinstance(body["prefix_aware"], bool):
                raise bad_request("prefix_aware must be true or false", param="prefix_aware")
            if "policy" in body:
                try:
                    routing.set_policy(body.get("policy"))  # type: ignore[arg-type]
                except ValueError as exc:
                    raise bad_request(f"{exc}", param="policy") from None
            if "prefix_aware" in body:
                routing.set_prefix_aware(body["prefix_aware"], self.router.settings.kv_block_size)
            log.info("routing policy set to %s, prefix-aware %s", routing.policy, routing.prefix_active)
        return JSONResponse(routing.state(self.router.decode))

    async def workers(self, request: Request) -> Response:
        self.authorize(request)
        pools = {}
        routing = self.router.routing
        index = routing.prefix_index if routing.prefix_active else None

        def state(w: Worker) -> dict:
            if index is None:
                return w.state()
            return {**w.state(), "prefix_index": {"source": index.source(w.url), "blocks": index.num_blocks(w)}}

        for pool in (self.router.prefill, self.router.decode):
            pools[pool.name] = {
                "breaker": pool.breaker.state.value if pool.breaker else None,
                "workers": [state(w) for w in pool.workers],
            }
        return JSONResponse({"pools": pools, "routing": self.router.routing.state(self.router.decode)})

    def _worker(self, request: Request) -> Worker:
        name = request.path_params["name"]
        worker = self.router.find_worker(name)
        if worker is None:
            known = [w.name for p in (self.router.prefill, self.router.decode) for w in p.workers]
            raise ApiError(404, f"No worker {name!r}; known: {', '.join(known)}.", type="not_found_error", param="name")
        return worker

    async def drain(self, request: Request) -> Response:
        self.authorize(request)
        worker = self._worker(request)
        body = await _json_body(request, self.router.settings.spec.bodyReadTimeoutS)
        timeout_s = body.get("timeout_s", self.router.settings.spec.drainTimeoutS)
        then = body.get("then", "none")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s <= 3600:
            raise bad_request("timeout_s must be a number of seconds in [0, 3600].", param="timeout_s")
        if then not in THEN_ACTIONS:
            raise bad_request(f"then must be one of {', '.join(THEN_ACTIONS)}.", param="then")
        control = self.router.worker_control
        if then != "none" and control is None:
            raise ApiError(409, "This router does not run its workers (dpd route); drain with then=none.", param="then")
        result = await drain_worker(worker, timeout_s)
        if then != "none" and result["drained"]:
            assert control is not None
            if then == "stop":
                await control.stop_worker(worker.name)
            else:
                await control.restart_worker(worker.name)  # resumes the worker when it is healthy again
        return JSONResponse({**result, "then": then, "done": result["drained"] or then == "none"})

    async def resume(self, request: Request) -> Response:
        self.authorize(request)
        worker = self._worker(request)
        control = self.router.worker_control
        if control is not None:
            await control.start_worker(worker.name)  # no-op when it runs
        worker.is_draining = False
        log.info("%s worker %s resumed", worker.pool, worker.name)
        return JSONResponse(worker.state())


async def drain_worker(worker: Worker, timeout_s: float, poll_s: float = 0.05) -> dict[str, Any]:
    """Stop new requests to ``worker`` and wait for its in-flight ones (at most ``timeout_s``)."""
    worker.is_draining = True
    log.info("%s worker %s draining (%d in flight)", worker.pool, worker.name, worker.num_in_flight)
    started = time.monotonic()
    while worker.num_in_flight > 0 and time.monotonic() - started < timeout_s:
        await asyncio.sleep(poll_s)
    waited_s = time.monotonic() - started
    drained = worker.num_in_flight == 0
    log.info("%s worker %s %s after %.1fs", worker.pool, worker.name, "drained" if drained else "still busy", waited_s)
    return {"worker": worker.name, "drained": drained, "in_flight": worker.num_in_flight, "waited_s": round(waited_s, 3)}

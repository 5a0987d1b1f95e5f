"""Worker discovery on Kubernetes: the ready pods of each pool, from EndpointSlices.

``EndpointSliceWatcher`` lists the EndpointSlices of the pools' (headless) Services by label
selector, then watches them from that list's ``resourceVersion``. After every change it
computes each pool's set of *ready* endpoints — a pod is ready when its readiness probe
(vLLM's ``/health``) passes, and not ready once it is terminating — and calls
``on_change(pool, endpoints)`` for each pool whose set changed (once per pool after the first
list, even when empty). A watch that ends is resumed; one that is too old (``410 Gone``) or
fails is followed by a fresh list.

NOTE: EndpointSlices, not DNS. A headless Service's DNS answer is cached by resolvers and says
nothing about a pod that is terminating; the watch pushes each readiness change within
moments and names the pod, which the router's metrics and errors then carry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SLICES_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


@dataclass(frozen=True, order=True)
class Endpoint:
    name: str  # the pod's name (or its address when the slice names no pod)
    url: str


OnChange = Callable[[str, tuple[Endpoint, ...]], None]


class WatchApi(Protocol):
    async def get(self, path: str) -> dict | None: ...

    def watch(self, path: str, timeout_s: float = ...) -> Any: ...


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


def ready_endpoints(slices: Iterable[dict[str, Any]], port_name: str = "http") -> tuple[Endpoint, ...]:
    """The ready endpoints of ``slices`` on the port named ``port_name``, sorted; pure."""
    found: set[Endpoint] = set()
    for eps in slices:
        ports = [p.get("port") for p in eps.get("ports") or [] if p.get("name") == port_name and p.get("port")]
        if not ports:
            continue
        for endpoint in eps.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            # The API says an unset `ready` means ready; a terminating pod is never ready.
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            name = (endpoint.get("targetRef") or {}).get("name")
            for address in endpoint.get("addresses") or []:
                host = f"[{address}]" if ":" in address else address
                found.add(Endpoint(name or address, f"http://{host}:{ports[0]}"))
    return tuple(sorted(found))


class EndpointSliceWatcher:
    def __init__(
        self,
        api: WatchApi,
        namespace: str,
        services: dict[str, str],
        on_change: OnChange,
        *,
        port_name: str = "http",
        retry_s: float = 1.0,
        watch_timeout_s: float = 300,
    ):
        self._api = api
        self._services = services  # pool name → Service name
        self._pools = {service: pool for pool, service in services.items()}
        self._on_change = on_change
        self._port_name = port_name
        self._retry_s = retry_s
        self._watch_timeout_s = watch_timeout_s
        selector = f"{SERVICE_NAME_LABEL} in ({','.join(sorted(services.values()))})"
        self._path = SLICES_PATH.format(namespace=namespace) + f"?labelSelector={quote(selector)}"
        self._slices: dict[str, dict[str, Any]] = {}
        self._published: dict[str, tuple[Endpoint, ...]] = {}

    def _publish(self) -> None:
        for pool, service in self._services.items():
            slices = [s for s in self._slices.values() if (s.get("metadata", {}).get("labels") or {}).get(SERVICE_NAME_LABEL) == service]
            endpoints = ready_endpoints(slices, self._port_name)
            if self._published.get(pool) != endpoints:
                self._published[pool] = endpoints
                log.info("%s pool: %d ready worker(s): %s", pool, len(endpoints), ", ".join(e.name for e in endpoints) or "-")
                self._on_change(pool, endpoints)

    async def _list(self) -> str:
        listing = await self._api.get(self._path)
        if listing is None:
            raise RuntimeError(f"GET {self._path}: not found")
        self._slices = {s["metadata"]["name"]: s for s in listing.get("items") or []}
        self._publish()
        return listing.get("metadata", {}).get("resourceVersion", "")

    async def _watch(self, resource_version: str) -> str:
        path = (
            f"{self._path}&watch=1&allowWatchBookmarks=true"
            f"&resourceVersion={resource_version}&timeoutSeconds={int(self._watch_timeout_s)}"
        )
        async for event in self._api.watch(path, self._watch_timeout_s):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise WatchExpired()
                raise RuntimeError(f"watch error: {obj.get('message')}")
            resource_version = obj.get("metadata", {}).get("resourceVersion", resource_version)
            if kind == "BOOKMARK":
                continue
            name = obj["metadata"]["name"]
            if kind == "DELETED":
                self._slices.pop(name, None)
            else:
                self._slices[name] = obj
            self._publish()
        return resource_version

    async def run(self) -> None:
        """List and watch until cancelled."""
        resource_version: str | None = None
        while True:
            try:
                if resource_version is None:
                    resource_version = await self._list()
                resource_version = await self._watch(resource_version)
            except asyncio.CancelledError:
                raise
            except WatchExpired:
                resource_version = None
            except Exception as exc:  # noqa: BLE001 - any API failure: back off, then list afresh
                log.warning("endpointslice watch failed (%s); listing again in %.1f s", exc, self._retry_s)
                resource_version = None
                await asyncio.sleep(self._retry_s)

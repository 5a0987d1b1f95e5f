"""Discovery: EndpointSlices listed and watched from a scripted API server, into the router's pools."""

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dpd.config.model import AdaptiveSpec
from dpd.k8s.api import KubeApi
from dpd.k8s.discovery import Endpoint, EndpointSliceWatcher, ready_endpoints
from dpd.k8s.router_main import ThresholdReloader, load_document, on_group_change, sync_pool
from dpd.router.metrics import RouterMetrics
from dpd.router.pools import make_pool
from dpd.router.routing import RoutingPolicy

SERVICES = {"prefill": "ep-prefill", "decode": "ep-decode"}


def eps(name, service, rv, endpoints, port=8000):
    return {
        "metadata": {"name": name, "resourceVersion": rv, "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "nixl", "port": 5600}, {"name": "http", "port": port}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": ready}, "targetRef": {"kind": "Pod", "name": pod}}
            for pod, ip, ready in endpoints
        ],
    }


@pytest.mark.parametrize(
    "endpoint, expected",
    [
        ({"addresses": ["10.0.0.1"], "conditions": {"ready": True}, "targetRef": {"name": "p-0"}}, [Endpoint("p-0", "http://10.0.0.1:8000")]),
        ({"addresses": ["10.0.0.1"], "conditions": {}, "targetRef": {"name": "p-0"}}, [Endpoint("p-0", "http://10.0.0.1:8000")]),
        ({"addresses": ["10.0.0.1"], "conditions": {"ready": False}}, []),
        ({"addresses": ["10.0.0.1"], "conditions": {"ready": True, "terminating": True}}, []),
        ({"addresses": ["fd00::5"], "conditions": {"ready": True}}, [Endpoint("fd00::5", "http://[fd00::5]:8000")]),
    ],
)
def test_ready_endpoints(endpoint, expected):
    slices = [{"ports": [{"name": "http", "port": 8000}], "endpoints": [endpoint]}]
    assert list(ready_endpoints(slices)) == expected


def test_ready_endpoints_needs_the_named_port():
    assert ready_endpoints([{"ports": [{"name": "metrics", "port": 9}], "endpoints": [{"addresses": ["10.0.0.1"]}]}]) == ()


class ScriptedApiServer:
    """Answers the list and watch requests of the EndpointSlice API from a script."""

    def __init__(self):
        self.requests = []
        self.lists = [
            {"metadata": {"resourceVersion": "10"}, "items": [
                eps("ep-prefill-a", "ep-prefill", "8", [("prefill-0", "10.0.0.1", True)]),
                eps("ep-decode-a", "ep-decode", "9", [("decode-0", "10.0.1.1", True), ("decode-1", "10.0.1.2", False)]),
            ]},
            {"metadata": {"resourceVersion": "20"}, "items": [
                eps("ep-decode-a", "ep-decode", "19", [("decode-1", "10.0.1.2", True)]),
            ]},
        ]
        self.watches = [
            [
                {"type": "MODIFIED",
                 "object": eps("ep-decode-a", "ep-decode", "11", [("decode-0", "10.0.1.1", True), ("decode-1", "10.0.1.2", True)])},
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "12"}}},
                {"type": "ADDED", "object": eps("ep-prefill-b", "ep-prefill", "13", [("prefill-1", "10.0.0.2", True)])},
                {"type": "MODIFIED",
                 "object": eps("ep-decode-a", "ep-decode", "14", [("decode-0", "10.0.1.1", True), ("decode-1", "10.0.1.2", True)])},
            ],
            [
                {"type": "DELETED", "object": eps("ep-prefill-a", "ep-prefill", "15", [])},
                {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}},
            ],
            None,  # the watch after the relist: stays open
        ]

    async def handle(self, request):
        self.requests.append(dict(request.query))
        if "watch" not in request.query:
            return web.json_response(self.lists.pop(0))
        response = web.StreamResponse()
        await response.prepare(request)
        events = self.watches.pop(0)
        if events is None:
            await asyncio.sleep(30)
        for event in events:
            await response.write(json.dumps(event).encode() + b"\n")
        return response


async def test_watcher_follows_list_watch_relist():
    api_server = ScriptedApiServer()
    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices", api_server.handle)
    changes = []
    seen_all = asyncio.Event()

    def on_change(pool, endpoints):
        changes.append((pool, [e.name for e in endpoints]))
        if len(changes) == 7:
            seen_all.set()

    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        api = KubeApi(session, str(server.make_url("")))
        watcher = EndpointSliceWatcher(api, "ns", SERVICES, on_change, retry_s=0.01)
        task = asyncio.create_task(watcher.run())
        await asyncio.wait_for(seen_all.wait(), 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    assert changes == [
        # step 1: the first list publishes both pools; the not-ready decoder is left out
        ("prefill", ["prefill-0"]), ("decode", ["decode-0"]),
        # step 2: watch — decode-1 became ready; a second prefill slice appeared (the
        # bookmark and the repeated MODIFIED change nothing, so publish nothing)
        ("decode", ["decode-0", "decode-1"]), ("prefill", ["prefill-0", "prefill-1"]),
        # step 3: a slice was deleted
        ("prefill", ["prefill-1"]),
        # step 4: 410 Gone → list again: no prefill slice is left, only decode-1
        ("prefill", []), ("decode", ["decode-1"]),
    ]
    selector = "kubernetes.io/service-name in (ep-decode,ep-prefill)"
    assert all(r["labelSelector"] == selector for r in api_server.requests)
    watches = [r for r in api_server.requests if "watch" in r]
    assert [w["resourceVersion"] for w in watches] == ["10", "14", "20"]


def test_sync_pool_keeps_the_state_of_workers_still_there():
    pool = make_pool("decode", ["http://10.0.1.1:8000", "http://10.0.1.2:8000"], ["decode-0", "decode-1"])
    kept = pool.workers[0]
    kept.record_probe(False, "probe")
    kept.num_in_flight = 3
    sync_pool(pool, (Endpoint("decode-0", "http://10.0.1.1:8000"), Endpoint("decode-7", "http://10.0.1.7:8000")))
    assert [w.name for w in pool.workers] == ["decode-0", "decode-7"]
    assert pool.workers[0] is kept and kept.num_in_flight == 3 and not kept.is_healthy
    assert pool.workers[1].is_healthy  # its readiness probe (vLLM /health) already passed
    sync_pool(pool, ())
    assert pool.workers == [] and pool.available() == []


def test_a_tenants_dedicated_pods_serve_that_tenant_only():
    """Discovery reports each group (``decode``, ``decode/<tenant>``) on its own; a group's update
    leaves the other groups' workers alone, and a dedicated pod is its tenant's."""
    pool = make_pool("decode", [], [])
    apply = on_group_change({"decode": pool})
    apply("decode", (Endpoint("ep-decode-x1", "http://10.0.1.1:8000"),))
    apply("decode/a", (Endpoint("ep-decode-a-y1", "http://10.0.2.1:8000"),))
    assert [w.name for w in pool.available("a")] == ["ep-decode-a-y1"]
    assert [w.name for w in pool.available("b")] == [w.name for w in pool.available(None)] == ["ep-decode-x1"]
    apply("decode", (Endpoint("ep-decode-x2", "http://10.0.1.2:8000"),))
    assert sorted(w.name for w in pool.workers) == ["ep-decode-a-y1", "ep-decode-x2"]
    apply("decode/a", ())
    assert pool.available("a") == []  # none of its own ready: a 503, never a shared worker
    assert not pool.is_available("a") and pool.is_available("b")


def test_threshold_reloads_from_the_mounted_config(tmp_path):
    config = tmp_path / "config.yaml"
    secrets = tmp_path / "secrets.yaml"
    config.write_text("kind: InferenceEndpointConfig\nspec: {pdSpec: {routingThreshold: 2048}}\n")
    secrets.write_text("adminKeySha256: abababababababababababababababababababababababababababababababab\n")
    router = SimpleNamespace(routing=RoutingPolicy("threshold", 2048, AdaptiveSpec(), RouterMetrics()))
    reloader = ThresholdReloader(router, str(config), str(secrets))
    assert reloader.reload_once() is False
    config.write_text("kind: InferenceEndpointConfig\nspec: {pdSpec: {routingThreshold: 512}}\n")
    assert reloader.reload_once() is True and router.routing.threshold_tokens == 512
    config.write_text("kind: InferenceEndpointConfig\nspec: {pdSpec: {routingThreshold: -5}}\n")
    assert reloader.reload_once() is False and router.routing.threshold_tokens == 512  # a bad file keeps the value
    assert load_document(str(config), str(secrets))["spec"]["pdSpec"]["router"] == {
        "adminKeySha256": "abababababababababababababababababababababababababababababababab"
    }

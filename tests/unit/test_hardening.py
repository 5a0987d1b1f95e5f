"""Limits applied before the work they guard, and an admin API no proxy header can open.

Against the real router under uvicorn (in this process, on a loopback port, with scripted
workers): a 64 MiB body, slow clients, a spoofed X-Forwarded-For. And the helpers on their own.
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import time

import httpx
import psutil
import pytest
from starlette.requests import Request

from dpd.config.model import RouterSpec, TenantSpec
from dpd.router.app import Router, RouterSettings
from dpd.router.errors import ApiError
from dpd.router.server import make_server
from dpd.router.streaming import read_body
from dpd.router.tenants import hash_key
from tests.unit.test_router_flow import BODY, ScriptedWorker, WordTokenizer

MiB = 1024 * 1024


# -- the body, bounded while it is read ------------------------------------------------------------
def _request(parts: list[bytes], headers: dict[str, str], delay_s: float = 0.0) -> tuple[Request, list[int]]:
    sent: list[int] = []  # how many parts the router pulled

    async def receive():
        if delay_s:
            await asyncio.sleep(delay_s)
        i = len(sent)
        sent.append(i)
        if i < len(parts):
            return {"type": "http.request", "body": parts[i], "more_body": i < len(parts) - 1}
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    return Request(scope, receive), sent


async def test_a_declared_length_over_the_limit_is_refused_before_reading():
    request, pulled = _request([b"x" * 100], {"content-length": str(64 * MiB)})
    with pytest.raises(ApiError) as info:
        await read_body(request, 4 * MiB, timeout_s=5)
    assert info.value.status == 413 and pulled == []


async def test_a_body_growing_past_the_limit_is_cut_off_at_it():
    request, pulled = _request([b"x" * MiB] * 64, {})  # chunked: no Content-Length
    with pytest.raises(ApiError) as info:
        await read_body(request, 4 * MiB, timeout_s=5)
    assert info.value.status == 413 and len(pulled) == 5  # 4 MiB kept, the fifth part refused, the rest unread


async def test_a_slow_body_is_a_408():
    request, _ = _request([b"{}"] * 10, {}, delay_s=0.2)
    with pytest.raises(ApiError) as info:
        await read_body(request, 4 * MiB, timeout_s=0.5)
    assert info.value.status == 408 and info.value.code == "body_timeout"


async def test_each_4_mib_of_a_large_body_gets_the_timeout_anew():
    """A long context allows bodies of tens of MiB: 12 MiB arriving at 4 MiB a 0.2 s (0.6 s in
    all) is read within a 0.5 s timeout; one 4 MiB slice slower than it is a 408 however many
    came before."""
    steady, _ = _request([b"x" * MiB] * 12, {}, delay_s=0.05)
    assert len(await read_body(steady, 16 * MiB, timeout_s=0.5)) == 12 * MiB
    # 8 MiB by 0.4 s (the next slice due by 0.9 s), then a byte every 0.05 s: still short of it at 1.9 s
    stalled, _ = _request([b"x" * MiB] * 8 + [b"x"] * 30, {}, delay_s=0.05)
    with pytest.raises(ApiError) as info:
        await read_body(stalled, 16 * MiB, timeout_s=0.5)
    assert info.value.status == 408 and "each 4 MiB" in info.value.message


async def test_a_bad_content_length_is_a_400():
    request, _ = _request([b"{}"], {"content-length": "-3"})
    with pytest.raises(ApiError) as info:
        await read_body(request, 4 * MiB, timeout_s=5)
    assert info.value.status == 400


# -- the real router under uvicorn -----------------------------------------------------------------
@pytest.fixture
async def served(unused_tcp_port):
    started: list = []

    async def serve(worker: ScriptedWorker | None = None, **spec) -> tuple[str, Router]:
        worker = worker or ScriptedWorker()
        await worker.server.start_server()
        settings = RouterSettings(
            spec=RouterSpec(healthIntervalS=0.2, host="127.0.0.1", port=unused_tcp_port, **spec), model_name="m",
            max_model_len=1000, tokenizer_path="", threshold_tokens=0, prefill_urls=(), decode_urls=(worker.url,),
            is_colocated=True, routing_policy="threshold",
        )
        router = Router(settings, tokenizer=WordTokenizer())
        await router.start()
        server = make_server(router, "127.0.0.1", unused_tcp_port, is_embedded=True)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        started.append((server, task, router, worker))
        router.server = server  # type: ignore[attr-defined]  # for the shutdown test
        return f"http://127.0.0.1:{unused_tcp_port}", router

    yield serve
    for server, task, router, worker in started:
        server.should_exit = True
        if not task.done():
            await task
        await router.stop()
        await worker.server.close()


async def _raw(port: int, data: bytes, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(data)
    await writer.drain()
    return reader, writer


async def test_a_64_mib_body_is_refused_with_memory_bounded_and_others_served(served, unused_tcp_port, capsys):
    url, _ = await served()
    process = psutil.Process(os.getpid())
    before = process.memory_info().rss
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    reader, writer = await _raw(unused_tcp_port, head)
    chunk = b"x" * MiB
    status = b""
    try:
        for _ in range(64):
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
            if reader.at_eof() or len(reader._buffer):  # type: ignore[attr-defined]  # the answer came early
                break
    except ConnectionError:
        pass  # the router answered and closed while we were still sending
    status = (await asyncio.wait_for(reader.readline(), 10))
    writer.close()
    grown_mib = (process.memory_info().rss - before) / MiB
    assert b"413" in status
    assert grown_mib < 32, f"RSS grew {grown_mib:.0f} MiB for a 64 MiB body"
    async with httpx.AsyncClient() as client:
        started = time.monotonic()
        resp = await client.post(url + "/v1/completions", json=BODY)
    assert resp.status_code == 200
    with capsys.disabled():
        print(f"\n[64 MiB body] {status.strip().decode()}; router process RSS grew {grown_mib:.1f} MiB; "
              f"the next client served in {time.monotonic() - started:.3f} s")


async def test_slow_clients_get_a_408_and_do_not_block_others(served, unused_tcp_port, capsys):
    url, _ = await served(bodyReadTimeoutS=1.0)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"model\"")
    slow = [await _raw(unused_tcp_port, head) for _ in range(20)]  # send part of a body, then nothing
    async with httpx.AsyncClient() as client:
        started = time.monotonic()
        resp = await client.post(url + "/v1/completions", json=BODY)
    served_s = time.monotonic() - started
    assert resp.status_code == 200 and served_s < 1.0
    statuses = [await asyncio.wait_for(reader.readline(), 5) for reader, _ in slow]
    for _, writer in slow:
        writer.close()
    assert all(b"408" in s for s in statuses), statuses
    with capsys.disabled():
        print(f"\n[slowloris] 20 clients sending part of a body: all {statuses[0].strip().decode()} after "
              f"bodyReadTimeoutS (1 s); another client served meanwhile in {served_s:.3f} s")


@pytest.mark.parametrize("implementation", ["httptools", "h11"])
async def test_a_connection_that_sends_no_request_head_in_time_is_closed(served, unused_tcp_port, monkeypatch,
                                                                          implementation):
    """uvicorn arms no timer before a connection's first request: silent or half-sent heads
    would hold sockets (up to maxConnections) for good. With either of uvicorn's HTTP parsers
    (h11 where httptools is not installed)."""
    if implementation == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        monkeypatch.setattr("dpd.router.server.AutoHTTPProtocol", H11Protocol)
    url, _ = await served(bodyReadTimeoutS=1.5)
    silent = await _raw(unused_tcp_port, b"")
    half = await _raw(unused_tcp_port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    # a client that keeps its connection and sends half of its second request's head
    reader, writer = await _raw(unused_tcp_port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
    writer.write(b"GET /v1/models HTTP/1.1\r\n")
    await writer.drain()
    started = time.perf_counter()
    assert await asyncio.wait_for(_read_to_eof(silent[0]), 10) == b""  # closed by the router, nothing sent
    assert await asyncio.wait_for(_read_to_eof(half[0]), 10) == b""
    assert b"HTTP/1.1" not in await asyncio.wait_for(_read_to_eof(reader), 10)  # the rest of the first answer only
    assert time.perf_counter() - started < 8
    # a request that takes its time, within the deadline each way, is served
    reader, writer = await _raw(unused_tcp_port, b"GET /v1/mo")
    await asyncio.sleep(0.3)
    writer.write(b"dels HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await writer.drain()
    assert (await _read_to_eof(reader)).startswith(b"HTTP/1.1 200")
    for _, w in (silent, half, (reader, writer)):
        w.close()


async def _read_to_eof(reader: asyncio.StreamReader) -> bytes:
    return await reader.read()


async def test_connections_past_the_limit_get_a_503(served, unused_tcp_port):
    url, _ = await served(maxConnections=2, bodyReadTimeoutS=2.0)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
    for held in (head, b""):  # two requests in progress; then two connections that send nothing
        holders = [await _raw(unused_tcp_port, held) for _ in range(2)]
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient() as client:
            resp = await client.get(url + "/v1/models")
        for _, writer in holders:
            writer.close()
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1", held
        assert resp.json()["error"]["code"] == "too_many_connections"  # an OpenAI error body, not uvicorn's text
        async with httpx.AsyncClient() as client:  # the holders gone, the next one is served
            for _ in range(50):
                if (resp := await client.get(url + "/v1/models")).status_code == 200:
                    break
                await asyncio.sleep(0.1)
            assert resp.status_code == 200
            metrics = (await client.get(url + "/metrics")).text
    assert "dpd_connection_limit_refusals_total 2.0" in metrics


def _loopback_alias_available() -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _loopback_alias_available(), reason="no 127.0.0.2 to connect from")
async def test_a_forwarded_header_never_opens_the_admin_api(served, unused_tcp_port, monkeypatch):
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")  # even when uvicorn is told to trust every proxy
    await served()
    request = b"GET /admin/workers HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 127.0.0.1\r\nConnection: close\r\n\r\n"
    reader, writer = await _raw(unused_tcp_port, request, source="127.0.0.2")
    status = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    assert b"403" in status
    # From the loopback peer itself the admin API answers (no key configured).
    reader, writer = await _raw(unused_tcp_port, request.replace(b"X-Forwarded-For: 127.0.0.1\r\n", b""))
    assert b"200" in await asyncio.wait_for(reader.readline(), 5)
    writer.close()


# -- the admin API's other doors -----------------------------------------------------------------
@pytest.mark.parametrize("peer", ["testclient", "localhost", "10.0.0.7"])
async def test_only_loopback_addresses_count_as_loopback(make_router, peer):
    client = await make_router(None, ScriptedWorker())
    transport = httpx.ASGITransport(app=client._transport.app, client=(peer, 5000))  # type: ignore[attr-defined]
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as other:
        assert (await other.get("/admin/workers")).status_code == 403


async def test_a_router_bound_beyond_loopback_needs_the_admin_key(make_router):
    client = await make_router(None, ScriptedWorker(), host="0.0.0.0")
    resp = await client.get("/admin/workers")  # from 127.0.0.1
    assert resp.status_code == 403 and "adminKeySha256" in resp.json()["error"]["message"]


# -- /metrics names tenants and workers (issue 16, finding 9) --------------------------------------
async def test_a_router_bound_beyond_loopback_serves_metrics_only_on_its_metrics_port(make_router):
    client = await make_router(None, ScriptedWorker(), host="0.0.0.0")
    resp = await client.get("/metrics")
    assert resp.status_code == 403 and "router.metricsPort" in resp.json()["error"]["message"]
    client = await make_router(None, ScriptedWorker(), host="0.0.0.0", metricsPort=9999)
    assert (await client.get("/metrics")).status_code == 404


async def test_the_metrics_port_serves_metrics_and_nothing_else(served, unused_tcp_port_factory):
    metrics_port = unused_tcp_port_factory()
    url, router = await served(metricsPort=metrics_port)
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.post(url + "/v1/completions", json=BODY)).status_code == 200
        page = await http.get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert page.status_code == 200 and "dpd_requests_total" in page.text
        assert (await http.get(f"http://127.0.0.1:{metrics_port}/v1/models")).status_code == 404
        assert (await http.get(url + "/metrics")).status_code == 404
    router.server.should_exit = True  # type: ignore[attr-defined]  # the metrics port closes with the API's
    await asyncio.sleep(0.5)
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(timeout=2) as http:
            await http.get(f"http://127.0.0.1:{metrics_port}/metrics")


async def test_the_router_keeps_its_startup_objects_out_of_full_collections_while_it_serves(served):
    """A full collection walked the tokenizer's and the imports' objects: ~0.24 s of every stream."""
    _, router = await served()
    assert gc.get_freeze_count() > 0  # frozen once started
    router.server.should_exit = True  # type: ignore[attr-defined]
    for _ in range(100):
        if gc.get_freeze_count() == 0:
            break
        await asyncio.sleep(0.05)
    assert gc.get_freeze_count() == 0  # and collectable again once stopped


def test_the_startup_objects_stay_frozen_until_the_last_freeze_is_undone():
    """A server and a benchmark run in one process: the first to end leaves the other's freeze."""
    from dpd.router.server import freeze_startup_objects, thaw_startup_objects

    freeze_startup_objects()
    freeze_startup_objects()
    thaw_startup_objects()
    assert gc.get_freeze_count() > 0
    thaw_startup_objects()
    assert gc.get_freeze_count() == 0
    thaw_startup_objects()  # one too many: nothing to undo, and the next freeze still counts
    freeze_startup_objects()
    assert gc.get_freeze_count() > 0
    thaw_startup_objects()
    assert gc.get_freeze_count() == 0


async def test_a_removed_workers_series_leave_the_metrics(make_router):
    """Pods come and go on a cluster: a worker discovery no longer lists leaves no series behind."""
    first, second = ScriptedWorker(), ScriptedWorker()
    client = await make_router(None, [first, second])
    for _ in range(4):
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    text = (await client.get("/metrics")).text
    assert 'worker="decode-1"' in text and 'worker="decode-0"' in text
    router = client.router  # type: ignore[attr-defined]
    kept = router.decode.find("decode-0")
    router.decode.replace_workers([(kept.name, kept.url)])
    text = (await client.get("/metrics")).text
    assert 'decode-1"' not in text and 'worker="decode-0"' in text


async def test_prompt_token_ids_are_bounded_before_forwarding(make_router):
    """A prompt of token ids longer than the context, or with a negative id, never reaches a worker."""
    worker = ScriptedWorker()
    client = await make_router(None, worker)
    long = await client.post("/v1/completions", json={**BODY, "prompt": [1] * 5000})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    negative = await client.post("/v1/completions", json={**BODY, "prompt": [1, -2, 3]})
    assert negative.status_code == 400
    assert worker.bodies == []


# -- tenants: the buckets before the tokenizer -----------------------------------------------------
async def test_a_tenant_over_its_rate_is_refused_before_its_prompt_is_tokenized(make_router):
    tenant = TenantSpec(name="t", apiKeySha256=(hash_key("key-t"),), requestsPerSecond=0.01, burstRequests=1)
    client = await make_router(None, ScriptedWorker(), tenants=(tenant,))
    counted: list[str] = []
    encode = client.router.counter._tokenizer.encode  # type: ignore[attr-defined]
    client.router.counter._tokenizer.encode = lambda text, **kw: counted.append(text) or encode(text, **kw)  # type: ignore[attr-defined]
    auth = {"Authorization": "Bearer key-t"}
    assert (await client.post("/v1/completions", json=BODY, headers=auth)).status_code == 200
    num_tokenized = len(counted)
    resp = await client.post("/v1/completions", json=BODY, headers=auth)
    assert resp.status_code == 429 and resp.json()["error"]["param"] == "requests_per_second"
    assert len(counted) == num_tokenized  # refused without tokenizing


# -- a worker's stream: JSON that is not an event ------------------------------------------------
async def test_a_non_object_event_fails_the_stream_with_an_error_event(make_router):
    from dpd.config.model import MigrationSpec

    worker = ScriptedWorker(bad_event=b"[1, 2]")
    client = await make_router(None, worker, migration=MigrationSpec(maxMigrations=0))
    resp = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    assert '"error"' in resp.text and "stream broke" in resp.text
    assert client.router.decode.workers[0].breaker.num_consecutive_failures == 1


# -- shutdown: streams finish --------------------------------------------------------------------
async def test_a_stopping_router_lets_open_streams_finish(served):
    url, router = await served(ScriptedWorker(token_delay_s=0.4))
    async with httpx.AsyncClient() as client:
        async with client.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}) as resp:
            lines = resp.aiter_lines()
            first = await anext(lines)
            router.server.should_exit = True  # type: ignore[attr-defined]  # what SIGTERM does
            rest = [line async for line in lines]
    assert first.startswith("data: ") and "data: [DONE]" in rest


# -- workers behind the router (issue 16, finding 1) ---------------------------------------------
async def test_every_hop_carries_the_workers_key_and_the_settings_never_show_it(make_router):
    prefill, decode = ScriptedWorker(), ScriptedWorker()
    client = await make_router(prefill, decode, threshold=0, worker_api_key="s3cret")
    assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    assert prefill.authorizations == decode.authorizations == ["Bearer s3cret"]
    assert "s3cret" not in repr(client.router.settings)  # type: ignore[attr-defined]


def test_dpd_serve_gives_its_workers_a_key_through_the_environment(tmp_path, monkeypatch):
    from dpd.launch.process import WorkerProcess

    monkeypatch.setenv("DPD_WORKER_API_KEY", "from-env")
    captured = {}

    async def fake_exec(*command, env, **kwargs):
        captured.update(command=command, env=env)
        raise RuntimeError("stop here")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", fake_exec)
    from dpd.config import load_config
    from dpd.launch.plan import plan_workers

    (plan, *_) = plan_workers(load_config("examples/minimal.yaml"), "/model", is_colocated=False)
    worker = WorkerProcess(plan, tmp_path, secret_env={"VLLM_API_KEY": "k"})
    with pytest.raises(RuntimeError):
        asyncio.run(worker.start())
    assert captured["env"]["VLLM_API_KEY"] == "k" and "k" not in " ".join(captured["command"]).split()

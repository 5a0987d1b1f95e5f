"""The router's P/D flow against scripted HTTP workers: fallbacks, stalls, admission.

These are component tests of dpd's own logic — the workers are small aiohttp servers that
speak the vLLM wire format and can be told to fail or stall. What vLLM itself does is covered
by tests/integration, which start real workers; nothing here claims end-to-end behaviour.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dpd.config.model import RouterSpec
from dpd.router.app import Router, RouterSettings, build_app
from dpd.router.breaker import BreakerState
from dpd.router.decide import Decision, Path, Reason
from dpd.router.outcomes import OUTCOMES, HopOutcome, Verdict


class WordTokenizer:
    def encode(self, text, add_special_tokens=True):
        return text.split()

    def apply_chat_template(self, conversation, **kwargs):
        return " ".join(m["content"] for m in conversation)

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


class ScriptedWorker:
    """Answers prefill hops with kv_transfer_params and decode hops with three tokens."""

    def __init__(
        self,
        *,
        prefill_status: int = 200,
        first_token_delay_s: float = 0.0,
        token_delay_s: float = 0.0,
        prefill_delay_s: float = 0.0,
        num_decode_failures: int = 0,
        prefill_kv: bool = True,
        bad_event: bytes | None = None,
        direct_first_token_delay_s: float = 0.0,
        decode_failure_status: int = 500,
        health_delay_s: float = 0.0,
    ):
        self.health_delay_s = health_delay_s  # how late GET /health answers
        self.decode_failure_status = decode_failure_status  # what each of num_decode_failures answers
        self.direct_first_token_delay_s = direct_first_token_delay_s  # a whole request's first token
        self.bad_event = bad_event  # sent after the first token, as if it were an event
        self.prefill_status = prefill_status
        self.prefill_kv = prefill_kv
        self.prefill_delay_s = prefill_delay_s
        self.num_decode_failures = num_decode_failures
        self.first_token_delay_s = first_token_delay_s
        self.token_delay_s = token_delay_s
        self.bodies: list[dict] = []
        self.authorizations: list[str | None] = []
        self.traceparents: list[str | None] = []
        self.metrics_text = ""  # what GET /metrics answers (vLLM's exposition format)
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        self.server = TestServer(app)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def health(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.health_delay_s)
        return web.json_response({})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.authorizations.append(request.headers.get("Authorization"))
        self.traceparents.append(request.headers.get("traceparent"))
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            await asyncio.sleep(self.prefill_delay_s)
            if self.prefill_status != 200:
                return web.json_response({"error": {"message": "boom"}}, status=self.prefill_status)
            if not self.prefill_kv:
                return web.json_response({"choices": [{"text": "x"}]})
            return web.json_response(
                {"choices": [{"text": "x"}], "kv_transfer_params": {"remote_request_id": "r", "do_remote_prefill": True}}
            )
        if self.num_decode_failures > 0:
            self.num_decode_failures -= 1
            return web.json_response({"error": {"message": "engine dead"}}, status=self.decode_failure_status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        delay = self.first_token_delay_s if kv.get("do_remote_prefill") else self.direct_first_token_delay_s
        await asyncio.sleep(delay)
        for i, text in enumerate("abc"):
            if i:
                await asyncio.sleep(self.token_delay_s)
            chunk = {
                "id": "c", "created": 1, "model": "m",
                "choices": [{"index": 0, "text": text, "finish_reason": "length" if i == 2 else None}],
            }
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.bad_event is not None:
                await resp.write(b"data: " + self.bad_event + b"\n\n")
        usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp


@pytest.fixture
async def make_router():
    started: list[tuple[Router, list[ScriptedWorker]]] = []

    async def make(
        prefill: ScriptedWorker | list[ScriptedWorker] | None,
        decode: ScriptedWorker | list[ScriptedWorker],
        threshold: int = 0,
        tenants: tuple = (),
        policy: str = "threshold",
        worker_api_key: str | None = None,
        kv_lease_s: float = 30.0,
        **spec,
    ) -> httpx.AsyncClient:
        prefills = prefill if isinstance(prefill, list) else [prefill] if prefill else []
        decodes = decode if isinstance(decode, list) else [decode]
        workers = [*prefills, *decodes]
        for w in workers:
            await w.server.start_server()
        settings = RouterSettings(
            spec=RouterSpec(healthIntervalS=0.2, **spec), model_name="m", max_model_len=1000, tokenizer_path="",
            threshold_tokens=threshold, prefill_urls=tuple(w.url for w in prefills), decode_urls=tuple(w.url for w in decodes),
            is_colocated=not prefills, tenants=tuple(tenants), routing_policy=policy,
            worker_api_key=worker_api_key, kv_lease_s=kv_lease_s,
        )
        router = Router(settings, tokenizer=WordTokenizer())
        await router.start()
        started.append((router, workers))
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router)), base_url="http://router", timeout=30)
        client.router = router  # type: ignore[attr-defined]  # for tests that inspect its state
        return client

    yield make
    for router, workers in started:
        await assert_idle(router)
        await router.stop()
        for w in workers:
            await w.server.close()


async def assert_idle(router: Router, wait_s: float = 2.0) -> None:
    """After a flow test nothing a request took is still held: in-flight counts, queued prefill
    tokens, decode streams, admission slots (as vLLM's tests assert an empty scheduler)."""

    def held() -> list[str]:
        found = [f"{w.name}: in_flight={w.num_in_flight} queued={w.load.queued_prefill_tokens} streams={w.load.num_streams}"
                 for pool in (router.prefill, router.decode) for w in pool.workers
                 if w.num_in_flight or w.load.queued_prefill_tokens or w.load.num_streams or w.load.num_prefills]
        found += [f"gate {name}: {gate.num_in_flight}" for name, gate in router.gates.items() if gate.num_in_flight]
        return found + ([f"{router.num_active} active requests"] if router.num_active else [])

    for _ in range(int(wait_s / 0.05)):
        if not held():
            return
        await asyncio.sleep(0.05)
    assert not held(), held()


def metric(router_text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in router_text.splitlines() if line.startswith(name))


BODY = {"model": "m", "prompt": "one two three four", "max_tokens": 3}


async def test_disaggregated_hops_and_aggregation(make_router):
    prefill, decode = ScriptedWorker(), ScriptedWorker()
    client = await make_router(prefill, decode, threshold=0)
    resp = await client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200 and resp.headers["x-dpd-path"] == "disaggregated"
    assert resp.json()["choices"][0]["text"] == "abc" and resp.json()["usage"]["completion_tokens"] == 3
    hop1, hop2 = prefill.bodies[0], decode.bodies[0]
    assert hop1["max_tokens"] == 1 and hop1["stream"] is False and hop1["kv_transfer_params"]["do_remote_decode"]
    assert hop2["kv_transfer_params"] == {"remote_request_id": "r", "do_remote_prefill": True}  # forwarded untouched
    assert hop2["max_tokens"] == 3 and hop2["stream"] is True


async def test_prefill_error_falls_back_to_direct(make_router):
    client = await make_router(ScriptedWorker(prefill_status=500), ScriptedWorker(), threshold=0)
    resp = await client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200
    assert (resp.headers["x-dpd-path"], resp.headers["x-dpd-fallback"]) == ("fallback", "prefill_error")


@pytest.mark.parametrize("status", [401, 403, 404])
async def test_a_worker_refusing_the_routers_key_is_a_broken_worker_not_the_clients_error(make_router, status):
    """A worker answering 401/403 refused the router's own worker API key (a misconfigured
    pdSpec), one answering 404 serves another model name (the router checks the client's): the
    prefill hop falls back, the breaker counts a failure, and a client whose request reaches no
    other worker gets a 502 — never an "unauthorized" or "not found" it cannot fix."""
    prefill = ScriptedWorker(prefill_status=status)
    client = await make_router(prefill, ScriptedWorker(), threshold=0)
    resp = await client.post("/v1/completions", json=BODY)
    assert (resp.status_code, resp.headers["x-dpd-fallback"]) == (200, "prefill_error")
    assert client.router.prefill.workers[0].breaker.num_consecutive_failures == 1  # type: ignore[attr-defined]
    decode = ScriptedWorker(num_decode_failures=100, decode_failure_status=status)
    client = await make_router(None, decode)
    resp = await client.post("/v1/completions", json=BODY)
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "worker_error"
    assert ("HTTP 404: engine dead" if status == 404 else "refused the router's worker API key") in resp.json()["error"]["message"]


async def test_a_wrong_method_is_a_405_with_allow_and_an_openai_error(make_router):
    client = await make_router(None, ScriptedWorker())
    resp = await client.get("/v1/completions")
    assert resp.status_code == 405 and "POST" in resp.headers["allow"]
    assert resp.json()["error"]["type"] == "invalid_request_error"


async def test_decode_stall_is_cancelled_counted_and_served_direct(make_router):
    decode = ScriptedWorker(first_token_delay_s=1.0)  # stalls only when it must pull KV
    client = await make_router(ScriptedWorker(), decode, threshold=0, decodeFirstTokenTimeoutS=0.2)
    resp = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert resp.status_code == 200 and resp.headers["x-dpd-fallback"] == "decode_stall"
    assert resp.text.endswith("data: [DONE]\n\n") and '"text": "a"' in resp.text
    text = (await client.get("/metrics")).text
    assert metric(text, "dpd_pd_stalls_total") == 1
    assert metric(text, 'dpd_fallbacks_total{reason="decode_stall"}') == 1


async def test_a_pairs_first_transfer_waits_for_the_nixl_handshake_and_later_ones_do_not(make_router):
    """A pair's first KV transfer carries NIXL's handshake: its first token may take 4× the
    deadline (here 0.8 s, the decoder answering in 0.5 s: served disaggregated); the pair's next
    transfers get the deadline itself (a stall, served direct); a worker that went unhealthy
    handshakes again."""
    decode = ScriptedWorker(first_token_delay_s=0.5)
    client = await make_router(ScriptedWorker(), decode, threshold=0, decodeFirstTokenTimeoutS=0.2)
    router = client.router  # type: ignore[attr-defined]
    assert router.flow.first_transfer_timeout_s() == pytest.approx(0.8)
    first = await client.post("/v1/completions", json=BODY)
    assert first.status_code == 200 and first.headers["x-dpd-path"] == "disaggregated"
    assert router.routing.endpoint.split_overhead.num_samples == 0  # the handshake is not a split's overhead
    second = await client.post("/v1/completions", json=BODY)
    assert second.status_code == 200 and second.headers.get("x-dpd-fallback") == "decode_stall"
    router.flow.forget(router.prefill.workers[0].name)  # as when the prefiller goes unhealthy
    again = await client.post("/v1/completions", json=BODY)
    assert again.status_code == 200 and again.headers["x-dpd-path"] == "disaggregated"
    # A request that finds a worker down opens its breaker before any probe: its pairs go too.
    assert router.flow._transferred
    router.decode.workers[0].breaker.record_failure("refused", is_definite=True)
    assert not router.flow._transferred
    router.decode.workers[0].breaker.record_success()  # closed again for the fixture's idle check


async def test_a_pair_whose_first_transfer_stalled_gets_the_deadline_next(make_router):
    """One long wait per pair: a first transfer that stalls past the long deadline too is not
    waited for that long again."""
    decode = ScriptedWorker(first_token_delay_s=3.0)
    client = await make_router(ScriptedWorker(), decode, threshold=0, decodeFirstTokenTimeoutS=0.5)
    started = time.monotonic()
    first = await client.post("/v1/completions", json=BODY)
    assert first.headers.get("x-dpd-fallback") == "decode_stall" and time.monotonic() - started >= 2.0  # 4 × 0.5 s
    started = time.monotonic()
    second = await client.post("/v1/completions", json=BODY)
    assert second.headers.get("x-dpd-fallback") == "decode_stall" and time.monotonic() - started < 2.0


def test_a_first_transfer_deadline_stays_within_half_the_kv_lease():
    from dpd.router.flow import PdFlow
    from dpd.router.metrics import RouterMetrics

    flow = PdFlow(None, None, None, None, RouterSpec(decodeFirstTokenTimeoutS=5.0), RouterMetrics(), kv_lease_s=30.0)  # type: ignore[arg-type]
    assert flow.first_transfer_timeout_s() == 15.0  # not 20: the prefiller holds the KV for 30 s
    flow = PdFlow(None, None, None, None, RouterSpec(decodeFirstTokenTimeoutS=20.0), RouterMetrics(), kv_lease_s=30.0)  # type: ignore[arg-type]
    assert flow.first_transfer_timeout_s() == 20.0  # never shorter than the deadline itself


def test_a_first_transfer_waits_no_longer_than_the_lease_left_since_its_prefill():
    """The prefiller frees the KV when its lease ends: a first transfer whose decode hop started
    late (it queued for a decode slot) waits only for what is left of it, less a second — never
    less than the configured deadline; later transfers get the deadline whatever the lease."""
    from dpd.router.flow import LEASE_MARGIN_S, PdFlow
    from dpd.router.metrics import RouterMetrics

    flow = PdFlow(None, None, None, None, RouterSpec(decodeFirstTokenTimeoutS=5.0), RouterMetrics(), kv_lease_s=30.0)  # type: ignore[arg-type]
    assert flow.decode_deadline_s(True, 0.0) == 15.0  # the lease's half: 29 s are left
    assert flow.decode_deadline_s(True, 20.0) == pytest.approx(30.0 - 20.0 - LEASE_MARGIN_S)  # 9 s left
    assert flow.decode_deadline_s(True, 27.0) == 5.0  # 2 s left: the configured deadline still
    assert flow.decode_deadline_s(False, 0.0) == 5.0 and flow.decode_deadline_s(False, 27.0) == 5.0

def split_every_request(router: Router) -> None:
    """The adaptive policy's plan fixed to a split of the first prefiller and decoder."""
    p, d = router.prefill.workers[0], router.decode.workers[0]
    router.routing.decide = lambda *args, **kwargs: Decision(Path.DISAGGREGATED, Reason.DECODER_BUSY, prefill=p,
                                                             decode=d, computed_tokens=4)


PREFIX_AWARE = {"enabled": True, "blockSize": 16}


def recorded_prefill_tokens(worker) -> list[int]:
    """The token counts ``worker``'s load is told each prefill computes, from now on."""
    counts: list[int] = []
    begin = worker.load.begin_prefill

    def recording(num_tokens, *args, **kwargs):
        counts.append(num_tokens)
        return begin(num_tokens, *args, **kwargs)

    worker.load.begin_prefill = recording
    return counts


@pytest.mark.parametrize("decode_kw, reason", [({"first_token_delay_s": 1.0}, "decode_stall"),
                                               ({"num_decode_failures": 1}, "decode_error")])
async def test_after_a_failed_decode_hop_the_adaptive_policy_serves_it_on_its_prefiller(make_router, decode_kw, reason):
    prefill, decode = ScriptedWorker(), ScriptedWorker(**decode_kw)
    client = await make_router(prefill, decode, policy="adaptive", decodeFirstTokenTimeoutS=0.2, prefixAware=PREFIX_AWARE)
    router = client.router  # type: ignore[attr-defined]
    split_every_request(router)
    counts = recorded_prefill_tokens(router.prefill.workers[0])
    prompt = " ".join(f"w{i}" for i in range(200))
    resp = await client.post("/v1/completions", json={**BODY, "prompt": prompt, "stream": True})
    assert resp.status_code == 200 and resp.headers["x-dpd-fallback"] == reason
    # its prefix cache holds the prompt: the whole request runs there, no decoder recomputes it
    assert resp.headers["x-dpd-workers"] == router.prefill.workers[0].name
    assert [bool(b.get("kv_transfer_params")) for b in prefill.bodies] == [True, False]
    assert len(decode.bodies) == 1  # the failed decode hop only
    assert counts == [4, 16]  # the split's planned tokens, then one block of the cached prompt


async def test_a_prefiller_that_misses_the_decode_deadline_too_leaves_it_to_a_decoder(make_router):
    prefill = ScriptedWorker(direct_first_token_delay_s=1.0)
    decode = ScriptedWorker(first_token_delay_s=1.0)
    client = await make_router(prefill, decode, policy="adaptive", decodeFirstTokenTimeoutS=0.2,
                               prefixAware=PREFIX_AWARE, retry={"maxAttempts": 1})
    router = client.router  # type: ignore[attr-defined]
    split_every_request(router)
    resp = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert resp.status_code == 200 and resp.headers["x-dpd-fallback"] == "decode_stall"
    assert resp.headers["x-dpd-workers"] == router.decode.workers[0].name  # outside the attempts: maxAttempts 1
    assert metric((await client.get("/metrics")).text, 'dpd_retries_total{pool="prefill"}') == 1
    assert router.prefill.workers[0].breaker.state is BreakerState.CLOSED  # a slow answer, no failure


async def test_without_prefix_aware_routing_a_fallback_recomputes_on_a_decoder(make_router):
    """Nothing says the prefiller's prefix cache is on (the ladder runs workers without it)."""
    prefill, decode = ScriptedWorker(), ScriptedWorker(first_token_delay_s=1.0)
    client = await make_router(prefill, decode, policy="adaptive", decodeFirstTokenTimeoutS=0.2)
    router = client.router  # type: ignore[attr-defined]
    split_every_request(router)
    resp = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert resp.headers["x-dpd-fallback"] == "decode_stall"
    assert resp.headers["x-dpd-workers"] == router.decode.workers[0].name and len(prefill.bodies) == 1


async def test_the_static_split_falls_back_on_a_decoder_only(make_router):
    prefill, decode = ScriptedWorker(), ScriptedWorker(first_token_delay_s=1.0)
    client = await make_router(prefill, decode, threshold=0, decodeFirstTokenTimeoutS=0.2)
    resp = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert resp.headers["x-dpd-fallback"] == "decode_stall"
    assert resp.headers["x-dpd-workers"] == client.router.decode.workers[0].name  # type: ignore[attr-defined]
    assert len(prefill.bodies) == 1


async def test_short_prompt_goes_direct(make_router):
    prefill = ScriptedWorker()
    client = await make_router(prefill, ScriptedWorker(), threshold=100)
    resp = await client.post("/v1/completions", json=BODY)
    assert resp.headers["x-dpd-path"] == "direct" and prefill.bodies == []


async def test_admission_sheds_with_429_when_full(make_router):
    client = await make_router(None, ScriptedWorker(token_delay_s=0.5), admission={"decode": {"maxInFlight": 1, "maxQueue": 0}})
    first = asyncio.create_task(client.post("/v1/completions", json=BODY))
    await asyncio.sleep(0.2)
    second = await client.post("/v1/completions", json=BODY)
    assert second.status_code == 429 and second.headers["retry-after"]
    assert second.json()["error"]["type"] == "rate_limit_error"
    assert (await first).status_code == 200
    third = await client.post("/v1/completions", json=BODY)  # the slot came back
    assert third.status_code == 200
    assert metric((await client.get("/metrics")).text, "dpd_shed_requests_total") == 1


async def test_decode_wait_after_a_prefill_is_bounded_by_the_kv_lease(make_router):
    """Issue 16, finding 8: a decode hop queued after its prefill waits at most half the KV lease
    (not the queue's 30 s), so it never pulls expired KV and silently recomputes; the prefill
    whose KV nobody took is counted."""
    client = await make_router(ScriptedWorker(), ScriptedWorker(token_delay_s=1.0), kv_lease_s=1.0,
                               admission={"decode": {"maxInFlight": 1, "maxQueue": 4, "queueTimeoutS": 30}})
    first = asyncio.create_task(client.post("/v1/completions", json=BODY))
    await asyncio.sleep(0.3)
    started = time.monotonic()
    second = await client.post("/v1/completions", json=BODY)
    waited_s = time.monotonic() - started
    assert second.status_code == 429 and waited_s < 1.5
    assert (await first).status_code == 200
    text = (await client.get("/metrics")).text
    assert metric(text, 'dpd_kv_abandoned_total{prefiller="prefill-0",reason="decode_queue_timeout"}') == 1


async def test_kv_transfer_failures_the_engine_counts_are_reported(make_router):
    """Issue 16, finding 8: a decoder that recomputed a failed KV pull answers normally; the
    router reads vLLM's NIXL counters and reports what grew, per worker and kind."""
    page = ('# HELP vllm:nixl_num_failed_transfers Number of failed NIXL KV Cache transfers.\n'
            '# TYPE vllm:nixl_num_failed_transfers counter\n'
            'vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} %s\n'
            '# HELP vllm:nixl_num_kv_expired_reqs Requests whose KV expired.\n'
            '# TYPE vllm:nixl_num_kv_expired_reqs counter\n'
            'vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="m"} %s\n')
    prefill, decode = ScriptedWorker(), ScriptedWorker()
    decode.metrics_text = page % (1.0, 0.0)  # before the router started: the baseline, not news
    prefill.metrics_text = page % (0.0, 0.0)
    client = await make_router(prefill, decode)
    watch = client.router.kv_watch
    decode.metrics_text, prefill.metrics_text = page % (3.0, 0.0), page % (0.0, 1.0)
    await watch.scrape_once()
    text = (await client.get("/metrics")).text
    assert metric(text, 'dpd_kv_transfer_failures_total{kind="failed_pull",pool="decode",worker="decode-0"}') == 2
    assert metric(text, 'dpd_kv_transfer_failures_total{kind="lease_expired",pool="prefill",worker="prefill-0"}') == 1
    decode.metrics_text = page % (0.0, 0.0)  # the decoder restarted: a new baseline, nothing counted
    await watch.scrape_once()
    decode.metrics_text = page % (1.0, 0.0)
    await watch.scrape_once()
    text = (await client.get("/metrics")).text
    assert metric(text, 'dpd_kv_transfer_failures_total{kind="failed_pull",pool="decode",worker="decode-0"}') == 3


async def test_no_decoder_is_a_503_with_retry_after(make_router):
    decode = ScriptedWorker()
    client = await make_router(None, decode)
    await decode.server.close()
    for _ in range(2):  # the first failure marks it down; then the pool is empty
        resp = await client.post("/v1/completions", json=BODY)
    assert resp.status_code == 503 and resp.headers["retry-after"]
    assert "decode pool" in resp.json()["error"]["message"]


async def test_tokenize_and_detokenize_answer_with_the_routers_tokenizer(make_router):
    client = await make_router(None, ScriptedWorker())
    resp = await client.post("/tokenize", json={"model": "m", "prompt": "one two three four"})
    assert resp.json() == {"count": 4, "max_model_len": 1000, "tokens": ["one", "two", "three", "four"]}
    chat = await client.post("/tokenize", json={"model": "m", "messages": [{"role": "user", "content": "a b"}]})
    assert chat.json()["count"] == 2
    assert (await client.post("/detokenize", json={"model": "m", "tokens": [1, 2]})).json() == {"prompt": "w1 w2"}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", b"{nope", 400, None),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, None),
    ("/tokenize", {"model": "m", "prompt": "x", "stream": True}, 400, "stream"),
    ("/tokenize", {"model": "m", "prompt": 3}, 400, "prompt"),
    ("/tokenize", {"model": "m", "messages": []}, 400, "messages"),
    ("/detokenize", {"model": "m", "tokens": [-1]}, 400, "tokens[0]"),
    ("/detokenize", {"model": "m"}, 400, "tokens"),
])
async def test_tokenizer_endpoints_refuse_bad_input_with_openai_errors(make_router, path, body, status, param):
    client = await make_router(None, ScriptedWorker())
    resp = await (client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body))
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)


# -- the adaptive policy (its decisions are table-tested in test_adaptive.py) -------------------------

async def test_adaptive_idle_endpoint_runs_a_long_prompt_whole_on_a_decoder(make_router):
    prefill, decode = ScriptedWorker(), ScriptedWorker()
    client = await make_router(prefill, decode, policy="adaptive")
    resp = await client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "abc"
    assert (resp.headers["x-dpd-path"], resp.headers["x-dpd-reason"], resp.headers["x-dpd-workers"]) == (
        "direct", "split_no_gain", "decode-0")
    assert prefill.bodies == [] and "kv_transfer_params" not in decode.bodies[0]


async def test_adaptive_idle_prefill_worker_takes_a_whole_request_while_the_decoder_streams(make_router):
    prefill, decode = ScriptedWorker(), ScriptedWorker(token_delay_s=0.4)
    client = await make_router(prefill, decode, policy="adaptive")
    first = asyncio.create_task(client.post("/v1/completions", json=BODY))
    for _ in range(100):  # until the decoder streams the first request
        await asyncio.sleep(0.02)
        if client.router.decode.workers[0].load.num_streams:
            break
    second = await client.post("/v1/completions", json=BODY)
    assert (second.headers["x-dpd-path"], second.headers["x-dpd-workers"]) == ("direct", "prefill-0")
    assert len(prefill.bodies) == 1 and "kv_transfer_params" not in prefill.bodies[0]  # a plain, whole request
    assert (await first).headers["x-dpd-workers"] == "decode-0"


async def test_adaptive_splits_when_the_decoder_streams_and_the_prefill_worker_prefills(make_router):
    prefill, decode = ScriptedWorker(), ScriptedWorker(token_delay_s=0.4)
    client = await make_router(prefill, decode, policy="adaptive")
    p = client.router.prefill.workers[0]
    p.load._add_busy(40.0, time.monotonic())  # it spent most of the last minute prefilling
    first = asyncio.create_task(client.post("/v1/completions", json={**BODY, "max_tokens": 100}))
    for _ in range(100):
        await asyncio.sleep(0.02)
        if client.router.decode.workers[0].load.num_streams:
            break
    long_body = {**BODY, "prompt": " ".join(["w"] * 600), "max_tokens": 100}
    resp = await client.post("/v1/completions", json=long_body)
    assert (resp.headers["x-dpd-path"], resp.headers["x-dpd-reason"], resp.headers["x-dpd-workers"]) == (
        "disaggregated", "decoder_busy", "prefill-0>decode-0")
    assert prefill.bodies[0]["kv_transfer_params"]["do_remote_decode"] is True
    await first
    state = (await client.get("/admin/workers")).json()
    # the pair's first transfer (NIXL's handshake) is not a sample of the split's overhead
    assert state["routing"]["policy"] == "adaptive" and state["routing"]["split_overhead_samples"] == 0
    assert state["pools"]["prefill"]["workers"][0]["prefill_rate_samples"] == 1  # 600 tokens: sampled


async def test_adaptive_planned_worker_gone_is_replaced_by_a_pick(make_router):
    prefill, decode = ScriptedWorker(), ScriptedWorker()
    client = await make_router(prefill, decode, policy="adaptive")
    await decode.server.close()  # the plan may name it; the flow must not send there blindly
    for _ in range(3):
        resp = await client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200 and resp.headers["x-dpd-workers"] == "prefill-0"


async def test_admin_policy_switches_and_refuses_bad_values(make_router):
    prefill, decode = ScriptedWorker(), ScriptedWorker()
    client = await make_router(prefill, decode, policy="adaptive", threshold=0)
    bad = await client.put("/admin/policy", json={"policy": "fastest"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "policy"
    assert (await client.put("/admin/policy", json={"policy": "threshold"})).json()["policy"] == "threshold"
    resp = await client.post("/v1/completions", json=BODY)
    assert (resp.headers["x-dpd-path"], resp.headers["x-dpd-reason"]) == ("disaggregated", "above_threshold")
    text = (await client.get("/metrics")).text
    assert metric(text, "dpd_routing_policy_adaptive") == 0
    assert metric(text, 'dpd_worker_queued_prefill_tokens{pool="prefill",worker="prefill-0"}') == 0
    assert "recommended_threshold_tokens" in (await client.get("/admin/threshold")).json()


# One flow per row of outcomes.OUTCOMES: how each ending of a disaggregated attempt is produced
# against scripted workers, and what the client, the metrics and the prefill pool's breaker see.
OUTCOME_SETUPS: dict[HopOutcome, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    HopOutcome.OK: ({}, {}, {}),
    HopOutcome.PREFILL_BREAKER_OPEN: ({}, {}, {}),  # the pool's breaker is forced open below
    HopOutcome.PREFILL_UNAVAILABLE: ({}, {}, {}),  # the prefill worker is draining
    HopOutcome.CANCELLED: ({"prefill_delay_s": 5.0}, {}, {}),  # the client leaves during the prefill
    HopOutcome.PREFILL_ERROR: ({"prefill_status": 500}, {}, {}),
    HopOutcome.PREFILL_TIMEOUT: ({"prefill_delay_s": 1.0}, {}, {"prefillTimeoutS": 0.2}),
    HopOutcome.PREFILL_NO_KV: ({"prefill_kv": False}, {}, {}),
    HopOutcome.DECODE_STALL: ({}, {"first_token_delay_s": 1.0}, {"decodeFirstTokenTimeoutS": 0.2}),
    HopOutcome.DECODE_ERROR: ({}, {"num_decode_failures": 1}, {}),
    HopOutcome.DECODE_UNAVAILABLE: ({}, {}, {}),  # the decoder is draining: the prefill worker serves it whole
}


def test_every_outcome_has_a_flow_test():
    assert set(OUTCOME_SETUPS) == set(OUTCOMES)


@pytest.mark.parametrize("outcome", list(OUTCOME_SETUPS), ids=lambda o: o.value)
async def test_outcome_row_end_to_end_through_the_flow(make_router, outcome):
    prefill_kw, decode_kw, spec = OUTCOME_SETUPS[outcome]
    client = await make_router(ScriptedWorker(**prefill_kw), ScriptedWorker(**decode_kw), threshold=0, **spec)
    router = client.router  # type: ignore[attr-defined]
    pool_breaker = router.prefill.breaker
    if outcome in (HopOutcome.PREFILL_BREAKER_OPEN, HopOutcome.PREFILL_UNAVAILABLE, HopOutcome.DECODE_UNAVAILABLE):
        # These arise when the state changes between the decision and the flow (the decider saw
        # usable pools): the decision is made as before, then a pool goes away.
        decided = router.routing.decide

        def decide_then_lose_the_pool(*args, **kwargs):
            decision = decided(*args, **kwargs)
            if outcome is HopOutcome.PREFILL_BREAKER_OPEN:
                for _ in range(pool_breaker.failure_threshold):
                    pool_breaker.record_failure("scripted")
            elif outcome is HopOutcome.PREFILL_UNAVAILABLE:
                router.prefill.workers[0].is_draining = True
            else:
                router.decode.workers[0].is_draining = True
            return decision

        router.routing.decide = decide_then_lose_the_pool
    body = {**BODY, "stream": True}
    if outcome is HopOutcome.CANCELLED:
        task = asyncio.create_task(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        resp = None
    else:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    rule = OUTCOMES[outcome]
    text = (await client.get("/metrics")).text
    num_fallbacks = metric(text, f'dpd_fallbacks_total{{reason="{outcome.value}"}}')
    if rule.falls_back:
        assert resp is not None
        assert (resp.headers["x-dpd-path"], resp.headers["x-dpd-fallback"]) == ("fallback", outcome.value)
        assert num_fallbacks == 1
    else:
        assert num_fallbacks == 0
        assert resp is None or resp.headers["x-dpd-path"] == "disaggregated"
    if rule.pool_breaker is Verdict.FAILURE:
        assert pool_breaker.num_consecutive_failures == 1
    elif outcome is HopOutcome.PREFILL_BREAKER_OPEN:  # Verdict.NONE: refused, not told: still open
        assert rule.pool_breaker is Verdict.NONE and pool_breaker.state is BreakerState.OPEN
    else:
        assert pool_breaker.num_consecutive_failures == 0 and pool_breaker.state is BreakerState.CLOSED


async def test_a_client_gone_during_the_decode_hop_tells_the_prefill_breaker_nothing(make_router):
    """The prefill hop succeeded, then the client left while the decoder pulled: neither a success
    (which would reset the pool breaker's failures, or close it half-open) nor a failure."""
    client = await make_router(ScriptedWorker(), ScriptedWorker(first_token_delay_s=2.0), threshold=0)
    breaker = client.router.prefill.breaker  # type: ignore[attr-defined]
    breaker.record_failure("scripted")
    task = asyncio.create_task(client.post("/v1/completions", json={**BODY, "stream": True}))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert breaker.num_consecutive_failures == 1


async def test_a_flooding_tenant_leaves_another_admitted(make_router):
    """Issue 16, finding 6: one tenant floods the shared decode pool (far more requests than slots
    and queue); the other tenant's requests are all admitted — the flood is capped per tenant and
    the queue makes room for the quiet tenant — while the flood gets 429s."""
    from dpd.config.model import TenantSpec
    from dpd.router.tenants import hash_key

    tenants = (TenantSpec(name="flood", apiKeySha256=(hash_key("key-flood"),), maxConcurrentRequests=6),
               TenantSpec(name="quiet", apiKeySha256=(hash_key("key-quiet"),)))
    client = await make_router(None, ScriptedWorker(token_delay_s=0.2), tenants=tenants,
                               admission={"decode": {"maxInFlight": 2, "maxQueue": 4, "queueTimeoutS": 10}})
    flood = [asyncio.create_task(client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer key-flood"}))
             for _ in range(20)]
    await asyncio.sleep(0.1)
    quiet_started = time.monotonic()
    quiet = await asyncio.gather(*(client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer key-quiet"})
                                   for _ in range(3)))
    quiet_s = time.monotonic() - quiet_started
    flood_codes = [r.status_code for r in await asyncio.gather(*flood)]
    assert [r.status_code for r in quiet] == [200, 200, 200]
    assert flood_codes.count(429) >= 14 and 200 in flood_codes
    assert quiet_s < 3.0, quiet_s  # served beside the flood's two slots, not behind its queue
    text = (await client.get("/metrics")).text
    assert metric(text, 'dpd_tenant_rate_limited_total{limit="max_concurrent_requests",tenant="flood"}') >= 14


async def test_tokenize_counts_against_the_tenants_request_bucket(make_router):
    """Issue 16, finding 6: /tokenize is work too — a tenant's request bucket and cap apply."""
    from dpd.config.model import TenantSpec
    from dpd.router.tenants import hash_key

    tenants = (TenantSpec(name="t", apiKeySha256=(hash_key("key-t"),), requestsPerSecond=0.01, burstRequests=1),)
    client = await make_router(None, ScriptedWorker(), tenants=tenants)
    auth = {"Authorization": "Bearer key-t"}
    assert (await client.post("/tokenize", json={"model": "m", "prompt": "a b c"}, headers=auth)).status_code == 200
    second = await client.post("/tokenize", json={"model": "m", "prompt": "a b c"}, headers=auth)
    assert second.status_code == 429 and second.json()["error"]["param"] == "requests_per_second"
    assert client.router.tenants.tenants["t"].num_in_flight == 0  # type: ignore[attr-defined]


async def test_prefix_aware_routing_sends_a_sessions_turns_to_one_worker_and_salts_tenants(make_router):
    """Issue 14: with router.prefixAware on, a session's next turn goes where its prefix was
    computed (reason prefix_hit), and each tenant's prompts carry a cache_salt of the router's
    (a client may not send one)."""
    from dpd.config.model import TenantSpec
    from dpd.router.tenants import hash_key

    tenants = (TenantSpec(name="x", apiKeySha256=(hash_key("key-x"),)), TenantSpec(name="y", apiKeySha256=(hash_key("key-y"),)))
    first, second = ScriptedWorker(), ScriptedWorker()
    client = await make_router(None, [first, second], tenants=tenants,
                               prefixAware={"enabled": True, "minCachedTokens": 16, "loadWeightTokens": 0})
    x, y = {"Authorization": "Bearer key-x"}, {"Authorization": "Bearer key-y"}
    history = " ".join(f"w{i}" for i in range(64))
    turn1 = await client.post("/v1/completions", json={**BODY, "prompt": history}, headers=x)
    served = turn1.headers["x-dpd-workers"]
    for turn in range(2, 5):
        history += " " + " ".join(f"t{turn}-{i}" for i in range(20))
        resp = await client.post("/v1/completions", json={**BODY, "prompt": history}, headers=x)
        assert resp.headers["x-dpd-reason"] == "prefix_hit" and resp.headers["x-dpd-workers"] == served
        assert int(resp.headers["x-dpd-prefix-cached-tokens"]) >= 64
    other = await client.post("/v1/completions", json={**BODY, "prompt": history}, headers=y)
    assert other.headers["x-dpd-reason"] == "colocated"  # y's cache is its own: no hit on x's prefix
    salts = {b["cache_salt"] for w in (first, second) for b in w.bodies}
    assert len(salts) == 2 and all(len(s) == 64 for s in salts)
    refused = await client.post("/v1/completions", json={**BODY, "cache_salt": "mine"}, headers=x)
    assert refused.status_code == 400


async def test_requests_are_judged_by_their_slo_class(make_router):
    """Issue 15: router.slo classes by prompt length; a fast answer meets both targets, a slow
    stream misses TPOT, a failed one misses both, and the latency histograms carry the class."""
    slo = {"ttftS": 5.0, "tpotS": 0.05, "classes": [{"name": "short", "maxPromptTokens": 3},
                                                    {"name": "long", "tpotS": 1.0}]}
    slow = ScriptedWorker(token_delay_s=0.1)  # 3 tokens, 0.1 s apart: TPOT 0.1 s
    client = await make_router(None, slow, slo=slo)
    for prompt in ("a b", "a b c d e"):  # short (2 tokens) and long (5)
        assert (await client.post("/v1/completions", json={**BODY, "prompt": prompt})).status_code == 200
    text = (await client.get("/metrics")).text
    judged = 'dpd_slo_requests_total{class="%s",outcome="%s",path="direct",slo="%s"}'
    assert metric(text, judged % ("short", "met", "ttft")) == 1
    assert metric(text, judged % ("short", "missed", "tpot")) == 1  # 0.1 s > 0.05 s
    assert metric(text, judged % ("short", "missed", "all")) == 1
    assert metric(text, judged % ("long", "met", "all")) == 1  # its own 1 s TPOT target
    assert metric(text, 'dpd_ttft_seconds_count{class="long",path="direct"}') == 1
    assert metric(text, 'dpd_itl_seconds_count{class="short",path="direct"}') == 2


async def test_a_failed_request_misses_its_slo_and_bad_input_is_not_judged(make_router):
    decode = ScriptedWorker(num_decode_failures=5)
    client = await make_router(None, decode, retry={"maxAttempts": 1})
    resp = await client.post("/v1/completions", json=BODY)
    assert resp.status_code >= 500
    assert (await client.post("/v1/completions", json={**BODY, "max_tokens": -1})).status_code == 400
    text = (await client.get("/metrics")).text
    assert metric(text, 'dpd_slo_requests_total{class="chat",outcome="missed"') == 3  # ttft, tpot, all
    assert metric(text, 'dpd_slo_requests_total{class="chat",outcome="met"') == 0


async def test_kv_transfers_the_engine_measured_are_re_exported(make_router):
    page = ('# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration.\n'
            '# TYPE vllm:nixl_xfer_time_seconds histogram\n'
            'vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf"} %(n)s\n'
            'vllm:nixl_xfer_time_seconds_count{engine="0"} %(n)s\n'
            'vllm:nixl_xfer_time_seconds_sum{engine="0"} %(s)s\n'
            '# HELP vllm:nixl_bytes_transferred Histogram of bytes.\n'
            '# TYPE vllm:nixl_bytes_transferred histogram\n'
            'vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf"} %(n)s\n'
            'vllm:nixl_bytes_transferred_count{engine="0"} %(n)s\n'
            'vllm:nixl_bytes_transferred_sum{engine="0"} %(b)s\n')
    prefill, decode = ScriptedWorker(), ScriptedWorker()
    decode.metrics_text = page % {"n": 2, "s": 0.5, "b": 2048}  # the baseline
    client = await make_router(prefill, decode)
    watch = client.router.kv_watch
    await watch.scrape_once()
    decode.metrics_text = page % {"n": 5, "s": 1.1, "b": 8192}
    await watch.scrape_once()
    text = (await client.get("/metrics")).text
    where = '{pool="decode",worker="decode-0"}'
    assert metric(text, "dpd_kv_transfers_total" + where) == 3
    assert metric(text, "dpd_kv_transfer_seconds_total" + where) == pytest.approx(0.6)
    assert metric(text, "dpd_kv_transfer_bytes_total" + where) == 6144
    assert metric(text, "dpd_kv_transfer_failures_total") == 0


async def test_the_request_log_says_what_each_request_got(make_router, tmp_path):
    path = tmp_path / "requests.jsonl"
    client = await make_router(ScriptedWorker(), ScriptedWorker(), threshold=3, requestLog={"path": str(path)})
    assert (await client.post("/v1/completions", json={**BODY, "prompt": "a b"})).status_code == 200  # direct
    assert (await client.post("/v1/completions", json=BODY)).status_code == 200  # 4 tokens: split
    assert (await client.post("/v1/completions", json={**BODY, "max_tokens": -1})).status_code == 400  # not logged
    await client.router.stop()  # closes the log
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["prompt_tokens"], x["path"], x["output_tokens"], x["outcome"]) for x in lines] == [
        (2, "direct", 3, "ok"), (4, "disaggregated", 3, "ok")]
    assert lines[1]["workers"] == "prefill-0>decode-0" and lines[1]["class"] == "chat" and lines[1]["slo_met"] is True
    assert all(x["ttft_s"] >= 0 and x["e2e_s"] >= x["ttft_s"] and "prompt" not in x for x in lines)
    assert all("predicted_ttft_s" not in x for x in lines)  # the static threshold predicts nothing


async def test_the_request_log_holds_the_adaptive_policys_prediction(make_router, tmp_path):
    path = tmp_path / "requests.jsonl"
    client = await make_router(ScriptedWorker(), ScriptedWorker(), policy="adaptive", requestLog={"path": str(path)})
    assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    await client.router.stop()
    [line] = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["predicted_ttft_s"] >= 0 and line["ttft_s"] >= 0
    # The prediction's error joins the window of the path it planned; /admin/policy shows it.
    errors = client.router.routing.endpoint.ttft_errors[line["path"]]
    assert errors.num_samples == 1 and errors.quantile(0.5) == pytest.approx(line["ttft_s"] - line["predicted_ttft_s"], abs=2e-3)
    state = (await client.get("/admin/policy")).json()
    assert state["ttft_errors"][line["path"]]["samples"] == 1


async def test_a_disaggregated_request_is_one_trace_across_the_hops(make_router):
    """Issue 15: with router.tracing on, the router's spans form one trace that continues the
    client's traceparent, and each hop hands its own span to its worker (vLLM continues it)."""
    from tests.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        prefill, decode = ScriptedWorker(), ScriptedWorker()
        client = await make_router(prefill, decode, threshold=0, tracing={"otlpEndpoint": receiver.url})
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        resp = await client.post("/v1/completions", json=BODY, headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
        assert resp.status_code == 200 and resp.headers["x-dpd-path"] == "disaggregated"
        await client.router.stop()  # flushes the batched spans
        spans = {s.name: s for s in receiver.trace(trace_id)}
    assert {"dpd.request", "tokenize", "decide", "admission_wait", "prefill_hop", "decode_hop", "stream"} <= set(spans)
    root = spans["dpd.request"]
    assert root.parent_id == "00f067aa0ba902b7" and root.service == "dpd-router"
    assert all(s.parent_id == root.span_id for name, s in spans.items() if name != "dpd.request")
    # The workers got the hop's span as their parent: their spans join this trace.
    assert len(prefill.bodies) == len(decode.bodies) == 1
    assert prefill.traceparents == [f"00-{trace_id}-{spans['prefill_hop'].span_id}-01"]
    assert decode.traceparents == [f"00-{trace_id}-{spans['decode_hop'].span_id}-01"]


async def test_tracing_off_sends_no_trace_headers(make_router):
    decode = ScriptedWorker()
    client = await make_router(None, decode)
    client_trace = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    assert (await client.post("/v1/completions", json=BODY, headers=client_trace)).status_code == 200
    assert client.router.tracing.is_on is False and decode.traceparents == [None]


async def test_shadow_traffic_never_delays_or_fails_the_primary(make_router, tmp_path):
    """Issue 15: mirrors to a slow target, a down one, and past maxConcurrent — every primary
    request answered at once and without error; each mirror counted by outcome."""
    slow = ScriptedWorker(token_delay_s=1.5)  # its 3 tokens take 3 s
    await slow.server.start_server()
    log = tmp_path / "requests.jsonl"
    client = await make_router(None, ScriptedWorker(), requestLog={"path": str(log)}, worker_api_key="workers-only",
                               shadow={"url": slow.url, "share": 1.0, "maxConcurrent": 2, "model": "other"})
    latencies = []
    for _ in range(4):
        started = time.monotonic()
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        latencies.append(time.monotonic() - started)
    assert max(latencies) < 1.0, latencies  # the mirrors' 3 s are not ours
    text = (await client.get("/metrics")).text
    assert metric(text, 'dpd_shadow_requests_total{outcome="dropped"}') == 2  # two were still open
    while client.router.shadow.num_in_flight:
        await asyncio.sleep(0.1)
    text = (await client.get("/metrics")).text
    assert metric(text, 'dpd_shadow_requests_total{outcome="ok"}') == 2
    assert metric(text, 'dpd_shadow_ttft_seconds_count{class="chat"}') == 2
    assert metric(text, 'dpd_shadow_itl_seconds_count{class="chat"}') == 4
    assert [b["model"] for b in slow.bodies] == ["other", "other"] and all(b["stream"] for b in slow.bodies)
    assert slow.authorizations == [None, None]  # the workers' key is never sent to the shadow target
    await client.router.stop()
    shadows = [json.loads(x) for x in log.read_text().splitlines() if json.loads(x).get("shadow")]
    assert len(shadows) == 2 and all(s["outcome"] == "ok" and s["tpot_s"] >= 1.0 for s in shadows)
    await slow.server.close()


async def test_a_shadow_target_that_is_down_costs_nothing(make_router):
    down = ScriptedWorker()
    await down.server.start_server()
    url = down.url
    await down.server.close()
    client = await make_router(None, ScriptedWorker(), shadow={"url": url, "share": 1.0})
    for _ in range(3):
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    while client.router.shadow.num_in_flight:
        await asyncio.sleep(0.05)
    assert metric((await client.get("/metrics")).text, 'dpd_shadow_requests_total{outcome="error"}') == 3


async def test_a_body_past_four_mib_is_parsed_off_the_event_loop():
    """A long context's body limit runs to tens of MiB: parsing that on the event loop would stall
    every stream being relayed (and could trip a decode hop's first-token deadline)."""
    import threading

    from dpd.router.protocol import MAX_BODY_BYTES

    def where(raw: bytes) -> str:
        return threading.current_thread().name

    loop_thread = threading.current_thread().name
    assert await Router._parsed(where, b"x" * 100) == loop_thread
    assert await Router._parsed(where, b"x" * (MAX_BODY_BYTES + 1)) != loop_thread

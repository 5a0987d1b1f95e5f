"""Breakers, retries, per-pool admission, tenants and drain, against scripted workers.

Component tests of dpd's own logic (see test_router_flow.py for the scripted worker); the
end-to-end figures with real vLLM workers are in tests/integration.
"""

from __future__ import annotations

import asyncio

from dpd.config.model import TenantSpec
from dpd.router.tenants import hash_key
from tests.unit.test_router_flow import BODY, ScriptedWorker, metric

LONG = {**BODY, "prompt": " ".join(["w"] * 50)}


def tenant(name: str, *dedicated: str, **limits) -> TenantSpec:
    return TenantSpec(name=name, apiKeySha256=(hash_key(f"key-{name}"),), dedicatedWorkers=dedicated, **limits)


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer key-{name}"}


async def test_prefill_pool_breaker_sends_long_prompts_direct_then_recovers(make_router):
    prefill = ScriptedWorker(prefill_status=500)
    client = await make_router(
        prefill, ScriptedWorker(), threshold=10, breaker={"poolFailureThreshold": 2, "openS": 0.5, "failureThreshold": 10}
    )
    for _ in range(2):
        resp = await client.post("/v1/completions", json=LONG)
        assert resp.status_code == 200 and resp.headers["x-dpd-fallback"] == "prefill_error"
    num_prefills = len(prefill.bodies)
    resp = await client.post("/v1/completions", json=LONG)  # the pool breaker is open: straight to direct
    assert resp.status_code == 200 and resp.headers["x-dpd-path"] == "direct"
    assert len(prefill.bodies) == num_prefills
    text = (await client.get("/metrics")).text
    assert metric(text, 'dpd_breaker_state{pool="prefill",worker="*"}') == 2
    assert metric(text, 'dpd_decisions_total{path="direct",reason="prefill_unavailable"}') == 1
    prefill.prefill_status = 200  # the pool recovers
    await asyncio.sleep(0.6)
    resp = await client.post("/v1/completions", json=LONG)  # the half-open trial
    assert resp.headers["x-dpd-path"] == "disaggregated"
    assert client.router.prefill.breaker.state.value == "closed"


async def test_short_prompts_unaffected_by_a_dead_prefill_pool(make_router):
    prefill = ScriptedWorker()
    client = await make_router(prefill, ScriptedWorker(), threshold=10)
    await prefill.server.close()
    statuses = [(await client.post("/v1/completions", json=BODY)).status_code for _ in range(5)]
    long = await client.post("/v1/completions", json=LONG)
    assert statuses == [200] * 5 and long.status_code == 200 and long.headers["x-dpd-path"] in ("fallback", "direct")


async def test_failed_decoder_is_retried_on_another_and_its_breaker_opens(make_router):
    bad, good = ScriptedWorker(num_decode_failures=100), ScriptedWorker()
    client = await make_router(None, [bad, good], breaker={"failureThreshold": 2}, retry={"backoffBaseS": 0.01})
    results = [await client.post("/v1/completions", json=BODY) for _ in range(20)]  # ties break at random
    assert [r.status_code for r in results] == [200] * 20
    text = (await client.get("/metrics")).text
    assert 1 <= metric(text, "dpd_retries_total") <= 2  # at most threshold failures before the breaker opens
    assert client.router.decode.workers[0].breaker.state.value == "open"


async def test_retries_are_bounded(make_router):
    client = await make_router(None, ScriptedWorker(num_decode_failures=100), retry={"maxAttempts": 3, "backoffBaseS": 0.01},
                               breaker={"failureThreshold": 10})
    resp = await client.post("/v1/completions", json=BODY)
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "worker_error"
    assert metric((await client.get("/metrics")).text, "dpd_retries_total") == 2


async def test_prefill_pool_admission_sheds_with_429(make_router):
    client = await make_router(ScriptedWorker(prefill_delay_s=0.5), ScriptedWorker(), threshold=10,
                               admission={"prefill": {"maxInFlight": 1, "maxQueue": 0}})
    first = asyncio.create_task(client.post("/v1/completions", json=LONG))
    await asyncio.sleep(0.2)
    second = await client.post("/v1/completions", json=LONG)
    short = await client.post("/v1/completions", json=BODY)  # needs no prefill slot
    assert second.status_code == 429 and second.headers["retry-after"] and short.status_code == 200
    assert (await first).status_code == 200
    assert metric((await client.get("/metrics")).text, 'dpd_shed_requests_total{pool="prefill",reason="queue_full"}') == 1


async def test_tenant_keys_and_dedicated_workers(make_router):
    shared, dedicated = ScriptedWorker(), ScriptedWorker()
    client = await make_router(None, [shared, dedicated], tenants=(tenant("a"), tenant("b", "decode-1")))
    assert (await client.post("/v1/completions", json=BODY)).status_code == 401
    wrong = await client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    tokenize = {"model": "m", "prompt": "x y"}
    assert (await client.post("/tokenize", json=tokenize)).status_code == 401  # the tokenizer needs a key too
    assert (await client.post("/tokenize", json=tokenize, headers=auth("a"))).json()["count"] == 2
    for _ in range(6):
        assert (await client.post("/v1/completions", json=BODY, headers=auth("a"))).status_code == 200
    assert len(shared.bodies) == 6 and dedicated.bodies == []  # a never reaches b's worker
    for _ in range(4):
        assert (await client.post("/v1/completions", json=BODY, headers=auth("b"))).status_code == 200
    assert len(dedicated.bodies) == 4 and len(shared.bodies) == 6  # b uses only its own


async def test_dedicated_worker_down_is_a_503_not_a_leak_to_shared(make_router):
    shared, dedicated = ScriptedWorker(), ScriptedWorker()
    client = await make_router(None, [shared, dedicated], tenants=(tenant("a"), tenant("b", "decode-1")))
    await dedicated.server.close()
    resp = await client.post("/v1/completions", json=BODY, headers=auth("b"))
    assert resp.status_code in (502, 503) and shared.bodies == []


async def test_the_prefill_pool_is_no_last_resort_for_a_tenant_with_decoders_of_its_own(make_router):
    """A tenant with decoders of its own and none of its prefill workers: with its decoders down
    it gets a 503, never a shared prefill worker; the other tenants' last resort is unchanged."""
    prefill, shared, dedicated = ScriptedWorker(), ScriptedWorker(), ScriptedWorker()
    client = await make_router(prefill, [shared, dedicated], threshold=10,
                               tenants=(tenant("a"), tenant("b", "decode-1")))
    await dedicated.server.close()
    await shared.server.close()
    await client.router._prober.probe_once()
    refused = await client.post("/v1/completions", json=BODY, headers=auth("b"))
    assert refused.status_code == 503 and prefill.bodies == []
    served = await client.post("/v1/completions", json=BODY, headers=auth("a"))
    assert served.status_code == 200 and served.headers["x-dpd-workers"] == "prefill-0"


async def test_decoders_gone_during_the_prefill_hop_the_prefiller_serves_it_whole(make_router):
    """The prefill hop succeeded, then no decoder is left: the request is served whole on a
    prefill worker (fallback decode_unavailable), its prefilled KV counted as abandoned, and the
    prefill pool's breaker learns nothing."""
    prefill, decode = ScriptedWorker(prefill_delay_s=0.3), ScriptedWorker()
    client = await make_router(prefill, decode, threshold=10)
    router = client.router
    request = asyncio.create_task(client.post("/v1/completions", json=LONG))
    await asyncio.sleep(0.15)  # in the prefill hop
    router.decode.workers[0].is_draining = True
    resp = await request
    assert resp.status_code == 200, resp.text
    assert (resp.headers["x-dpd-path"], resp.headers["x-dpd-fallback"]) == ("fallback", "decode_unavailable")
    assert resp.headers["x-dpd-workers"] == "prefill-0" and decode.bodies == []
    text = (await client.get("/metrics")).text
    assert metric(text, 'dpd_kv_abandoned_total{prefiller="prefill-0",reason="decode_unavailable"}') == 1
    assert router.prefill.breaker.state.value == "closed" and router.prefill.breaker.num_consecutive_failures == 0
    router.decode.workers[0].is_draining = False


async def test_tenant_rate_limits(make_router):
    client = await make_router(None, ScriptedWorker(), tenants=(tenant("a", requestsPerSecond=0.5, burstRequests=2),
                                                                tenant("b", promptTokensPerSecond=1, burstPromptTokens=10)))
    codes = [(await client.post("/v1/completions", json=BODY, headers=auth("a"))).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    assert (await client.post("/v1/completions", json=BODY, headers=auth("b"))).status_code == 200  # 4 of 10 tokens
    assert (await client.post("/v1/completions", json=BODY, headers=auth("b"))).status_code == 200
    refused = await client.post("/v1/completions", json=BODY, headers=auth("b"))
    assert refused.status_code == 429 and refused.json()["error"]["param"] == "prompt_tokens_per_second"
    text = (await client.get("/metrics")).text
    assert metric(text, 'dpd_tenant_rate_limited_total{limit="requests_per_second",tenant="a"}') == 1
    assert metric(text, 'dpd_tenant_requests_total{outcome="ok",tenant="a"}') == 2


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_drain_waits_for_in_flight_and_routes_new_requests_elsewhere(make_router):
    slow, other = ScriptedWorker(token_delay_s=0.3), ScriptedWorker()
    client = await make_router(None, [slow, other], picker="least-outstanding")
    client.router.decode.workers[1].num_in_flight = 5  # steer the first request to decode-0
    in_flight = asyncio.create_task(client.post("/v1/completions", json=BODY))
    await until(lambda: len(slow.bodies) == 1)  # events, not sleeps: the suite may share a busy CPU
    client.router.decode.workers[1].num_in_flight = 0
    drain = asyncio.create_task(client.post("/admin/workers/decode-0/drain", json={"timeout_s": 10}))
    await until(lambda: client.router.decode.workers[0].is_draining)
    assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    assert len(slow.bodies) == 1 and len(other.bodies) == 1  # the new request avoided the draining worker
    assert not drain.done()  # still waiting for the in-flight request
    assert (await in_flight).status_code == 200
    result = (await drain).json()
    assert result["drained"] and result["in_flight"] == 0 and result["waited_s"] > 0.2
    state = (await client.get("/admin/workers")).json()["pools"]["decode"]["workers"][0]
    assert state["draining"] is True
    stop = await client.post("/admin/workers/decode-0/drain", json={"then": "stop"})
    assert stop.status_code == 409  # no launcher behind this router
    assert (await client.post("/admin/workers/decode-0/resume")).json()["draining"] is False
    bad = await client.post("/admin/workers/nope/drain")
    assert bad.status_code == 404 and "decode-0" in bad.json()["error"]["message"]


async def test_with_tenants_the_model_list_needs_a_tenants_key(make_router):
    client = await make_router(None, ScriptedWorker(), tenants=(tenant("a"),))
    assert (await client.get("/v1/models")).status_code == 401
    assert (await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status_code == 401
    listed = await client.get("/v1/models", headers=auth("a"))
    assert listed.status_code == 200 and listed.json()["data"][0]["id"] == "m"
    open_client = await make_router(None, ScriptedWorker())  # no tenants: open, as the endpoint is
    assert (await open_client.get("/v1/models")).status_code == 200


async def test_admin_key_is_checked_against_its_hash(make_router):
    client = await make_router(None, ScriptedWorker(), adminKeySha256=hash_key("admin-secret"),
                               tenants=(tenant("a"),))
    assert (await client.get("/admin/threshold")).status_code == 401
    assert (await client.get("/admin/threshold", headers=auth("a"))).status_code == 401  # a tenant key is no admin key
    ok = await client.put("/admin/threshold", json={"threshold_tokens": 7}, headers={"Authorization": "Bearer admin-secret"})
    assert ok.status_code == 200 and ok.json()["threshold_tokens"] == 7
    bad = await client.put("/admin/threshold", json={"threshold_tokens": -1}, headers={"Authorization": "Bearer admin-secret"})
    assert bad.status_code == 400
    for raw in (b"not json", b"\xff", b"[" * 3000, b"{\"threshold_tokens\": " + b"1" * 5000 + b"}"):
        bad = await client.put("/admin/threshold", content=raw, headers={"Authorization": "Bearer admin-secret"})
        assert bad.status_code == 400 and bad.json()["error"]["message"] == "The body must be a JSON object.", raw[:20]


async def test_no_decoder_a_prefill_worker_serves_whole_requests(make_router):
    """Every worker can serve a whole request: with no decoder up, the prefill worker is the last
    resort before a 503 — a long prompt is not split (its KV would have nowhere to go)."""
    prefill, decode = ScriptedWorker(), ScriptedWorker()
    client = await make_router(prefill, decode, threshold=10)
    await decode.server.close()
    await client.router._prober.probe_once()
    short, long = (await client.post("/v1/completions", json=BODY)), (await client.post("/v1/completions", json=LONG))
    assert short.status_code == 200 and (short.headers["x-dpd-path"], short.headers["x-dpd-workers"]) == ("direct", "prefill-0")
    assert long.status_code == 200 and long.headers["x-dpd-path"] == "fallback"
    assert (long.headers["x-dpd-fallback"], long.headers["x-dpd-workers"]) == ("decode_unavailable", "prefill-0")
    assert [("kv_transfer_params" in b) for b in prefill.bodies] == [False, False]  # two whole requests, no prefill hop
    text = (await client.get("/metrics")).text
    assert metric(text, 'dpd_fallbacks_total{reason="decode_unavailable"}') == 1


async def test_no_worker_at_all_is_an_immediate_503(make_router):
    prefill, decode = ScriptedWorker(), ScriptedWorker()
    client = await make_router(prefill, decode, threshold=10)
    await decode.server.close()
    await prefill.server.close()
    await client.router._prober.probe_once()
    resp = await client.post("/v1/completions", json=LONG)
    assert resp.status_code == 503 and resp.headers["retry-after"] and prefill.bodies == []


async def test_a_decoder_that_answers_health_late_keeps_serving(make_router):
    """On a machine short of CPU a busy worker answers /health after the probe's timeout: that
    alone must not turn the only decoder away (it once made every request a 503 for a cooldown)."""
    decode = ScriptedWorker()
    client = await make_router(None, decode, breaker={"failureThreshold": 3})
    await client.router._prober.stop()  # this test probes by hand
    decode.health_delay_s = 1.5  # the probe's timeout is max(1 s, healthIntervalS)
    await client.router._prober.probe_once()
    await client.router._prober.probe_once()
    worker = client.router.decode.workers[0]
    assert worker.breaker.state.value == "closed", worker.breaker.last_error
    assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    await client.router._prober.probe_once()  # the third late answer running: the worker is judged hung
    assert worker.breaker.state.value == "open" and "timed out" in worker.breaker.last_error
    decode.health_delay_s = 0.0


async def test_graceful_shutdown_refuses_new_requests_and_waits_for_streams(make_router):
    client = await make_router(None, ScriptedWorker(token_delay_s=0.3))
    router = client.router
    stream = asyncio.create_task(client.post("/v1/completions", json={**BODY, "stream": True}))
    await asyncio.sleep(0.1)
    assert router.num_active == 1
    shutdown = asyncio.create_task(router.shut_down_gracefully(10))
    await asyncio.sleep(0.05)
    refused = await client.post("/v1/completions", json=BODY)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert not shutdown.done()
    assert (await stream).status_code == 200
    assert await shutdown == 0 and router.num_active == 0


async def test_graceful_shutdown_gives_up_after_its_timeout(make_router):
    client = await make_router(None, ScriptedWorker(token_delay_s=1.0))
    stream = asyncio.create_task(client.post("/v1/completions", json={**BODY, "stream": True}))
    await asyncio.sleep(0.1)
    assert await client.router.shut_down_gracefully(0.2) == 1
    await stream


async def test_prefiller_counts_the_request_until_its_kv_is_pulled(make_router):
    """Drain waits on in-flight counts: a prefiller must count a request until the decoder's
    first token (its KV pulled), not just until the prefill hop returns."""
    prefill, decode = ScriptedWorker(), ScriptedWorker(first_token_delay_s=0.5)
    client = await make_router(prefill, decode, threshold=0)
    request = asyncio.create_task(client.post("/v1/completions", json=BODY))
    await asyncio.sleep(0.3)  # prefill done, the decode hop is pulling
    assert len(prefill.bodies) == 1 and client.router.prefill.workers[0].num_in_flight == 1
    assert (await request).headers["x-dpd-path"] == "disaggregated"
    assert client.router.prefill.workers[0].num_in_flight == 0


async def test_decode_admission_slot_is_held_only_by_decode_hops(make_router):
    """A long prompt in its prefill hop holds no decode slot, so short requests keep flowing."""
    client = await make_router(ScriptedWorker(prefill_delay_s=0.6), ScriptedWorker(), threshold=10,
                               admission={"decode": {"maxInFlight": 1, "maxQueue": 0}})
    long = asyncio.create_task(client.post("/v1/completions", json=LONG))
    await asyncio.sleep(0.2)
    assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    assert (await long).status_code == 200
    assert client.router.gates["decode"].num_in_flight == 0


def test_token_ids_outside_the_vocabulary_are_refused():
    import pytest

    from dpd.router.protocol import CompletionRequest
    from dpd.router.tokens import TokenCounter

    class Tok:
        def __len__(self) -> int:
            return 100

    counter = TokenCounter(Tok())
    assert counter.count(CompletionRequest(model="m", prompt=[0, 99])) == 2
    for ids in ([100], [-1], [5, 10**9]):
        with pytest.raises(ValueError, match="out of the vocabulary"):
            counter.count(CompletionRequest(model="m", prompt=ids))


def test_a_chat_prompt_is_counted_with_the_reasoning_fields_vllm_gives_its_template():
    """vLLM 0.32 takes an earlier turn's reasoning from ``reasoning`` (else ``reasoning_content``)
    and hands an assistant turn's template both fields, any other turn's neither: a template that
    reads either field renders the same text for the router as for the worker."""
    from dpd.router.protocol import ChatCompletionRequest
    from dpd.router.tokens import TokenCounter

    seen: list[list[dict]] = []

    class Tok:
        def apply_chat_template(self, conversation, **kwargs):
            seen.append(conversation)
            return "".join(m.get("reasoning_content", "") + m["content"] for m in conversation)

        def encode(self, text, add_special_tokens=True):
            return list(range(len(text)))

    counter = TokenCounter(Tok())
    request = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": "q", "reasoning": "ignored"},
        {"role": "assistant", "content": "a", "reasoning": "rr"},
        {"role": "assistant", "content": "b", "reasoning_content": "ss"},
        {"role": "assistant", "content": "c", "reasoning": "tt", "reasoning_content": "xx"},
        {"role": "user", "content": "d"}])
    assert counter.count(request) == len("q" + "rra" + "ssb" + "ttc" + "d")
    user, a, b, c, d = seen[-1]
    assert "reasoning" not in user and "reasoning_content" not in user
    assert a["reasoning"] == a["reasoning_content"] == "rr" and b["reasoning"] == b["reasoning_content"] == "ss"
    assert c["reasoning"] == c["reasoning_content"] == "tt"  # `reasoning` wins, as in vLLM
    assert d == {"role": "user", "content": "d"}


def test_a_tenant_with_workers_of_its_own_never_spills_onto_shared_ones():
    from dpd.router.pools import make_pool

    pool = make_pool("decode", ["http://w0", "http://w1"], owners={"decode-1": "b"})
    for w in pool.workers:
        w.record_probe(True)
    assert [w.name for w in pool.available("b")] == ["decode-1"]
    assert [w.name for w in pool.available("a")] == [w.name for w in pool.available(None)] == ["decode-0"]
    pool.workers[1].is_draining = True
    assert pool.available("b") == [] and not pool.is_available("b")  # a 503 for b, not decode-0

"""Mid-stream migration (router/migrate.py): the continuation's body, usage merging, and the flow
against scripted workers that speak vLLM's ``return_token_ids`` stream and break on cue.

Component tests of dpd's logic; the end-to-end check with real vLLM workers killed mid-stream is
in tests/integration (resilience.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dpd.router.migrate import continuation_body, merged_usage, why_not_migratable
from dpd.router.outcomes import STREAM_BREAKS, StreamBreak
from tests.unit.test_router_flow import metric

PROMPT_IDS = [11, 12, 13]
ANSWER = [101, 102, 103, 104, 105, 106]  # the model's greedy answer to PROMPT_IDS, one token per id


# -- the continuation body ----------------------------------------------------------------------
def test_completions_continuation_carries_sampling_and_reduces_max_tokens():
    body = {"model": "m", "prompt": "hi", "max_tokens": 10, "temperature": 0, "seed": 7, "stop": ["\n"],
            "min_tokens": 3, "stream": False, "user": "u"}
    out = continuation_body(body, "/v1/completions", PROMPT_IDS, [101, 102], max_model_len=100)
    assert out["prompt"] == [11, 12, 13, 101, 102]
    assert (out["max_tokens"], out["min_tokens"]) == (8, 1)
    assert (out["temperature"], out["seed"], out["stop"], out["user"]) == (0, 7, ["\n"], "u")
    assert out["stream"] is True and out["return_token_ids"] is True and out["stream_options"] == {"include_usage": True}


def test_a_tenants_cache_salt_goes_with_the_continuation():
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "cache_salt": "tenant-a-salt"}
    assert continuation_body(body, "/v1/completions", PROMPT_IDS, [101], max_model_len=100)["cache_salt"] == "tenant-a-salt"


def test_completions_without_max_tokens_continue_to_the_default_16():
    out = continuation_body({"model": "m", "prompt": "hi"}, "/v1/completions", PROMPT_IDS, [1] * 5, max_model_len=100)
    assert out["max_tokens"] == 11


def test_chat_continuation_is_a_completion_of_the_templated_ids():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 6,
            "stream_options": {"include_usage": False, "continuous_usage_stats": True}, "stream": True}
    out = continuation_body(body, "/v1/chat/completions", PROMPT_IDS, [101], max_model_len=100)
    assert "messages" not in out and out["prompt"] == [11, 12, 13, 101] and out["max_tokens"] == 5
    assert out["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_chat_without_a_cap_continues_to_the_end_of_the_context():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    out = continuation_body(body, "/v1/chat/completions", PROMPT_IDS, [101, 102], max_model_len=100)
    assert out["max_tokens"] == 95


def test_usage_counts_the_prompt_once_and_every_generated_token():
    usage = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert merged_usage(usage, num_prompt_tokens=3, num_tokens_before=2) == {
        "prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


@pytest.mark.parametrize("body, why", [
    ({"logprobs": 2}, "logprobs"), ({"logprobs": True, "top_logprobs": 1}, "logprobs"), ({"echo": True}, "echo"),
    ({"logprobs": 0}, "logprobs"),  # completions: 0 still returns the sampled token's logprob
    ({"logprobs": False}, None), ({"logprobs": None}, None), ({"temperature": 1.0, "seed": 3}, None),
])
def test_what_cannot_be_continued(body, why):
    assert why_not_migratable(body) == why


def test_every_stream_break_has_a_rule():
    assert set(STREAM_BREAKS) == set(StreamBreak)


# -- the flow ------------------------------------------------------------------------------------
class TokenWorker:
    """Greedy-deterministic worker: the answer to a prompt of ids is the next ids of ANSWER, one per
    chunk, with vLLM's ``return_token_ids`` fields. ``break_after`` tokens then it fails (``how``)."""

    def __init__(self, *, break_after: int | None = None, how: str = "reset", drop_after_finish: bool = False):
        self.break_after = break_after
        self.how = how
        self.drop_after_finish = drop_after_finish  # the connection drops after the finish chunk, before usage
        self.bodies: list[dict[str, Any]] = []
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.serve)
        app.router.add_post("/v1/chat/completions", self.serve)
        self.server = TestServer(app)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def serve(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        is_chat = request.path.endswith("chat/completions")
        prompt = PROMPT_IDS if is_chat or isinstance(body["prompt"], str) else body["prompt"]
        done = len(prompt) - len(PROMPT_IDS)  # a continuation's prompt holds what was generated
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        ids = ANSWER[done: done + max_tokens]
        with_ids = body.get("return_token_ids")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        head = {"id": "chatcmpl-1" if is_chat else "cmpl-1", "created": 1, "model": "m",
                "object": "chat.completion.chunk" if is_chat else "text_completion"}
        if is_chat:
            await send({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                        **({"prompt_token_ids": prompt} if with_ids else {})})
        for i, token in enumerate(ids):
            if self.break_after is not None and i == self.break_after:
                if self.how == "reset":
                    await asyncio.sleep(0.1)  # what was written reaches the router first
                    request.transport.close()  # type: ignore[union-attr]  # the worker died
                    return resp
                if self.how == "error":
                    await send({"error": {"message": "EngineDeadError", "code": 500}})
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                if self.how == "hang":
                    await asyncio.sleep(30)
                return resp  # "truncate": the stream just ends
            finish = "length" if i == len(ids) - 1 else None
            text = f"t{token} "
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            choice.update({"delta": {"content": text}} if is_chat else {"text": text})
            if with_ids:
                choice["token_ids"] = [token]
                if i == 0 and not is_chat:
                    choice["prompt_token_ids"] = prompt
            await send({**head, "choices": [choice]})
        if self.drop_after_finish:
            await asyncio.sleep(0.1)
            request.transport.close()  # type: ignore[union-attr]
            return resp
        await send({**head, "choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                                     "total_tokens": len(prompt) + len(ids)}})
        await resp.write(b"data: [DONE]\n\n")
        return resp


def events(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def completion_text(evts: list[dict[str, Any]], is_chat: bool = False) -> str:
    parts = []
    for e in evts:
        for c in e.get("choices") or ():
            parts.append((c.get("delta") or {}).get("content") or "" if is_chat else c.get("text") or "")
    return "".join(parts)


EXPECTED = "".join(f"t{t} " for t in ANSWER)
STREAM = {"model": "m", "prompt": "one two three", "max_tokens": 6, "stream": True,
          "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("how, reason", [("reset", "stream_broken"), ("truncate", "stream_truncated"),
                                         ("error", "worker_error_event")])
async def test_a_stream_broken_mid_way_continues_on_the_other_decoder(make_router, how, reason):
    broken, other = TokenWorker(break_after=2, how=how), TokenWorker()
    client = await make_router(None, [broken, other])
    client.router.decode.workers[1].num_in_flight += 1  # the first pick is the worker that breaks
    resp = await client.post("/v1/completions", json=STREAM)
    client.router.decode.workers[1].num_in_flight -= 1
    assert resp.status_code == 200
    evts = events(resp.text)
    assert resp.text.count("data: [DONE]") == 1 and not any("error" in e for e in evts)
    assert completion_text(evts) == EXPECTED
    assert evts[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert {e["id"] for e in evts} == {"cmpl-1"} and not any("token_ids" in json.dumps(e) for e in evts)
    finals = [e for e in evts if any(c.get("finish_reason") for c in e["choices"])]
    assert finals[0]["dpd_migrations"] == [{"from": "decode-0", "to": "decode-1", "reason": reason, "after_tokens": 2}]
    cont = other.bodies[0]
    assert cont["prompt"] == [*PROMPT_IDS, 101, 102] and cont["max_tokens"] == 4 and cont["return_token_ids"]
    text = (await client.get("/metrics")).text
    assert metric(text, f'dpd_migrations_total{{outcome="migrated",reason="{reason}"}}') == 1
    assert client.router.decode.workers[0].breaker.num_consecutive_failures == 1


async def test_chat_streaming_client_keeps_its_format_across_the_move(make_router):
    broken, other = TokenWorker(break_after=3), TokenWorker()
    client = await make_router(None, [broken, other])
    client.router.decode.workers[1].num_in_flight += 1
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
    resp = await client.post("/v1/chat/completions", json=body)
    client.router.decode.workers[1].num_in_flight -= 1
    evts = events(resp.text)
    assert completion_text(evts, is_chat=True) == EXPECTED
    assert {e["object"] for e in evts} == {"chat.completion.chunk"} and {e["id"] for e in evts} == {"chatcmpl-1"}
    assert not any(e.get("usage") for e in evts)  # the client did not ask for usage
    assert other.bodies[0]["prompt"] == [*PROMPT_IDS, 101, 102, 103] and "messages" not in other.bodies[0]


async def test_non_streaming_client_gets_the_whole_answer_and_a_header(make_router):
    broken, other = TokenWorker(break_after=1), TokenWorker()
    client = await make_router(None, [broken, other])
    client.router.decode.workers[1].num_in_flight += 1
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    resp = await client.post("/v1/chat/completions", json=body)
    client.router.decode.workers[1].num_in_flight -= 1
    assert resp.status_code == 200 and resp.headers["x-dpd-migrated"] == "decode-0>decode-1"
    data = resp.json()
    assert data["choices"][0]["message"]["content"] == EXPECTED and data["choices"][0]["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


async def test_an_idle_stream_past_its_deadline_moves(make_router):
    broken, other = TokenWorker(break_after=2, how="hang"), TokenWorker()
    client = await make_router(None, [broken, other], streamIdleTimeoutS=0.3)
    client.router.decode.workers[1].num_in_flight += 1
    resp = await client.post("/v1/completions", json=STREAM)
    client.router.decode.workers[1].num_in_flight -= 1
    assert completion_text(events(resp.text)) == EXPECTED
    assert events(resp.text)[-2]["dpd_migrations"][0]["reason"] == "stream_idle"


async def test_the_prefill_pool_is_the_last_resort(make_router):
    decoder, prefiller = TokenWorker(break_after=2), TokenWorker()
    client = await make_router(prefiller, decoder, threshold=10_000)  # everything direct, on the decoder
    resp = await client.post("/v1/completions", json=STREAM)
    assert completion_text(events(resp.text)) == EXPECTED
    assert prefiller.bodies[0]["prompt"] == [*PROMPT_IDS, 101, 102]


@pytest.mark.parametrize("extra, spec", [({"logprobs": 1}, {}), ({}, {"migration": {"maxMigrations": 0}})])
async def test_what_cannot_move_ends_with_todays_error_event(make_router, extra, spec):
    from dpd.config.model import MigrationSpec

    spec = {"migration": MigrationSpec(**spec["migration"])} if spec else {}
    broken, other = TokenWorker(break_after=2), TokenWorker()
    client = await make_router(None, [broken, other], **spec)
    client.router.decode.workers[1].num_in_flight += 1
    resp = await client.post("/v1/completions", json={**STREAM, **extra})
    client.router.decode.workers[1].num_in_flight -= 1
    evts = events(resp.text)
    assert resp.text.endswith("data: [DONE]\n\n") and "error" in evts[-1] and "decode-0" in evts[-1]["error"]["message"]
    assert other.bodies == []
    assert ("return_token_ids" in broken.bodies[0]) is not bool(spec)


async def test_every_worker_failing_ends_with_an_error_after_the_limit(make_router):
    workers = [TokenWorker(break_after=1), TokenWorker(break_after=1), TokenWorker(break_after=1)]
    client = await make_router(None, workers)
    resp = await client.post("/v1/completions", json=STREAM)
    evts = events(resp.text)
    assert resp.text.count("data: [DONE]") == 1 and "error" in evts[-1]
    assert sum(len(w.bodies) for w in workers) == 3  # the first and two migrations (maxMigrations 2)


async def test_a_stream_that_breaks_after_its_finish_is_not_continued(make_router):
    """The finish chunk arrived, then the connection dropped before usage: the answer is whole, and
    no token may follow the finish."""
    broken, other = TokenWorker(drop_after_finish=True), TokenWorker()
    client = await make_router(None, [broken, other])
    client.router.decode.workers[1].num_in_flight += 1
    resp = await client.post("/v1/completions", json=STREAM)
    client.router.decode.workers[1].num_in_flight -= 1
    evts = events(resp.text)
    assert completion_text(evts) == EXPECTED and other.bodies == []
    assert sum(1 for e in evts for c in e.get("choices") or () if c.get("finish_reason")) == 1


async def test_a_client_gone_during_a_moves_backoff_gives_its_admission_slot_back(make_router, monkeypatch):
    """The second move waits a backoff first; a client leaving then must not keep the decode slot
    (the fixture checks every gate is empty afterwards)."""
    import dpd.router.migrate as migrate

    monkeypatch.setattr(migrate.random, "uniform", lambda low, high: high)  # the longest backoff: 5 s
    workers = [TokenWorker(break_after=1) for _ in range(3)]
    client = await make_router(None, workers, admission={"decode": {"maxInFlight": 1, "maxQueue": 0}},
                               retry={"backoffBaseS": 5.0, "backoffMaxS": 5.0})
    task = asyncio.create_task(client.post("/v1/completions", json=STREAM))
    await asyncio.sleep(1.0)  # two breaks (~0.1 s each): now in the second move's backoff
    assert sum(len(w.bodies) for w in workers) == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.router.gates["decode"].num_in_flight == 0

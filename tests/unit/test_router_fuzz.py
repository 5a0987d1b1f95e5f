"""Property-based fuzz of the router's request handling against scripted workers: whatever the
body, the answer is a 2xx or a 4xx with an OpenAI-style error, never a 5xx. (The same fuzz
runs against real vLLM workers in tests/integration/resilience.py, with fewer examples.)"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_router_flow import ScriptedWorker

_scalar = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20)
_json = st.recursive(_scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=10)
_fields = {
    "model": st.sampled_from(["m", "", "other"]) | _json,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 10**6), max_size=5) | st.lists(st.text(max_size=5), max_size=3) | _json,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                                "content": st.text(max_size=30) | _json}), max_size=3) | _json,
    "max_tokens": st.integers(-3, 2000) | _json,
    "max_completion_tokens": st.integers(-3, 2000) | _json,
    "temperature": st.floats() | _json,
    "top_p": st.floats() | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": _json}) | _json,
    "stop": st.lists(st.text(max_size=5), max_size=5) | _json,
    "logprobs": _json,
    "n": _json,
    "seed": _json,
    "echo": _json,
    "user": _json,
    "unknown": _json,
}
_bodies = st.fixed_dictionaries({}, optional=_fields).map(json.dumps).map(str.encode)
_raw = st.binary(max_size=200)


_clients: dict[int, object] = {}


async def _client(make_router):
    """One router (prefill + decode workers, threshold 5 tokens) for all examples of a run."""
    if id(make_router) not in _clients:
        _clients.clear()
        _clients[id(make_router)] = await make_router(ScriptedWorker(), ScriptedWorker(), threshold=5)
    return _clients[id(make_router)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=_bodies | _raw, route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
async def test_no_body_makes_the_router_fail(make_router, body, route):
    client = await _client(make_router)
    resp = await client.post(route, content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code < 500, (body, resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert error["message"] and error["type"]

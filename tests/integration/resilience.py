"""Resilience end to end, on the disaggregated endpoint of test_a_disaggregated.py (imported
there, so one endpoint start serves both; this file is not collected on its own).

  * a battery of bad inputs: each a 4xx with an OpenAI-style body, and the router keeps serving
  * a property-based fuzz run (hypothesis) of request bodies: no 5xx
  * 5x the measured capacity offered: 429s with Retry-After, admitted requests within the SLO,
    router memory bounded
  * a soak at ~70% of capacity (DPD_SOAK_S seconds, default 60): 0 errors, RSS growth < 10%
  * kill -9 of the decoder mid-stream and during a long prompt's prefill: the requests streaming
    from it continue on the prefill worker (router/migrate.py) — complete, greedy text equal to an
    uninterrupted run, one [DONE], no error event, usage right — the long request is served whole by
    the prefill worker, as is a request sent while no decoder is up, the prefiller's KV usage
    returns to its baseline within the lease, and requests succeed once the decoder is back
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import statistics
import threading
import time

import psutil
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.helpers import scrape, wait_healthy

MODEL = "smollm2-135m"
PREFILL_URL = "http://127.0.0.1:18100"
DECODE_URL = "http://127.0.0.1:18101"
SHORT = {"model": MODEL, "prompt": "Write one short sentence about rivers.", "max_tokens": 16}

_X = "x" * 10
BAD_INPUTS = [  # (route, body bytes, headers, expected status or None for "any 4xx")
    ("/v1/completions", b"{not json", {}, 400),
    ("/v1/completions", b"\xff\xfe", {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "\xc3\x28"}', {}, 400),  # invalid UTF-8 inside a string
    ("/v1/completions", b"", {}, 400),
    ("/v1/completions", b"[]", {}, 400),
    ("/v1/completions", b"null", {}, 400),
    ("/v1/completions", b'"just a string"', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": -1}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 0}', {}, None),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 100000}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 1e400}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 99999999999999999999999}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": "10"}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2.5}', {}, 400),
    ("/v1/completions", b'{"model": "nope", "prompt": "hi"}', {}, 404),
    ("/v1/completions", b'{"prompt": "hi"}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m"}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": 42}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "bogus": 1}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "stream": "yes"}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "stream": null, "stream_options": 5}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "temperature": "hot"}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "temperature": -3}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "n": 3}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "top_p": 7}', {}, 400),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": [999999999]}', {}, 400),  # out of the vocabulary
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "' + b"a " * 2_500_000 + b'"}', {}, 413),  # 5 MB body
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "' + b"hello " * 9000 + b'"}', {}, 400),  # over-long prompt
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi"}', {"Content-Type": "text/plain"}, None),
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": []}', {}, 400),
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "wizard", "content": "x"}]}', {}, 400),
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"content": "x"}]}', {}, 400),
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user"}]}', {}, 400),
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": "hello"}', {}, 400),
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": 5}]}', {}, 400),
    ("/v1/chat/completions", b'{"model": "smollm2-135m"}', {}, 400),
    ("/v1/chat/completions",
     b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5}', {}, 400),
    ("/v1/nope", b"{}", {}, 404),
    ("/admin/workers/nope/drain", b"{}", {}, 404),
    ("/admin/threshold", b'{"threshold_tokens": "many"}', {"X-Method": "PUT"}, 400),
]


@pytest.mark.parametrize("route, body, headers, status", BAD_INPUTS, ids=[f"bad{i}" for i in range(len(BAD_INPUTS))])
def test_bad_input_battery(endpoint, route, body, headers, status):
    headers = dict(headers)
    method = headers.pop("X-Method", "POST")
    headers.setdefault("Content-Type", "application/json")
    resp = requests.request(method, endpoint.url + route, data=body, headers=headers, timeout=60)
    if status is None:  # either a 4xx or a normal answer, never a 5xx
        assert resp.status_code < 500, resp.text[:300]
        return
    assert resp.status_code == status, resp.text[:300]
    error = resp.json()["error"]
    assert error["message"] and error["type"]


def test_router_still_serves_after_the_battery(endpoint):
    resp = requests.post(endpoint.url + "/v1/completions", json={**SHORT, "temperature": 0}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1, resp.text
    assert scrape(endpoint.url, "dpd_requests_total", outcome="500") == 0


# -- fuzz: arbitrary JSON shaped like a request, sent to the real endpoint ----------------------
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
_fields = {
    "model": st.sampled_from([MODEL, "", "other"]) | _json,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 60000), max_size=5) | _json,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                                "content": st.text(max_size=30) | _json}), max_size=3) | _json,
    "temperature": st.floats(-1, 3) | _json,
    "stream": st.booleans() | _json,
    "stop": st.lists(st.text(max_size=5), max_size=3) | _json,
    "logprobs": st.integers(-1, 30) | _json,
    "n": st.integers(0, 3),
    "seed": st.integers(-2**64, 2**64),
    "unknown_field": _json,
}
# max_tokens always present and small or invalid (never null, which means "up to the context
# length"): a valid request must stay cheap for the real workers.
_max_tokens = st.integers(-3, 4) | st.just(10**12) | st.text(max_size=3) | st.floats(-2, 4) | st.booleans()
_bodies = st.fixed_dictionaries({"max_tokens": _max_tokens}, optional=_fields)


@settings(max_examples=int(os.environ.get("DPD_FUZZ_EXAMPLES", "120")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=_bodies, route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_requests_never_get_a_5xx(endpoint, body, route):
    resp = requests.post(endpoint.url + route, data=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=120)
    assert resp.status_code < 500, (body, resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        assert resp.json()["error"]["message"]


# -- overload and soak ---------------------------------------------------------------------------
def _serve_rss(endpoint) -> int:
    return psutil.Process(endpoint.proc.pid).memory_info().rss


def _one(endpoint, body: dict) -> tuple[int, float, str | None]:
    return _one_traced(endpoint, body)[:3]


def _one_traced(endpoint, body: dict) -> tuple[int, float, str | None, str]:
    """(status, e2e, Retry-After, the router's path [+ fallback reason]) of one request."""
    started = time.monotonic()
    resp = requests.post(endpoint.url + "/v1/completions", json=body, timeout=300)
    path = resp.headers.get("x-dpd-path", "?") + (f"/{resp.headers['x-dpd-fallback']}" if "x-dpd-fallback" in resp.headers else "")
    return resp.status_code, time.monotonic() - started, resp.headers.get("retry-after"), path


def _open_loop(endpoint, rate_rps: float, duration_s: float, make_body, seed: int, one=_one) -> list[tuple]:
    """Poisson arrivals at ``rate_rps`` for ``duration_s``, each request on its own thread."""
    rng = random.Random(seed)
    futures = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=256) as pool:
        started = time.monotonic()
        at = 0.0
        i = 0
        while at < duration_s:
            time.sleep(max(0.0, started + at - time.monotonic()))
            futures.append(pool.submit(one, endpoint, make_body(i)))
            at += rng.expovariate(rate_rps)
            i += 1
        return [f.result() for f in futures]


def _closed_loop_rps(endpoint, make_body, num_threads: int, duration_s: float) -> float:
    done = []
    stop = time.monotonic() + duration_s

    def loop(thread: int) -> None:
        i = thread
        while time.monotonic() < stop:
            status, _, _ = _one(endpoint, make_body(i))
            done.append(status)
            i += num_threads

    threads = [threading.Thread(target=loop, args=(t,)) for t in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(done) == {200}
    return len(done) / duration_s


@pytest.fixture(scope="module")
def soak_mix(make_prompt):
    """The soak's workload: short requests, and one in forty a 1,500-token prompt (disaggregated)."""
    long_prompts = [make_prompt(1500, seed=7000 + i) for i in range(8)]

    def body(i: int) -> dict:
        if i % 40 == 39:
            return {"model": MODEL, "prompt": long_prompts[(i // 40) % len(long_prompts)] + f" #{i}", "max_tokens": 8}
        return {**SHORT, "prompt": f"{SHORT['prompt']} ({i})"}

    return body


@pytest.fixture(scope="module")
def capacity_rps(endpoint) -> float:
    """Closed-loop throughput of short requests at the decode pool's admission limit."""
    return _closed_loop_rps(endpoint, lambda i: SHORT, endpoint.config.spec.pdSpec.router.admission.decode.maxInFlight, 20)


def test_overload_is_shed_with_429_and_admitted_requests_meet_the_slo(endpoint, capacity_rps, capsys):
    slo_s = endpoint.config.spec.pdSpec.router.admission.decode.queueTimeoutS + 10
    rss_before = _serve_rss(endpoint)
    results = _open_loop(endpoint, 5 * capacity_rps, 30, lambda i: SHORT, seed=1)
    rss_after = _serve_rss(endpoint)
    statuses = [s for s, _, _ in results]
    admitted = [e for s, e, _ in results if s == 200]
    shed = [(s, r) for s, _, r in results if s == 429]
    with capsys.disabled():
        print(f"\n[overload] capacity {capacity_rps:.2f} req/s; offered {5 * capacity_rps:.2f} req/s for 30 s: "
              f"{len(results)} requests, {len(admitted)} admitted, {len(shed)} shed (429); admitted e2e "
              f"p50 {statistics.median(admitted):.2f}s max {max(admitted):.2f}s (SLO {slo_s:.0f}s); "
              f"router RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    assert shed and all(r for _, r in shed)
    assert max(admitted) <= slo_s
    assert rss_after < rss_before * 1.10 + 20 * 2**20
    assert scrape(endpoint.url, "dpd_shed_requests_total", pool="decode") >= len(shed)


def test_soak_at_70_percent_of_capacity(endpoint, soak_mix, capsys):
    """~70% of the capacity measured on the soak's own mix (its long prompts load the prefill
    core, which the router and this client share with the workers on 2 cores)."""
    duration_s = float(os.environ.get("DPD_SOAK_S", "60"))
    capacity = _closed_loop_rps(endpoint, soak_mix, endpoint.config.spec.pdSpec.router.admission.decode.maxInFlight, 40)
    rate = 0.7 * capacity
    _open_loop(endpoint, rate, min(10.0, duration_s), soak_mix, seed=2)  # warm-up: let allocator pools settle
    rss_before = _serve_rss(endpoint)
    results = _open_loop(endpoint, rate, duration_s, soak_mix, seed=3, one=_one_traced)
    rss_after = _serve_rss(endpoint)
    errors = [s for s, _, _, _ in results if s != 200]
    e2e = sorted(e for s, e, _, _ in results if s == 200)
    # The tail's make-up (request number: 1 in 40 is a long prompt; path the router took).
    slowest = sorted(((e, i, path) for i, (_, e, _, path) in enumerate(results)), reverse=True)[:5]
    tail = ", ".join(f"#{i} {'long' if i % 40 == 39 else 'short'} {path} {e:.1f}s" for e, i, path in slowest)
    with capsys.disabled():
        print(f"\n[soak] {duration_s:.0f}s at {rate:.2f} req/s (70% of {capacity:.2f}, the mix's capacity): {len(results)} "
              f"requests, {len(errors)} non-200 {sorted(set(errors))}; e2e p50 {e2e[len(e2e) // 2]:.2f}s "
              f"p99 {e2e[int(len(e2e) * 0.99)]:.2f}s; router RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB "
              f"({100 * (rss_after / rss_before - 1):+.1f}%); slowest: {tail}")
    assert not errors
    assert rss_after < rss_before * 1.10


# -- drain ------------------------------------------------------------------------------------------
def _worker_state(endpoint, name: str) -> dict:
    pools = requests.get(endpoint.url + "/admin/workers", timeout=10).json()["pools"]
    return next(w for pool in pools.values() for w in pool["workers"] if w["name"] == name)


def test_drain_and_restart_the_prefill_worker_loses_nothing(endpoint, make_prompt, capsys):
    """A rolling restart: drain waits for the in-flight prefill, the worker restarts, long
    prompts go direct meanwhile, and it takes disaggregated traffic again once healthy."""
    result: dict = {}

    def long_request() -> None:
        body = {"model": MODEL, "prompt": make_prompt(3000, seed=5151), "max_tokens": 4}
        resp = requests.post(endpoint.url + "/v1/completions", json=body, timeout=300)
        result.update(status=resp.status_code, path=resp.headers.get("x-dpd-path"))

    in_flight = threading.Thread(target=long_request)
    in_flight.start()
    deadline = time.monotonic() + 30
    while _worker_state(endpoint, "prefill-0")["in_flight"] == 0:
        assert time.monotonic() < deadline, "the long request never reached the prefill worker"
        time.sleep(0.1)
    drain = requests.post(endpoint.url + "/admin/workers/prefill-0/drain", json={"then": "restart"}, timeout=300).json()
    in_flight.join(timeout=300)
    assert drain["drained"] and drain["then"] == "restart" and drain["waited_s"] > 0, drain
    assert result == {"status": 200, "path": "disaggregated"}  # the drained request finished where it started
    # While it restarts: long prompts are served direct, nothing fails.
    body = {"model": MODEL, "prompt": make_prompt(1500, seed=5152), "max_tokens": 4}
    resp = requests.post(endpoint.url + "/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200 and resp.headers["x-dpd-path"] == "direct"
    assert "prefill-0 drained; restarting" in endpoint.log_tail(200)
    wait_healthy(PREFILL_URL, timeout_s=400)
    deadline = time.monotonic() + 30
    while _worker_state(endpoint, "prefill-0")["draining"] or _worker_state(endpoint, "prefill-0")["breaker"] == "open":
        assert time.monotonic() < deadline, _worker_state(endpoint, "prefill-0")
        time.sleep(1)
    resp = requests.post(endpoint.url + "/v1/completions", json={**body, "prompt": make_prompt(1500, seed=5153)}, timeout=300)
    assert resp.status_code == 200 and resp.headers["x-dpd-path"] == "disaggregated"
    with capsys.disabled():
        print(f"\n[drain] prefill-0 drained after {drain['waited_s']:.1f}s (1 request in flight), restarted, back in service")


# -- kill -9 of the decoder ---------------------------------------------------------------------
def _prefill_kv_usage(endpoint) -> float:
    """The prefiller's KV usage. vLLM updates the gauge (and frees expired leases) only when its
    engine steps, so step it with a one-token request first (with the workers' key, as the router)."""
    requests.post(PREFILL_URL + "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1},
                  headers=endpoint.worker_headers, timeout=60)
    return scrape(PREFILL_URL, "vllm:kv_cache_usage_perc")


def _answer(endpoint, route: str, body: dict, on_event=lambda: None) -> tuple[str, str | None, str | None]:
    """(text, error or None, where it migrated or None); usage checked against the text's tokens."""
    is_chat = route.endswith("chat/completions")
    with requests.post(endpoint.url + route, json=body, stream=body.get("stream", False), timeout=300) as resp:
        if resp.status_code != 200:
            return "", f"HTTP {resp.status_code}: {resp.text[:200]}", None
        if not body.get("stream"):
            data = resp.json()
            assert data["usage"]["completion_tokens"] == body["max_tokens"], data["usage"]
            return data["choices"][0]["message"]["content"], None, resp.headers.get("x-dpd-migrated")
        text, error, moved, num_done, usage = [], None, None, 0, None
        for line in resp.iter_lines():
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                num_done += 1
                continue
            event = json.loads(line[6:])
            on_event()
            if "error" in event:
                error = event["error"]["message"]
            usage = event.get("usage") or usage
            moved = event.get("dpd_migrations") or moved
            for c in event.get("choices") or ():
                text.append((c.get("delta") or {}).get("content") or "" if is_chat else c.get("text") or "")
    assert num_done == 1
    if usage is not None:
        assert usage["completion_tokens"] == body["max_tokens"], usage
    return "".join(text), error, moved and ">".join([moved[0]["from"], *(m["to"] for m in moved)])


def test_kill_decoder_mid_stream_and_after_a_prefill(endpoint, make_prompt, capsys):
    lease_s = endpoint.config.spec.pdSpec.kvTransferSpec.kvLeaseDurationS
    wait_healthy(PREFILL_URL, timeout_s=400)  # a failed test before may have left it restarting
    deadline = time.monotonic() + 30
    while _worker_state(endpoint, "prefill-0")["breaker"] != "closed":  # the long prompt must be disaggregated
        assert time.monotonic() < deadline, _worker_state(endpoint, "prefill-0")
        requests.post(endpoint.url + "/v1/completions", json={**SHORT, "prompt": make_prompt(1500, seed=4240)}, timeout=120)
    baseline = max(_prefill_kv_usage(endpoint), _prefill_kv_usage(endpoint))
    # In flight on the decoder when it dies: two streaming completions, a streaming chat and a
    # non-streaming chat, greedy; each answer is first recorded uninterrupted.
    # 128 tokens: still streaming when the decoder dies on a machine twice as fast as this one's
    # slowest (48 ended before the kill there).
    completion = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 128, "ignore_eos": True,
                  "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name the planets of the solar system."}],
            "max_tokens": 128, "ignore_eos": True, "temperature": 0}
    bodies = {"stream-a": ("/v1/completions", completion), "stream-b": ("/v1/completions", completion),
              "chat-stream": ("/v1/chat/completions", {**chat, "stream": True}),
              "chat": ("/v1/chat/completions", chat)}
    expected = {name: _answer(endpoint, route, body)[0] for name, (route, body) in bodies.items()}
    results: dict[str, tuple] = {}
    num_events: dict[str, int] = {}

    def one(name: str) -> None:
        results[name] = _answer(endpoint, *bodies[name], on_event=lambda: num_events.__setitem__(name, num_events.get(name, 0) + 1))

    threads = [threading.Thread(target=one, args=(name,)) for name in bodies]
    for t in threads:
        t.start()
    long_result: dict = {}

    def long_request() -> None:
        started = time.monotonic()
        body = {"model": MODEL, "prompt": make_prompt(3000, seed=4242), "max_tokens": 8}
        resp = requests.post(endpoint.url + "/v1/completions", json=body, timeout=300)
        long_result.update(status=resp.status_code, body=resp.json(), seconds=time.monotonic() - started,
                           ended_at=time.monotonic(), path=resp.headers.get("x-dpd-path"),
                           workers=resp.headers.get("x-dpd-workers"))

    deadline = time.monotonic() + 60
    while min(num_events.get(n, 0) for n in ("stream-a", "stream-b", "chat-stream")) < 5:
        assert time.monotonic() < deadline, "the streams never started"
        time.sleep(0.05)
    longer = threading.Thread(target=long_request)
    longer.start()
    time.sleep(1.0)  # the long prompt is in its ~5 s prefill hop
    killed_at = time.monotonic()
    os.kill(endpoint.worker_pid("decode-0"), signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    longer.join(timeout=300)
    assert not any(t.is_alive() for t in threads) and not longer.is_alive(), "a request hung after the decoder died"
    errors = {name: r for name, r in results.items() if r[0] != expected[name] or r[1] is not None}
    migrated = {name: r[2] for name, r in results.items() if r[2]}
    with capsys.disabled():
        print(f"\n[kill -9 decoder] {len(results)} requests in flight on it: {len(errors)} client-visible errors or "
              f"wrong answers, {len(migrated)} migrated ({migrated})")
    assert not errors, errors
    assert set(migrated) == set(bodies), migrated  # every one was mid-answer on the dead decoder
    # The long request: prefilled, then no decoder: served whole by the prefill worker (every
    # worker can serve a whole request), not a 5xx and not a hang.
    assert long_result["status"] == 200, long_result
    assert long_result["body"]["usage"]["completion_tokens"] == 8 and long_result["workers"] == "prefill-0", long_result
    # Its KV blocks on the prefiller: held for the lease, then freed. Timed from the request's end
    # (its prefill finished just before): the continuations share the prefiller, so the prefill
    # itself may end well after the kill.
    peak, freed_after = 0.0, None
    prefilled_at = long_result["ended_at"]
    while time.monotonic() - prefilled_at < lease_s + 30:
        usage = _prefill_kv_usage(endpoint)
        peak = max(peak, usage)
        if usage <= baseline and time.monotonic() - killed_at > 2:
            freed_after = time.monotonic() - prefilled_at
            break
        time.sleep(1)
    with capsys.disabled():
        print(f"[kill -9 decoder] long request: "
              f"{long_result['status']} after {long_result['seconds']:.1f}s; prefiller KV usage baseline {baseline:.4f}, "
              f"peak {peak:.4f}, back to baseline {freed_after and round(freed_after, 1)}s after its end (lease {lease_s}s)")
    assert freed_after is not None and freed_after <= lease_s + 30
    # While no decoder is up: the prefill worker serves requests whole (the last resort before a 503).
    resp = requests.post(endpoint.url + "/v1/completions", json=SHORT, timeout=120)
    assert resp.status_code == 200 and resp.headers["x-dpd-workers"] == "prefill-0", (resp.status_code, resp.headers)
    # The launcher restarts the decoder; requests succeed again.
    wait_healthy(DECODE_URL, timeout_s=400)
    deadline = time.monotonic() + 30
    while (resp := requests.post(endpoint.url + "/v1/completions", json=SHORT, timeout=120)).status_code != 200:
        assert time.monotonic() < deadline, resp.text
        time.sleep(1)

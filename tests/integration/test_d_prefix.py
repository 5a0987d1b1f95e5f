"""End to end on `dpd serve --colocated` with prefix-aware routing (router.prefixAware): two real
workers, two tenants sharing both. A session's next turn goes to the worker that served the
last (vLLM's own usage says its prefix was cached there), and another tenant sending the same
prompt gets no cache hit (the router salts each tenant's prompts)."""

from __future__ import annotations

import pytest
import requests

from dpd.launch.child import ServeProcess, write_config
from dpd.router.tenants import hash_key
from tests.integration.helpers import scrape
from tests.integration.test_a_disaggregated import WORKER_ARGS

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("prefix")
    tenants = [{"name": "x", "apiKeySha256": [hash_key("key-x")]}, {"name": "y", "apiKeySha256": [hash_key("key-y")]}]
    config = write_config(
        tmp / "endpoint.yaml", router_port=18020, worker_base_port=18300, side_channel_base_port=15800, worker_args=WORKER_ARGS,
        prefillSpec={"replicas": 0}, decodingSpec={"replicas": 2}, router={"prefixAware": {"enabled": True}},
        spec_overrides={"tenants": tenants},
    )
    serve = ServeProcess(config, "--colocated", log_path=tmp / "serve.log")
    try:
        serve.wait_ready()
        yield serve
    finally:
        assert serve.stop() == []


def ask(endpoint, tenant: str, prompt: str) -> requests.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    resp = requests.post(endpoint.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer key-{tenant}"},
                         timeout=300)
    assert resp.status_code == 200, resp.text
    return resp


def cached_tokens(resp: requests.Response) -> int:
    return (resp.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_a_sessions_next_turn_goes_where_its_prefix_is_cached(endpoint, make_prompt, capsys):
    sessions = {s: make_prompt(700, seed=1400 + s) for s in range(3)}
    first_worker: dict[int, str] = {}
    report = []
    for turn in range(3):
        for s, prompt in sessions.items():  # interleaved: each turn of every session before the next turn
            resp = ask(endpoint, "x", prompt)
            worker, reason = resp.headers["x-dpd-workers"], resp.headers["x-dpd-reason"]
            if turn == 0:
                first_worker[s] = worker
            else:
                assert (worker, reason) == (first_worker[s], "prefix_hit"), (s, turn)
                assert cached_tokens(resp) >= 512, resp.json()["usage"]  # vLLM's own count: the prefix was reused
            report.append((s, turn, worker, reason, resp.json()["usage"]["prompt_tokens"], cached_tokens(resp)))
            sessions[s] = prompt + resp.json()["choices"][0]["text"] + f"\nTurn {turn + 2}: go on, briefly."
    # The index follows the engines' own KV-cache events (router.prefixAware.kvEvents, on by default).
    state = requests.get(endpoint.url + "/admin/workers", timeout=10).json()
    workers = [w for pool in state["pools"].values() for w in pool["workers"]]
    served = {first_worker[s] for s in sessions}
    # Every worker that served a turn reports its blocks from its events (docs/design.md: the events
    # travel on a Unix socket in the run directory; a loopback TCP endpoint never delivered one).
    assert state["routing"]["prefix_index"] in ("events", "mixed"), state["routing"]
    assert all(w["prefix_index"]["source"] == "events" and w["prefix_index"]["blocks"] >= 5
               for w in workers if w["name"] in served), workers
    with capsys.disabled():
        print("\n[prefix] session, turn, worker, reason, prompt tokens, cached tokens:")
        for row in report:
            print("   ", row)
        print(f"[prefix] index: {state['routing']['prefix_index']}; blocks per worker "
              f"{ {w['name']: w['prefix_index']['blocks'] for w in workers} }")


def test_another_tenants_same_prompt_hits_no_cache(endpoint, make_prompt):
    prompt = make_prompt(700, seed=1500)
    ask(endpoint, "x", prompt)
    assert cached_tokens(ask(endpoint, "x", prompt)) > 0  # x's own prefix is reused
    other = ask(endpoint, "y", prompt)
    assert other.headers["x-dpd-reason"] != "prefix_hit" and cached_tokens(other) == 0
    assert cached_tokens(ask(endpoint, "y", prompt)) > 0  # y's cache works for y
    assert scrape(endpoint.url, "dpd_decisions_total", path="direct", reason="prefix_hit") >= 1

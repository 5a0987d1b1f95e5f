"""End to end on `dpd serve --colocated`: the same two workers as independent full servers.

Runs after the disaggregated module (file order), so the greedy output recorded there can be
compared: the disaggregated path must be token-identical to colocated serving.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import requests

from tests.integration.helpers import GREEDY_RECORD, scrape
from dpd.launch.child import ServeProcess, write_config
from tests.integration.test_a_disaggregated import WORKER_ARGS

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"
WORKER_URLS = ("http://127.0.0.1:18200", "http://127.0.0.1:18201")


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("colocated")
    config = write_config(
        tmp / "endpoint.yaml", router_port=18010, worker_base_port=18200, side_channel_base_port=15700, worker_args=WORKER_ARGS
    )
    serve = ServeProcess(config, "--colocated", log_path=tmp / "serve.log")
    try:
        serve.wait_ready()
        yield serve
    finally:
        assert serve.stop() == []


@pytest.fixture(scope="module")
def client(endpoint):
    return openai.OpenAI(base_url=endpoint.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_greedy_output_matches_the_disaggregated_path(client, make_prompt):
    if "prompt" not in GREEDY_RECORD:
        pytest.skip("the disaggregated module did not record its output (run the whole suite)")
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=GREEDY_RECORD["prompt"], max_tokens=24, temperature=0
    )
    assert raw.headers["x-dpd-path"] == "direct"
    assert raw.parse().choices[0].text == GREEDY_RECORD["text"]


def test_every_request_is_direct_and_load_is_spread(endpoint, client, make_prompt):
    before = [scrape(url, "vllm:request_success_total") for url in WORKER_URLS]

    def one(i: int) -> str:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=make_prompt(3000 if i % 2 else 100, seed=700 + i), max_tokens=16
        )
        return raw.headers["x-dpd-path"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(one, range(8)))
    assert set(paths) == {"direct"}
    after = [scrape(url, "vllm:request_success_total") for url in WORKER_URLS]
    assert all(a > b for a, b in zip(after, before)), (before, after)
    assert scrape(endpoint.url, "dpd_decisions_total", path="direct", reason="colocated") >= 8


def test_streaming_chat(endpoint):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "stream": True}
    with requests.post(endpoint.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    assert len(events) >= 3

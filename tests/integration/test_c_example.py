"""The same example file runs locally and renders for a cluster (issue 5's last acceptance).

`examples/minimal.yaml` — the file `dpd render` and the operator take — is served with
`dpd serve`, changed only in where it listens (ports and run directory, so it does not clash
with a developer's own endpoint); a short and a long prompt get answers on their paths, the
same file renders to valid manifests, and Ctrl-C leaves nothing behind.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import requests
import yaml

from dpd.config import load_config
from dpd.launch.child import ServeProcess
from tests.integration.helpers import warm_pair

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "minimal.yaml"


def test_minimal_example_serves_locally_and_renders(tmp_path, make_prompt):
    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["pdSpec"]["router"] = {"port": 18050}
    document["spec"]["pdSpec"]["local"] = {"workerBasePort": 18060, "sideChannelBasePort": 16060, "runDir": str(tmp_path / "run")}
    config = tmp_path / "minimal.yaml"
    config.write_text(yaml.safe_dump(document))

    serve = ServeProcess(config, log_path=tmp_path / "serve.log")
    try:
        serve.wait_ready()
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        threshold = serve.config.spec.pdSpec.routingThreshold
        assert serve.config.spec.pdSpec.routingPolicy == "adaptive"  # the default: any path may serve
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2-135m", messages=[{"role": "user", "content": make_prompt(threshold + 400, seed=1)}], max_tokens=8)
        assert raw.headers["x-dpd-reason"] and raw.parse().choices[0].message.content
        # The static split, switched live: both paths by prompt length (the pair warmed first: its
        # first transfer carries NIXL's handshake — warm_pair).
        assert requests.put(serve.url + "/admin/policy", json={"policy": "threshold"}, timeout=10).status_code == 200
        warm_pair(serve.url, "smollm2-135m", make_prompt(threshold + 400, seed=90))
        for tokens, path in ((100, "direct"), (threshold + 400, "disaggregated")):
            raw = client.chat.completions.with_raw_response.create(
                model="smollm2-135m", messages=[{"role": "user", "content": make_prompt(tokens, seed=tokens)}], max_tokens=8)
            assert raw.headers["x-dpd-path"] == path
            assert raw.parse().choices[0].message.content
        assert requests.get(serve.url + "/health", timeout=5).status_code == 200
    finally:
        survivors = serve.stop()
    assert survivors == [], survivors

    rendered = subprocess.run([sys.executable, "-m", "dpd", "render", str(EXAMPLE)], capture_output=True, text=True, check=True)
    kinds = {doc["kind"] for doc in yaml.safe_load_all(rendered.stdout) if doc}
    assert {"Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget", "ConfigMap"} <= kinds
    # What was served differs from what renders only in where the local endpoint listens.
    served, example = serve.config.model_dump(), load_config(EXAMPLE).model_dump()
    for c in (served, example):
        del c["spec"]["pdSpec"]["local"]
        c["spec"]["pdSpec"]["router"].pop("port")
    assert served == example

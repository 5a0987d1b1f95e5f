"""Helpers of the integration tests: prompt words, metric scraping, waiting."""

from __future__ import annotations

import re
import time

import requests

# Outputs recorded on the disaggregated endpoint, compared on the colocated one.
GREEDY_RECORD: dict[str, str] = {}

WORDS = (
    "river mountain engine quiet harbor lantern copper orbit meadow signal violet canyon ember "
    "garden pixel thunder willow marble falcon crystal summit breeze anchor velvet prism cedar "
    "glacier beacon saffron tundra cobalt meteor orchard quartz raven silver timber walnut zephyr"
).split()


def scrape(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample `name` whose labels include `labels`."""
    text = requests.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def is_healthy(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_healthy(url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout_s}s")
        time.sleep(2)


def warm_pair(url: str, model: str, prompt: str, tries: int = 3) -> list[tuple[str, str | None]]:
    """Send long ``prompt`` (past the threshold) until one goes disaggregated, at most ``tries``
    times; the paths seen. A prefill → decode pair's first KV transfer carries NIXL's handshake,
    which on a busy 2-core machine can outlast even its longer first deadline and fall back
    (docs/pd-stall.md) — served all the same; a test asserting the path warms the pair first."""
    seen: list[tuple[str, str | None]] = []
    for attempt in range(tries):
        resp = requests.post(url + "/v1/completions", timeout=300,
                             json={"model": model, "prompt": f"{attempt} {prompt}", "max_tokens": 2, "temperature": 0})
        assert resp.status_code == 200, resp.text
        seen.append((resp.headers["x-dpd-path"], resp.headers.get("x-dpd-fallback")))
        if seen[-1][0] == "disaggregated":
            break
    assert seen[-1][0] == "disaggregated", seen
    return seen

"""A real Prometheus (Debian's package) scrapes a running P/D endpoint: every query of the shipped
dashboard and every alerting rule evaluates without error, the core ones return data, and the
rule file loads healthy (issue 15).

These steps run on test_a_disaggregated.py's endpoint (imported there, like resilience.py, so
one endpoint start serves both); in a session that includes that module they are skipped here.
Run on its own, this module starts an endpoint of its own, on ports no other test uses.

  1. Prometheus starts in a temporary directory on a free port: 1 s scrapes of the router's
     /metrics, dpd's rule file, 1 s rule evaluation
  2. once it has scraped the router, two waves of short and long prompts (direct and
     disaggregated), scrapes between and after them
  3. every dashboard query (``$__rate_interval`` and ``$job`` as Grafana fills them) and every
     alert expression: no error; goodput, TTFT P99, decisions and queued prefill tokens have data
  4. /api/v1/rules: dpd's three groups, every rule evaluated with health "ok"
  5. Prometheus is stopped, whatever happened (terminate, then kill)
"""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from dpd.launch.child import ServeProcess, write_config
from dpd.observe.alerts import alert_rules, expressions, rule_file
from dpd.observe.dashboard import GOODPUT, expand, queries

pytestmark = pytest.mark.integration

__all__ = ["prometheus", "loaded", "test_every_dashboard_query_and_alert_evaluates_on_a_real_prometheus",
           "test_prometheus_loads_the_rule_groups_healthy"]

SHARED_MODULE = "tests.integration.test_a_disaggregated"
JOB = "dpd-router"
MODEL = "smollm2-135m"
# Run on its own: ports of its own (test_a 18000/18100/15600, test_b 18010/18200/15700, test_d
# 18020/18300/15800, test_c 18050/18060/16060, benchmarks 184xx-189xx).
OWN_PORTS = {"router_port": 18070, "worker_base_port": 18080, "side_channel_base_port": 16080}
LONG_MIN_TOKENS = 600
# What must not only evaluate but return data after the load.
CORE = {
    "goodput": GOODPUT,
    "ttft_p99": next(q for q in queries() if q.startswith("histogram_quantile(0.99") and "dpd_ttft_seconds" in q),
    "decisions": next(q for q in queries() if "dpd_decisions_total" in q),
    "queued_prefill_tokens": next(q for q in queries() if "dpd_worker_queued_prefill_tokens" in q),
}


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen
    log_path: Path

    def query(self, expr: str) -> list[dict]:
        """The instant vector of ``expr`` now; fails the test on any error Prometheus reports."""
        resp = requests.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        body = resp.json()
        assert resp.status_code == 200 and body["status"] == "success", f"{expr}\n→ {body.get('errorType')}: {body.get('error')}"
        assert not body.get("warnings"), f"{expr}\n→ warnings {body['warnings']}"
        return body["data"]["result"]

    def log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(interval_s)


@pytest.fixture(scope="module")
def endpoint(request, tmp_path_factory, model_dir):
    """This module's own endpoint, when test_a_disaggregated.py is not in the session (where
    these steps run on its endpoint instead). Not exported: there, its ``endpoint`` is used."""
    if any(getattr(getattr(item, "module", None), "__name__", "") == SHARED_MODULE for item in request.session.items):
        pytest.skip(f"run on {SHARED_MODULE}'s endpoint (imported there): one endpoint start serves both")
    tmp = tmp_path_factory.mktemp("prometheus-endpoint")
    config = write_config(tmp / "endpoint.yaml", **OWN_PORTS, routingThreshold=512, routingPolicy="threshold")
    serve = ServeProcess(config, log_path=tmp / "serve.log")
    try:
        serve.wait_ready()
        yield serve
    finally:
        serve.stop()


@pytest.fixture(scope="module")
def prometheus(endpoint, tmp_path_factory):
    """Step 1: Debian's prometheus on a free port, scraping the router every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed: `make test-tools` (scripts/install.sh test-tools) installs Debian's package")
    tmp = tmp_path_factory.mktemp("prometheus")
    (tmp / "dpd-alerts.yaml").write_text(rule_file())
    target = endpoint.url.removeprefix("http://")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": ["dpd-alerts.yaml"],
        "scrape_configs": [{"job_name": JOB, "metrics_path": "/metrics", "static_configs": [{"targets": [target]}]}],
    }))
    port = free_port()
    log_path = tmp / "prometheus.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    server = Prometheus(f"http://127.0.0.1:{port}", process, log_path)
    try:
        def ready() -> bool:
            assert process.poll() is None, f"prometheus exited ({process.returncode}):\n{server.log_tail()}"
            try:
                return requests.get(server.url + "/-/ready", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_until(ready, 60, "prometheus to be ready")
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


def complete(endpoint, prompt: str) -> str:
    resp = requests.post(endpoint.url + "/v1/completions", timeout=300,
                         json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-dpd-path"]


@pytest.fixture(scope="module")
def loaded(prometheus, endpoint, make_prompt):
    """Step 2: a short load once Prometheus has the router as a target, in two waves with scrapes
    between, so every counter it touches grows inside the queries' window."""
    wait_until(lambda: prometheus.query(f'up{{job="{JOB}"}} == 1'), 30, "the first scrape of the router")
    long_tokens = max(LONG_MIN_TOKENS, endpoint.config.spec.pdSpec.routingThreshold + 100)  # disaggregated
    started = time.monotonic()
    paths = []
    for wave, (num_short, num_long) in enumerate(((4, 2), (3, 2))):
        prompts = [make_prompt(40, seed=1500 + 10 * wave + i) for i in range(num_short)]
        prompts += [make_prompt(long_tokens, seed=1600 + 10 * wave + i) for i in range(num_long)]
        with ThreadPoolExecutor(max_workers=3) as pool:
            paths += list(pool.map(lambda p: complete(endpoint, p), prompts))
        time.sleep(3)  # three scrapes
    assert {"direct", "disaggregated"} <= set(paths), paths
    return max(60, math.ceil(time.monotonic() - started) + 30)  # a window holding the whole load, in seconds


def test_every_dashboard_query_and_alert_evaluates_on_a_real_prometheus(prometheus, loaded):
    """Step 3."""
    window = f"{loaded}s"
    for expr in queries():
        for job in (JOB, ".*"):  # one router picked, and "All"
            prometheus.query(expand(expr, rate_interval=window, job=job))
    for expr in expressions().values():
        prometheus.query(expr)
    results = {name: prometheus.query(expand(expr, rate_interval=window, job=JOB)) for name, expr in CORE.items()}
    empty = [name for name, result in results.items() if not result]
    assert not empty, f"no data for {empty}:\n{prometheus.log_tail()}"
    values = {name: [float(r["value"][1]) for r in result] for name, result in results.items()}
    assert values["goodput"][0] > 0, values  # the short requests meet the default SLO
    assert sum(values["decisions"]) > 0, values
    # A path with no request inside the window (the fallbacks of an earlier step on a shared
    # endpoint) has a quantile of NaN: only the paths this load used must be finite.
    p99 = {r["metric"]["path"]: float(r["value"][1]) for r in results["ttft_p99"]}
    paths = {path for path, v in p99.items() if math.isfinite(v) and v > 0}
    assert {"direct", "disaggregated"} <= paths, p99
    workers = {r["metric"]["worker"] for r in results["queued_prefill_tokens"]}
    assert len(workers) >= 2, workers  # both workers, idle or not
    print(f"\n[prometheus] {len(queries())} dashboard queries and {len(expressions())} alerts evaluated; "
          f"goodput {values['goodput'][0]:.2f} req/s, TTFT P99 {p99}")


def test_prometheus_loads_the_rule_groups_healthy(prometheus, loaded):
    """Step 4: the rule file as Prometheus itself loads it, each rule evaluated without error."""
    expected = {group["name"]: {rule["alert"] for rule in group["rules"]} for group in alert_rules()}

    def evaluated() -> dict | None:
        groups = requests.get(prometheus.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        return groups if rules and all(rule["health"] != "unknown" for rule in rules) else None

    groups = wait_until(evaluated, 30, "every rule to be evaluated once")
    assert {g["name"]: {r["name"] for r in g["rules"]} for g in groups} == expected
    unhealthy = {r["name"]: r.get("lastError") for g in groups for r in g["rules"] if r["health"] != "ok"}
    assert unhealthy == {}, unhealthy
    states = {r["name"]: r["state"] for g in groups for r in g["rules"]}
    assert states["DpdNoHealthyDecoder"] == "inactive"  # the endpoint is serving

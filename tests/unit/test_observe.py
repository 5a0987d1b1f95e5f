"""The dashboard and the alerts (dpd/observe): built, laid out, reading metrics the router
exports with labels it has; every query and rule parsed by Prometheus's own ``promtool``; the
alerts fire, and stay quiet, on the cases of fixtures/alerts-test.yaml (``promtool test rules``).

Evaluating every query against a live router's metrics is tests/integration/test_e_prometheus.py.
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dpd.cli import main
from dpd.observe.alerts import alert_rules, expressions, rule_file
from dpd.observe.dashboard import PANELS, dashboard, expand, panel_table, queries
from dpd.router.metrics import RouterMetrics

FIXTURES = Path(__file__).parent / "fixtures"
DOC = Path("docs/observability.md")
TABLE = re.compile(r"(<!-- panels:begin -->\n)(.*?)(<!-- panels:end -->)", re.DOTALL)
# What the dashboard must show (issue 15): metric → the panel that shows it.
REQUIRED = {
    "dpd_slo_requests_total": "Goodput", "dpd_ttft_seconds_bucket": "TTFT by path", "dpd_itl_seconds_bucket": "ITL by class",
    "dpd_decisions_total": "Decisions by path and reason", "dpd_fallbacks_total": "Fallbacks and P/D stalls",
    "dpd_pd_stalls_total": "Fallbacks and P/D stalls", "dpd_breaker_state": "Circuit breakers",
    "dpd_admission_queue_depth": "Admission queue", "dpd_shed_requests_total": "Shed (429)",
    "dpd_admission_wait_seconds_bucket": "Admission wait", "dpd_worker_queued_prefill_tokens": "Queued prefill tokens",
    "dpd_worker_queued_prefills": "Queued prefills", "dpd_kv_transfer_seconds_total": "KV transfer time (mean)",
    "dpd_kv_transfers_total": "KV transfer time (mean)", "dpd_kv_transfer_bytes_total": "KV bytes moved",
    "dpd_kv_transfer_failures_total": "KV failures and abandoned KV", "dpd_kv_abandoned_total": "KV failures and abandoned KV",
    "dpd_tenant_requests_total": "Requests by tenant", "dpd_tenant_prompt_tokens_total": "Tokens by tenant",
    "dpd_tenant_output_tokens_total": "Tokens by tenant", "dpd_tenant_rate_limited_total": "Rate limited by tenant",
    "dpd_worker_in_flight": "In flight and streams", "dpd_worker_streams": "In flight and streams",
    "dpd_worker_prefill_tokens_per_second": "Prefill rate", "dpd_worker_healthy": "Worker health",
}


def exported_series() -> dict[str, set[str]]:
    """Every series name the router exports → its labels (``le`` on histogram buckets)."""
    series: dict[str, set[str]] = {}
    for collector in RouterMetrics().registry._collector_to_names:
        name, labels = collector._name, set(collector._labelnames)
        if collector._type == "counter":
            series[f"{name}_total"] = labels
        elif collector._type == "histogram":
            series.update({f"{name}_bucket": labels | {"le"}, f"{name}_sum": labels, f"{name}_count": labels})
        else:
            series[name] = labels
    return series


def read_series(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, the labels an aggregation of it groups by) for each metric ``expr`` reads."""
    found = []
    for match in re.finditer(r"(?:by \(([^)]*)\) \((?:(?:rate|increase)\()?\(?)?\b(dpd_\w+|up)\b", expr):
        found.append((match.group(2), {label.strip() for label in (match.group(1) or "").split(",") if label.strip()}))
    return found


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed: `make test-tools` (scripts/install.sh test-tools) installs Debian's prometheus")
    return path


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_the_dashboard_is_json_with_every_panel_laid_out():
    board = dashboard()
    assert json.loads(json.dumps(board)) == board
    panels = [p for p in board["panels"] if p["type"] != "row"]
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == [row.title for row in PANELS]
    assert [p["title"] for p in panels] == [panel.title for row in PANELS for panel in row.panels]
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids) and 0 not in ids
    cells = set()
    for p in board["panels"]:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, p["title"]
        covered = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not covered & cells, f"{p['title']} overlaps another panel"
        cells |= covered
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["type"] in ("timeseries", "state-timeline") and p["description"] and p["options"]["legend"]["showLegend"]
        assert [t["refId"] for t in p["targets"]] == [chr(ord("A") + i) for i in range(len(p["targets"]))]
    assert [t["expr"] for p in panels for t in p["targets"]] == queries()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["type"] == "query" and variables["job"]["allValue"] == ".*"
    assert "current" not in variables["job"] or not variables["job"]["current"].get("value")
    picked = {v["name"]: v for v in dashboard(job="demo-router")["templating"]["list"]}
    assert picked["job"]["current"]["value"] == "demo-router"


def test_the_breaker_and_health_panels_name_their_states():
    panels = {p["title"]: p for p in dashboard()["panels"]}
    breaker = panels["Circuit breakers"]["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert {k: v["text"] for k, v in breaker.items()} == {"0": "closed", "1": "half-open", "2": "open"}
    health = panels["Worker health"]["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert {k: v["text"] for k, v in health.items()} == {"0": "unhealthy", "1": "healthy"}


def test_every_panel_the_issue_asks_for_is_there():
    read_by: dict[str, str] = {}  # metric → the first panel reading it
    for panel in (panel for row in PANELS for panel in row.panels):
        for metric, _ in (s for q in panel.queries for s in read_series(q.expr)):
            read_by.setdefault(metric, panel.title)
    assert {m: read_by.get(m) for m in REQUIRED} == REQUIRED
    assert 'sum(rate(dpd_slo_requests_total{job=~"$job",slo="all",outcome="met"}[$__rate_interval]))' in queries()
    assert 'histogram_quantile(0.99, sum by (le, path) (rate(dpd_ttft_seconds_bucket{job=~"$job"}[$__rate_interval])))' in queries()


@pytest.mark.parametrize("source, exprs", [("dashboard", queries()), ("alerts", list(expressions().values()))])
def test_every_series_read_is_exported_by_the_router_with_those_labels(source, exprs):
    """A misspelt metric or label would only ever show as an empty panel or a silent alert."""
    exported = exported_series()
    for expr in exprs:
        series = read_series(expr)
        assert series, expr
        for metric, by in series:
            if metric == "up":  # Prometheus's own, per target
                continue
            assert metric in exported, f"{source}: {metric} is not a series the router exports"
            assert by - {"job", "namespace"} <= exported[metric], f"{source}: {metric} has no label(s) {by - exported[metric]}"


def test_every_query_parses(tmp_path):
    """promtool checks PromQL only inside rules: each dashboard query, expanded as Grafana sends
    it, becomes a recording rule of a throwaway rule file."""
    rules = [{"record": f"dpd:dashboard_query_{i}", "expr": expand(q)} for i, q in enumerate(queries())]
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = run_promtool("check", "rules", "queries.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules)} rules found" in checked.stdout


def test_the_rule_file_passes_promtool_check(tmp_path):
    (tmp_path / "dpd-alerts.yaml").write_text(rule_file())
    (tmp_path / "scoped.yaml").write_text(rule_file(0.99, 'job="demo-router",namespace="inference"'))
    checked = run_promtool("check", "rules", "dpd-alerts.yaml", "scoped.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    count = sum(len(group["rules"]) for group in alert_rules())
    assert checked.stdout.count(f"SUCCESS: {count} rules found") == 2


def test_the_alerts_fire_on_their_cases_and_only_those(tmp_path):
    """fixtures/alerts-test.yaml: each alert firing (labels and rendered annotations), and series
    beside it that must not fire it (a healthy endpoint, a recovered one, a first stall that
    increase() alone would miss, old stalls after a Prometheus restart, a one-off burst of 429s)."""
    shutil.copy(FIXTURES / "alerts-test.yaml", tmp_path / "alerts-test.yaml")
    (tmp_path / "dpd-alerts.yaml").write_text(rule_file())
    tested = run_promtool("test", "rules", "alerts-test.yaml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    tested_names = set(re.findall(r"alertname: (\w+)", (FIXTURES / "alerts-test.yaml").read_text()))
    assert tested_names == set(expressions()), "every alert has its promtool cases"


def test_the_rule_file_and_its_target():
    assert yaml.safe_load(rule_file()) == {"groups": alert_rules()}
    assert all(r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
               and r["annotations"]["description"] for g in alert_rules() for r in g["rules"])
    assert ") > 0.05\nand" in expressions(0.95)["DpdSloBudgetBurn"]
    for target in (0, 1, 1.5):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            alert_rules(target)


def test_dpd_dashboard_prints_the_dashboard_or_the_rules(capsys):
    assert main(["dashboard"]) == 0
    assert json.loads(capsys.readouterr().out) == dashboard()
    assert main(["dashboard", "--alerts", "--slo-target", "0.95", "--job", "demo-router"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == {"groups": alert_rules(0.95, 'job="demo-router"')}
    assert main(["dashboard", "--alerts", "--slo-target", "95"]) == 2
    assert "strictly between 0 and 1" in capsys.readouterr().err


def test_the_docs_table_is_the_dashboards():
    text = DOC.read_text()
    if os.environ.get("DPD_UPDATE_GOLDEN"):
        DOC.write_text(TABLE.sub(lambda m: m.group(1) + panel_table() + m.group(3), text))
        text = DOC.read_text()
    assert TABLE.search(text).group(2) == panel_table(), "run with DPD_UPDATE_GOLDEN=1 to regenerate"
    assert all(q in text for q in queries())
    assert all(f"`{name}`" in text for name in expressions()), "every alert is documented"

"""The Grafana dashboard of a dpd endpoint, built as code with grafana-foundation-sdk.

``PANELS`` is the dashboard as data: rows of panels, each a title, a unit and its PromQL
queries. ``dashboard()`` turns it into Grafana's JSON model with the SDK's builders; ``queries()``
lists every query, so the tests evaluate each one on a real Prometheus and docs/observability.md
carries the same table (``panel_table()``).

Every query reads the router's own ``/metrics`` — one Prometheus target per endpoint, KV
transfer figures included (the router re-exports the workers' NIXL counters, kvwatch.py) — and
is filtered by the ``job`` variable, so one Prometheus may watch several endpoints. Queries use
Grafana's ``$__rate_interval``; ``expand()`` substitutes it (and ``$job``) for a plain PromQL
query, as Grafana does before sending one.

NOTE: attainment is ``(met or 0 * judged) / judged``, not ``met / judged``: a counter series
exists only once it was first incremented, so while no request of a path has met its SLO the
plain ratio would be empty — a blank panel exactly when it matters — instead of 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as builders
from grafana_foundation_sdk.builders import prometheus, statetimeline, timeseries
from grafana_foundation_sdk.cog import variants
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as models

DEFAULT_UID = "dpd"
DEFAULT_TITLE = "dpd: disaggregated prefill/decode"
RATE = "$__rate_interval"
JOB = 'job=~"$job"'
DATASOURCE = models.DataSourceRef(type_val="prometheus", uid="${datasource}")
GRID_WIDTH = 24
PANEL_HEIGHT = 8


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: Literal["timeseries", "states"] = "timeseries"
    width: int = 12
    # kind "states": the value → (text, colour) a state timeline shows.
    states: tuple[tuple[int, str, str], ...] = ()


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def sel(metric: str, matchers: str = "") -> str:
    """``metric`` of the dashboard's job(s), with extra label ``matchers``."""
    return f"{metric}{{{JOB}{',' + matchers if matchers else ''}}}"


def rate(metric: str, by: str, matchers: str = "") -> str:
    return f"sum by ({by}) (rate({sel(metric, matchers)}[{RATE}]))"


def gauge(metric: str, by: str) -> str:
    return f"sum by ({by}) ({sel(metric)})"


def quantile(q: float, histogram: str, by: str) -> str:
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', 'le, ' + by)})"


def attainment(by: str, slo: str = 'slo="all"') -> str:
    judged = rate("dpd_slo_requests_total", by, slo)
    met = rate("dpd_slo_requests_total", by, f'{slo},outcome="met"' if slo else 'outcome="met"')
    return f"({met} or 0 * {judged}) / {judged}"


GOODPUT = "sum(rate(" + sel("dpd_slo_requests_total", 'slo="all",outcome="met"') + f"[{RATE}]))"
BREAKER_STATES = ((0, "closed", "green"), (1, "half-open", "yellow"), (2, "open", "red"))
HEALTH_STATES = ((0, "unhealthy", "red"), (1, "healthy", "green"))

PANELS: tuple[Row, ...] = (
    Row("Goodput and SLOs", (
        Panel("Goodput", "Requests per second that met every target of their SLO class (router.slo): "
              "dpd_slo_requests_total{slo=\"all\",outcome=\"met\"}.", "reqps", (
                  Query(GOODPUT, "goodput"),
                  Query(rate("dpd_slo_requests_total", "path", 'slo="all",outcome="met"'), "{{path}}"))),
        Panel("SLO attainment by target", "Share of judged requests meeting the TTFT target, the TPOT target, and both "
              "(all).", "percentunit", (Query(attainment("slo", ""), "{{slo}}"),)),
        Panel("SLO attainment by path", "Share of judged requests meeting both targets, per path.", "percentunit",
              (Query(attainment("path"), "{{path}}"),)),
        Panel("SLO attainment by class", "Share of judged requests meeting both targets, per SLO class "
              "(prompt-length band).", "percentunit", (Query(attainment("class"), "{{class}}"),)),
    )),
    Row("Latency", (
        Panel("TTFT by path", "Time to first token at the router, P50/P95/P99 per path.", "s", tuple(
            Query(quantile(q, "dpd_ttft_seconds", "path"), f"p{round(q * 100)} {{{{path}}}}") for q in (0.5, 0.95, 0.99))),
        Panel("ITL by class", "Inter-token latency (one gap per streamed chunk), P50/P99 per SLO class.", "s", tuple(
            Query(quantile(q, "dpd_itl_seconds", "class"), f"p{round(q * 100)} {{{{class}}}}") for q in (0.5, 0.99))),
    )),
    Row("Routing", (
        Panel("Decisions by path and reason", "What the decider chose, and why (dpd_decisions_total).", "reqps",
              (Query(rate("dpd_decisions_total", "path, reason"), "{{path}} · {{reason}}"),)),
        Panel("Fallbacks and P/D stalls", "Disaggregated requests served direct instead, by why; decode hops whose first "
              "token missed decodeFirstTokenTimeoutS (the NIXL stall), by worker pair.", "reqps", (
                  Query(rate("dpd_fallbacks_total", "reason"), "fallback · {{reason}}"),
                  Query(rate("dpd_pd_stalls_total", "prefiller, decoder"), "stall · {{prefiller}} → {{decoder}}"))),
        Panel("Circuit breakers", "Each worker's breaker and each pool's own (worker \"*\"): closed, half-open, open.",
              "none", (Query(f"max by (pool, worker) ({sel('dpd_breaker_state')})", "{{pool}}/{{worker}}"),),
              kind="states", width=24, states=BREAKER_STATES),
    )),
    Row("Admission", (
        Panel("Admission queue", "Requests waiting for an admission slot, per pool.", "short",
              (Query(gauge("dpd_admission_queue_depth", "pool"), "{{pool}}"),), width=8),
        Panel("Shed (429)", "Requests refused by admission control, by pool and why.", "reqps",
              (Query(rate("dpd_shed_requests_total", "pool, reason"), "{{pool}} · {{reason}}"),), width=8),
        Panel("Admission wait", "Time admitted requests waited in the queue, P50/P99 per pool.", "s", tuple(
            Query(quantile(q, "dpd_admission_wait_seconds", "pool"), f"p{round(q * 100)} {{{{pool}}}}") for q in (0.5, 0.99)),
              width=8),
    )),
    Row("Prefill queue", (
        Panel("Queued prefill tokens", "Prompt tokens sent to each worker whose prefill has not finished (the router's "
              "view of the queue).", "short",
              (Query(gauge("dpd_worker_queued_prefill_tokens", "pool, worker"), "{{pool}}/{{worker}}"),)),
        Panel("Queued prefills", "Requests waiting for their prefill, per worker.", "short",
              (Query(gauge("dpd_worker_queued_prefills", "pool, worker"), "{{pool}}/{{worker}}"),)),
    )),
    Row("KV transfer", (
        Panel("KV transfer time (mean)", "Mean duration of a KV transfer per worker, as its engine measured it "
              "(vllm:nixl_xfer_time_seconds, re-exported by the router).", "s",
              (Query(f"{rate('dpd_kv_transfer_seconds_total', 'worker')} / {rate('dpd_kv_transfers_total', 'worker')}",
                     "{{worker}}"),), width=8),
        Panel("KV bytes moved", "KV bytes transferred per second per worker (vllm:nixl_bytes_transferred).", "Bps",
              (Query(rate("dpd_kv_transfer_bytes_total", "worker"), "{{worker}}"),), width=8),
        Panel("KV failures and abandoned KV", "Transfers an engine counted as lost, by kind; prefills whose KV no "
              "decode hop took, by why.", "ops", (
                  Query(rate("dpd_kv_transfer_failures_total", "pool, worker, kind"), "{{worker}} · {{kind}}"),
                  Query(rate("dpd_kv_abandoned_total", "prefiller, reason"), "abandoned · {{prefiller}} · {{reason}}")),
              width=8),
    )),
    Row("Tenants", (
        Panel("Requests by tenant", "Requests per tenant by outcome (ok or the HTTP status).", "reqps",
              (Query(rate("dpd_tenant_requests_total", "tenant, outcome"), "{{tenant}} · {{outcome}}"),), width=8),
        Panel("Tokens by tenant", "Prompt tokens admitted and tokens generated per second, per tenant.", "short", (
            Query(rate("dpd_tenant_prompt_tokens_total", "tenant"), "{{tenant}} prompt"),
            Query(rate("dpd_tenant_output_tokens_total", "tenant"), "{{tenant}} output")), width=8),
        Panel("Rate limited by tenant", "Requests refused by a tenant's token bucket, by which limit.", "reqps",
              (Query(rate("dpd_tenant_rate_limited_total", "tenant, limit"), "{{tenant}} · {{limit}}"),), width=8),
    )),
    Row("Workers", (
        Panel("In flight and streams", "Outstanding requests and decoding streams per worker.", "short", (
            Query(gauge("dpd_worker_in_flight", "pool, worker"), "in flight · {{worker}}"),
            Query(gauge("dpd_worker_streams", "pool, worker"), "streams · {{worker}}")), width=8),
        Panel("Prefill rate", "Measured prefill rate per worker (EWMA).", "short",
              (Query(gauge("dpd_worker_prefill_tokens_per_second", "pool, worker"), "{{pool}}/{{worker}}"),), width=8),
        Panel("Worker health", "1 while the worker passes the router's health checks.", "none",
              (Query(f"min by (pool, worker) ({sel('dpd_worker_healthy')})", "{{pool}}/{{worker}}"),),
              kind="states", width=8, states=HEALTH_STATES),
    )),
)


def queries() -> list[str]:
    """Every PromQL query of the dashboard, in panel order (Grafana variables unexpanded)."""
    return [q.expr for row in PANELS for panel in row.panels for q in panel.queries]


def expand(expr: str, rate_interval: str = "5m", job: str = ".*") -> str:
    """``expr`` as Grafana sends it: ``$__rate_interval`` and ``$job`` substituted."""
    return expr.replace(RATE, rate_interval).replace("$job", job)


def _targets(panel: Panel) -> list[Builder[variants.Dataquery]]:
    return [prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
            for i, q in enumerate(panel.queries)]


def _panel(panel: Panel, panel_id: int) -> timeseries.Panel | statetimeline.Panel:
    legend = common_builders.VizLegendOptions().show_legend(True).display_mode(common.LegendDisplayMode.LIST) \
        .placement(common.LegendPlacement.BOTTOM)
    built: timeseries.Panel | statetimeline.Panel
    if panel.kind == "states":
        mapping = models.ValueMap({str(value): models.ValueMappingResult(text=text, color=colour, index=value)
                                   for value, text, colour in panel.states})
        built = statetimeline.Panel().mappings([mapping]).legend(legend).merge_values(True) \
            .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.SINGLE))
    else:
        built = timeseries.Panel().legend(legend).fill_opacity(10).line_width(1) \
            .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING))
        if panel.unit == "percentunit":
            built = built.min(0).max(1)
    return built.id(panel_id).title(panel.title).description(panel.description).unit(panel.unit) \
        .datasource(DATASOURCE).targets(_targets(panel)).span(panel.width).height(PANEL_HEIGHT)


def _variables(job: str | None) -> list[Any]:
    datasource = builders.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
    router = builders.QueryVariable("job").label("Router job").datasource(DATASOURCE) \
        .query("label_values(dpd_worker_healthy, job)").refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED) \
        .sort(models.VariableSort.ALPHABETICAL_ASC).multi(True).include_all(True).all_value(".*")
    if job is not None:  # a rendered endpoint's dashboard opens on its own router
        router = router.current(models.VariableOption(selected=True, text=job, value=job))
    return [datasource, router]


def dashboard(uid: str = DEFAULT_UID, title: str = DEFAULT_TITLE, job: str | None = None) -> dict[str, Any]:
    """Grafana's JSON model of the dashboard (import it, or provision it); ``job`` preselects a
    router's Prometheus job (all jobs otherwise)."""
    board = builders.Dashboard(title).uid(uid).tags(["dpd", "llm-serving"]).refresh("30s").time("now-1h", "now") \
        .timezone("browser").tooltip(models.DashboardCursorSync.CROSSHAIR).variables(_variables(job)) \
        .description("What dpd does for its endpoint: goodput under the SLOs, latency per path and class, routing "
                     "decisions, breakers, admission, the prefill queue, KV transfers, tenants and workers.")
    panel_id = 1
    for row in PANELS:
        board = board.with_row(builders.Row(row.title).id(panel_id))
        panel_id += 1
        for panel in row.panels:
            board = board.with_panel(_panel(panel, panel_id))
            panel_id += 1
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def dashboard_json(uid: str = DEFAULT_UID, title: str = DEFAULT_TITLE, job: str | None = None) -> str:
    return json.dumps(dashboard(uid, title, job), indent=2, sort_keys=True) + "\n"


def panel_table() -> str:
    """The Markdown table of docs/observability.md: every panel and its queries."""
    lines = ["| row | panel | unit | queries |", "|---|---|---|---|"]
    for row in PANELS:
        for panel in row.panels:
            shown = "<br>".join(f"`{q.expr}`" for q in panel.queries)  # PromQL here has no "|"
            lines.append(f"| {row.title} | {panel.title} | {panel.unit} | {shown} |")
    return "\n".join(lines) + "\n"

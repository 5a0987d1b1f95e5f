"""The Prometheus alerting rules of a dpd endpoint, as code.

``alert_rules()`` returns the rule groups (the ``groups`` of a Prometheus rule file, and the
``spec`` of a PrometheusRule); ``rule_file()`` the file itself. Every rule reads the router's
``/metrics`` and groups by ``job, namespace``, so each endpoint alerts on its own; ``scope``
(label matchers) narrows every rule to one endpoint's router, as a rendered PrometheusRule does.

- **SLO burn**: the share of requests missing their SLO (``dpd_slo_requests_total``,
  ``slo="all"``) is above the error budget (1 − target) over both 1 h and 5 min — the
  multi-window burn-rate form: the long window makes the alert significant, the short one
  makes it stop as soon as the endpoint recovers.
- **Breakers**: a prefill breaker (a worker's, or the pool's own, ``worker="*"``) open for 1 min
  means long prompts are served direct; a decoder's means one fewer decoder.
- **P/D stalls, KV transfer failures**: any in the last 10 min.
- **Workers**: one unhealthy for 2 min; no healthy decoder at all for 1 min.
- **Shedding**: admission refusing requests (429) for 5 min running.

NOTE: "grew in the last 10 min" is ``increase(...) > 0`` *or* a series that has appeared in that
window (with its target scraped before, so a restarted Prometheus does not count old stalls as
new). ``increase()`` alone misses a counter's first increment: the router creates a labelled
series at 1, and the first stall between two workers is the one an operator most needs to see.
"""

from __future__ import annotations

from typing import Any

import yaml

DEFAULT_SLO_TARGET = 0.9
ENDPOINT = "job, namespace"  # what one endpoint's series share (namespace: on a cluster)
SLO_WINDOWS = ("1h", "5m")
RECENT = "10m"


def sel(metric: str, scope: str, matchers: str = "") -> str:
    """``metric`` with label ``matchers``, within ``scope`` (matchers too; "" = every endpoint)."""
    both = ",".join(m for m in (scope, matchers) if m)
    return f"{metric}{{{both}}}" if both else metric


def missed_ratio(window: str, scope: str = "") -> str:
    """The share of judged requests that missed their SLO over ``window``, per endpoint."""
    missed, judged = (f"sum by ({ENDPOINT}) (rate({sel('dpd_slo_requests_total', scope, matchers)}[{window}]))"
                      for matchers in ('slo="all",outcome="missed"', 'slo="all"'))
    return f"{missed}\n  /\n{judged}"


def grew(metric: str, by: str, scope: str = "", window: str = RECENT) -> str:
    """The series of counter ``metric`` that grew within ``window``, summed ``by`` labels."""
    series = sel(metric, scope)
    appeared = f"({series} unless {series} offset {window}) and on (job, instance) ({sel('up', scope)} offset {window} == 1)"
    return f"sum by ({by}) (increase({series}[{window}])) > 0\nor\nsum by ({by}) ({appeared}) > 0"


def _alert(name: str, expr: str, severity: str, summary: str, description: str, for_: str | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": name, "expr": expr}
    if for_:
        rule["for"] = for_
    rule["labels"] = {"severity": severity}
    rule["annotations"] = {"summary": summary, "description": description}
    return rule


def alert_rules(slo_target: float = DEFAULT_SLO_TARGET, scope: str = "") -> list[dict[str, Any]]:
    """The rule groups; ``slo_target`` is the share of requests that must meet their SLO, and
    ``scope`` label matchers that pick one endpoint's series (``job="demo-router"``; "": every
    endpoint the Prometheus scrapes)."""
    if not 0 < slo_target < 1:
        raise ValueError(f"the SLO target is a share of requests, strictly between 0 and 1, not {slo_target}")
    budget = round(1 - slo_target, 6)
    long_window, short_window = SLO_WINDOWS
    where = "{{ $labels.job }}"
    prefill, not_prefill, decode = 'pool="prefill"', 'pool!="prefill"', 'pool="decode"'
    slo = [_alert(
        "DpdSloBudgetBurn",
        f"(\n{missed_ratio(long_window, scope)}\n) > {budget}\nand\n(\n{missed_ratio(short_window, scope)}\n) > {budget}",
        "critical", f"{where}: more than {budget:.0%} of requests miss their SLO",
        f"{{{{ $value | humanizePercentage }}}} of the requests judged by router.slo missed a target over the last "
        f"{long_window}, and still more than {budget:.0%} over the last {short_window} (target: {slo_target:.0%} "
        "meet it). The dashboard's SLO rows say which path and class.",
    )]
    serving = [
        _alert("DpdPrefillBreakerOpen", f"max by ({ENDPOINT}, pool, worker) ({sel('dpd_breaker_state', scope, prefill)}) == 2",
               "warning", f"{where}: prefill breaker {{{{ $labels.worker }}}} is open",
               "The circuit breaker of prefill worker {{ $labels.worker }} (\"*\": the prefill pool's own) has been open "
               "for 1 minute: long prompts are served without disaggregation, on the decoders.", "1m"),
        _alert("DpdDecoderBreakerOpen", f"max by ({ENDPOINT}, pool, worker) ({sel('dpd_breaker_state', scope, not_prefill)}) == 2",
               "warning", f"{where}: breaker of {{{{ $labels.pool }}}}/{{{{ $labels.worker }}}} is open",
               "The circuit breaker of {{ $labels.pool }} worker {{ $labels.worker }} has been open for 1 minute: it gets "
               "no requests.", "1m"),
        _alert("DpdPdStalls", grew("dpd_pd_stalls_total", f"{ENDPOINT}, prefiller, decoder", scope),
               "warning", f"{where}: P/D stalls from {{{{ $labels.prefiller }}}} to {{{{ $labels.decoder }}}}",
               f"Decode hops from {{{{ $labels.prefiller }}}} to {{{{ $labels.decoder }}}} missed "
               f"decodeFirstTokenTimeoutS in the last {RECENT} (the NIXL stall, docs/pd-stall.md); each was served again "
               "on the direct path.", None),
        _alert("DpdKvTransferFailures", grew("dpd_kv_transfer_failures_total", f"{ENDPOINT}, pool, worker, kind", scope),
               "warning", f"{where}: KV transfers lost on {{{{ $labels.worker }}}} ({{{{ $labels.kind }}}})",
               f"Worker {{{{ $labels.worker }}}}'s engine counted KV transfers as lost ({{{{ $labels.kind }}}}) in the "
               f"last {RECENT}: a failed pull is recomputed on the decoder, an expired lease frees the prefiller's blocks.",
               None),
    ]
    capacity = [
        _alert("DpdWorkerUnhealthy", f"min by ({ENDPOINT}, pool, worker) ({sel('dpd_worker_healthy', scope)}) == 0",
               "warning", f"{where}: worker {{{{ $labels.pool }}}}/{{{{ $labels.worker }}}} is unhealthy",
               "The router's health checks of {{ $labels.pool }} worker {{ $labels.worker }} have failed for 2 minutes.",
               "2m"),
        _alert("DpdNoHealthyDecoder", f"max by ({ENDPOINT}) ({sel('dpd_worker_healthy', scope, decode)}) == 0",
               "critical", f"{where}: no healthy decoder",
               "Every decode worker has failed the router's health checks for 1 minute: requests run whole on the "
               "prefill pool, unsplit (503 if it is down too).", "1m"),
        _alert("DpdAdmissionShedding", f"sum by ({ENDPOINT}, pool, reason) (rate({sel('dpd_shed_requests_total', scope)}[5m])) > 0",
               "warning", f"{where}: admission is shedding {{{{ $labels.pool }}}} requests",
               "Admission control has refused {{ $labels.pool }} requests with 429 ({{ $labels.reason }}) for 5 minutes: "
               "{{ $value | humanize }} requests/s. The pool is short of capacity for the offered load.", "5m"),
    ]
    return [{"name": "dpd-slo", "rules": slo}, {"name": "dpd-serving", "rules": serving},
            {"name": "dpd-capacity", "rules": capacity}]


def expressions(slo_target: float = DEFAULT_SLO_TARGET, scope: str = "") -> dict[str, str]:
    """Every alert's expression by name (for the tests that evaluate them)."""
    return {rule["alert"]: rule["expr"] for group in alert_rules(slo_target, scope) for rule in group["rules"]}


class _Dumper(yaml.SafeDumper):
    """Multi-line expressions as ``|`` blocks, as rule files are written by hand."""


_Dumper.add_representer(
    str, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def rule_file(slo_target: float = DEFAULT_SLO_TARGET, scope: str = "") -> str:
    """The Prometheus rule file (``rule_files:``; ``promtool check rules`` takes it)."""
    return yaml.dump({"groups": alert_rules(slo_target, scope)}, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)

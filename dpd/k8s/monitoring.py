"""An endpoint's monitoring objects: what Prometheus scrapes, the dashboard Grafana shows, the
alerts Prometheus evaluates (pure; ``render.py`` adds them when ``spec.metrics.enabled``).

- **ServiceMonitor** ``NAME``: prometheus-operator scrapes ``/metrics`` of every Service
  labelled ``dpd.dev/metrics`` of the endpoint — the router's ``metrics`` port, the workers'.
  Its targets get ``job`` = the Service's name, so the router's job is ``NAME-router``.
- **ConfigMap** ``NAME-dashboard``, labelled ``grafana_dashboard: "1"``: the Grafana sidecar
  convention (kube-prometheus-stack's ``sidecar.dashboards``) loads every such ConfigMap's JSON
  as a dashboard. One per endpoint: its own uid and title, its router's job preselected.
- **PrometheusRule** ``NAME-alerts``: dpd's alerting rules scoped to this endpoint's router
  (``dpd.observe.alerts``).

NOTE: the operator applies the first two and leaves the PrometheusRule out (reconcile.py,
``RENDER_ONLY_KINDS``): a ConfigMap needs nothing installed, while a PrometheusRule's kind
exists only where prometheus-operator's CRDs do, and creating it elsewhere fails the whole
reconcile. ``dpd render`` prints it for whoever applies the files (and has the CRD).
"""

from __future__ import annotations

import hashlib
from typing import Any

from dpd.observe.alerts import alert_rules
from dpd.observe.dashboard import dashboard_json

GRAFANA_DASHBOARD_LABEL = "grafana_dashboard"
UID_HASH_CHARS = 16  # Grafana's uid is at most 40 characters; names may be 63


def router_job(name: str) -> str:
    """The Prometheus job of the router's targets (the ServiceMonitor's default: the Service name)."""
    return f"{name}-router"


def scope(name: str, namespace: str | None) -> str:
    """Label matchers that pick this endpoint's router series out of a shared Prometheus."""
    return f'job="{router_job(name)}"' + (f',namespace="{namespace}"' if namespace else "")


def dashboard_uid(name: str, namespace: str | None) -> str:
    """Stable and distinct per endpoint (a same-named endpoint in another namespace included)."""
    return "dpd-" + hashlib.sha256(f"{namespace or ''}/{name}".encode()).hexdigest()[:UID_HASH_CHARS]


def service_monitor(meta: dict[str, Any], selector: dict[str, str], interval_s: int) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector},
            "endpoints": [{"port": "metrics", "path": "/metrics", "interval": f"{interval_s}s"}],
        },
    }


def dashboard_config_map(meta: dict[str, Any], name: str, namespace: str | None) -> dict[str, Any]:
    """``meta`` gains the sidecar's label; the file name is unique across namespaces, as the
    sidecar writes every ConfigMap's files into one directory."""
    meta = {**meta, "labels": {**meta["labels"], GRAFANA_DASHBOARD_LABEL: "1"}}
    title = f"dpd: {namespace}/{name}" if namespace else f"dpd: {name}"
    file_name = f"dpd-{namespace}-{name}.json" if namespace else f"dpd-{name}.json"
    board = dashboard_json(uid=dashboard_uid(name, namespace), title=title, job=router_job(name))
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {file_name: board}}


def prometheus_rule(meta: dict[str, Any], name: str, namespace: str | None) -> dict[str, Any]:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": meta,
            "spec": {"groups": alert_rules(scope=scope(name, namespace))}}

"""What an operator watches: the Grafana dashboard (``dashboard.py``) and the Prometheus alerting
rules (``alerts.py``) of a dpd endpoint, built as code from the router's metrics.

Pure: data in, JSON-able dicts out. ``dpd dashboard`` prints them; ``dpd render`` ships them to
a cluster (k8s/monitoring.py: a ConfigMap for Grafana's sidecar, a PrometheusRule). Nothing is
imported here, so a caller of the alerts does not load the Grafana SDK.
"""

"""Admission: the operator's validating webhook runs the very validation ``dpd validate`` runs.

``admission_problems`` takes the object the API server sends (an ``InferenceEndpointConfig``
resource) and returns the messages ``dpd validate`` would print for the same file — one per
problem, each with its field path — followed by what only rendering can find
(``autoScalingSpec``, the Service names of tenants' dedicated pools). An empty list admits the
object. Pure; ``dpd.k8s.operator`` wires it to kopf's ``@kopf.on.validate``.
"""

from __future__ import annotations

from typing import Any

from dpd.config.load import ConfigError, parse_config
from dpd.k8s.autoscaling import RenderError
from dpd.k8s.render import config_document, shared_autoscaling, worker_groups


def admission_problems(body: dict[str, Any]) -> list[str]:
    try:
        config = parse_config(config_document(body), "resource")
    except ConfigError as exc:
        return list(exc.problems)
    try:
        shared_autoscaling(config, worker_groups(config))  # parses autoScalingSpec as render does
    except RenderError as exc:
        return list(exc.problems)
    return []

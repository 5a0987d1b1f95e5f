"""Admission: the operator's validating webhook runs the very validation ``dpd validate`` runs.

``admission_problems`` takes the object the API server sends (an ``InferenceEndpointConfig``
resource) and returns the messages ``dpd validate`` would print for the same file — one per
problem, each with its field path — followed by what only rendering can find
(``autoScalingSpec``, the Service names of tenants' dedicated pools). An empty list admits the
object. With the operator's ``policy`` (``dpd.k8s.policy``), it also refuses images and host
paths the operator may not use on the author's behalf. Pure; ``dpd.k8s.operator`` wires it to
kopf's ``@kopf.on.validate``.
"""

from __future__ import annotations

from typing import Any

from dpd.config.load import ConfigError, parse_config
from dpd.k8s.autoscaling import RenderError
from dpd.k8s.policy import OperatorPolicy, policy_problems
from dpd.k8s.render import (
    RenderOptions,
    check_router_ports,
    config_document,
    render,
    shared_autoscaling,
    worker_groups,
)


def admission_problems(body: dict[str, Any], options: RenderOptions | None = None,
                       policy: OperatorPolicy | None = None) -> list[str]:
    """``policy``: the operator's (images and host paths it may use for the author); None = none."""
    try:
        config = parse_config(config_document(body), "resource")
    except ConfigError as exc:
        return list(exc.problems)
    try:
        check_router_ports(config)
        shared_autoscaling(config, worker_groups(config))  # parses autoScalingSpec as render does
        if policy is not None:
            return policy_problems(render(config_document(body), options or RenderOptions(), source="resource"), policy)
    except RenderError as exc:
        return list(exc.problems)
    return []

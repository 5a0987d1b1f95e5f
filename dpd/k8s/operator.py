"""The operator: kopf handlers, kept thin over ``dpd.k8s.reconcile`` and ``dpd.k8s.webhook``.

Run in a cluster with ``dpd operator`` (the Deployment ``dpd crd --operator`` prints). It
- validates every create/update of an ``InferenceEndpointConfig`` in an admission webhook that
  answers with ``dpd validate``'s messages (kopf serves it and manages the
  ValidatingWebhookConfiguration ``WEBHOOK_CONFIG``, self-signed, on ``WEBHOOK_PORT``);
- reconciles on create, update and resume, and every ``RESYNC_S`` (repairing drift and
  refreshing the status: ready replicas per pool, Valid and Ready conditions).

Configured from the environment: ``DPD_IMAGE`` (the router's image; default the operator's
own), ``DPD_WORKER_IMAGE`` (overrides ``spec.worker.image``), ``DPD_WEBHOOK_HOST`` (the
webhook Service's DNS name; unset = no webhook, e.g. when running outside the cluster),
``DPD_WEBHOOK_CERT_DIR`` (``tls.crt``/``tls.key``/``ca.crt`` of the webhook's certificate;
unset = a self-signed one made at start, ``certs.py``),
``DPD_ALLOWED_IMAGES`` / ``DPD_ALLOWED_HOST_PATHS`` (what it may run and mount for a resource's
author: ``dpd.k8s.policy``), ``DPD_WATCH_NAMESPACES`` (comma-separated: watch only these; the
namespaced install sets it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import kopf

from dpd.config.model import API_VERSION, KIND
from dpd.k8s.api import KubeApi
from dpd.k8s.certs import self_signed_certificate
from dpd.k8s.operator_settings import WATCH_NAMESPACES_ENV, WEBHOOK_CONFIG, WEBHOOK_PORT
from dpd.k8s.policy import OperatorPolicy
from dpd.k8s.reconcile import reconcile
from dpd.k8s.render import DPD_IMAGE, VLLM_GPU_IMAGE, RenderOptions
from dpd.k8s.webhook import admission_problems
from dpd.k8s.workers import AWS_CLI_IMAGE

GROUP, VERSION = API_VERSION.split("/")
RESYNC_S = 30


def render_options() -> RenderOptions:
    return RenderOptions(dpd_image=os.environ.get("DPD_IMAGE", DPD_IMAGE), worker_image=os.environ.get("DPD_WORKER_IMAGE") or None)


def operator_policy(options: RenderOptions) -> OperatorPolicy:
    """The images dpd renders itself, plus ``DPD_ALLOWED_IMAGES``; host paths ``DPD_ALLOWED_HOST_PATHS``."""
    builtin = [options.dpd_image, VLLM_GPU_IMAGE, AWS_CLI_IMAGE, *([options.worker_image] if options.worker_image else [])]
    return OperatorPolicy.from_env(builtin)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    host = os.environ.get("DPD_WEBHOOK_HOST")
    if not host:
        return
    cert_dir = os.environ.get("DPD_WEBHOOK_CERT_DIR")
    # With a cert-manager (or any kubernetes.io/tls) Secret mounted there, serve that
    # certificate; without, a self-signed one made now (kopf publishes it as the CA bundle).
    if cert_dir:
        tls: dict[str, Any] = {"certfile": f"{cert_dir}/tls.crt", "pkeyfile": f"{cert_dir}/tls.key", "cafile": f"{cert_dir}/ca.crt"}
    else:
        cert, key = self_signed_certificate(host, Path(tempfile.mkdtemp(prefix="dpd-webhook-")))
        tls = {"certfile": str(cert), "pkeyfile": str(key)}
    settings.admission.server = kopf.WebhookServer(addr="0.0.0.0", port=WEBHOOK_PORT, host=host, **tls)
    settings.admission.managed = WEBHOOK_CONFIG


@kopf.on.validate(GROUP, VERSION, KIND, operations=["CREATE", "UPDATE"])
def validate(body: kopf.Body, **_: Any) -> None:
    options = render_options()
    problems = admission_problems(dict(body), options, operator_policy(options))
    if problems:
        raise kopf.AdmissionError("\n".join(problems), code=422)


async def _reconcile(body: kopf.Body, patch: kopf.Patch, logger: Any) -> None:
    async with aiohttp.ClientSession() as session:
        options = render_options()
        status, actions = await reconcile(KubeApi.in_cluster(session), dict(body), options, operator_policy(options))
    for action in actions:
        logger.info(action)
    patch.status.update(status)


@kopf.on.create(GROUP, VERSION, KIND)
@kopf.on.update(GROUP, VERSION, KIND, field="spec")
@kopf.on.resume(GROUP, VERSION, KIND)
async def apply(body: kopf.Body, patch: kopf.Patch, logger: Any, **_: Any) -> None:
    await _reconcile(body, patch, logger)


@kopf.timer(GROUP, VERSION, KIND, interval=RESYNC_S, initial_delay=RESYNC_S, idle=RESYNC_S)
async def resync(body: kopf.Body, patch: kopf.Patch, logger: Any, **_: Any) -> None:
    await _reconcile(body, patch, logger)


def watched_namespaces(cli: list[str] | None) -> list[str]:
    """The namespaces to watch: the command line's, else ``DPD_WATCH_NAMESPACES``; [] = all."""
    return list(cli or []) or [ns.strip() for ns in os.environ.get(WATCH_NAMESPACES_ENV, "").split(",") if ns.strip()]


def run_operator(namespaces: list[str] | None = None) -> int:
    """Run the operator until interrupted (watches ``namespaces``, or all namespaces)."""
    watched = watched_namespaces(namespaces)
    kopf.configure(verbose=False)
    kopf.run(clusterwide=not watched, namespaces=watched, standalone=True)
    return 0

"""``dpd k8s-router CONFIG``: the router in a pod, its pools kept by discovery.

The same ``Router`` ``dpd serve`` runs, started with empty pools. ``EndpointSliceWatcher``
fills them, one worker group at a time (a pool's shared workers, or those dedicated to a
tenant: ``render.worker_groups``, each behind its own Service): ``sync_pool`` replaces a
group's workers with its ready pods, marking them the tenant's if dedicated, and keeping the
``Worker`` object (in-flight count, health) of every pod still there. A new pod is marked
healthy at once — its readiness probe is vLLM's ``/health`` — and the router's own prober
and passive marking take over from there.

The config arrives as a mounted ConfigMap (``render.CONFIG_PATH``) and the secret parts as a
mounted Secret (``DPD_SECRETS_FILE``). The kubelet refreshes both in place; ``ThresholdReloader``
re-reads the config and applies a new ``routingThreshold`` live, the way ``PUT
/admin/threshold`` does, so changing the threshold restarts nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from dpd.config.load import parse_config
from dpd.config.model import InferenceEndpointConfig, tls_files
from dpd.k8s.api import KubeApi
from dpd.k8s.discovery import Endpoint, EndpointSliceWatcher
from dpd.k8s.render import CLUSTER_METRICS_PORT, worker_groups
from dpd.k8s.workers import model_argument
from dpd.launch.plan import kv_block_size, pool_is_gpu
from dpd.router import WORKER_KEY_ENV, Router, RouterSettings, make_server
from dpd.router.pools import Pool

log = logging.getLogger(__name__)


def sync_pool(pool: Pool, endpoints: tuple[Endpoint, ...], tenant: str | None = None) -> None:
    """Make ``pool``'s workers of one group (shared, or dedicated to ``tenant``) the ready
    ``endpoints``; a worker still present keeps its state."""
    pool.replace_workers([(e.name, e.url) for e in endpoints], owner=tenant)


def on_group_change(pools: dict[str, Pool]):
    """Discovery's callback: a group key (``decode``, ``decode/<tenant>``) → that group's pods."""

    def apply(key: str, endpoints: tuple[Endpoint, ...]) -> None:
        pool, _, tenant = key.partition("/")
        sync_pool(pools[pool], endpoints, tenant or None)

    return apply


def load_document(config_path: str, secrets_path: str | None) -> dict[str, Any]:
    """The config file with the Secret's parts put back where ``render.split_secrets`` took them."""
    document = yaml.safe_load(Path(config_path).read_text()) or {}
    if secrets_path and Path(secrets_path).exists():
        secrets = yaml.safe_load(Path(secrets_path).read_text()) or {}
        spec = document.setdefault("spec", {})
        router = spec.setdefault("pdSpec", {}).setdefault("router", {})
        for key in ("adminKeySha256",):
            if key in secrets:
                router[key] = secrets[key]
        if "tenants" in secrets:
            spec["tenants"] = secrets["tenants"]
    return document


def cluster_settings(config: InferenceEndpointConfig) -> RouterSettings:
    spec = config.spec
    base = spec.pdSpec.router
    router = base.model_copy(update={"host": "0.0.0.0", "metricsPort": base.metricsPort or CLUSTER_METRICS_PORT})
    is_gpu = pool_is_gpu(config, spec.pdSpec.decodingSpec)
    return RouterSettings.for_endpoint(spec, tokenizer_path=model_argument(config), router=router,
                                       worker_api_key=os.environ.get(WORKER_KEY_ENV) or None,
                                       kv_block_size=kv_block_size(config, is_gpu))


class ThresholdReloader:
    """Applies the config file's ``routingThreshold`` to a running router when it changes."""

    def __init__(self, router: Router, config_path: str, secrets_path: str | None, interval_s: float = 5.0):
        self._router = router
        self._config_path = config_path
        self._secrets_path = secrets_path
        self._interval_s = interval_s

    def reload_once(self) -> bool:
        try:
            config = parse_config(load_document(self._config_path, self._secrets_path), self._config_path)
        except Exception as exc:  # noqa: BLE001 - a half-written or bad file: keep the running value
            log.warning("config reload skipped: %s", exc)
            return False
        threshold = config.spec.pdSpec.routingThreshold
        if threshold == self._router.routing.threshold_tokens:
            return False
        self._router.routing.set_threshold(threshold)
        log.info("routing threshold reloaded: %d tokens", threshold)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            self.reload_once()


async def _serve(config: InferenceEndpointConfig, config_path: str, secrets_path: str | None, namespace: str) -> None:
    router = Router(cluster_settings(config))
    router_spec = config.spec.pdSpec.router
    # SIGTERM (after the pod's preStop pause): stop accepting, let streams finish for drainTimeoutS.
    server = make_server(router, "0.0.0.0", router_spec.port, is_embedded=False, graceful_s=router_spec.drainTimeoutS,
                         tls=tls_files(config.spec, on_cluster=True))
    pools = {"prefill": router.prefill, "decode": router.decode}
    groups = worker_groups(config)
    for group in groups:
        if group.tenant is not None:  # before discovery has seen a pod: the tenant waits for its own
            pools[group.pool].dedicated_tenants.add(group.tenant)
    services = {group.key: group.name for group in groups}
    async with aiohttp.ClientSession() as session:
        watcher = EndpointSliceWatcher(KubeApi.in_cluster(session), namespace, services, on_group_change(pools))
        tasks = [asyncio.create_task(watcher.run()), asyncio.create_task(ThresholdReloader(router, config_path, secrets_path).run())]
        try:
            await server.serve()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def run_router(config_path: str) -> int:
    secrets_path = os.environ.get("DPD_SECRETS_FILE")
    config = parse_config(load_document(config_path, secrets_path), config_path)
    namespace = os.environ.get("POD_NAMESPACE") or config.metadata.namespace or "default"
    asyncio.run(_serve(config, config_path, secrets_path, namespace))
    return 0

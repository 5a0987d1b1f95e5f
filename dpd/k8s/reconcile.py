"""Reconcile one ``InferenceEndpointConfig`` into its objects, and report its status.

``reconcile(api, body)`` is the operator's whole job, independent of kopf: validate the body
as ``dpd validate`` would, render the desired objects (``dpd.k8s.render``), then for each one
create it, or patch only what changed since dpd last applied it, and delete what is no longer
desired (an autoscaler or a Secret removed from the spec, a tenant's dedicated pool no longer
in it). It returns the status to write.

Changes are computed against the object dpd last applied (kept in the ``dpd.dev/last-applied``
annotation, as ``kubectl apply`` does), not against the live object: the API server's
defaults and an HPA's replica count are not drift. So:

- a replica change patches ``spec.replicas`` of that pool's Deployment and nothing else;
- a threshold change patches the config ConfigMap only — the router reloads it — and no pod
  template, so no worker or router restarts;
- a change to a pool's engine args patches that pool's pod template: a rolling update of that
  pool alone.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import quote

from dpd.config.load import parse_config
from dpd.k8s.api import collection_path, object_path
from dpd.k8s.policy import OperatorPolicy
from dpd.k8s.render import TENANT_LABEL, RenderOptions, config_document, labels, names, render, worker_groups
from dpd.k8s.webhook import admission_problems
from dpd.k8s.workers import WORKER_KEY_ITEM, worker_key_secret

LAST_APPLIED = "dpd.dev/last-applied"
# Kinds render may stop producing for a spec (and so must be deleted), by name key.
OPTIONAL = (("v1", "Secret", "secrets"), ("autoscaling/v2", "HorizontalPodAutoscaler", "prefill"),
            ("autoscaling/v2", "HorizontalPodAutoscaler", "decode"), ("v1", "ConfigMap", "dashboard"),
            ("monitoring.coreos.com/v1", "ServiceMonitor", "monitor"))
# Kinds `dpd render` prints but the operator does not apply: a PrometheusRule exists only where
# prometheus-operator's CRDs are installed, and creating one elsewhere would fail every reconcile
# (monitoring.py); an FSx source's PersistentVolume is cluster-scoped, and the operator holds no
# cluster-wide rights (its claim it does create). Who applies the rendered files applies them.
RENDER_ONLY_KINDS = ("PrometheusRule", "PersistentVolume")
# Kinds a tenant's dedicated pool is made of; found by label when the tenant's pool goes.
TENANT_KINDS = (("apps/v1", "Deployment"), ("v1", "Service"), ("policy/v1", "PodDisruptionBudget"))


class Api(Protocol):
    async def get(self, path: str) -> dict | None: ...
    async def create(self, path: str, obj: dict) -> dict: ...
    async def patch(self, path: str, patch: dict) -> dict: ...
    async def delete(self, path: str) -> None: ...


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) taking ``old`` to ``new``; ``{}`` when equal. Pure."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value) if isinstance(value, dict) and isinstance(old[key], dict) else value
    return patch


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    return {"apiVersion": body["apiVersion"], "kind": body["kind"], "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def owned(obj: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    """``obj`` owned by the resource, so it is garbage-collected with it."""
    return {**obj, "metadata": {**obj["metadata"], "ownerReferences": [owner]}}


def is_owned_by(live: dict[str, Any], owner: dict[str, Any]) -> bool:
    """``live`` is this resource's: its controller owner reference has the resource's uid. The
    operator patches and deletes only such objects; a same-named object of anyone else's is a
    conflict reported in the status, never adopted or deleted."""
    refs = live.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == owner["uid"] and ref.get("controller") for ref in refs)


def applied_json(obj: dict[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def with_last_applied(obj: dict[str, Any]) -> dict[str, Any]:
    annotations = {**obj["metadata"].get("annotations", {}), LAST_APPLIED: applied_json(obj)}
    return {**obj, "metadata": {**obj["metadata"], "annotations": annotations}}


def plan_update(desired: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """The patch taking ``live`` from what dpd last applied to ``desired``; ``{}`` when nothing
    changed. Pure."""
    annotations = live.get("metadata", {}).get("annotations") or {}
    if LAST_APPLIED not in annotations:  # not dpd's (or from before the annotation): take it over whole
        target = with_last_applied(desired)
        return {k: v for k, v in target.items() if k not in ("apiVersion", "kind")}
    patch = merge_patch(json.loads(annotations[LAST_APPLIED]), desired)
    if not patch:
        return {}
    patch.setdefault("metadata", {}).setdefault("annotations", {})[LAST_APPLIED] = applied_json(desired)
    return patch


def status_of(body: dict[str, Any], deployments: dict[str, dict | None], problems: list[str],
              conflicts: Sequence[str] = ()) -> dict[str, Any]:
    """Ready replicas per pool and the Ready/Valid conditions (Ready is False while an object the
    resource needs is someone else's). Pure."""
    generation = body.get("metadata", {}).get("generation")
    if problems:
        return {"observedGeneration": generation, "conditions": [
            {"type": "Valid", "status": "False", "reason": "InvalidSpec", "message": "\n".join(problems)},
            {"type": "Ready", "status": "False", "reason": "InvalidSpec", "message": "the spec is invalid; nothing was changed"},
        ]}
    pools: dict[str, Any] = {}
    lagging = []
    for component, deployment in deployments.items():
        spec = (deployment or {}).get("spec", {})
        status = (deployment or {}).get("status", {})
        wanted, ready = spec.get("replicas", 0), status.get("readyReplicas", 0)
        pools[component] = {"replicas": wanted, "readyReplicas": ready, "updatedReplicas": status.get("updatedReplicas", 0),
                            "summary": f"{ready}/{wanted}"}
        if deployment is None or ready < wanted:
            lagging.append(f"{component} {ready}/{wanted} ready")
    is_ready = not lagging and not conflicts
    if conflicts:
        ready = {"type": "Ready", "status": "False", "reason": "Conflict", "message": "; ".join(conflicts)}
    else:
        ready = {"type": "Ready", "status": "True" if is_ready else "False",
                 "reason": "PoolsReady" if is_ready else "PoolsNotReady",
                 "message": "; ".join(lagging) or "every pool has all its replicas ready"}
    return {"observedGeneration": generation, "pools": pools, "conditions": [
        {"type": "Valid", "status": "True", "reason": "Validated", "message": "the spec passed dpd validate"}, ready,
    ]}


async def reconcile(api: Api, body: dict[str, Any], options: RenderOptions | None = None,
                    policy: OperatorPolicy | None = None) -> tuple[dict[str, Any], list[str]]:
    """Bring the cluster to ``body``'s spec. Returns (status, actions taken as ``verb path``);
    with ``policy``, a spec using an image or host path it does not allow changes nothing."""
    namespace = body["metadata"].get("namespace", "default")
    problems = admission_problems(body, options, policy)
    if problems:
        return status_of(body, {}, problems), []
    document = config_document(body)
    document.setdefault("metadata", {})["namespace"] = namespace
    source = f"{namespace}/{body['metadata']['name']}"
    desired = [obj for obj in render(document, options or RenderOptions(), source=source) if obj["kind"] not in RENDER_ONLY_KINDS]
    parsed = parse_config(document, source)
    config = names(parsed)
    owner = owner_reference(body)
    actions: list[str] = []
    conflicts: list[str] = []
    wanted_paths = set()
    # The workers' API key: created once at random, never rendered (a render is deterministic,
    # and a new key on every reconcile would restart every pod).
    key_secret = {"apiVersion": "v1", "kind": "Secret",
                  "metadata": {"name": worker_key_secret(parsed), "namespace": namespace, "labels": labels(parsed, "router")},
                  "type": "Opaque", "stringData": {WORKER_KEY_ITEM: secrets.token_urlsafe(32)}}
    key_path = object_path(key_secret, namespace)
    wanted_paths.add(key_path)
    live_key = await api.get(key_path)
    if live_key is None:
        await api.create(key_path.rsplit("/", 1)[0], owned(key_secret, owner))
        actions.append(f"create {key_path}")
    elif not is_owned_by(live_key, owner):
        conflicts.append(f"{key_path} exists and is not this resource's: dpd neither adopts nor deletes it")
    for obj in desired:
        path = object_path(obj, namespace)
        wanted_paths.add(path)
        live = await api.get(path)
        target = owned(obj, owner)
        if live is None:
            await api.create(path.rsplit("/", 1)[0], with_last_applied(target))
            actions.append(f"create {path}")
            continue
        if not is_owned_by(live, owner):
            conflicts.append(f"{path} exists and is not this resource's (no owner reference to it): rename the "
                             "resource or remove that object; dpd neither adopts nor deletes it")
            continue
        patch = plan_update(target, live)
        if patch:
            await api.patch(path, patch)
            actions.append(f"patch {path}")
    for api_version, kind, key in OPTIONAL:
        stale = {"apiVersion": api_version, "kind": kind, "metadata": {"name": config[key], "namespace": namespace}}
        path = object_path(stale, namespace)
        live = await api.get(path) if path not in wanted_paths else None
        if live is not None and is_owned_by(live, owner):
            await api.delete(path)
            actions.append(f"delete {path}")
    selector = quote(f"app.kubernetes.io/instance={body['metadata']['name']},app.kubernetes.io/managed-by=dpd,{TENANT_LABEL}")
    for api_version, kind in TENANT_KINDS:
        listing = await api.get(f"{collection_path(api_version, kind, namespace)}?labelSelector={selector}") or {}
        for item in listing.get("items") or []:
            path = object_path({"apiVersion": api_version, "kind": kind, "metadata": item["metadata"]}, namespace)
            if path not in wanted_paths and is_owned_by(item, owner):
                await api.delete(path)
                actions.append(f"delete {path}")
    groups = {g.key: g.name for g in worker_groups(parsed)}
    deployments = {}
    for component, name in [*groups.items(), ("router", config["router"])]:
        ref = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace}}
        deployments[component] = await api.get(object_path(ref, namespace))
    return status_of(body, deployments, [], conflicts), actions


"""An in-memory stand-in for the Kubernetes API server, faithful where reconcile depends on it.

Like the real one it: refuses to create what exists (409) and to patch what does not (404);
applies JSON merge patches (RFC 7386); stamps uid, resourceVersion and generation, bumping
generation only when ``spec`` changes; and fills in defaults (a Deployment's
revisionHistoryLimit, progressDeadlineSeconds, imagePullPolicy …), so that code which mistook
defaults for drift would be caught. It records every write. It runs no controllers: tests set
a Deployment's status themselves (``set_ready``).
"""

from __future__ import annotations

import copy
import itertools
from urllib.parse import unquote

from dpd.k8s.api import KubeApiError


def apply_merge_patch(target, patch):
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = apply_merge_patch(out.get(key), value)
    return out


def _default(obj):
    kind = obj["kind"]
    if kind == "Deployment":
        spec = obj["spec"]
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
        pod = spec["template"]["spec"]
        pod.setdefault("restartPolicy", "Always")
        pod.setdefault("dnsPolicy", "ClusterFirst")
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            c.setdefault("imagePullPolicy", "IfNotPresent")
            c.setdefault("terminationMessagePath", "/dev/termination-log")
        obj.setdefault("status", {})
    elif kind == "Service":
        obj["spec"].setdefault("clusterIP", "10.96.0.17")
        obj["spec"].setdefault("sessionAffinity", "None")
    return obj


class FakeApiServer:
    def __init__(self):
        self.objects: dict[str, dict] = {}
        self.writes: list[tuple[str, str, dict | None]] = []
        self._versions = itertools.count(100)

    async def get(self, path):
        if "?labelSelector=" in path:  # a list: `key=value` and `key` (exists) terms
            collection, _, query = path.partition("?labelSelector=")
            terms = [t.partition("=") for t in unquote(query).split(",")]
            items = [copy.deepcopy(o) for p, o in sorted(self.objects.items()) if p.rsplit("/", 1)[0] == collection and all(
                k in (o["metadata"].get("labels") or {}) and (not eq or o["metadata"]["labels"][k] == v) for k, eq, v in terms)]
            return {"kind": "List", "items": items, "metadata": {"resourceVersion": str(next(self._versions))}}
        obj = self.objects.get(path)
        return copy.deepcopy(obj) if obj is not None else None

    async def create(self, collection, obj):
        path = f"{collection}/{obj['metadata']['name']}"
        if path in self.objects:
            raise KubeApiError(409, f"{path} already exists")
        stored = _default(copy.deepcopy(obj))
        stored["metadata"].update(uid=f"uid-{len(self.objects)}", resourceVersion=str(next(self._versions)), generation=1)
        self.objects[path] = stored
        self.writes.append(("create", path, copy.deepcopy(obj)))
        return copy.deepcopy(stored)

    async def patch(self, path, patch):
        if path not in self.objects:
            raise KubeApiError(404, f"{path} not found")
        old = self.objects[path]
        new = _default(apply_merge_patch(old, patch))
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"]["generation"] + 1
        new["metadata"]["resourceVersion"] = str(next(self._versions))
        self.objects[path] = new
        self.writes.append(("patch", path, copy.deepcopy(patch)))
        return copy.deepcopy(new)

    async def delete(self, path):
        if self.objects.pop(path, None) is None:
            raise KubeApiError(404, f"{path} not found")
        self.writes.append(("delete", path, None))

    # -- what controllers would do -------------------------------------------------------
    def set_ready(self, path, ready=None):
        obj = self.objects[path]
        replicas = obj["spec"].get("replicas", 1)
        obj["status"] = {"replicas": replicas, "readyReplicas": replicas if ready is None else ready, "updatedReplicas": replicas}

    def scale_by_hpa(self, path, replicas):
        self.objects[path]["spec"]["replicas"] = replicas

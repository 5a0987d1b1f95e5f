"""A small asyncio client of the Kubernetes API, on aiohttp (already a dependency).

Only what dpd needs: get, create, JSON-merge-patch, delete, and a watch stream, by URL path.
``KubeApi.in_cluster`` authenticates with the pod's service-account token. The operator's
reconcile and the router's discovery take any object with these methods, so tests drive them
with an in-memory fake or a scripted HTTP server.

NOTE: not the official ``kubernetes`` client: it is large, synchronous, and would be the
router's only reason to carry it; the handful of calls here are the whole surface dpd uses.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# kind → (plural, is_namespaced); the group/version comes from the object's apiVersion.
PLURALS = {
    "ConfigMap": "configmaps", "Secret": "secrets", "Service": "services", "ServiceAccount": "serviceaccounts",
    "Deployment": "deployments", "PodDisruptionBudget": "poddisruptionbudgets",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers", "NetworkPolicy": "networkpolicies",
    "Role": "roles", "RoleBinding": "rolebindings", "ServiceMonitor": "servicemonitors",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "EndpointSlice": "endpointslices", "InferenceEndpointConfig": "inferenceendpointconfigs",
}


class KubeApiError(RuntimeError):
    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"{status}: {message}")


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{PLURALS[kind]}"


def object_path(obj: dict[str, Any], namespace: str) -> str:
    meta = obj["metadata"]
    return f"{collection_path(obj['apiVersion'], obj['kind'], meta.get('namespace', namespace))}/{meta['name']}"


class KubeApi:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str | None = None, ssl_context: ssl.SSLContext | bool = True):
        self._session = session
        self._base = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._ssl = ssl_context

    @classmethod
    def in_cluster(cls, session: aiohttp.ClientSession) -> KubeApi:
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        context = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
        return cls(session, f"https://{host}:{port}", (SA_DIR / "token").read_text().strip(), context)

    async def _request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> dict | None:
        headers = {**self._headers, "Content-Type": content_type}
        data = None if body is None else json.dumps(body)
        async with self._session.request(method, self._base + path, data=data, headers=headers, ssl=self._ssl) as resp:
            if method == "GET" and resp.status == 404:
                return None
            text = await resp.text()
            if resp.status >= 400:
                raise KubeApiError(resp.status, f"{method} {path}: {text[:500]}")
            return json.loads(text) if text else None

    async def get(self, path: str) -> dict | None:
        return await self._request("GET", path)

    async def create(self, path: str, obj: dict) -> dict:
        return await self._request("POST", path, obj) or {}

    async def patch(self, path: str, patch: dict) -> dict:
        return await self._request("PATCH", path, patch, "application/merge-patch+json") or {}

    async def delete(self, path: str) -> None:
        await self._request("DELETE", path)

    async def watch(self, path: str, timeout_s: float = 300) -> AsyncIterator[dict]:
        """The events of a watch (``?watch=1`` already in ``path``), one JSON object per line."""
        timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_s + 30)
        async with self._session.get(self._base + path, headers=self._headers, ssl=self._ssl, timeout=timeout) as resp:
            if resp.status >= 400:
                raise KubeApiError(resp.status, f"watch {path}: {(await resp.text())[:500]}")
            async for line in resp.content:
                if line.strip():
                    yield json.loads(line)

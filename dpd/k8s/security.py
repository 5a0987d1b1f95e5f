"""Pod Security: every pod dpd renders meets the Kubernetes "restricted" profile, except where
the hardware needs more (RDMA workers add ``IPC_LOCK``: verbs pins memory; named in
``exceptions``).

The dpd image runs as user 1000 (Dockerfile); worker images (vLLM's) run under the same uid
here. Nothing writes to the image: ``HOME`` is an emptyDir (vLLM's and torch's compile caches,
Hugging Face's), the model an emptyDir or a read-only hostPath, ``/dev/shm`` an emptyDir.
"""

from __future__ import annotations

from typing import Any

UID = 1000
HOME = "/home/dpd"

POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": UID,
    "runAsGroup": UID,
    "fsGroup": UID,  # emptyDir volumes (model, home) writable by the uid
    "seccompProfile": {"type": "RuntimeDefault"},
}


def container_security(*, add_capabilities: tuple[str, ...] = ()) -> dict[str, Any]:
    """A container's securityContext: no privilege escalation, every capability dropped but
    ``add_capabilities`` (which take the pod out of "restricted": RDMA's IPC_LOCK only)."""
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if add_capabilities:
        capabilities["add"] = list(add_capabilities)
    return {"allowPrivilegeEscalation": False, "capabilities": capabilities, "runAsNonRoot": True}


def home_volume() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(volume, mount, env) of a writable home for a container whose image may not have one."""
    return ({"name": "home", "emptyDir": {}}, {"name": "home", "mountPath": HOME}, {"name": "HOME", "value": HOME})

"""What the operator will create on a resource author's behalf: allowed images and host paths.

The operator holds rights its users may not (it creates Deployments, Secrets and Roles), so a
resource must not be a way to run any image or mount any node directory through it (a
confused deputy). ``policy_problems`` walks every pod template ``render`` produced and names
each container image and ``hostPath`` volume the operator's policy does not allow; the
webhook refuses such a resource and the reconciler changes nothing for it.

The policy comes from the operator's environment (``OperatorPolicy.from_env``):
``DPD_ALLOWED_IMAGES`` — comma-separated image references; an entry ending in ``*`` is a
prefix (``registry.example.com/ml/*``), any other matches that repository at any tag or digest;
the images dpd itself renders (the operator's, the vLLM GPU image, the model-download image
and ``DPD_WORKER_IMAGE``) are always allowed. ``DPD_ALLOWED_HOST_PATHS`` — comma-separated
absolute directories a ``local`` model may mount read-only (and what lies under them); none by
default, so a node path is refused until the cluster's admin allows it. ``dpd render`` (the
author's own rights, applied with kubectl) applies no policy. Pure.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

IMAGES_ENV = "DPD_ALLOWED_IMAGES"
HOST_PATHS_ENV = "DPD_ALLOWED_HOST_PATHS"


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(item.strip() for item in (value or "").split(",") if item.strip())


def repository(image: str) -> str:
    """``registry:5000/a/b:tag@sha256:…`` -> ``registry:5000/a/b``."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


@dataclass(frozen=True)
class OperatorPolicy:
    images: tuple[str, ...] = ()
    host_paths: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, builtin_images: Iterable[str], env: dict[str, str] | None = None) -> OperatorPolicy:
        env = dict(os.environ) if env is None else env
        return cls(images=(*builtin_images, *_split(env.get(IMAGES_ENV))), host_paths=_split(env.get(HOST_PATHS_ENV)))

    def allows_image(self, image: str) -> bool:
        for allowed in self.images:
            if allowed.endswith("*"):
                if image.startswith(allowed[:-1]):
                    return True
            elif image == allowed or repository(image) == repository(allowed):
                return True
        return False

    def allows_host_path(self, path: str) -> bool:
        if not path.startswith("/"):
            return False
        path = posixpath.normpath(path)
        for root in self.host_paths:
            root = posixpath.normpath(root)
            if path == root or path.startswith(root.rstrip("/") + "/"):
                return True
        return False


def _pod_specs(obj: dict[str, Any]) -> Iterable[dict[str, Any]]:
    spec = obj.get("spec") or {}
    template = spec.get("template") or (spec.get("jobTemplate") or {}).get("spec", {}).get("template")
    if isinstance(template, dict):
        yield template.get("spec") or {}
    if obj.get("kind") == "Pod":
        yield spec


def policy_problems(objects: Iterable[dict[str, Any]], policy: OperatorPolicy) -> list[str]:
    """One message per image or host path in ``objects``' pods that ``policy`` does not allow."""
    problems: list[str] = []
    for obj in objects:
        where = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
        for pod in _pod_specs(obj):
            for container in [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]:
                image = container.get("image", "")
                if not policy.allows_image(image):
                    problems.append(
                        f"{where}: image {image!r} is not allowed by the operator ({IMAGES_ENV} lists the images it may run; "
                        "spec.worker.image must be one of them)")
            for volume in pod.get("volumes") or []:
                host = (volume.get("hostPath") or {}).get("path")
                if host is not None and not policy.allows_host_path(host):
                    problems.append(
                        f"{where}: hostPath {host!r} is not allowed by the operator ({HOST_PATHS_ENV} lists the node "
                        "directories a local model may be read from)")
    return sorted(set(problems))

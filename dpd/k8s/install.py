"""What installs the operator: the CRD plus its ServiceAccount, RBAC, Deployment and webhook
Service (``dpd crd --operator``). Pure; validated against Kubernetes' schemas in the tests.

Two scopes. Cluster-wide (the default): one ClusterRole holds every right the operator needs, in
every namespace. Namespaced (``--watch-namespace NS``, repeatable): the operator watches only
those namespaces, and what it writes there (Deployments, Secrets, Roles, …) is granted by a
Role in each of them; its ClusterRole keeps only the cluster-scoped reads and its own webhook
configuration. In both, the webhook configuration it may patch is its own, by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpd.k8s.crd import GROUP, PLURAL, crd
from dpd.k8s.operator_settings import OPERATOR_NAME, WATCH_NAMESPACES_ENV, WEBHOOK_CONFIG, WEBHOOK_PORT
from dpd.k8s.render import DPD_IMAGE
from dpd.k8s.security import POD_SECURITY, container_security

MANAGED = [
    ("", ["configmaps", "secrets", "services", "serviceaccounts", "persistentvolumeclaims"]),
    ("apps", ["deployments"]),
    ("policy", ["poddisruptionbudgets"]),
    ("autoscaling", ["horizontalpodautoscalers"]),
    ("networking.k8s.io", ["networkpolicies"]),
    ("rbac.authorization.k8s.io", ["roles", "rolebindings"]),
    ("monitoring.coreos.com", ["servicemonitors"]),
]


def namespaced_rules() -> list[dict[str, Any]]:
    """What the operator does inside a namespace it serves."""
    crud = ["get", "list", "watch", "create", "update", "patch", "delete"]
    return [
        {"apiGroups": [GROUP], "resources": [PLURAL, f"{PLURAL}/status"], "verbs": ["get", "list", "watch", "patch", "update"]},
        # The router's Role grants these, and only a holder may grant them.
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        *({"apiGroups": [group], "resources": resources, "verbs": crud} for group, resources in MANAGED),
    ]


def cluster_rules() -> list[dict[str, Any]]:
    """What kopf needs outside any namespace: CRD discovery, namespaces, its own webhook
    configuration (create cannot be limited by name; get and patch are)."""
    webhooks = "validatingwebhookconfigurations"
    return [
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["admissionregistration.k8s.io"], "resources": [webhooks], "verbs": ["create"]},
        {"apiGroups": ["admissionregistration.k8s.io"], "resources": [webhooks], "resourceNames": [WEBHOOK_CONFIG],
         "verbs": ["get", "patch"]},
    ]


def operator_manifests(namespace: str = "dpd-system", image: str = DPD_IMAGE,
                       watch_namespaces: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The install; ``watch_namespaces`` empty = cluster-wide, else namespaced to those."""
    labels = {"app.kubernetes.io/name": OPERATOR_NAME, "app.kubernetes.io/managed-by": "dpd"}
    meta = {"name": OPERATOR_NAME, "namespace": namespace, "labels": labels}
    subject = {"kind": "ServiceAccount", "name": OPERATOR_NAME, "namespace": namespace}
    watched = list(dict.fromkeys(watch_namespaces))
    rbac: list[dict[str, Any]] = [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": OPERATOR_NAME, "labels": labels},
         "rules": cluster_rules() if watched else [*namespaced_rules(), *cluster_rules()]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": OPERATOR_NAME, "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": OPERATOR_NAME},
         "subjects": [subject]},
    ]
    for ns in watched:
        role_meta = {"name": OPERATOR_NAME, "namespace": ns, "labels": labels}
        rbac += [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": role_meta, "rules": namespaced_rules()},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": role_meta,
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": OPERATOR_NAME}, "subjects": [subject]},
        ]
    host = f"{OPERATOR_NAME}.{namespace}.svc"
    env = [{"name": "DPD_IMAGE", "value": image}, {"name": "DPD_WEBHOOK_HOST", "value": host}]
    if watched:
        env.append({"name": WATCH_NAMESPACES_ENV, "value": ",".join(watched)})
    container = {
        "name": "operator",
        "image": image,
        "command": ["dpd", "operator"],
        "env": env,
        "ports": [{"name": "webhook", "containerPort": WEBHOOK_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
    }
    return [
        crd(),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        *rbac,
        {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {
            "selector": labels, "ports": [{"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {
            "replicas": 1, "selector": {"matchLabels": labels}, "strategy": {"type": "Recreate"},
            "template": {"metadata": {"labels": labels}, "spec": {
                "serviceAccountName": OPERATOR_NAME, "containers": [{**container, "securityContext": container_security()}],
                "securityContext": POD_SECURITY}}}},
    ]

"""What installs the operator: the CRD plus its ServiceAccount, RBAC, Deployment and webhook
Service (``dpd crd --operator``). Pure; validated against Kubernetes' schemas in the tests."""

from __future__ import annotations

from typing import Any

from dpd.k8s.crd import GROUP, PLURAL, crd
from dpd.k8s.operator_settings import OPERATOR_NAME, WEBHOOK_PORT
from dpd.k8s.render import DPD_IMAGE
from dpd.k8s.security import POD_SECURITY, container_security

MANAGED = [
    ("", ["configmaps", "secrets", "services", "serviceaccounts"]),
    ("apps", ["deployments"]),
    ("policy", ["poddisruptionbudgets"]),
    ("autoscaling", ["horizontalpodautoscalers"]),
    ("networking.k8s.io", ["networkpolicies"]),
    ("rbac.authorization.k8s.io", ["roles", "rolebindings"]),
    ("monitoring.coreos.com", ["servicemonitors"]),
]


def operator_manifests(namespace: str = "dpd-system", image: str = DPD_IMAGE) -> list[dict[str, Any]]:
    labels = {"app.kubernetes.io/name": OPERATOR_NAME, "app.kubernetes.io/managed-by": "dpd"}
    meta = {"name": OPERATOR_NAME, "namespace": namespace, "labels": labels}
    crud = ["get", "list", "watch", "create", "update", "patch", "delete"]
    rules = [
        {"apiGroups": [GROUP], "resources": [PLURAL, f"{PLURAL}/status"], "verbs": ["get", "list", "watch", "patch", "update"]},
        # The router's Role grants these, and only a holder may grant them.
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
        # kopf: events, CRD discovery, its own webhook configuration, namespaces to watch.
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["admissionregistration.k8s.io"], "resources": ["validatingwebhookconfigurations"],
         "verbs": ["get", "list", "watch", "create", "patch"]},
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
        *({"apiGroups": [group], "resources": resources, "verbs": crud} for group, resources in MANAGED),
    ]
    host = f"{OPERATOR_NAME}.{namespace}.svc"
    container = {
        "name": "operator",
        "image": image,
        "command": ["dpd", "operator"],
        "env": [{"name": "DPD_IMAGE", "value": image}, {"name": "DPD_WEBHOOK_HOST", "value": host}],
        "ports": [{"name": "webhook", "containerPort": WEBHOOK_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
    }
    return [
        crd(),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": OPERATOR_NAME, "labels": labels},
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": OPERATOR_NAME, "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": OPERATOR_NAME},
         "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_NAME, "namespace": namespace}]},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {
            "selector": labels, "ports": [{"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {
            "replicas": 1, "selector": {"matchLabels": labels}, "strategy": {"type": "Recreate"},
            "template": {"metadata": {"labels": labels}, "spec": {
                "serviceAccountName": OPERATOR_NAME, "containers": [{**container, "securityContext": container_security()}],
                "securityContext": POD_SECURITY}}}},
    ]

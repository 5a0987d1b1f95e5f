"""Names shared by the operator and its install manifests (no kopf import, so render stays light)."""

from dpd.config.model import API_VERSION

OPERATOR_NAME = "dpd-operator"
WEBHOOK_PORT = 8443
WATCH_NAMESPACES_ENV = "DPD_WATCH_NAMESPACES"  # comma-separated; unset = every namespace
WEBHOOK_CONFIG = f"dpd.{API_VERSION.split('/')[0]}"  # the ValidatingWebhookConfiguration kopf manages (by name)

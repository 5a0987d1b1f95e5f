"""Names shared by the operator and its install manifests (no kopf import, so render stays light)."""

OPERATOR_NAME = "dpd-operator"
WEBHOOK_PORT = 8443

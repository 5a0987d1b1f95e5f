"""Validate an instance against a Kubernetes structural schema with Kubernetes' semantics.

``jsonschema``'s Draft 4 validator already reads ``minimum`` + ``exclusiveMinimum: true`` as
OpenAPI v3.0 (and Kubernetes) do; this extends it with the three Kubernetes keywords the CRD
uses: ``nullable`` (null allowed), ``x-kubernetes-int-or-string`` (an int or a string) and
``x-kubernetes-preserve-unknown-fields`` (no effect on validation: unknown fields are kept).
CEL rules (``x-kubernetes-validations``) are not evaluated here.
"""

from __future__ import annotations

import jsonschema
from jsonschema import validators

_draft4_type = jsonschema.Draft4Validator.VALIDATORS["type"]


def _type(validator, types, instance, schema):
    if instance is None and schema.get("nullable"):
        return
    yield from _draft4_type(validator, types, instance, schema)


def _int_or_string(validator, value, instance, schema):
    if value and not (isinstance(instance, str) or (isinstance(instance, int) and not isinstance(instance, bool))):
        yield jsonschema.ValidationError(f"{instance!r} is not an integer or a string")


def _nullable(validator, value, instance, schema):
    return iter(())


KubeValidator = validators.extend(
    jsonschema.Draft4Validator,
    {"type": _type, "x-kubernetes-int-or-string": _int_or_string, "nullable": _nullable},
)


def errors(schema: dict, instance: object) -> list[str]:
    """Every violation as ``path: message``, sorted."""
    out = []
    for error in KubeValidator(schema).iter_errors(instance):
        path = ".".join(str(p) for p in error.absolute_path) or "(root)"
        out.append(f"{path}: {error.message}")
    return sorted(out)

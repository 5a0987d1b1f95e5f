"""Load and validate a config file; turn pydantic errors into field-path messages.

``load_config`` is the only way a config enters dpd. It either returns an immutable
``InferenceEndpointConfig`` or raises ``ConfigError`` listing *every* problem, each with its
field path (``spec.pdSpec.prefillSpec.replicas``) and, where the field is an enumeration, the
allowed values.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from dpd.config.model import InferenceEndpointConfig


class ConfigError(ValueError):
    """A config that cannot be used; ``problems`` holds one message per field."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))


def _field_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "(root)"


def _describe(error: ErrorDetails) -> str:
    # Union/literal branches report the same field several times; the path stays readable
    # because pydantic appends the branch name, which we drop here.
    loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p.startswith(("literal[", "function-"))))
    message = error["msg"]
    if error["type"] == "extra_forbidden":
        message = "unknown field (check spelling; see `dpd validate --schema`)"
    elif error["type"] == "missing":
        message = "required field is missing"
    return f"{_field_path(loc)}: {message}"


def parse_config(data: Any, source: str = "<config>") -> InferenceEndpointConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, [f"(root): expected a mapping, got {type(data).__name__}"])
    try:
        return InferenceEndpointConfig.model_validate(data)
    except ValidationError as exc:
        problems = sorted({_describe(e) for e in exc.errors()})
        raise ConfigError(source, problems) from None


def load_config(path: str | Path | None = None) -> InferenceEndpointConfig:
    """Load ``path``, or the embedded default when ``path`` is None."""
    if path is None:
        text = resources.files("dpd.config").joinpath("default.yaml").read_text()
        source = "<embedded default>"
    else:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(source, [f"(file): cannot read: {exc.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"(yaml): {exc}"]) from None
    return parse_config(data, source)


def json_schema() -> dict[str, Any]:
    """The config's JSON schema: the single source for `dpd validate --schema` and the CRD."""
    return InferenceEndpointConfig.model_json_schema()

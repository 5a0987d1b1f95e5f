"""The declarative config: one ``InferenceEndpointConfig`` drives the launcher, router and operator."""

from dpd.config.load import ConfigError, json_schema, load_config, parse_config
from dpd.config.model import (
    EndpointSpec,
    InferenceEndpointConfig,
    KvCacheOffloadingSpec,
    KvTransferSpec,
    LocalSpec,
    PdSpec,
    PoolSpec,
    RouterSpec,
)

__all__ = [
    "ConfigError",
    "EndpointSpec",
    "InferenceEndpointConfig",
    "KvCacheOffloadingSpec",
    "KvTransferSpec",
    "LocalSpec",
    "PdSpec",
    "PoolSpec",
    "RouterSpec",
    "json_schema",
    "load_config",
    "parse_config",
]

"""The configuration: the schema (`launch.config.schema`, every key with its type, default and rule)
and its loading (`launch.config.loader`: base.yaml + group files + files + overrides, merged,
resolved and validated once).

This part imports only `launch.common`; everything else in scaleout reads a `Config` from here.
The names below are the part's whole public interface.
"""

from launch.config.loader import (
                                  CHOICES,
                                  CONFIG_DIR,
                                  FREE_MAPPINGS,
                                  GROUPS,
                                  ConfigError,
                                  available,
                                  get,
                                  load,
                                  load_resolved,
                                  math_hash,
                                  mesh_shape,
                                  replace,
                                  resolve_parallel,
                                  save,
                                  schema_keys,
                                  to_dict,
                                  validate,
)
from launch.config.schema import FRAMEWORKS, TARGETS, Config

__all__ = ["CHOICES", "CONFIG_DIR", "FREE_MAPPINGS", "FRAMEWORKS", "GROUPS", "TARGETS", "Config", "ConfigError",
           "available", "get", "load", "load_resolved", "math_hash", "mesh_shape", "replace", "resolve_parallel",
           "save", "schema_keys", "to_dict", "validate"]

"""The device mesh and the sharding of every array, from the rules in `launch.sharding`."""

from __future__ import annotations

from typing import Any, Dict

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from launch import config as config_mod
from launch import sharding
from launch.params import LAYERS, param_table
from launch.schema import Config


def make_mesh(cfg: Config) -> Mesh:
    """Mesh ("data", "fsdp", "tensor") over the first `devices` devices, in process order."""
    shape = config_mod.mesh_shape(cfg)
    procs = jax.process_count()
    per_proc = cfg.devices // procs
    chosen = []
    for p in range(procs):  # every process contributes the same number of its devices, in process order
        mine = [d for d in jax.devices() if d.process_index == p][:per_proc]
        if len(mine) < per_proc or cfg.devices % procs:
            raise RuntimeError(f"devices={cfg.devices} over {procs} process(es) needs {cfg.devices / procs:g} device(s) per process, "
                               f"but process {p} has {len(mine)} ({jax.devices()[0].platform}); on CPU set "
                               "XLA_FLAGS=--xla_force_host_platform_device_count (the local target does)")
        chosen += mine
    grid = np.array(chosen).reshape([shape[a] for a in sharding.MESH_AXES])
    return Mesh(grid, sharding.MESH_AXES, axis_types=(AxisType.Auto,) * len(sharding.MESH_AXES))


def param_partitions(cfg: Config) -> Dict[str, P]:
    """PartitionSpec of every JAX parameter, keyed by its stacked name (`layers.attention.wq`)."""
    out = {}
    for spec in param_table(cfg.model):
        axes = ((LAYERS,) + spec.axes) if spec.per_layer else spec.axes
        out[spec.name.replace(".{i}", "")] = P(*sharding.jax_partition(axes))
    return out


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(sharding.BATCH_AXES, None))


def activation_constraint(mesh: Mesh):
    spec = NamedSharding(mesh, P(sharding.BATCH_AXES, None, None))
    return lambda x: jax.lax.with_sharding_constraint(x, spec)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def path_name(path: Any) -> str:
    """`('layers', 'attention', 'wq')` -> `layers.attention.wq`."""
    return ".".join(str(k.key) for k in path if hasattr(k, "key"))  # drops the Variable's `.value`

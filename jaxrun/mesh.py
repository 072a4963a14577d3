"""The device mesh and the sharding of every array, from the rules in `launch.core.sharding`.

Every `NamedSharding` the JAX trainer uses is made here: parameters, the batch, grad-accumulation
micro-batches, activations, replicated scalars and the one-value-per-device stop flag.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from launch import config as config_mod
from launch.config.schema import Config
from launch.core import sharding
from launch.core.params import LAYERS, param_table

log = logging.getLogger(__name__)
AXIS_TYPES = (AxisType.Auto,) * len(sharding.MESH_AXES)  # shardings come from the rules, not from types


def make_mesh(cfg: Config) -> Mesh:
    """Mesh ("data", "fsdp", "tensor") over `devices` devices, the same number from every process.

    `jax.make_mesh` lays the chosen devices out on the grid following the hardware topology (on
    TPU, neighbours on the interconnect end up neighbours on the inner mesh axes).
    """
    shape = config_mod.mesh_shape(cfg)
    axis_shapes = tuple(shape[a] for a in sharding.MESH_AXES)
    chosen = choose_devices(cfg.devices)
    try:
        return jax.make_mesh(axis_shapes, sharding.MESH_AXES, axis_types=AXIS_TYPES, devices=chosen)
    except (ValueError, NotImplementedError, AssertionError) as e:
        # a part of a TPU slice that is no physical sub-grid: keep the process order instead
        log.warning(f"no topology-aware layout for {cfg.devices} of {len(jax.devices())} devices ({e}); "
                    "using process order")
        return Mesh(np.array(chosen).reshape(axis_shapes), sharding.MESH_AXES, axis_types=AXIS_TYPES)


def choose_devices(devices: int) -> List[Any]:
    """The first devices/processes devices of every process, in process order; a clear error if a
    process has too few."""
    procs = jax.process_count()
    per_proc = devices // procs
    chosen = []
    for p in range(procs):
        mine = [d for d in jax.devices() if d.process_index == p][:per_proc]
        if len(mine) < per_proc or devices % procs:
            raise RuntimeError(f"devices={devices} over {procs} process(es) needs {devices / procs:g} device(s) per process, "
                               f"but process {p} has {len(mine)} ({jax.devices()[0].platform}); on CPU set "
                               "XLA_FLAGS=--xla_force_host_platform_device_count (the local target does)")
        chosen += mine
    return chosen


def param_partitions(cfg: Config) -> Dict[str, P]:
    """PartitionSpec of every JAX parameter, keyed by its stacked name (`layers.attention.wq`)."""
    out = {}
    for spec in param_table(cfg.model):
        axes = ((LAYERS,) + spec.axes) if spec.per_layer else spec.axes
        out[spec.stacked_name] = P(*sharding.jax_partition(axes))
    return out


def param_shardings(mesh: Mesh, cfg: Config, abstract_params: Any) -> Any:
    """The tree of `NamedSharding`s for a (abstract) parameter tree of the JAX model."""
    parts = param_partitions(cfg)
    return jax.tree.map_with_path(lambda p, _: NamedSharding(mesh, parts[path_name(p)]), abstract_params)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """(batch, seq): rows split over data x fsdp."""
    return NamedSharding(mesh, P(sharding.BATCH_AXES, None))


def microbatch_sharding(mesh: Mesh) -> NamedSharding:
    """(accum, batch/accum, seq) for gradient accumulation: each micro-batch split as the batch is."""
    return NamedSharding(mesh, P(None, sharding.BATCH_AXES, None))


def per_device_sharding(mesh: Mesh) -> NamedSharding:
    """A 1-D array with one entry per device of the mesh (e.g. each process's stop flag)."""
    return NamedSharding(mesh, P(mesh.axis_names))


def activation_constraint(mesh: Mesh):
    spec = NamedSharding(mesh, P(sharding.BATCH_AXES, None, None))
    return lambda x: jax.lax.with_sharding_constraint(x, spec)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def path_name(path: Any) -> str:
    """`('layers', 'attention', 'wq')` -> `layers.attention.wq`."""
    return ".".join(str(k.key) for k in path if hasattr(k, "key"))  # drops the Variable's `.value`

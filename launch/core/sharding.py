"""The mesh rules: how each logical axis of the parameter table maps onto the device mesh.

JAX mesh axes are ("data", "fsdp", "tensor"). The batch is split over data x fsdp; weights are
split over fsdp along their `embed` dimension and over tensor along heads / mlp / vocab; the
stacked `layers` axis and norms are never split. PyTorch FSDP2 shards dimension 0 of every
parameter over the fsdp axis (replicated over data in HSDP). `jaxrun.mesh` turns these rules into
every sharding the JAX trainer uses (parameters, batch, grad-accumulation micro-batches,
activations) and `launch.launcher.plan` describes them; nothing else decides sharding.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

from launch.core.params import EMBED, HEADS, LAYERS, MLP, NORM, VOCAB

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
LOGICAL_RULES: Dict[str, Optional[str]] = {
    EMBED: "fsdp",
    HEADS: "tensor",
    MLP: "tensor",
    VOCAB: "tensor",
    NORM: None,
    LAYERS: None,
}


def jax_partition(axes: Tuple[str, ...]) -> Tuple[Optional[str], ...]:
    """Mesh axis (or None) for each dimension, in jax.sharding.PartitionSpec order."""
    return tuple(LOGICAL_RULES[a] for a in axes)


def jax_local_shape(shape: Tuple[int, ...], axes: Tuple[str, ...], mesh: Dict[str, int]) -> Tuple[int, ...]:
    return tuple(math.ceil(n / mesh[ax]) if ax else n for n, ax in zip(shape, jax_partition(axes)))


def torch_local_shape(shape: Tuple[int, ...], mesh: Dict[str, int]) -> Tuple[int, ...]:
    """FSDP2 shards dim 0 over the fsdp axis (padded to equal chunks)."""
    return (math.ceil(shape[0] / mesh["fsdp"]),) + tuple(shape[1:])


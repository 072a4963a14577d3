"""The bytes each collective of a training step moves, from the parameter table and the mesh.

`per_step(...)` lists, for one optimizer step of one cell, every collective its framework runs:
what it moves, over which mesh axis, how often, how many bytes each device sends in total, and on
which interconnect tier (`launch.core.interconnects.TIERS`) its group lies. Sizes come from
`launch.core.params.param_table` and the sharding rules of `launch.core.sharding`; nothing is
measured here. Bytes are what one device sends with the bandwidth-optimal (ring) algorithms, the
convention of nccl-tests' "bus bandwidth": for a group of n devices and a tensor of S bytes in full,

    all-gather      (n - 1) / n * S      (each device receives the n - 1 shards it lacks)
    reduce-scatter  (n - 1) / n * S
    all-reduce      2 (n - 1) / n * S    (a reduce-scatter then an all-gather)

What each framework runs per optimizer step of `train.grad_accum` = k micro-batches:

- PyTorch FSDP2 (`torchrun_fsdp.parallel`; every parameter sharded on dim 0 over `fsdp`, padded to
  equal shards): each block's parameters all-gathered in its forward and again in its backward
  (`reshard_after_forward`), the root's (embeddings, final norm, lm head) once (FSDP2 keeps the root
  unsharded between forward and backward), k times each; gradients reduce-scattered once per step
  (sync on the last micro-batch only); with `parallel.data` > 1 (HSDP) the gradient shards are
  all-reduced over `data` once per step. Gathers move the compute dtype (`param_dtype`), reductions
  fp32 (`reduce_dtype`). One fp32 rank runs no FSDP and no collective.
- JAX (`jaxrun`; weights sharded over `fsdp` on their `embed` dimension and over `tensor` on heads /
  mlp / vocab, norms replicated): weights all-gathered over `fsdp` in forward and in backward, their
  gradients reduce-scattered over `fsdp` and the shards all-reduced over `data`, norms' gradients
  all-reduced over data x fsdp, once per micro-batch each (the accumulator in the micro-batch scan is
  sharded like the parameters). Gathers are assumed to move the compute dtype (the cast to bf16 is
  elementwise on the shard, before the gather), reductions fp32. Where XLA's partitioner decides
  otherwise (a gathered weight kept for backward, a bf16 reduction), the true bytes differ by a
  constant factor per mesh shape; a bandwidth fitted from measured cells absorbs it.
- Tensor parallelism (JAX, `parallel.tensor` > 1, Megatron-LM's count): per layer two all-reduces
  of the activations (batch x seq x d_model, compute dtype) in forward (after the attention output
  projection and after the MLP) and two in backward (the inputs of the column-parallel projections),
  two more with `model.remat=full` (the recomputed forward); plus one for the vocab-sharded
  embedding lookup and one for the lm head's input gradient. The vocab-sharded softmax's per-token
  max and sum (d_model times smaller) and the gradient-norm and loss scalars are left out.

Devices are laid out row-major over the mesh axes ("data", "fsdp", "tensor": tensor varies
fastest, as `jax.make_mesh` and `init_device_mesh` order ranks) and a node holds
`devices_per_node` consecutive ones; a group whose members sit on more than one node is `inter`
(its ring crosses the network, which then limits it), else `intra`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Sequence

from launch.config.schema import ModelConfig
from launch.core import sharding
from launch.core.params import named_params

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
REDUCE_BYTES = 4  # gradients are reduced in fp32 by both frameworks
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all-gather", "reduce-scatter", "all-reduce"


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a step: `bytes` is what each device sends in all `count` of them."""
    op: str
    what: str
    axis: str  # mesh axis (or axes joined by '+') the groups run over
    group: int  # devices per group
    count: int  # times per optimizer step
    bytes: float
    tier: str  # intra | inter


def wire_fraction(op: str, n: int) -> float:
    """Bytes each device sends per byte of the full tensor, for a group of n (ring algorithms)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if op == ALL_REDUCE else (n - 1) / n


def group_tier(mesh: Mapping[str, int], axes: Sequence[str], devices_per_node: int) -> str:
    """`inter` when the group over `axes` that holds device 0 spans more than one node, else `intra`."""
    strides = {a: math.prod(mesh[b] for b in sharding.MESH_AXES[i + 1:]) for i, a in enumerate(sharding.MESH_AXES)}
    members = [0]
    for a in axes:
        members = [m + j * strides[a] for m in members for j in range(mesh[a])]
    return "inter" if len({m // max(1, devices_per_node) for m in members}) > 1 else "intra"


def _elements(shape: Iterable[int]) -> int:
    return math.prod(shape)


def per_step(model: ModelConfig, framework: str, mesh: Mapping[str, int], global_batch: int, grad_accum: int = 1,
             devices_per_node: int = 1 << 30) -> List[Collective]:
    """Every collective of one optimizer step of a cell (see the module docstring); empty when it has none."""
    mesh = {a: int(mesh.get(a, 1)) for a in sharding.MESH_AXES}
    data, fsdp, tensor = mesh["data"], mesh["fsdp"], mesh["tensor"]
    k = max(1, grad_accum)
    gather_bytes = DTYPE_BYTES[model.dtype]
    if framework == "torch" and data * fsdp == 1 and model.dtype == "fp32":
        return []  # one fp32 rank: torchrun_fsdp.parallel.needs_fsdp leaves it unwrapped
    out: List[Collective] = []

    def add(op, what, axes, count, full_bytes):
        n = math.prod(mesh[a] for a in axes)
        sent = wire_fraction(op, n) * full_bytes * count
        if sent > 0:
            out.append(Collective(op, what, "+".join(axes), n, count, sent, group_tier(mesh, axes, devices_per_node)))

    if framework == "torch":
        block = root = full = 0
        for _, spec in named_params(model):
            padded = _elements(sharding.torch_local_shape(spec.shape, mesh)) * fsdp  # dim 0 padded to equal shards
            full += padded
            if spec.per_layer:
                block += padded
            else:
                root += padded
        add(ALL_GATHER, "block parameters, forward and backward", ("fsdp",), 2 * k, block * gather_bytes)
        add(ALL_GATHER, "root parameters (embeddings, final norm, lm head), forward", ("fsdp",), k, root * gather_bytes)
        add(REDUCE_SCATTER, "gradients", ("fsdp",), 1, full * REDUCE_BYTES)
        add(ALL_REDUCE, "gradient shards (HSDP replicas)", ("data",), 1, full / fsdp * REDUCE_BYTES)
        return out

    sharded = replicated = 0  # elements per tensor-parallel rank: weights with an fsdp dimension, and the rest
    for _, spec in named_params(model):
        local = _elements(sharding.jax_local_shape(spec.shape, spec.axes, mesh))
        if "fsdp" in sharding.jax_partition(spec.axes):
            sharded += local * fsdp
        else:
            replicated += local
    add(ALL_GATHER, "weights, forward and backward", ("fsdp",), 2 * k, sharded * gather_bytes)
    add(REDUCE_SCATTER, "weight gradients", ("fsdp",), k, sharded * REDUCE_BYTES)
    add(ALL_REDUCE, "weight-gradient shards (data replicas)", ("data",), k, sharded / fsdp * REDUCE_BYTES)
    add(ALL_REDUCE, "norm gradients (replicated weights)", ("data", "fsdp"), k, replicated * REDUCE_BYTES)
    if tensor > 1:
        rows = global_batch // (data * fsdp) // k  # sequences per device per micro-batch
        per_layer = 6 if model.remat == "full" else 4
        activations = rows * model.seq_len * model.d_model * gather_bytes
        add(ALL_REDUCE, f"activations ({per_layer} per layer + embedding + lm head)", ("tensor",),
            k * (per_layer * model.n_layers + 2), activations)
    return out


def by_tier(collectives: Iterable[Collective]) -> Dict[str, float]:
    """Bytes each device sends per step on each tier (both tiers always present)."""
    out = {"intra": 0.0, "inter": 0.0}
    for c in collectives:
        out[c.tier] += c.bytes
    return out


def as_dicts(collectives: Iterable[Collective]) -> List[Dict[str, object]]:
    """Plain data for report.json."""
    return [dict(c.__dict__) for c in collectives]

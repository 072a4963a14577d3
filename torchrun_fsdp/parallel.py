"""How the PyTorch model is spread over devices: activation checkpointing, torch.compile, FSDP2.

`parallelize(model, cfg, mesh)` is the one place that decides, as torchtitan's `parallelize_llama`
does, in this order: activation checkpointing per block (`apply_ac`), then `torch.compile` per
block (`apply_compile`, so the compiled region includes the recomputation), then FSDP2
(`apply_fsdp`: `fully_shard` on each block, then the root). A single fp32 rank is left unwrapped:
there is nothing to shard, and FSDP's hooks would only cost time. With `parallel.data>1` and
`parallel.fsdp>1` the mesh is 2-D and FSDP2 does HSDP (replicate over data, shard over fsdp).
bf16 compute uses `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from launch.config import mesh_shape
from launch.config.schema import Config


def build_mesh(cfg: Config, device_type: str) -> DeviceMesh:
    shape = mesh_shape(cfg)
    return init_device_mesh(device_type, (shape["data"], shape["fsdp"]), mesh_dim_names=("data", "fsdp"))


def parallelize(model: torch.nn.Module, cfg: Config, mesh: DeviceMesh) -> torch.nn.Module:
    """Apply AC, then compile, then FSDP to `model` (built on the meta device); returns it."""
    m = cfg.model
    apply_ac(model, m.remat)
    if cfg.torch.compile:
        apply_compile(model, dynamic=cfg.torch.compile_dynamic, fullgraph=cfg.torch.compile_fullgraph)
    if needs_fsdp(mesh, m.dtype):
        apply_fsdp(model, mesh, m.dtype)
    return model


def needs_fsdp(mesh: DeviceMesh, dtype: str) -> bool:
    """FSDP unless this is one fp32 rank: nothing to shard, no dtype to cast, so its hooks are pure cost."""
    return mesh.size() > 1 or dtype == "bf16"


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """1-D fsdp mesh for plain FSDP, 2-D (data, fsdp) for HSDP."""
    return mesh if mesh["data"].size() > 1 else mesh["fsdp"]


def apply_ac(model: torch.nn.Module, mode: str) -> None:
    """Activation checkpointing per block (`model.remat`: full; `dots` saves matmul outputs)."""
    if mode == "none":
        return
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def wrap(block):
        if mode == "full":
            return checkpoint_wrapper(block, preserve_rng_state=False)
        save = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

        return checkpoint_wrapper(block, preserve_rng_state=False,
                                  context_fn=functools.partial(create_selective_checkpoint_contexts, policy))

    for i, block in enumerate(model.layers):
        model.layers[i] = wrap(block)


def apply_compile(model: torch.nn.Module, dynamic: bool = False, fullgraph: bool = True) -> None:
    """torch.compile each block (compilation happens lazily on the first step). `dynamic`: symbolic
    shapes from the first compile (`dynamic=True`); else torch's default (`dynamic=None`: static,
    then dynamic once a shape changed). `fullgraph=False` lets Dynamo break the graph."""
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, fullgraph=fullgraph, dynamic=True if dynamic else None)


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, dtype: str) -> None:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16" else MixedPrecisionPolicy()
    m = fsdp_mesh(mesh)
    for block in model.layers:
        fully_shard(block, mesh=m, mp_policy=mp)
    fully_shard(model, mesh=m, mp_policy=mp)

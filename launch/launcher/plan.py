"""`scaleout plan`: what a config would do, computed without jax, torch or any device.

The resolved config, the mesh and how the batch and every weight are split, the parameter count
(total and per device), FLOPs per token from `launch.core.flops`, the bytes per device of weights,
gradients and AdamW state, and the exact commands the target would run.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List

from omegaconf import OmegaConf

from launch import config as config_mod, targets
from launch.config import ConfigError, contenders
from launch.config.schema import Config
from launch.core import engine, flops, sharding
from launch.core.params import LAYERS, count_params, param_table
from launch.launcher.rundir import RunDir, applied

BYTES_PER_PARAM = 4  # fp32 master weights
ADAM_STATES = 2  # mu and nu, fp32


def weight_layouts(cfg: Config) -> List[Dict[str, Any]]:
    """One row per parameter-table entry: global shape, logical axes, split, shape on one device."""
    mesh = config_mod.mesh_shape(cfg)
    rows = []
    for spec in param_table(cfg.model):
        shape, axes = spec.shape, spec.axes
        if spec.per_layer and cfg.framework == "jax":
            shape, axes = (cfg.model.n_layers,) + shape, (LAYERS,) + axes
        if cfg.framework == "jax":
            split = [ax for ax in sharding.jax_partition(axes)]
            local = sharding.jax_local_shape(shape, axes, mesh)
        else:
            split = ["fsdp"] + [None] * (len(shape) - 1) if mesh["fsdp"] > 1 else [None] * len(shape)
            local = sharding.torch_local_shape(shape, mesh)
        count = cfg.model.n_layers if spec.per_layer and cfg.framework == "torch" else 1
        rows.append({"name": spec.name if cfg.framework == "torch" else spec.stacked_name,
                     "shape": list(shape), "axes": list(axes), "split": split, "local_shape": list(local),
                     "copies": count})
    return rows


def describe(cfg: Config) -> Dict[str, Any]:
    cfg = applied(cfg)
    mesh = config_mod.mesh_shape(cfg)
    counts = count_params(cfg.model)
    layouts = weight_layouts(cfg)
    per_device = sum(math.prod(r["local_shape"]) * r["copies"] for r in layouts)
    dp = mesh["data"] * mesh["fsdp"]
    weights = per_device * BYTES_PER_PARAM
    run = RunDir(cfg)
    cell = run.cell(contenders.of_run(cfg), cfg.devices)
    return {
        "framework": cfg.framework,
        "contender": cell.contender,
        "target": cfg.target,
        "devices": cfg.devices,
        "params": counts["total"],
        "params_matmul": counts["matmul"],
        "params_per_device": per_device,
        "flops_per_token": flops.flops_per_token(cfg.model),
        "tokens_per_step": cfg.train.global_batch * cfg.model.seq_len,
        "bytes_per_device": engine.bytes_per_device(weights=weights, optimizer=weights * ADAM_STATES),
        "mesh": {"axes": dict(mesh), "batch": {"split": list(sharding.BATCH_AXES), "global": cfg.train.global_batch,
                                               "per_device": cfg.train.global_batch // dp,
                                               "micro_batch_per_device": cfg.train.global_batch // dp // cfg.train.grad_accum},
                 "weights": layouts},
        "cell": cell.name,
        "run_dir": str(run.path),
        "commands": targets.get(cfg.target).plan_commands(cell.cfg, cell.dir),
        "sweep": sweep_cells(cfg, run),
        "config": config_mod.to_dict(cfg),
    }


def sweep_cells(cfg: Config, run: RunDir) -> Dict[str, Any]:
    """The cells `scaleout sweep` would run with this config (plan itself describes the one cell of `framework` x
    `devices`), or the sentence that would refuse the sweep."""
    from launch.launcher import sweep
    try:
        cells = sweep.expand(cfg, run)
    except ConfigError as e:
        return {"cells": [], "error": str(e)}
    return {"cells": [{"name": c.name, "framework": c.framework, "devices": c.devices,
                       "global_batch": c.cfg.train.global_batch} for c in cells], "error": None}


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"


def format_text(p: Dict[str, Any]) -> str:
    m = p["mesh"]
    lines = ["# resolved config", OmegaConf.to_yaml(OmegaConf.create(p["config"])).rstrip(), "",
             f"# {p['contender']} ({p['framework']}) on {p['devices']} device(s), target={p['target']}",
             "mesh: " + " x ".join(f"{k}={v}" for k, v in m["axes"].items()),
             f"batch: {m['batch']['global']} sequences split over {'x'.join(m['batch']['split'])} -> "
             f"{m['batch']['per_device']} per device ({m['batch']['micro_batch_per_device']} per micro-batch)",
             f"params: {p['params']:,} total ({p['params_matmul']:,} in matmuls), {p['params_per_device']:,} per device",
             f"flops/token: {p['flops_per_token']:,} (6*N + 12*L*T*d)  tokens/step: {p['tokens_per_step']:,}",
             "bytes/device: " + ", ".join(f"{k} {_gib(v)}" for k, v in p["bytes_per_device"].items()),
             "", f"{'weight':38} {'shape':>22} {'split':>24} {'per device':>20}"]
    for r in m["weights"]:
        split = "(" + ", ".join(s or "-" for s in r["split"]) + ")"
        times = f" x{r['copies']}" if r["copies"] > 1 else ""
        lines.append(f"{r['name']:38} {str(tuple(r['shape'])):>22} {split:>24} {str(tuple(r['local_shape'])) + times:>20}")
    lines += ["", f"# run dir: {p['run_dir']}  cell: {p['cell']}", "# commands"] + p["commands"]
    sw = p["sweep"]
    lines += ["", f"# sweep: this plan is the one cell of framework={p['framework']} devices={p['devices']} "
              f"(train.global_batch={m['batch']['global']} as given); `scaleout sweep` with this config would run " +
              (f"{len(sw['cells'])} cell(s): " + ", ".join(f"{c['name']} (batch {c['global_batch']})" for c in sw["cells"]) +
               "; plan one of them with framework=F devices=N train.global_batch=B"
               if not sw["error"] else f"nothing: {sw['error']}")]
    return "\n".join(lines)


def to_json(p: Dict[str, Any]) -> str:
    return json.dumps(p, indent=2)

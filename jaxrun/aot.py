"""Compile the JAX trainer's train step ahead of time for devices this machine does not have.

    python -m jaxrun.aot CELL.yaml [CELL.yaml ...]   -> one JSON list on stdout (launch.launcher.aot runs it)

For target=tpu the devices come from libtpu's topology description of the cell's slice (e.g.
`v5e:4x8`, 8 hosts of 2x2 chips), so XLA:TPU compiles the program every host of that slice would
run. For NVIDIA GPUs (`plan.device`, e.g. h100) they come from XLA:GPU's deviceless topology
(`get_topology_desc(platform="cuda", target_config=<GpuTargetConfigProto text>,
topology="1x<hosts>x<gpus per host>")`, needs a jax CUDA plugin and ptxas: the `gpu-aot` extra).
Otherwise they are simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count, set by
the caller). The program is `jaxrun.train.TrainStep`: the function, shardings and donation
`JaxEngine` compiles before its first step, with the attention kernel the trainer would run there
(`launch.core.attention`). Per device it reports XLA's `memory_analysis()` and `cost_analysis()`
next to `launch.core.flops`.

A program that does not fit is refused by XLA:TPU at compile time ("Ran out of memory in memory
space hbm. Used X of Y hbm"): that is reported as an estimate of X that does not fit, not an error.
XLA:GPU compiles it anyway (its rematerialisation only warns); the caller compares the total.

Results are kept in a cache (`plan.cache_dir`, handed over in SCALEOUT_COMPILE_CACHE) keyed by the
lowered program's text, the devices it is compiled for, the jax/jaxlib/plugin versions, the XLA
flags and this file: a repeated `plan --compile` of the same cell is answered without compiling.
JAX's persistent compilation cache cannot do it: it stores the executable of a compile-only client
but cannot load it back ("PjRtCompiler must be constructed with a Client to call
DeserializeLoadedExecutable", jaxlib 0.10.2).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrun import mesh as mesh_mod
from jaxrun.train import MATMUL_PRECISION, TrainStep
from launch import config as config_mod
from launch.common import envvars, files
from launch.config.schema import Config
from launch.core import attention, flops, sharding

log = logging.getLogger(__name__)
# XLA:TPU's refusals: "Ran out of memory on HBM, the total memory required for HLO temporaries (60.04G)
# exceeds available HBM (15.75G)." and "Ran out of memory in memory space hbm. Used 25.49G of 15.75G hbm."
OOM_RES = (re.compile(r"required for HLO (temporaries) \(([0-9.]+)([KMGT])\) exceeds available HBM \(([0-9.]+)([KMGT])\)"),
           re.compile(r"(Used) ([0-9.]+)([KMGT]) of ([0-9.]+)([KMGT]) hbm", re.IGNORECASE))
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
SCAN_NOTE = ("XLA's cost analysis counts a loop body once, not once per iteration ({what}); "
             "compile with model.scan_layers=false train.grad_accum=1 for a FLOPs figure to compare with the formula")


def topology_devices(t: Dict[str, Any]) -> tuple:
    """(devices, description) of a TPU slice, from libtpu without any TPU attached; `t` is the slice's
    topology as the launcher describes it (`launch.launcher.aot.tpu_topology`, in files.TOPOLOGY_SUFFIX)."""
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="tpu", topology_name=t["name"], chip_config_name=t["chip_config_name"],
                                        chips_per_host_bounds=tuple(t["chips_per_host_bounds"]), num_slices=1)
    devices = list(topo.devices)
    hosts = len({d.process_index for d in devices})
    where = (f"TPU {t['accelerator_type']} (topology {t['name']}: {hosts} host(s) x {t['chips_per_host']} chips, "
             f"compiled here through libtpu)")
    return devices, where, {**t, "hosts_seen": hosts}


def gpu_devices(t: Dict[str, Any]) -> tuple:
    """(devices, description, topology) of `t["hosts"]` hosts of `t["gpus_per_host"]` NVIDIA GPUs described by
    `t["target_config"]` (`launch.core.gpu_targets`), from XLA:GPU without any GPU attached."""
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", target_config=t["target_config"], topology=t["topology"])
    devices = list(topo.devices)
    hosts = len({d.process_index for d in devices})
    where = (f"{len(devices)} x {t['name']} ({hosts} host(s) x {t['gpus_per_host']} GPUs, compiled here for XLA:GPU "
             "without a GPU)")
    return devices, where, {k: v for k, v in t.items() if k != "target_config"} | {"hosts_seen": hosts}


def make_mesh(cfg: Config, devices: List[Any]) -> Mesh:
    """The trainer's mesh (`jaxrun.mesh.make_mesh`) over the given devices instead of this machine's."""
    shape = config_mod.mesh_shape(cfg)
    axis_shapes = tuple(shape[a] for a in sharding.MESH_AXES)
    try:
        return jax.make_mesh(axis_shapes, sharding.MESH_AXES, axis_types=mesh_mod.AXIS_TYPES, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        return Mesh(np.array(devices).reshape(axis_shapes), sharding.MESH_AXES, axis_types=mesh_mod.AXIS_TYPES)


def _oom(e: Exception) -> Dict[str, Any] | None:
    """What XLA:TPU said when it refused a program for its memory: {what, used, capacity} in bytes."""
    for pattern in OOM_RES:
        m = pattern.search(str(e))
        if m:
            return {"what": "temporaries" if m.group(1) == "temporaries" else "total",
                    "used": int(float(m.group(2)) * UNITS[m.group(3).upper()]),
                    "capacity": int(float(m.group(4)) * UNITS[m.group(5).upper()])}
    return None


def argument_bytes(program: TrainStep, cfg: Config) -> int:
    """Bytes of the step's arguments on one device: its shard of the state and of the batch."""
    total = 0
    for leaf in jax.tree.leaves((program.abstract_params, program.abstract_opt)):
        total += int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
    batch = program.batch_sh.shard_shape((cfg.train.global_batch, cfg.model.seq_len))
    return total + 2 * int(np.prod(batch)) * 4 + 4  # inputs, targets (int32), lr


GPU_LEAVES_OUT = ("a deviceless XLA:GPU compile: no autotuning (GEMMs are default-tiled Triton fusions), no cuDNN "
                  "workspace, no NCCL buffers, no CUDA context or allocator overhead; model.gpu_memory_fraction leaves "
                  "the rest of the GPU for them")


def lower_step(cfg: Config, mesh: Mesh, platform: str) -> tuple:
    """(program, lowered, kernel compiled, notes): the train step with the attention kernel the trainer would
    run on `platform`; a fused kernel that cannot be lowered here (cuDNN's needs cuDNN installed even without
    a GPU) falls back to the dense one, said in a note."""
    m = cfg.model
    notes = []
    options = attention.candidates("jax", platform, m.dtype, m.attention, m.attention_impl)
    dense = next((k for k in options if k.kind == attention.DENSE), None) or attention.Kernel("jax", "xla", attention.DENSE)
    for k in options + ([] if dense in options else [dense]):
        program = TrainStep(cfg, mesh, k.name)
        try:
            return program, program.lower(), k, notes
        except Exception as e:
            if k.kind == attention.DENSE:
                raise
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            notes.append(f"attention compiled with XLA's dense path, not {k.name} ({k.kind}), which the trainer runs "
                         f"on the GPU: it could not be lowered here ({why}); installing nvidia-cudnn-cu12 (~700 MB) "
                         "compiles the fused kernel, which needs less memory than the dense one")
    raise AssertionError("unreachable")


def cache_key(cfg: Config, lowered, topology: Dict[str, Any] | None) -> str:
    """Everything that determines the compiled program and what this module reports of it."""
    import importlib.metadata as md
    versions = {}
    for dist in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
                 "jax-cuda13-pjrt", "nvidia-cuda-nvcc-cu12", "nvidia-cudnn-cu12"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    h = hashlib.sha256()
    for part in (lowered.as_text(), json.dumps(topology, sort_keys=True, default=str), json.dumps(versions, sort_keys=True),
                 os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""), Path(__file__).read_text(),
                 json.dumps({"devices": cfg.devices, "target": cfg.target, "batch": cfg.train.global_batch,
                             "seq_len": cfg.model.seq_len, "grad_accum": cfg.train.grad_accum,
                             "scan_layers": cfg.model.scan_layers, "n_layers": cfg.model.n_layers,
                             "remat": cfg.model.remat, "mesh": config_mod.mesh_shape(cfg)}, sort_keys=True)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _cache_dir() -> Path | None:
    value = os.environ.get(envvars.COMPILE_CACHE, "")
    return Path(value) if value else None


def compile_cell(cfg: Config, topology: Dict[str, Any] | None = None) -> Dict[str, Any]:
    """Compile the cell's train step for `topology` (a TPU slice, or NVIDIA GPUs with `"platform": "cuda"`) if
    given, else for simulated CPU devices; answered from the compile cache when it holds the same program."""
    jax.config.update("jax_default_matmul_precision", MATMUL_PRECISION[cfg.model.matmul_precision])
    if topology is not None and topology.get("platform") == "cuda":
        devices, where, topo = gpu_devices(topology)
    elif topology is not None:
        devices, where, topo = topology_devices(topology)
    else:
        cpus = jax.devices("cpu")
        if len(cpus) < cfg.devices:
            raise RuntimeError(f"{cfg.devices} simulated CPU devices needed, {len(cpus)} present "
                               "(XLA_FLAGS=--xla_force_host_platform_device_count)")
        devices, where, topo = cpus[:cfg.devices], f"{cfg.devices} simulated CPU device(s) (target={cfg.target})", None
    mesh = make_mesh(cfg, devices)
    kind = devices[0].device_kind
    t0 = time.perf_counter()
    program, lowered, kernel, notes = lower_step(cfg, mesh, devices[0].platform)
    lower_s = time.perf_counter() - t0
    cache = _cache_dir()
    key = cache_key(cfg, lowered, topology) if cache else None
    if cache and key:
        hit = files.read_json(cache / f"{key}.json")
        if isinstance(hit, dict):
            return {**hit, "lower_s": lower_s, "cache": {"hit": True, "key": key, "dir": str(cache)}}
    out = _compile(cfg, program, lowered, devices, where, topo, kind, lower_s)
    out["attention_kernel"] = kernel.settings()
    out["notes"] = notes + out["notes"]
    if devices[0].platform == "gpu":
        out["notes"].append(GPU_LEAVES_OUT)
    if cache and key:
        files.write_json(cache / f"{key}.json", {**out, "compiled_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        out["cache"] = {"hit": False, "key": key, "dir": str(cache)}
    return out


def _compile(cfg: Config, program: TrainStep, lowered, devices, where: str, topo, kind: str, lower_s: float) -> Dict[str, Any]:
    tokens = cfg.train.global_batch * cfg.model.seq_len
    formula = flops.flops_per_token(cfg.model) * tokens
    out: Dict[str, Any] = {"framework": "jax", "target": cfg.target, "devices": cfg.devices, "where": where,
                           "device_kind": kind, "platform": devices[0].platform, "topology": topo,
                           "mesh": config_mod.mesh_shape(cfg), "method": f"XLA memory_analysis ({devices[0].platform})",
                           "lower_s": lower_s, "notes": []}
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        compiled = lowered.compile()
    except Exception as e:  # XLA:TPU refuses a program that does not fit in HBM
        oom = _oom(e)
        if oom is None:
            raise
        out.update(compiled=False, compile_s=time.perf_counter() - t0, compile_cpu_s=time.process_time() - c0,
                   compiler_capacity_bytes=oom["capacity"], flops=None)
        if oom["what"] == "temporaries":  # the state's shard comes on top of the temporaries XLA counted
            arg = argument_bytes(program, cfg)
            out["memory"] = {"argument": arg, "temp": oom["used"], "total": arg + oom["used"]}
            out["notes"].append(f"XLA:TPU refused the program: its temporaries alone need {oom['used'] / 2**30:.2f} GiB "
                                f"where {oom['capacity'] / 2**30:.2f} GiB of HBM is usable; the total shown adds the "
                                "arguments (the state's shard and the batch) and omits the generated code")
        else:
            out["memory"] = {"total": oom["used"]}
            out["notes"].append(f"XLA:TPU refused the program: it needs {oom['used'] / 2**30:.2f} GiB of HBM where "
                                f"{oom['capacity'] / 2**30:.2f} GiB is usable")
        return out
    out["compile_s"] = time.perf_counter() - t0
    out["compile_cpu_s"] = time.process_time() - c0  # all threads: what a loaded machine does not inflate
    out["compiled"] = True
    ma = compiled.memory_analysis()
    mem = {"argument": ma.argument_size_in_bytes, "output": ma.output_size_in_bytes, "alias": ma.alias_size_in_bytes,
           "temp": ma.temp_size_in_bytes, "generated_code": ma.generated_code_size_in_bytes}
    mem["total"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["generated_code"]
    out["memory"] = mem
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla = float(cost["flops"]) if cost and "flops" in cost else None
    if xla is None and devices[0].platform == "gpu":
        xla = hlo_flops(compiled)
        if xla is not None:
            out["notes"].append("FLOPs: XLA's HLO cost analysis of the compiled GPU module, run through the CPU client "
                                "(a deviceless XLA:GPU compile reports no cost analysis of its own)")
    per_device = formula / cfg.devices
    out["flops"] = {"xla_per_device": xla, "formula_per_device": per_device, "tokens_per_step": tokens,
                    "ratio": xla / per_device if xla is not None else None}
    loops = []
    if cfg.model.scan_layers and cfg.model.n_layers > 1:
        loops.append(f"model.scan_layers=true: 1 of {cfg.model.n_layers} blocks")
    if cfg.train.grad_accum > 1:
        loops.append(f"train.grad_accum={cfg.train.grad_accum}: 1 of {cfg.train.grad_accum} micro-batches")
    if loops:
        out["flops"]["loops_counted_once"] = loops
        out["notes"].append(SCAN_NOTE.format(what="; ".join(loops)))
    if cfg.model.remat != "none":
        out["notes"].append(f"model.remat={cfg.model.remat}: XLA counts the recomputed forward, the formula does not")
    if devices[0].platform == "cpu" and cfg.target != "local":
        out["notes"].append("compiled for CPU devices: a GPU's compiler lays memory out differently")
    return out


def hlo_flops(compiled) -> float | None:
    """FLOPs of a compiled module whose backend reports none (deviceless XLA:GPU): XLA's HLO cost analysis
    of its optimised module on the CPU client. jaxlib has no public entry for it (`jax.stages.Compiled.
    cost_analysis()` is None here), so this is its one internal call, and a failure only drops the figure."""
    try:
        from jax._src.lib import xla_client
        module = compiled.runtime_executable().hlo_modules()[0]
        cost = xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
        return float(cost["flops"]) if cost and "flops" in cost else None
    except Exception as e:  # an internal API of jaxlib: another version may not have it
        log.warning(f"no FLOPs figure for the GPU compile: {type(e).__name__}: {e}")
        return None


def main(argv: List[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    results = []
    for path in map(Path, argv):
        topo = path.with_suffix(files.TOPOLOGY_SUFFIX)
        results.append(compile_cell(config_mod.load_resolved(path), json.loads(topo.read_text()) if topo.is_file() else None))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

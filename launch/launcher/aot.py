"""Know that a cell compiles and fits before it costs cluster time: `scaleout plan --compile` and the
sweep's fit check (`plan.check_fit=true`).

Per cell, one figure per device, from the framework's own machinery on this machine:

- jax: the trainer's real train step (`jaxrun.train.TrainStep`: the same function, shardings and
  donation, `grad_accum`, `remat` and `scan_layers` included) lowered and compiled ahead of time
  (`jaxrun.aot`), for the TPU slice that `devices` and `tpu.generation` name through libtpu's
  topology description (target tpu; needs the `tpu-aot` extra), for the NVIDIA GPUs `plan.device`
  names in the cell's node shape through XLA:GPU's deviceless compile (target slurm/local; needs
  the `gpu-aot` extra; `launch.core.gpu_targets` describes the GPU), else for simulated CPU devices.
  Memory from XLA's `memory_analysis()`: arguments + outputs - aliased (donated state) + temporaries
  (activations, compiler scratch) + generated code. FLOPs from `cost_analysis()` next to
  `launch.core.flops` x tokens.
- torch: one forward + backward + optimizer step of the real model and FSDP2 wrapping for the
  cell's world size in one process: a fake process group and `FakeTensorMode`, measured by
  `torch.distributed._tools.FSDPMemTracker` (`torchrun_fsdp.memory`). Traced on the CPU also for a
  GPU cell (a CPU build of torch cannot trace FSDP2 on CUDA devices), and labelled so.

On GPUs the limit is `model.gpu_memory_fraction` of the device's memory: the share both trainers
allow themselves.

Both run in a subprocess of this interpreter (jax or torch is never imported here) that prints
JSON; the limit each estimate is compared with is `device_limit`'s. Nothing is written but the
compile cache (`plan.cache_dir`, outside the run directory): the configs the subprocess reads live in
a temporary directory.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from launch import config as config_mod
from launch.common import envvars, files
from launch.config import ConfigError
from launch.config.schema import Config
from launch.core import flops
from launch.targets.errors import SubmitError

log = logging.getLogger(__name__)

EXTRA = "tpu-aot"
INSTALL = f"pip install 'scaleout[{EXTRA}]'"
GPU_INSTALL = "pip install -c constraints.txt 'scaleout[gpu-aot]'"
GIB = 2**30
TIMEOUT_S = 1800.0  # per cell of an estimating subprocess (300m compiles for a TPU slice in ~8 min on 2 busy cores)
KNOBS = "model.remat=full (or dots), a larger train.grad_accum, more fsdp (devices / parallel.fsdp), or a smaller train.global_batch"


# --------------------------------------------------------------------------- TPU slices

# chips -> the slice's torus: 2-D for v5e / v6e, 3-D for v4 / v5p (one JAX device per chip; megacore).
TORUS_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
TORUS_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
            256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16)}
CHIP_CONFIG = {"v4": "megacore", "v5p": "megacore", "v5e": "default", "v6e": "default"}


def tpu_topology(cfg: Config) -> Dict[str, Any]:
    """What `jax.experimental.topologies.get_topology_desc` needs for the cell's slice, and the slice's
    shape: e.g. v5e-32 is `v5e:4x8`, 8 hosts of 2x2 chips."""
    from launch.targets.tpu.target import slice_of
    s = slice_of(cfg)
    gen = s.generation
    dims = TORUS_2D[s.chips] if gen in ("v5e", "v6e") else TORUS_3D[s.chips]
    if s.workers == 1:
        per_host = dims + (1,) * (3 - len(dims))
    else:
        per_host = (2, 2, 1)
    hosts = s.chips // (per_host[0] * per_host[1] * per_host[2])
    if hosts != s.workers:
        raise ConfigError(f"devices={cfg.devices} on {gen}: no known host layout for {s.accelerator_type} "
                          f"({s.workers} hosts expected); plan --compile knows {', '.join(map(str, sorted(TORUS_2D if gen in ('v5e', 'v6e') else TORUS_3D)))} chips.")
    return {"name": f"{gen}:" + "x".join(map(str, dims)), "chip_config_name": CHIP_CONFIG[gen],
            "chips_per_host_bounds": list(per_host), "hosts": hosts, "chips_per_host": s.chips // hosts,
            "accelerator_type": s.accelerator_type}


TORCH_TPU_NOTE = ("framework=torch on TPU: TorchTPU has no compile without TPU chips, so this is the PyTorch estimate "
                  "(FSDP2 traced with fake tensors, as for GPUs), not XLA:TPU's own figure; the slice's compiler may "
                  "use more or less")


def tpu_env(accelerator_type: str) -> Dict[str, str]:
    """Environment for libtpu on a machine without TPUs: no metadata server, no chips to lock."""
    return {"TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_ACCELERATOR_TYPE": accelerator_type,
            "TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "localhost", "JAX_PLATFORMS": "cpu"}


# --------------------------------------------------------------------------- NVIDIA GPUs

def gpu_target(cfg: Config):
    """The `launch.core.gpu_targets` description of the cell's GPU when the JAX cell is compiled for GPUs
    (target slurm/local with a `plan.device` that has one), else None."""
    if cfg.framework != "jax" or cfg.target == "tpu" or not cfg.plan.device:
        return None
    from launch.core import gpu_targets
    return gpu_targets.lookup(cfg.plan.device)


def gpu_topology(cfg: Config) -> Optional[Dict[str, Any]]:
    """What `jaxrun.aot` compiles a GPU cell for: the node shape (SLURM: `slurm.devices_per_node` GPUs
    used per node; local: one host) and the GPU's target description."""
    from launch.core import gpu_targets
    t = gpu_target(cfg)
    if t is None:
        return None
    per_host = min(cfg.devices, cfg.slurm.devices_per_node) if cfg.target == "slurm" else cfg.devices
    hosts = -(-cfg.devices // per_host)
    if hosts * per_host != cfg.devices:
        raise ConfigError(f"devices={cfg.devices} does not fill nodes of slurm.devices_per_node={per_host} GPUs; "
                          "plan --compile needs whole nodes (a multiple of slurm.devices_per_node).")
    return {"platform": "cuda", "device": cfg.plan.device, "name": t.name, "hosts": hosts, "gpus_per_host": per_host,
            "topology": f"1x{hosts}x{per_host}", "memory_bytes": t.memory_bytes,
            "target_config": gpu_targets.target_config(t)}


def gpu_compiler_missing() -> Optional[str]:
    """What is missing for a deviceless XLA:GPU compile in this Python, or None."""
    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # no parent package
            return False

    if not any(found(f"jax_plugins.xla_cuda{v}") for v in (12, 13)):
        return "a jax CUDA plugin"
    ptxas = found("nvidia") and any(
        (Path(p) / sub / "bin" / "ptxas").exists() for p in importlib.util.find_spec("nvidia").submodule_search_locations
        for sub in ("cuda_nvcc", "cu13"))
    if not ptxas and shutil.which("ptxas") is None:
        return "ptxas (nvidia-cuda-nvcc-cu12)"
    return None


def gpu_env() -> Dict[str, str]:
    """Environment for XLA:GPU on a machine without GPUs: the CPU client only, nothing preallocated."""
    return {"JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


# --------------------------------------------------------------------------- limits

def host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_limit(cfg: Config, device_kind: Optional[str] = None) -> Tuple[Optional[int], str]:
    """(bytes one device may use, where that figure comes from); (None, why) when nothing says."""
    p = cfg.plan
    if p.device_memory_gib:
        return int(p.device_memory_gib * GIB), f"plan.device_memory_gib={p.device_memory_gib:g}"
    if cfg.target == "tpu":
        kind = device_kind or f"tpu {cfg.tpu.generation}"
        hbm = flops.datasheet_hbm(kind)
        return hbm, f"datasheet HBM of {kind}"
    if p.device:
        hbm = flops.datasheet_hbm(p.device)
        if hbm is None:
            known = ", ".join(sorted(flops.HBM_BYTES))
            raise ConfigError(f"plan.device={p.device!r} is not in the datasheet table; name one of {known}, "
                              "or set plan.device_memory_gib.")
        if p.device.lower().startswith("tpu"):
            return hbm, f"datasheet memory of {p.device}"
        from launch.core import gpu_targets
        t = gpu_targets.lookup(p.device)  # what the device reports, a little under the datasheet's GB
        memory, what = (t.memory_bytes, f"{t.name}'s {t.memory_bytes / GIB:.2f} GiB") if t else (hbm, f"datasheet memory of {p.device}")
        f = cfg.model.gpu_memory_fraction
        return int(f * memory), f"model.gpu_memory_fraction={f:g} of {what}"
    if cfg.target == "slurm":
        if cfg.slurm.gpus_per_node:
            return None, "the GPU model is unknown: set plan.device (e.g. h100) or plan.device_memory_gib"
        if cfg.slurm.mem_gb:
            ranks = min(cfg.devices, cfg.slurm.devices_per_node)
            return cfg.slurm.mem_gb * GIB // ranks, f"slurm.mem_gb={cfg.slurm.mem_gb} / {ranks} task(s) per node"
        return None, "the nodes' memory is unknown: set slurm.mem_gb or plan.device_memory_gib"
    return host_memory_bytes() // cfg.devices, f"host memory / {cfg.devices} device(s) sharing it"


# --------------------------------------------------------------------------- running the estimators

def needs_tpu_extra(cfgs: Sequence[Config]) -> bool:
    return any(c.framework == "jax" and c.target == "tpu" for c in cfgs)


def check_available(cfgs: Sequence[Config]) -> None:
    """One sentence saying what to install, before any subprocess starts."""
    fws = {c.framework for c in cfgs}
    for fw, extra in (("jax", "jax"), ("torch", "torch")):
        if fw in fws and importlib.util.find_spec(fw) is None:
            raise SubmitError(f"plan --compile for framework={fw} needs {fw} in this Python ({sys.executable}); "
                              f"install it with pip install 'scaleout[{extra}]'.")
    if needs_tpu_extra(cfgs) and importlib.util.find_spec("libtpu") is None:
        raise SubmitError(f"plan --compile with target=tpu compiles for the TPU slice through libtpu, which is not "
                          f"installed in this Python ({sys.executable}); install it with {INSTALL}.")
    gpu = next((c for c in cfgs if gpu_target(c) is not None), None)
    if gpu is not None:
        missing = gpu_compiler_missing()
        if missing:
            raise SubmitError(f"plan --compile with plan.device={gpu.plan.device} compiles for the GPU with XLA:GPU, "
                              f"which needs {missing} in this Python ({sys.executable}); install it with {GPU_INSTALL}.")


def _run(module: str, paths: List[Path], env: Dict[str, str], what: str) -> List[Dict[str, Any]]:
    cmd = [sys.executable, "-m", module, *map(str, paths)]
    log.debug(f"estimating {what}: {' '.join(cmd)}")
    timeout = TIMEOUT_S * len(paths)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SubmitError(f"estimating {what} took longer than {timeout:.0f} s; try one cell at a time "
                          "(scaleout plan --compile ...).") from None
    if p.returncode:
        last = [line for line in p.stderr.splitlines() if line.strip()][-3:] or [f"exit code {p.returncode}"]
        raise SubmitError(f"estimating {what} failed ({module}): {' | '.join(last)}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def estimate(cfgs: Sequence[Config], names: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """One estimate per config (in order), each with `limit_bytes`, `limit_source` and `fits`."""
    check_available(cfgs)
    names = list(names or [f"{c.framework}-{c.devices}" for c in cfgs])
    out: List[Optional[Dict[str, Any]]] = [None] * len(cfgs)
    with tempfile.TemporaryDirectory(prefix="scaleout-aot-") as tmp:
        paths = []
        for i, c in enumerate(cfgs):
            paths.append(Path(tmp) / f"{i}.yaml")
            config_mod.save(c, paths[-1])
        jax_tpu = [i for i, c in enumerate(cfgs) if c.framework == "jax" and c.target == "tpu"]
        jax_gpu = [i for i, c in enumerate(cfgs) if gpu_target(c) is not None]
        jax_cpu = [i for i, c in enumerate(cfgs) if c.framework == "jax" and c.target != "tpu" and i not in jax_gpu]
        for i in jax_gpu:
            files.write_json(paths[i].with_suffix(files.TOPOLOGY_SUFFIX), gpu_topology(cfgs[i]))
        cache = {envvars.COMPILE_CACHE: str(Path(cfgs[0].plan.cache_dir).expanduser()) if cfgs[0].plan.cache_dir else ""}
        torch_cells = [i for i, c in enumerate(cfgs) if c.framework == "torch"]
        by_type: Dict[str, List[int]] = {}
        for i in jax_tpu:  # a slice shape it cannot lay out is a one-sentence error here, before any compile
            topo = tpu_topology(cfgs[i])
            files.write_json(paths[i].with_suffix(files.TOPOLOGY_SUFFIX), topo)  # what jaxrun.aot compiles for
            by_type.setdefault(topo["accelerator_type"], []).append(i)
        for accelerator_type, idx in by_type.items():  # one process per slice type: libtpu reads it at start
            for i, r in zip(idx, _run("jaxrun.aot", [paths[i] for i in idx], {**tpu_env(accelerator_type), **cache},
                                      f"the {accelerator_type} compile")):
                out[i] = r
        if jax_gpu:
            for i, r in zip(jax_gpu, _run("jaxrun.aot", [paths[i] for i in jax_gpu], {**gpu_env(), **cache},
                                          "the XLA:GPU compile")):
                out[i] = r
        if jax_cpu:
            n = max(cfgs[i].devices for i in jax_cpu)
            env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", **cache}
            for i, r in zip(jax_cpu, _run("jaxrun.aot", [paths[i] for i in jax_cpu], env, "the CPU compile")):
                out[i] = r
        for i in torch_cells:  # one process per world size: the fake process group is per process
            out[i] = _run("torchrun_fsdp.memory", [paths[i]], {}, f"cell {names[i]}")[0]
            if cfgs[i].plan.device and not cfgs[i].plan.device.lower().startswith("tpu"):
                out[i].setdefault("notes", []).append(TORCH_GPU_NOTE)
            if not out[i].get("flops"):  # no compiler to count them: the formula's figure alone
                out[i]["flops"] = formula_flops(cfgs[i])
    for i, (c, r) in enumerate(zip(cfgs, out)):
        assert r is not None
        r["cell"] = names[i]
        torch_tpu = c.framework == "torch" and c.target == "tpu"
        if torch_tpu:  # TorchTPU cannot compile without chips: the PyTorch estimate stands in, and says so
            r.setdefault("notes", []).append(TORCH_TPU_NOTE)
        limit, source = device_limit(c, None if torch_tpu else r.get("device_kind"))
        if r.get("compiler_limit_bytes") and not c.plan.device_memory_gib:
            limit, source = r["compiler_limit_bytes"], f"usable HBM of {r.get('device_kind')} reported by XLA"
        r["limit_bytes"], r["limit_source"] = limit, source
        total = (r.get("memory") or {}).get("total")
        r["fits"] = None if limit is None or total is None else bool(total <= limit)
    return out  # type: ignore[return-value]


TORCH_GPU_NOTE = ("PyTorch's estimate is traced on this machine's CPU (a CPU build of torch cannot trace FSDP2 on "
                  "CUDA devices): tensor memory only, without the CUDA context, allocator slack or NCCL buffers; "
                  "the JAX figure for the same GPU is XLA:GPU's own")


def formula_flops(cfg: Config) -> Dict[str, Any]:
    """`launch.core.flops`' FLOPs of one step per device, for a cell whose framework reports no count of its own."""
    tokens = cfg.train.global_batch * cfg.model.seq_len
    return {"xla_per_device": None, "formula_per_device": flops.flops_per_token(cfg.model) * tokens / cfg.devices,
            "tokens_per_step": tokens, "ratio": None}


# --------------------------------------------------------------------------- the fit check

def refusal(r: Dict[str, Any]) -> Optional[str]:
    """The one sentence refusing a cell whose estimate exceeds its limit, or None."""
    if r.get("fits") is not False:
        return None
    return (f"cell {r['cell']} needs about {_gib(r['memory']['total'])} per device ({r['method']}) but a device has "
            f"{_gib(r['limit_bytes'])} ({r['limit_source']}); try {KNOBS}.")


def check_fit(cfg: Config, cells: Sequence[Any]) -> Dict[str, Dict[str, Any]]:
    """`plan.check_fit`: estimate every cell; a ConfigError naming the first that does not fit."""
    results = estimate([c.cfg for c in cells], [c.name for c in cells])
    refused = [r for r in results if refusal(r)]
    if refused:
        others = [r["cell"] for r in refused[1:]]
        more = f" (cell{'s' if len(others) > 1 else ''} {', '.join(others)} do{'es' if len(others) == 1 else ''} not fit either)" if others else ""
        raise ConfigError(refusal(refused[0])[:-1] + more + "; nothing was written or started.")
    return {r["cell"]: r for r in results}


# --------------------------------------------------------------------------- output

def _gib(n: Optional[float]) -> str:
    if n is None:
        return "?"
    return f"{n / GIB:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def format_text(results: Sequence[Dict[str, Any]]) -> str:
    lines = []
    for r in results:
        lines.append(f"# {r['cell']}: {r['framework']} on {r['devices']} device(s), {r['where']}")
        lines.append("mesh: " + " x ".join(f"{k}={v}" for k, v in r["mesh"].items()))
        mem = r.get("memory") or {}
        if r["framework"] == "jax":
            if r.get("compiled", True):
                lines.append(f"per device: arguments {_gib(mem.get('argument'))} + outputs {_gib(mem.get('output'))} "
                             f"- aliased (donated) {_gib(mem.get('alias'))} + temporaries {_gib(mem.get('temp'))} "
                             f"+ code {_gib(mem.get('generated_code'))} = {_gib(mem.get('total'))}")
            elif "temp" in mem:
                lines.append(f"per device: arguments {_gib(mem.get('argument'))} + temporaries {_gib(mem.get('temp'))} "
                             f"= at least {_gib(mem.get('total'))} (XLA refused to compile it)")
            else:
                lines.append(f"per device: {_gib(mem.get('total'))} (XLA refused to compile it)")
            cpu = f", {r['compile_cpu_s']:.1f} s of CPU" if r.get("compile_cpu_s") is not None else ""
            cached = (f"; answered from the compile cache ({(r.get('cache') or {}).get('dir')}), compiled {r.get('compiled_at')}"
                      if (r.get("cache") or {}).get("hit") else "")
            lines.append(f"compile: {r['compile_s']:.2f} s{cpu} (+ {r['lower_s']:.2f} s tracing and lowering){cached}")
            k = r.get("attention_kernel") or {}
            if k:
                lines.append(f"attention: {k.get('attention_kernel')} ({k.get('attention_class')})")
        else:
            parts = ", ".join(f"{k} {_gib(v)}" for k, v in (r.get("breakdown") or {}).items() if v)
            lines.append(f"per rank peak: {_gib(mem.get('total'))} ({r['method']}){': ' + parts if parts else ''}")
            lines.append("compile: none ahead of time (PyTorch runs eagerly; with torch.compile=true the blocks compile "
                         "during the first step, which the run records as compile_s)")
        verdict = {True: "fits", False: "DOES NOT FIT", None: "no verdict"}[r["fits"]]
        lines.append(f"limit: {_gib(r['limit_bytes']) if r['limit_bytes'] else '?'} per device ({r['limit_source']}) -> {verdict}")
        f = r.get("flops")
        if f:
            xla = f.get("xla_per_device")
            ratio = f"{f['ratio']:.3f}" if f.get("ratio") is not None else "?"
            formula = (f"formula {f['formula_per_device']:,.0f} (6*N + 12*L*T*d per token x {f['tokens_per_step']:,} "
                       f"tokens / {r['devices']})")
            if xla is not None:
                lines.append(f"flops/step per device: XLA {xla:,.0f} vs {formula} -> ratio {ratio}")
            else:
                lines.append(f"flops/step per device: {formula}; " + ("PyTorch has no compiler count to compare"
                             if r["framework"] == "torch" else "the compiler reported none"))
        for note in r.get("notes", []):
            lines.append(f"note: {note}")
        if r["fits"] is False:
            lines.append(f"help: {KNOBS}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def to_json(results: Sequence[Dict[str, Any]]) -> str:
    return json.dumps({"compile": list(results)}, indent=2)


def timestamped(results: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The estimates as they go into each cell's files.ESTIMATE_NAME."""
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return {k: {**v, "estimated_at": now} for k, v in results.items()}

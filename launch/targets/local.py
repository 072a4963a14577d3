"""The local target: a cell's trainer as subprocesses of this machine.

JAX runs in one process with `--xla_force_host_platform_device_count=N` (simulated CPU devices; on
a GPU host the real GPUs are used) or in `local.processes` processes joined by
`jax.distributed` with gloo CPU collectives, which is how a multi-host slice looks. PyTorch runs
under `torchrun --standalone --nproc_per_node=N`. Building the request is separate from running
it; the request prints as the exact commands.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from launch.rundir import CONFIG_NAME
from launch.schema import Config
from launch.targets import procs


@dataclass
class ProcessSpec:
    name: str
    argv: List[str]
    env: Dict[str, str]  # added to the parent's environment

    def __str__(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


@dataclass
class LocalRequest:
    cell_dir: Path
    processes: List[ProcessSpec]

    def __str__(self) -> str:
        return "\n".join(str(p) for p in self.processes)


@dataclass
class LocalResult:
    returncode: int
    failed: Optional[str] = None  # name of the first process that failed
    tail: List[str] = field(default_factory=list)  # its last output lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_process(cfg: Config, processes: int) -> int:
    if cfg.local.threads > 0:
        return cfg.local.threads
    return max(1, (os.cpu_count() or 1) // processes)


def build(cfg: Config, cell_dir: Path, port: Optional[int] = None) -> LocalRequest:
    config_path = str(cell_dir / CONFIG_NAME)
    base_env = {"PYTHONUNBUFFERED": "1"}
    if cfg.framework == "torch":
        threads = threads_per_process(cfg, cfg.devices)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.devices}",
                "-m", "torchrun_fsdp", "--config", config_path]
        return LocalRequest(cell_dir, [ProcessSpec("torchrun", argv, {**base_env, "OMP_NUM_THREADS": str(threads)})])
    procs = cfg.local.processes
    per_proc = cfg.devices // procs
    argv = [sys.executable, "-m", "jaxrun", "--config", config_path]
    env = {**base_env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={per_proc}"}
    if procs == 1:
        return LocalRequest(cell_dir, [ProcessSpec("jax", argv, env)])
    port = port or free_port()
    specs = []
    for i in range(procs):
        penv = {**env, "SCALEOUT_COORDINATOR": f"127.0.0.1:{port}", "SCALEOUT_NUM_PROCESSES": str(procs),
                "SCALEOUT_PROCESS_ID": str(i)}
        specs.append(ProcessSpec(f"p{i}", argv, penv))
    return LocalRequest(cell_dir, specs)


def plan_commands(cfg: Config, cell_dir: Path) -> List[str]:
    return [str(p) for p in build(cfg, cell_dir, port=29500 if cfg.local.processes > 1 else None).processes]


def launch(request: LocalRequest, echo: bool = True) -> LocalResult:
    """Run the processes, stream their output (also to <cell>/logs/), stop all when one fails."""
    multi = len(request.processes) > 1
    specs = [procs.Spec(p.name, p.argv, p.env, f"[{p.name}] " if multi else "") for p in request.processes]
    r = procs.run_group(specs, request.cell_dir / "logs", echo=echo)
    return LocalResult(r.returncode, r.failed, r.tail)

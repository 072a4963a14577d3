"""The local target: a cell's trainer as subprocesses of this machine.

JAX runs in one process with `--xla_force_host_platform_device_count=N` (simulated CPU devices; on
a GPU host the real GPUs are used) or in `local.processes` processes joined by
`jax.distributed` with gloo CPU collectives, which is how a multi-host slice looks (on a GPU host
each process drives its own share of the GPUs: `jaxrun.__main__.distributed_args`). PyTorch runs
under `torchrun --standalone --nproc_per_node=N`. On a host with more GPUs than the cell's N, the
cell's processes see only the first N (`CUDA_VISIBLE_DEVICES`). Building the request is separate from running
it; the request prints as the exact commands.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from launch.common import envvars, files
from launch.config.schema import Config
from launch.targets import procs
from launch.targets.base import Cell, ForegroundTarget, Outcome, exit_code

log = logging.getLogger(__name__)
TRAINER_MODULES = {"jax": "jaxrun", "torch": "torchrun_fsdp"}


@dataclass
class LocalRequest:
    cell_dir: Path
    processes: List[procs.Spec]

    def __str__(self) -> str:
        return "\n".join(_command(p) for p in self.processes)


def _command(p: procs.Spec) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in p.env.items())
    return (env + " " if env else "") + shlex.join(p.argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(cfg: Config, cell_dir: Path, port: Optional[int] = None) -> LocalRequest:
    from launch.core.engine import threads_per_process
    from launch.core import gpus
    config_path = str(cell_dir / files.CONFIG_NAME)
    base_env = {"PYTHONUNBUFFERED": "1", envvars.DISTRIBUTED: "local"}
    bound = gpus.first_gpus(os.environ, cfg.devices)  # a cell of N devices on a host with more GPUs: the first N
    if bound is not None:
        base_env["CUDA_VISIBLE_DEVICES"] = bound
    if cfg.framework == "torch":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.devices}",
                "-m", TRAINER_MODULES["torch"], "--config", config_path]
        env = {**base_env, "OMP_NUM_THREADS": str(threads_per_process(cfg, cfg.devices))}
        return LocalRequest(cell_dir, [procs.Spec("torchrun", argv, env)])
    n = cfg.local.processes
    argv = [sys.executable, "-m", TRAINER_MODULES["jax"], "--config", config_path]
    env = {**base_env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={cfg.devices // n}"}
    if not os.environ.get(envvars.JAX_PLATFORMS) and gpus.cpu_only(os.environ):
        env[envvars.JAX_PLATFORMS] = "cpu"  # no accelerator here: jax must not load libtpu (launch.core.gpus.cpu_only)
    if n == 1:
        return LocalRequest(cell_dir, [procs.Spec("jax", argv, env)])
    port = port or free_port()
    return LocalRequest(cell_dir, [
        procs.Spec(f"p{i}", argv, {**env, envvars.COORDINATOR: f"127.0.0.1:{port}", envvars.NUM_PROCESSES: str(n),
                                   envvars.PROCESS_ID: str(i)}, prefix=f"[p{i}] ")
        for i in range(n)])


class LocalTarget(ForegroundTarget):
    name = "local"

    def plan_commands(self, cfg: Config, cell_dir: Path) -> List[str]:
        return [_command(p) for p in build(cfg, cell_dir, port=29500 if cfg.local.processes > 1 else None).processes]

    def run(self, cells: Sequence[Cell], run_dir: Path) -> List[Outcome]:
        outcomes = []
        for i, c in enumerate(cells, 1):
            if len(cells) > 1:
                log.info(f"cell {i}/{len(cells)} {c.name}: {c.framework} on {c.devices} device(s), "
                         f"global batch {c.cfg.train.global_batch}")
            outcomes.append(run_cell(c))
        return outcomes


def run_cell(c: Cell) -> Outcome:
    """Run one written cell's processes in the foreground and wait."""
    r = procs.run_group(build(c.cfg, c.dir).processes, c.dir / files.LOGS_DIR,
                        env={envvars.PARENT_PID: str(os.getpid())})
    if not r.returncode:
        return Outcome(c.name, "ok")
    code = exit_code(r.returncode)
    procs.report_failure(f"cell {c.name} failed: process {r.failed} {procs.describe_exit(r.returncode)}", r.tail)
    return Outcome(c.name, "failed", code, f"process {r.failed} {procs.describe_exit(r.returncode)}")

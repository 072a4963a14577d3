"""Helpers for tests that start a trainer directly (`python -m jaxrun` / `torchrun_fsdp`), without the
launcher: write a cell's config, start the trainer, wait for its records, read a checkpoint back."""

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
from conftest import wait_for  # noqa: F401  (re-exported: the trainer tests import their helpers from here)

ROOT = Path(__file__).resolve().parents[1]


def final_params(ckpt_dir: Path, step: int) -> Dict[str, np.ndarray]:
    from jaxrun.checkpoint import load_params_numpy
    return load_params_numpy(ckpt_dir, step)


def write_cell(cell_dir: Path, *overrides: str) -> Path:
    """A resolved cell config at `cell_dir`/config.yaml, as the launcher writes one: checkpoints in
    `cell_dir`/checkpoints unless an override says otherwise."""
    from launch import config
    cell_dir.mkdir(parents=True, exist_ok=True)
    cfg = config.load([f"checkpoint.dir={cell_dir / 'checkpoints'}", f"jax.cache_dir={cell_dir.parent / 'jaxcache'}",
                       f"run.dir={cell_dir.parent}", "checkpoint.async=false", *overrides])
    path = cell_dir / "config.yaml"
    config.save(cfg, path)
    return path


def trainer_argv(framework: str, config_path: Path, nproc: int = 1) -> List[str]:
    if framework == "jax":
        return [sys.executable, "-m", "jaxrun", "--config", str(config_path)]
    if nproc == 1:
        return [sys.executable, "-m", "torchrun_fsdp", "--config", str(config_path)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "torchrun_fsdp", "--config", str(config_path)]


def trainer_env(devices: int = 1, **extra: str) -> Dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    for key in ("SCALEOUT_FAULT", "SCALEOUT_PARENT_PID", "SCALEOUT_PROCESS_ID", "RANK"):
        env.pop(key, None)
    env.update(extra)
    return env


def run_trainer(framework: str, config_path: Path, nproc: int = 1, timeout: float = 300, **env: str):
    """Run a trainer to the end: (completed process, records of its metrics.jsonl)."""
    p = subprocess.run(trainer_argv(framework, config_path, nproc), cwd=config_path.parent, capture_output=True,
                       text=True, timeout=timeout, env=trainer_env(nproc, **env))
    return p, records(config_path.parent)


def records(cell_dir: Path) -> List[dict]:
    from launch.common.files import read_records
    return read_records(cell_dir / "metrics.jsonl")


def steps_recorded(cell_dir: Path) -> int:
    return sum(1 for r in records(cell_dir) if r.get("kind") == "step")


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler installed for `sig` (Linux /proc SigCgt)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(mask & (1 << (sig - 1)))


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def children(pid: int) -> List[int]:
    """Every descendant of `pid` (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in Path(f"/proc/{p}/task").iterdir()
                    for c in (t / "children").read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def kill_all(pids) -> None:
    """Test teardown: nothing this test started may outlive it."""
    import signal
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def summary(recs: List[dict]) -> Optional[dict]:
    s = [r for r in recs if r.get("kind") == "summary"]
    return s[-1] if s else None



# A stand-in for the launcher: starts the trainer command with SCALEOUT_PARENT_PID set to itself,
# prints the trainer's PID, waits. A test SIGKILLs it to see that the trainer does not outlive it.
LAUNCHER = """
import os, subprocess, sys
log = open(sys.argv[1], "w")
p = subprocess.Popen(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "SCALEOUT_PARENT_PID": str(os.getpid())})
print(p.pid, flush=True)
p.wait()
"""


def start_under_launcher(argv: List[str], log_path: Path, env: Dict[str, str]) -> Tuple[subprocess.Popen, int]:
    """(the stand-in launcher, the PID of the trainer command it started)."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(log_path), *argv], env=env,
                                stdout=subprocess.PIPE, text=True)
    return launcher, int(launcher.stdout.readline())


def torch_ranks(torchrun_pid: int) -> List[int]:
    """The PIDs of the trainer processes torchrun started."""
    out = []
    for pid in children(torchrun_pid):
        try:
            if b"torchrun_fsdp" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return out

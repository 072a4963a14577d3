"""The SLURM target, through submitit.

One task per device: `tasks_per_node = min(devices, slurm.devices_per_node)`, `nodes = devices /
tasks_per_node`. Each task runs `CellJob`, a small picklable callable that starts the cell's
trainer as a child process with the rendezvous the trainer expects: PyTorch gets it from
`submitit.helpers.TorchDistributedEnvironment().export()`, JAX from
`jax.distributed.initialize()`'s own SLURM detection. Cells with the same resource shape go into
one job array (`executor.batch()`); job ids are recorded in `<run>/jobs.json`.

Preemption and time limits: SLURM sends USR2 to the tasks (submitit asks for it 90 s before the
limit). Every trainer process finishes its current step; the processes agree to stop at the same
step, save a checkpoint and exit; task 0's `CellJob.checkpoint()` waits for that, then submitit
requeues the job, and the requeued trainer resumes from the checkpoint. After
`slurm.max_requeues` time-outs the job ends with status "timed out".

Everything that lands in the sbatch script is checked or quoted: submitit quotes `#SBATCH` values;
names must be one line of SLURM-name characters; each `slurm.setup` entry becomes exactly one
command whose words are quoted (no `;`, `$(...)` or expansion reaches the shell).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from launch.config import ConfigError
from launch.targets.errors import SubmitError
from launch.rundir import CONFIG_NAME
from launch.schema import Config

NAME_RE = re.compile(r"^[A-Za-z0-9_.,:=+@%/\-\[\]&|*!]+$")  # partitions, accounts, QOS, constraints, features
KEY_RE = re.compile(r"^[a-z][a-z0-9_-]*$")
JOBS_FILE = "jobs.json"
MODULES = {"jax": "jaxrun", "torch": "torchrun_fsdp"}


# --------------------------------------------------------------------------- validation + parameters

def _check_name(key: str, value: Optional[str]) -> None:
    if value is not None and not NAME_RE.match(str(value)):
        raise ConfigError(f"{key}={value!r} is not valid: SLURM names are one line of letters, digits and -_.,:=+@%/[]&|*! "
                          "(no spaces, quotes, ;, $ or newlines).")


def shape(cfg: Config) -> Tuple[int, int]:
    """(nodes, tasks_per_node) for one task per device."""
    per_node = min(cfg.devices, cfg.slurm.devices_per_node)
    if cfg.devices % per_node:
        raise ConfigError(f"devices={cfg.devices} does not fill whole nodes of slurm.devices_per_node={cfg.slurm.devices_per_node}; "
                          f"use a multiple of {per_node} or change slurm.devices_per_node.")
    return cfg.devices // per_node, per_node


def setup_lines(cfg: Config) -> List[str]:
    """Each `slurm.setup` entry as exactly one command with its words quoted."""
    lines = []
    for i, entry in enumerate(cfg.slurm.setup):
        try:
            words = shlex.split(entry)
        except ValueError as e:
            raise ConfigError(f"slurm.setup[{i}]={entry!r} is not valid: {e}; write one command per entry.") from None
        if words:
            lines.append(shlex.join(words))
    return lines


def executor_params(cfg: Config) -> Dict[str, Any]:
    s = cfg.slurm
    for key in ("partition", "account", "qos", "constraint"):
        _check_name(f"slurm.{key}", getattr(s, key))
    extra = {}
    for k, v in s.additional.items():
        if not KEY_RE.match(str(k)):
            raise ConfigError(f"slurm.additional key {k!r} is not valid: sbatch options are lower-case words like 'reservation'.")
        if v is not True:
            _check_name(f"slurm.additional.{k}", str(v))
        extra[k] = v
    nodes, per_node = shape(cfg)
    params: Dict[str, Any] = {
        "slurm_job_name": f"scaleout-{cfg.run.name}",
        "timeout_min": s.time_min,
        "nodes": nodes,
        "tasks_per_node": per_node,
        "cpus_per_task": s.cpus_per_task,
        "slurm_setup": setup_lines(cfg),
    }
    if s.gpus_per_node:
        params["gpus_per_node"] = s.gpus_per_node
    if s.mem_gb:
        params["mem_gb"] = s.mem_gb
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(s, key):
            params[f"slurm_{key}"] = getattr(s, key)
    if s.exclusive:
        params["slurm_exclusive"] = True
    if extra:
        params["slurm_additional_parameters"] = extra
    return params


def resource_key(cfg: Config) -> str:
    p = executor_params(cfg)
    p.pop("slurm_job_name", None)
    return json.dumps(p, sort_keys=True)


def _executor(cfg: Config, folder: Path):
    import submitit
    ex = submitit.AutoExecutor(folder=str(folder), cluster="slurm", slurm_python=cfg.slurm.python or sys.executable,
                               slurm_max_num_timeout=cfg.slurm.max_requeues)
    ex.update_parameters(**executor_params(cfg))
    return ex


def render_script(cfg: Config, folder: Path) -> str:
    """The exact sbatch script submitit would submit for this cell (rendered by submitit)."""
    import submitit
    ex = submitit.SlurmExecutor(folder=str(folder), python=cfg.slurm.python or sys.executable)
    auto = _executor_params_for_slurm_executor(cfg)
    ex.update_parameters(**auto)
    return ex._make_submission_file_text(ex._submitit_command_str, "plan")


def _executor_params_for_slurm_executor(cfg: Config) -> Dict[str, Any]:
    """AutoExecutor names -> SlurmExecutor names (what AutoExecutor does internally)."""
    out = {}
    for k, v in executor_params(cfg).items():
        if k == "timeout_min":
            out["time"] = v
        elif k == "tasks_per_node":
            out["ntasks_per_node"] = v
        elif k == "mem_gb":
            out["mem"] = f"{v}GB"
        elif k.startswith("slurm_"):
            out[k[len("slurm_"):]] = v
        else:
            out[k] = v
    return out


def preflight(cfg: Config) -> None:
    executor_params(cfg)
    check_sbatch()


def plan_commands(cfg: Config, cell_dir: Path) -> List[str]:
    return [render_script(cfg, cell_dir.parent / "slurm" / "%j")]


# --------------------------------------------------------------------------- the job

class CellJob:
    """Runs one cell's trainer in a SLURM task; picklable, checkpointable (submitit requeues it)."""

    def __init__(self, cell_dir: str, framework: str):
        self.cell_dir, self.framework = cell_dir, framework
        self._child: Optional[subprocess.Popen] = None

    def __getstate__(self):
        return {"cell_dir": self.cell_dir, "framework": self.framework}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._child = None

    def __call__(self) -> Dict[str, Any]:
        import submitit
        env = dict(os.environ)
        if self.framework == "torch":
            dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
            env.update({k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                  "MASTER_ADDR", "MASTER_PORT") if k in os.environ})
            rank = dist_env.rank
        else:
            rank = submitit.JobEnvironment().global_rank
        env["PYTHONUNBUFFERED"] = "1"
        env["SCALEOUT_DISTRIBUTED"] = "slurm"
        if self.framework == "jax" and not os.environ.get("SLURM_STEP_GPUS") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
            # one task per device: on a CPU node each task is one JAX CPU device
            flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
            env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=1"])
        argv = [sys.executable, "-m", MODULES[self.framework], "--config", str(Path(self.cell_dir) / CONFIG_NAME)]
        self._child = subprocess.Popen(argv, env=env)
        submitit_handler = signal.getsignal(signal.SIGUSR2)

        def forward(signum, frame):  # every task tells its trainer; task 0 then checkpoints and requeues
            self._signal_child()
            if callable(submitit_handler):
                submitit_handler(signum, frame)

        signal.signal(signal.SIGUSR2, forward)
        while self._child.poll() is None:  # poll, not wait(): the signal handler must be able to reap the child
            time.sleep(0.2)
        code = self._child.returncode
        if code:
            raise RuntimeError(f"the {self.framework} trainer (task {rank}) exited with code {code}; see {self.cell_dir}/metrics.jsonl")
        summary = _last_summary(Path(self.cell_dir))
        return {"status": summary.get("status") if summary else None, "steps": summary.get("steps") if summary else None}

    def checkpoint(self, *args, **kwargs):
        """USR2 (preemption / time limit): the trainer saves after its current step and exits; then requeue."""
        import submitit
        self._signal_child()
        deadline = time.monotonic() + float(os.environ.get("SCALEOUT_SAVE_TIMEOUT_S", "80"))
        while self._child is not None and self._child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        counter = Path(self.cell_dir) / "requeues"
        n = int(counter.read_text()) + 1 if counter.is_file() else 1
        counter.write_text(str(n))
        return submitit.helpers.DelayedSubmission(CellJob(self.cell_dir, self.framework))


    def _signal_child(self) -> None:
        if self._child is not None and self._child.poll() is None:
            try:
                self._child.send_signal(signal.SIGUSR2)
            except ProcessLookupError:
                pass


def _last_summary(cell_dir: Path) -> Optional[Dict[str, Any]]:
    from launch import metrics
    from launch.rundir import METRICS_NAME
    recs = [r for r in metrics.read(cell_dir / METRICS_NAME) if r.get("kind") == "summary"]
    return recs[-1] if recs else None


# --------------------------------------------------------------------------- submission

def check_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch is not on PATH: target=slurm must run on a SLURM login node (or use target=local).")


@contextlib.contextmanager
def _captured_stderr():
    """sbatch writes its refusal to our stderr (fd 2); keep it for the one-sentence error instead."""
    with tempfile.NamedTemporaryFile("w+", suffix=".err", delete=False) as tmp:
        path = Path(tmp.name)
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    sys.stderr.flush()
    os.dup2(fd, 2)
    try:
        yield path
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def _sbatch_refusal(e: Exception) -> str:
    text = str(e)
    lines = [l.strip() for l in text.splitlines() if l.strip().lower().startswith("sbatch: error")]
    if lines:  # "sbatch: error: invalid partition specified: x" is more telling than "Batch job submission failed"
        specific = [l for l in lines if "submission failed" not in l.lower()]
        return (specific or lines)[0]
    return text.strip().splitlines()[-1] if text.strip() else type(e).__name__


def submit_cells(cfg: Config, cells, run_dir: Path) -> Dict[str, str]:
    """Submit every cell; cells of one resource shape share a job array. Returns {cell: job id}."""
    check_sbatch()
    groups: Dict[str, list] = {}
    for c in cells:
        groups.setdefault(resource_key(c.cfg), []).append(c)
    folder = run_dir / "slurm" / "%j"
    ids: Dict[str, str] = {}
    for group in groups.values():
        ex = _executor(group[0].cfg, folder)
        try:
            with _captured_stderr() as err, ex.batch():
                jobs = [ex.submit(CellJob(str(c.dir), c.framework)) for c in group]
        except Exception as e:  # submitit wraps sbatch's refusal (FailedJobError / CalledProcessError)
            if ids:
                _record(run_dir, ids, folder)
            reason = _sbatch_refusal(Exception(err.read_text() + "\n" + str(e)))
            raise SubmitError(f"sbatch refused the job for cell(s) {', '.join(c.name for c in group)}: {reason}") from None
        for c, job in zip(group, jobs):
            ids[c.name] = job.job_id
    _record(run_dir, ids, folder)
    return ids


def _record(run_dir: Path, ids: Dict[str, str], folder: Path) -> None:
    path = run_dir / JOBS_FILE
    data = json.loads(path.read_text()) if path.is_file() else {"cells": {}}
    for name, job_id in ids.items():
        history = data["cells"].get(name, {}).get("history", [])
        data["cells"][name] = {"target": "slurm", "job_id": job_id, "folder": str(folder), "history": history + [job_id]}
    tmp = path.with_name(JOBS_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def submit_sweep(cfg: Config, cells, run_dir: Path) -> int:
    from launch.sweep import is_finished
    todo = [c for c in cells if not is_finished(c)]
    for c in cells:
        if c not in todo:
            print(f"[scaleout] cell {c.name}: finished earlier, skipped", flush=True)
    if not todo:
        return _after(cfg, run_dir, {})
    ids = submit_cells(cfg, todo, run_dir)
    for name, job_id in ids.items():
        print(f"[scaleout] cell {name}: submitted as SLURM job {job_id}", flush=True)
    return _after(cfg, run_dir, ids)


def _after(cfg: Config, run_dir: Path, ids: Dict[str, str]) -> int:
    if not cfg.slurm.wait:
        print(f"[scaleout] follow with: scaleout status {run_dir}  |  scaleout logs {run_dir} CELL --follow  |  "
              f"scaleout report {run_dir}", flush=True)
        return 0
    from launch import jobs, report
    jobs.wait(run_dir)
    out = report.write(run_dir)
    print(f"[scaleout] report: {out['md']}", flush=True)
    states = jobs.cell_states(run_dir)
    failed = [s.cell for s in states if s.status != "ok"]
    for s in states:
        print(jobs.format_state(s), flush=True)
    return 1 if failed else 0


def run_cell(cell_cfg: Config, cell_dir: Path) -> int:
    """`scaleout run target=slurm`: one cell, one job."""
    from launch.sweep import Cell
    cell = Cell(cell_dir.name, cell_cfg.framework, cell_cfg.devices, {}, cell_cfg, cell_dir)
    return submit_sweep(cell_cfg, [cell], cell_dir.parent)


# --------------------------------------------------------------------------- queries used by launch.jobs

def squeue_states(job_ids: List[str]) -> Dict[str, str]:
    if not job_ids or shutil.which("squeue") is None:
        return {}
    p = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T %r", "-j", ",".join(job_ids)], capture_output=True, text=True)
    out = {}
    for line in p.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2:
            reason = parts[2] if len(parts) == 3 and parts[2] not in ("None", "(null)") else ""
            out[parts[0]] = parts[1] + (f" ({reason})" if reason else "")
    return out


def sacct_states(job_ids: List[str]) -> Dict[str, str]:
    """Final states from accounting; empty when accounting is disabled (common on small clusters)."""
    if not job_ids or shutil.which("sacct") is None:
        return {}
    p = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)], capture_output=True, text=True)
    if p.returncode:
        return {}
    out = {}
    for line in p.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 2:
            out[parts[0]] = parts[1].split()[0]
    return out


def result_of(folder: str, job_id: str) -> Optional[Tuple[str, Any]]:
    """submitit's result pickle of task 0: ("success", value) or ("error", traceback text)."""
    import pickle
    from submitit.core.utils import JobPaths
    path = JobPaths(folder, job_id=job_id, task_id=0).result_pickle
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception:
        return None


def log_paths(folder: str, job_id: str, tasks: int) -> List[Path]:
    from submitit.core.utils import JobPaths
    out = []
    for t in range(tasks):
        p = JobPaths(folder, job_id=job_id, task_id=t)
        out += [p.stdout, p.stderr]
    return out


def cancel(job_ids: List[str]) -> None:
    if job_ids:
        subprocess.run(["scancel", *job_ids], check=False)

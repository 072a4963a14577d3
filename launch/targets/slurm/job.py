"""What runs inside a SLURM task: `CellJob`, a picklable callable submitit executes once per task.

It starts the cell's trainer as a child process with the rendezvous the trainer expects:
PyTorch gets it from `submitit.helpers.TorchDistributedEnvironment().export()`, JAX from
`jax.distributed.initialize()`'s own SLURM detection (see jaxrun's entry point).

Preemption and time limits: SLURM signals the tasks `slurm.signal_delay_s` before it kills
them (USR2, which submitit asks for with `--signal`). Every task forwards the signal to its
trainer; the trainers finish their step, agree to stop at the same step, save and exit. Task 0's
`checkpoint()` waits for that (at most the signal delay less a margin), counts the requeue and
returns a `DelayedSubmission` of itself: submitit requeues the job and the trainer resumes from
the checkpoint. A job that SLURM ends with SIGTERM instead (preemption without
`PreemptParameters=send_user_signal`), or `scancel`, reaches every process of the step as SIGTERM:
submitit's task ignores it and the trainer handles it the same way (save after the step, exit).

Every task writes what became of it to `<run>/slurm/<job id>/<job id>_<task>_outcome.json`
(`files.TASK_OUTCOME`): `ok` / `stopped` (the trainer's summary), `failed` (the trainer's exit code,
or the error that ended the task), `requeued`, or `timed out` (submitit did not requeue: more
than slurm.max_requeues time limits). `scaleout status` reads that JSON, never submitit's result pickle.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

from launch.common import envvars, files
from launch.core import gpus
from launch.targets.slurm import submitit_api

log = logging.getLogger(__name__)
TRAINER_MODULES = {"jax": "jaxrun", "torch": "torchrun_fsdp"}
SAVE_MARGIN_S = 10.0  # what checkpoint() leaves of the signal delay for submitit to requeue


def link_logs(cell_dir: Path) -> None:
    """Link this task's submitit output files (RUN/slurm/<job>/<job>_<task>_log.out/.err) into CELL/logs/ as
    slurm-<job>-task<task>.out/.err, so that a SLURM cell has its logs where every cell has them. Never fails the task."""
    import submitit
    try:
        job = submitit.JobEnvironment()
        logs = cell_dir / files.LOGS_DIR
        logs.mkdir(parents=True, exist_ok=True)
        for kind, target in (("out", job.paths.stdout), ("err", job.paths.stderr)):
            link = logs / f"slurm-{job.job_id}-task{job.global_rank}.{kind}"
            tmp = link.with_name(f".{link.name}.{os.getpid()}")
            tmp.unlink(missing_ok=True)
            os.symlink(os.path.relpath(target, logs), tmp)
            os.replace(tmp, link)  # a requeued task (same job id) replaces its own link
    except (OSError, RuntimeError, KeyError) as e:
        log.warning(f"could not link this task's SLURM logs into {cell_dir / files.LOGS_DIR}: {e}")


class TrainerFailed(RuntimeError):
    """The trainer exited with a non-zero code (its own error is in its log and metrics)."""


class CellJob:
    """Runs one cell's trainer in a SLURM task; picklable, checkpointable (submitit requeues it)."""

    def __init__(self, cell_dir: str, framework: str, signal_delay_s: float = 90.0):
        self.cell_dir, self.framework, self.signal_delay_s = cell_dir, framework, signal_delay_s
        self._child: Optional[subprocess.Popen] = None

    def __getstate__(self):
        return {"cell_dir": self.cell_dir, "framework": self.framework, "signal_delay_s": self.signal_delay_s}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._child = None

    def trainer_env(self) -> Dict[str, str]:
        """The task's environment plus what the trainer needs to find its peers."""
        import submitit
        env = dict(os.environ)
        if self.framework == "torch":
            for stale in ("MASTER_ADDR", "MASTER_PORT"):  # inherited from the submitting shell: export() refuses them
                os.environ.pop(stale, None)
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
            env.update({k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                  "MASTER_ADDR", "MASTER_PORT") if k in os.environ})
        env["PYTHONUNBUFFERED"] = "1"
        env[envvars.DISTRIBUTED] = "slurm"
        env[envvars.PARENT_PID] = str(os.getpid())
        if self.framework == "jax" and not os.environ.get("SLURM_STEP_GPUS") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
            # one task per device: on a CPU node each task is one JAX CPU device
            flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
            env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=1"])
            if not env.get(envvars.JAX_PLATFORMS) and gpus.cpu_only(env):
                env[envvars.JAX_PLATFORMS] = "cpu"  # jax must not load libtpu on a CPU node (launch.core.gpus.cpu_only)
        return env

    def __call__(self) -> Dict[str, Any]:
        link_logs(Path(self.cell_dir))
        try:
            result = self._run()
        except SystemExit:  # submitit requeued the job (task 0, after checkpoint()) and exits this task
            self._outcome("requeued")
            raise
        except BaseException as e:
            if submitit_api.not_requeued(e):
                self._outcome("timed out", str(e))
            elif not isinstance(e, TrainerFailed):
                self._outcome("failed", f"{type(e).__name__}: {e}".strip().splitlines()[0])
            raise
        self._outcome(result["status"] or "ok", steps=result["steps"])
        return result

    def _run(self) -> Dict[str, Any]:
        env = self.trainer_env()
        rank = env.get("SLURM_PROCID", "?")
        argv = [sys.executable, "-m", TRAINER_MODULES[self.framework], "--config", str(Path(self.cell_dir) / files.CONFIG_NAME)]
        self._child = subprocess.Popen(argv, env=env)
        submitit_handler = signal.getsignal(signal.SIGUSR2)

        def forward(signum, frame):  # every task tells its trainer; task 0 then checkpoints and requeues
            self._signal_child(signal.SIGUSR2)
            if callable(submitit_handler):
                submitit_handler(signum, frame)

        signal.signal(signal.SIGUSR2, forward)
        while self._child.poll() is None:  # poll, not wait(): the signal handler must be able to reap the child
            time.sleep(0.2)
        code = self._child.returncode
        if code:
            why = f"the {self.framework} trainer (task {rank}) exited with code {code}; see {self.cell_dir}/{files.METRICS_NAME}"
            self._outcome("failed", why, code=code)
            raise TrainerFailed(why)
        summary = files.last_summary(self.cell_dir) or {}
        return {"status": summary.get("status"), "steps": summary.get("steps")}

    def _outcome(self, state: str, error: Optional[str] = None, **more: Any) -> None:
        """This task's `<job id>_<task>_outcome.json` (best effort: a task must not fail for its record)."""
        job_id = os.environ.get("SLURM_ARRAY_JOB_ID") and f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"
        job_id = job_id or os.environ.get("SLURM_JOB_ID")
        task = os.environ.get("SLURM_PROCID", "0")
        if not job_id:
            return
        path = Path(self.cell_dir).parent / files.SLURM_DIR / job_id / files.TASK_OUTCOME.format(job=job_id, task=task)
        try:
            files.write_json(path, {"job_id": job_id, "task": int(task), "state": state, "error": error, **more,
                                    "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        except OSError:
            pass

    def checkpoint(self, *args, **kwargs):
        """USR2 (preemption / time limit): the trainer saves after its current step and exits; then requeue."""
        import submitit
        self._signal_child(signal.SIGUSR2)
        deadline = time.monotonic() + max(1.0, self.signal_delay_s - SAVE_MARGIN_S)
        while self._child is not None and self._child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        counter = Path(self.cell_dir) / files.REQUEUES_FILE
        files.atomic_write(counter, str(files.read_int(counter) + 1))
        return submitit.helpers.DelayedSubmission(CellJob(self.cell_dir, self.framework, self.signal_delay_s))

    def _signal_child(self, signum: int) -> None:
        if self._child is not None and self._child.poll() is None:
            try:
                self._child.send_signal(signum)
            except ProcessLookupError:
                pass

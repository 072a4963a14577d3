"""The one module that touches submitit beyond its documented surface.

pyproject.toml bounds submitit to the minor version these uses were tested with (`>=1.5,<1.6`;
constraints.txt pins the exact release). What is used here and nowhere else:

- `Executor`: `submitit.SlurmExecutor` with `affinity()` answering without `srun` on this machine, so that
  `scaleout plan target=slurm` renders the script anywhere (submitting still needs sbatch: preflight);
- `render(executor)`: the sbatch script `submit()` writes, through the executor's own
  `_make_submission_file_text(_submitit_command_str, ...)`;
- `log_paths(folder, job_id, task)`: submitit's names for a task's stdout/stderr (`JobPaths`);
- `not_requeued(exc)`: whether an exception raised in a task is submitit's refusal to requeue a job
  that timed out more than `max_num_timeout` times (`UncompletedJobError`, its message).

The result pickle submitit writes for every task is never read: a task's outcome is the JSON file
`launch.targets.slurm.job.CellJob` writes (`status` must not unpickle what a run directory holds).
"""

from __future__ import annotations

from pathlib import Path
from typing import List

TIMED_OUT_MARK = "timed-out too many times"  # submitit.core.job_environment's reason for not requeuing


def executor(folder: Path, max_num_timeout: int, python: str):
    """A SlurmExecutor that renders without `srun` on PATH."""
    import submitit

    class Executor(submitit.SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:
            return 2

    return Executor(folder=str(folder), max_num_timeout=max_num_timeout, python=python)


def render(ex) -> str:
    """The sbatch script the executor submits (the method `submit()` itself uses)."""
    return ex._make_submission_file_text(ex._submitit_command_str, "plan")


def log_paths(folder: Path, job_id: str, task: int) -> List[Path]:
    """[stdout, stderr] of one task of a job, as submitit names them in the job's folder."""
    from submitit.core.utils import JobPaths
    p = JobPaths(str(folder), job_id=job_id, task_id=task)
    return [p.stdout, p.stderr]


def not_requeued(exc: BaseException) -> bool:
    """submitit gave up requeueing: the job timed out more than max_num_timeout times."""
    from submitit.core.utils import UncompletedJobError
    return isinstance(exc, UncompletedJobError) and TIMED_OUT_MARK in str(exc)

"""What the SLURM target knows about its jobs: `<run>/jobs.json` and the scheduler's answers.

State comes from `squeue`; a job that has left the queue is looked up with `sacct` when
accounting works, and otherwise judged from what it left behind: the JSON outcome each task writes
(`launch.targets.slurm.job`), what `scaleout cancel` recorded, and, for a task that failed before
Python started (a wrong `slurm.python`), the error lines of its log.

A run directory may have been written by someone else: nothing read from it is unpickled, imported
or executed, and every path comes from the run directory itself and a job id that is only digits
(`<run>/slurm/<job id>/...`), never from a path recorded in a file. jobs.json entries that are not
a cell name with such job ids are ignored. jobs.json is rewritten under the run lock
(`<run>/.run.lock`), so launchers of different cells of one run never lose each other's ids.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional

from launch.common import files
from launch.targets.slurm import submitit_api

log = logging.getLogger(__name__)
LIVE_PENDING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED"}
FAILED_STATES = {"FAILED", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
JOB_ID_RE = re.compile(r"\d+(_\d+)?")  # a job, or one task of a job array (submitit's `<array>_<index>`)
LOG_ERROR_RE = re.compile(r"\berror\b", re.IGNORECASE)


def is_job_id(value: Any) -> bool:
    return isinstance(value, str) and bool(JOB_ID_RE.fullmatch(value))


def _valid(name: Any, entry: Any) -> Optional[Dict[str, Any]]:
    """A jobs.json entry as {"job_id", "history", "cancelled"}, or None when it is not one."""
    if not files.is_name(name) or not isinstance(entry, dict) or not is_job_id(entry.get("job_id")):
        return None
    history = entry.get("history")
    history = [j for j in history if is_job_id(j)] if isinstance(history, list) else []
    if entry["job_id"] not in history:
        history.append(entry["job_id"])
    return {"job_id": entry["job_id"], "history": history, "cancelled": entry.get("cancelled") is True}


def read_jobs(run_dir: Path) -> Dict[str, Dict[str, Any]]:
    """{cell: {"job_id", "history", "cancelled"}} as recorded at submission (entries that are not valid are
    left out, with a warning)."""
    path = Path(run_dir) / files.JOBS_FILE
    data = files.read_json(path, {})
    cells = data.get("cells", {}) if isinstance(data, dict) else {}
    out = {}
    for name, entry in (cells.items() if isinstance(cells, dict) else []):
        ok = _valid(name, entry)
        if ok is None:
            log.warning(f"{path}: ignoring the entry {str(name)[:80]!r}: not a cell name with SLURM job ids")
            continue
        out[name] = ok
    return out


def _write(run_dir: Path, cells: Dict[str, Dict[str, Any]]) -> None:
    files.write_json(Path(run_dir) / files.JOBS_FILE, {"cells": cells})


def record(run_dir: Path, ids: Dict[str, str]) -> None:
    """Add the job ids of newly submitted cells (a cell's earlier jobs stay in its history)."""
    with files.flocked(Path(run_dir) / files.RUN_LOCK_FILE):
        cells = read_jobs(run_dir)
        for name, job_id in ids.items():
            history = cells.get(name, {}).get("history", [])
            cells[name] = {"job_id": job_id, "history": history + [job_id]}
        _write(run_dir, cells)


def mark_cancelled(run_dir: Path, names: List[str]) -> None:
    with files.flocked(Path(run_dir) / files.RUN_LOCK_FILE):
        cells = read_jobs(run_dir)
        for n in names:
            if n in cells:
                cells[n]["cancelled"] = True
        _write(run_dir, cells)


def job_folder(run_dir: Path, job_id: str) -> Path:
    """<run>/slurm/<job id>: where submitit and the job's tasks write (job_id: is_job_id)."""
    return Path(run_dir) / files.SLURM_DIR / job_id


def outcome_path(run_dir: Path, job_id: str, task: int) -> Path:
    return job_folder(run_dir, job_id) / files.TASK_OUTCOME.format(job=job_id, task=task)


def outcome(run_dir: Path, job_id: str, task: int) -> Optional[Dict[str, Any]]:
    """What task `task` of the job wrote when it ended (launch.targets.slurm.job), or None."""
    if not is_job_id(job_id):
        return None
    path = files.inside(run_dir, files.SLURM_DIR, job_id, files.TASK_OUTCOME.format(job=job_id, task=task))
    data = files.read_json(path) if path else None
    return data if isinstance(data, dict) and isinstance(data.get("state"), str) else None


def log_paths(run_dir: Path, job_id: str, tasks: int) -> List[Path]:
    """Every task's stdout and stderr of one job (only paths inside the run directory)."""
    if not is_job_id(job_id):
        return []
    out: List[Path] = []
    for t in range(tasks):
        for p in submitit_api.log_paths(job_folder(run_dir, job_id), job_id, t):
            confined = files.inside(run_dir, files.SLURM_DIR, job_id, p.name)  # not a link out of the run directory
            if confined:
                out.append(confined)
    return out


def log_errors(run_dir: Path, job_id: str, tasks: int, n: int = 4) -> List[str]:
    """The last error lines the tasks' stderr holds (slurmstepd's `execve(): ...: No such file` when
    slurm.python is wrong, srun's `task 0: Exited with exit code 2`)."""
    found: List[str] = []
    for p in log_paths(run_dir, job_id, tasks)[1::2]:
        try:
            text = p.read_text(errors="replace")
        except OSError:
            continue
        found += [line.strip() for line in text.splitlines() if LOG_ERROR_RE.search(line)]
    return list(dict.fromkeys(found))[-n:]


def squeue_states(job_ids: List[str]) -> Dict[str, str]:
    """{job id: "STATE (reason)"} of the jobs still in the queue."""
    job_ids = [j for j in job_ids if is_job_id(j)]
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
    job_ids = [j for j in job_ids if is_job_id(j)]
    if not job_ids or shutil.which("sacct") is None:
        return {}
    p = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)], capture_output=True, text=True)
    if p.returncode:
        return {}
    out = {}
    for line in p.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 2 and parts[1].strip():
            out[parts[0]] = parts[1].split()[0]
    return out


def scancel(job_ids: List[str]) -> None:
    job_ids = [j for j in job_ids if is_job_id(j)]
    if job_ids:
        subprocess.run(["scancel", *job_ids], check=False, capture_output=True)

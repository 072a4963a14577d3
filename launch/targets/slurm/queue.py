"""What the SLURM target knows about its jobs: `<run>/jobs.json` and the scheduler's answers.

State comes from `squeue`; a job that has left the queue is looked up with `sacct` when
accounting works, and otherwise judged from what it left behind (submitit's result file for
task 0, and what `scaleout cancel` recorded), so it works on clusters with accounting disabled.
"""

from __future__ import annotations

import pickle
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from launch.common import files

LIVE_PENDING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED"}
FAILED_STATES = {"FAILED", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def read_jobs(run_dir: Path) -> Dict[str, Dict[str, Any]]:
    """{cell: {"job_id", "folder", "history", "cancelled"?}} as recorded at submission."""
    data = files.read_json(Path(run_dir) / files.JOBS_FILE, {})
    return data.get("cells", {}) if isinstance(data, dict) else {}


def record(run_dir: Path, ids: Dict[str, str], folder: Path) -> None:
    """Add the job ids of newly submitted cells (a cell's earlier jobs stay in its history)."""
    cells = read_jobs(run_dir)
    for name, job_id in ids.items():
        history = cells.get(name, {}).get("history", [])
        cells[name] = {"job_id": job_id, "folder": str(folder), "history": history + [job_id]}
    files.write_json(Path(run_dir) / files.JOBS_FILE, {"cells": cells})


def mark_cancelled(run_dir: Path, names: List[str]) -> None:
    cells = read_jobs(run_dir)
    for n in names:
        if n in cells:
            cells[n]["cancelled"] = True
    files.write_json(Path(run_dir) / files.JOBS_FILE, {"cells": cells})


def squeue_states(job_ids: List[str]) -> Dict[str, str]:
    """{job id: "STATE (reason)"} of the jobs still in the queue."""
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
        if len(parts) == 2 and parts[1].strip():
            out[parts[0]] = parts[1].split()[0]
    return out


def result_of(folder: str, job_id: str) -> Optional[Tuple[str, Any]]:
    """submitit's result pickle of task 0: ("success", value) or ("error", traceback text)."""
    from submitit.core.utils import JobPaths
    path = JobPaths(folder, job_id=job_id, task_id=0).result_pickle
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception:  # a torn or foreign pickle: judged as no result
        return None


def log_paths(folder: str, job_id: str, tasks: int) -> List[Path]:
    from submitit.core.utils import JobPaths
    out: List[Path] = []
    for t in range(tasks):
        p = JobPaths(folder, job_id=job_id, task_id=t)
        out += [p.stdout, p.stderr]
    return out


def scancel(job_ids: List[str]) -> None:
    if job_ids:
        subprocess.run(["scancel", *job_ids], check=False, capture_output=True)

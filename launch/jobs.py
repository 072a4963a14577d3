"""Job control for a run directory: `scaleout status`, `logs`, `cancel` (and waiting for jobs).

State comes from `squeue`; a job that has left the queue is looked up with `sacct` when
accounting works, and otherwise judged from what it left behind (the cell's metrics summary and
submitit's result file), so it works on clusters with accounting disabled. Local cells have no
job: their state is their metrics summary.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from omegaconf import OmegaConf

from launch import metrics
from launch.rundir import CONFIG_NAME, METRICS_NAME

JOBS_FILE = "jobs.json"
LIVE_PENDING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED"}


@dataclass
class CellState:
    cell: str
    job_id: Optional[str]
    state: str  # the scheduler's word (RUNNING, PENDING, COMPLETED, FAILED, ...) or LOCAL
    status: str  # ok | running | pending | failed | stopped | timed out | not run
    step: Optional[int]
    steps: int
    loss: Optional[float]
    error: List[str] = field(default_factory=list)
    requeues: int = 0


def _jobs(run_dir: Path) -> Dict[str, Dict]:
    path = run_dir / JOBS_FILE
    return json.loads(path.read_text())["cells"] if path.is_file() else {}


def cell_names(run_dir: Path) -> List[str]:
    from launch.report import cell_dirs
    return [d.name for d in cell_dirs(run_dir) if (d / CONFIG_NAME).is_file()]


def _error_lines(summary: Optional[Dict], result) -> List[str]:
    if summary and summary.get("traceback"):
        lines = [l for l in summary["traceback"].splitlines() if l.strip()]
        return lines[-4:]
    if summary and summary.get("error"):
        return [summary["error"]]
    if result and result[0] == "error":
        lines = [l for l in str(result[1]).splitlines() if l.strip()]
        return lines[-4:]
    return []


def cell_states(run_dir: Path) -> List[CellState]:
    from launch.targets import slurm
    run_dir = Path(run_dir)
    jobs = _jobs(run_dir)
    ids = [j["job_id"] for j in jobs.values() if j.get("target") == "slurm"]
    live = slurm.squeue_states(ids)
    gone = [i for i in ids if i not in live]
    final = slurm.sacct_states(gone) if gone else {}
    out = []
    for name in cell_names(run_dir):
        cell_dir = run_dir / name
        cfg = OmegaConf.load(cell_dir / CONFIG_NAME)
        recs = metrics.read(cell_dir / METRICS_NAME)
        steps = [r for r in recs if r.get("kind") == "step"]
        summaries = [r for r in recs if r.get("kind") == "summary"]
        summary = summaries[-1] if summaries else None
        last = steps[-1] if steps else None
        job = jobs.get(name)
        requeues = int((cell_dir / "requeues").read_text()) if (cell_dir / "requeues").is_file() else 0
        st = CellState(name, job["job_id"] if job else None, "LOCAL", "not run", last["step"] if last else None,
                       int(cfg.train.steps), last["loss"] if last else None, requeues=requeues)
        result = slurm.result_of(job["folder"], job["job_id"]) if job else None
        done_ok = summary is not None and summary.get("status") == "ok" and summary.get("steps", 0) >= st.steps
        if job and job["job_id"] in live:
            st.state = live[job["job_id"]]
            st.status = "pending" if st.state.split()[0] in LIVE_PENDING else "running"
        else:
            if job:
                st.state = final.get(job["job_id"]) or ("COMPLETED" if done_ok else "FAILED" if (result and result[0] == "error") or
                                                        (summary and summary.get("status") == "failed") else
                                                        "ENDED" if result or summary else "UNKNOWN")
            if done_ok:
                st.status = "ok"
            elif result and result[0] == "error" and "timed-out too many times" in str(result[1]):
                st.status = "timed out"
                st.error = [f"timed out {requeues} time(s), more than slurm.max_requeues={cfg.slurm.max_requeues}; "
                            f"the checkpoint at step {st.step} is kept: rerun the sweep to continue"]
            elif summary and summary.get("status") == "failed" or (result and result[0] == "error"):
                st.status = "failed"
                st.error = _error_lines(summary, result)
            elif summary and summary.get("status") == "stopped":
                st.status = "stopped"
            elif job and not summary:
                st.status = "failed" if st.state in ("FAILED", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT") else "unknown"
    
        out.append(st)
    return out


def format_state(s: CellState) -> str:
    step = f"step {s.step}/{s.steps}" if s.step is not None else f"step -/{s.steps}"
    loss = f"loss {s.loss:.4f}" if s.loss is not None else "loss -"
    job = f"job {s.job_id}" if s.job_id else "local"
    line = f"{s.cell:24} {job:16} {s.state:11} {s.status:10} {step:14} {loss}"
    if s.requeues:
        line += f"  (requeued {s.requeues}x)"
    for e in s.error:
        line += f"\n    | {e}"
    return line


def wait(run_dir: Path, poll_s: float = 5.0, timeout_s: Optional[float] = None) -> None:
    from launch.targets import slurm
    start = time.monotonic()
    ids = [j["job_id"] for j in _jobs(run_dir).values() if j.get("target") == "slurm"]
    while slurm.squeue_states(ids):
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"jobs of {run_dir} still queued after {timeout_s:.0f} s")
        time.sleep(poll_s)


def log_files(run_dir: Path, cell: str) -> List[Path]:
    from launch.targets import slurm
    job = _jobs(run_dir).get(cell)
    files: List[Path] = []
    if job and job.get("target") == "slurm":
        cfg = OmegaConf.load(run_dir / cell / CONFIG_NAME)
        tasks = int(cfg.devices)
        for job_id in job.get("history", [job["job_id"]]):
            files += slurm.log_paths(job["folder"], job_id, tasks)
    logs = run_dir / cell / "logs"
    if logs.is_dir():
        files += sorted(logs.glob("*.log"))
    return files


def print_logs(run_dir: Path, cell: str, follow: bool = False, out=sys.stdout) -> None:
    files = log_files(run_dir, cell)
    offsets: Dict[Path, int] = {}

    def emit() -> None:
        for f in files:
            if not f.is_file():
                continue
            data = f.read_bytes()
            pos = offsets.get(f, 0)
            if len(data) > pos:
                if pos == 0:
                    out.write(f"==> {f} <==\n")
                out.write(data[pos:].decode(errors="replace"))
                offsets[f] = len(data)
        out.flush()

    emit()
    if not follow:
        return
    from launch.targets import slurm
    job = _jobs(run_dir).get(cell)
    while True:
        time.sleep(1.0)
        emit()
        if job and not slurm.squeue_states([job["job_id"]]):
            emit()
            return
        if not job:  # local: follow until the cell writes its summary
            recs = metrics.read(run_dir / cell / METRICS_NAME)
            if recs and recs[-1].get("kind") == "summary":
                emit()
                return


def cancel(run_dir: Path, cell: Optional[str]) -> List[str]:
    from launch.targets import slurm
    jobs = _jobs(run_dir)
    names = [cell] if cell else list(jobs)
    ids = [jobs[n]["job_id"] for n in names if n in jobs and jobs[n].get("target") == "slurm"]
    slurm.cancel(ids)
    return ids

"""`scaleout status`, `logs` and `cancel`: the state of a run directory's cells, for every target.

A cell's state combines what the trainer wrote (its metrics summary and last step record) with
what its target knows about the cell's job (`Target.jobs`: SLURM's queue and accounting, or what
the job left behind; a TPU cell's detached trainers on its slice). Local cells run in the
foreground and have no job: their state is their metrics.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from omegaconf import OmegaConf

from launch.common import files
from launch.targets import JobInfo, get as get_target

NO_JOB = "-"  # the job and job-state columns of a cell that has no job (local cells run in the foreground)
ERROR_LINE = re.compile(r"\[scaleout\] error \(((?:process|rank|worker) \d+)\): .*")


@dataclass
class CellState:
    cell: str
    job_id: Optional[str]
    state: str  # the scheduler's word (RUNNING, PENDING, COMPLETED, CANCELLED, ...); "-" for a local cell (no job)
    status: str  # ok | running | pending | failed | stopped | timed out | cancelled | not run | unknown
    step: Optional[int]
    steps: int
    loss: Optional[float]
    error: List[str] = field(default_factory=list)
    requeues: int = 0


def cell_names(run_dir: Path) -> List[str]:
    return [d.name for d in files.cell_dirs(run_dir)]


def _targets(run_dir: Path) -> Dict[str, List[str]]:
    """{target name: [cells]} from the cells' configs."""
    out: Dict[str, List[str]] = {}
    for d in files.cell_dirs(run_dir):
        target = OmegaConf.load(d / files.CONFIG_NAME).get("target", "local")
        out.setdefault(str(target), []).append(d.name)
    return out


def _jobs(run_dir: Path) -> Dict[str, JobInfo]:
    jobs: Dict[str, JobInfo] = {}
    for target in _targets(run_dir):
        jobs.update(get_target(target).jobs(run_dir))
    return jobs


def _summary_error(summary: Dict) -> List[str]:
    if summary.get("traceback"):
        return [l for l in str(summary["traceback"]).splitlines() if l.strip()][-4:]
    return [str(summary["error"])] if summary.get("error") else []


def state_of(cell_dir: Path, job: Optional[JobInfo]) -> CellState:
    cfg = OmegaConf.load(cell_dir / files.CONFIG_NAME)
    recs = files.read_records(cell_dir / files.METRICS_NAME)
    steps = [r for r in recs if r.get("kind") == "step" and isinstance(r.get("step"), int)]
    summaries = [r for r in recs if r.get("kind") == "summary"]
    summary = summaries[-1] if summaries else None
    last = steps[-1] if steps else None
    total = int(cfg.train.steps)
    st = CellState(cell_dir.name, job.job_id if job else None, job.state if job else NO_JOB, "not run",
                   last["step"] if last else None, total, last.get("loss") if last else None,
                   requeues=job.requeues if job else 0)
    done_ok = bool(summary) and summary.get("status") == "ok" and (summary.get("steps") or 0) >= total
    if job and job.live:
        st.status = "pending" if job.pending else "running"
    elif done_ok:
        st.status = "ok"
    elif job and job.timed_out:
        st.status = "timed out"
        st.error = [f"timed out {st.requeues} time(s), more than slurm.max_requeues={cfg.slurm.max_requeues}; "
                    f"the checkpoint at step {st.step} is kept: rerun the sweep to continue"]
    elif job and job.state.startswith("CANCELLED"):
        st.status = "cancelled"
    elif summary and summary.get("status") == "failed" or (job and job.error):
        st.status = "failed"
        st.error = _summary_error(summary) if summary and summary.get("status") == "failed" else job.error
    elif summary and summary.get("status") == "stopped":
        st.status = "stopped"
    elif job:
        st.status = "failed" if job.state in ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT") else "unknown"
    elif recs or steps:
        st.status = "unknown"
        st.error = [f"metrics lost or incomplete: the last step record is step {st.step}" if st.step else
                    "metrics lost or incomplete: no step record"]
    return st


def trainer_errors(run_dir: Path, cell: str) -> List[str]:
    """Every trainer process's own error line from the cell's logs, one per process, in process order:
    the process that failed first and the peers that failed because of it are all named."""
    found: Dict[str, str] = {}
    for path in log_files(run_dir, cell):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            m = ERROR_LINE.search(line)
            if m:
                found[m.group(1)] = m.group(0)
    return [found[k] for k in sorted(found, key=lambda who: (who.split()[0], int(who.split()[-1]) if who.split()[-1].isdigit() else 0))]


def cell_states(run_dir: Path) -> List[CellState]:
    run_dir = Path(run_dir)
    jobs = _jobs(run_dir)
    states = [state_of(d, jobs.get(d.name)) for d in files.cell_dirs(run_dir)]
    for st in states:
        if st.status == "failed":
            own = trainer_errors(run_dir, st.cell)
            if len(own) > 1 or (own and not st.error):
                st.error = own  # several processes failed: say what each said, not only process 0's view
    return states


COLUMNS = ("cell", "job", "job state", "status", "step reached", "last loss")


def _row(cell: str, job: str, state: str, status: str, step: str, loss: str) -> str:
    return f"{cell:24} {job:16} {state:11} {status:10} {step:14} {loss}"


def header() -> str:
    """The first line of `scaleout status`: what each column is."""
    return _row(*COLUMNS)


def format_state(s: CellState) -> str:
    step = f"step {s.step}/{s.steps}" if s.step is not None else f"step -/{s.steps}"
    loss = f"loss {s.loss:.4f}" if isinstance(s.loss, (int, float)) else "loss -"
    job = f"job {s.job_id}" if s.job_id else NO_JOB
    line = _row(s.cell, job, s.state, s.status, step, loss)
    if s.requeues:
        line += f"  (requeued {s.requeues}x)"
    for e in s.error:
        line += f"\n    | {e}"
    return line


def log_files(run_dir: Path, cell: str) -> List[Path]:
    paths: List[Path] = []
    for target, cells in _targets(run_dir).items():
        if cell in cells:
            paths += get_target(target).log_files(run_dir, cell)
    logs = Path(run_dir) / cell / files.LOGS_DIR
    if logs.is_dir():
        paths += sorted(logs.glob("*.log"))
    return paths


def print_logs(run_dir: Path, cell: str, follow: bool = False, out=sys.stdout, poll_s: float = 1.0) -> None:
    paths = log_files(run_dir, cell)
    offsets: Dict[Path, int] = {}

    def emit() -> None:
        for f in paths:
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
    while follow:
        time.sleep(poll_s)
        emit()
        job = _jobs(run_dir).get(cell)
        if (job and not job.live) or (not job and files.last_summary(Path(run_dir) / cell)):
            emit()
            return


def cancel(run_dir: Path, cells: Sequence[str]) -> Dict[str, str]:
    """Cancel the cells' jobs; {cell: what happened}."""
    out: Dict[str, str] = {}
    for target, names in _targets(run_dir).items():
        chosen = [c for c in names if c in cells]
        if chosen:
            out.update(get_target(target).cancel(run_dir, chosen))
    return out

"""Every file name shared between processes, and the one way to write a file atomically.

The layout of a run directory (which directory a name goes in) is `launch.rundir`'s; this module
only names the files, so that a trainer, a target and the report never spell a name twice.

    <run>/RUN_FILE            the run's identity (id, created), written once
    <run>/SWEEP_FILE          the cells of a sweep, in order
    <run>/JOBS_FILE           SLURM job ids per cell (launch.targets.slurm)
    <cell>/CONFIG_NAME        the cell's resolved config: all a trainer reads
    <cell>/METRICS_NAME       the trainer's records (launch.metrics)
    <cell>/LOGS_DIR/          the processes' output
    <cell>/REQUEUES_FILE      how often SLURM requeued the cell
    <cell>/LOCK_FILE          held by the launcher that runs the cell
    <checkpoint dir>/OWNER_FILE  which run a cell's checkpoints belong to
    <cell>/TPU_JOB_FILE       the cell's TPU slice and detached job (target=tpu)
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

RUN_FILE = "run.json"
SWEEP_FILE = "sweep.json"
JOBS_FILE = "jobs.json"
CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
LOGS_DIR = "logs"
REQUEUES_FILE = "requeues"
LOCK_FILE = ".lock"
OWNER_FILE = "scaleout-run.json"
TENSORBOARD_DIR = "tensorboard"
TPU_JOB_FILE = "tpu-job.json"


def atomic_write(path: Union[str, Path], data: Union[str, bytes]) -> Path:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the file gets the permissions open() would give it
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: Union[str, Path], obj: Any) -> Path:
    return atomic_write(path, json.dumps(obj, indent=2) + "\n")


def read_json(path: Union[str, Path], default: Any = None) -> Any:
    """The JSON in `path`, or `default` when the file is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def read_records(path: Union[str, Path]) -> List[Dict[str, Any]]:
    """Every JSON object of a metrics file; torn or non-object lines (a process killed mid-write) are skipped."""
    out: List[Dict[str, Any]] = []
    try:
        text = Path(path).read_text(errors="replace")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def last_summary(cell_dir: Union[str, Path]) -> Optional[Dict[str, Any]]:
    """The last `summary` record of a cell's metrics, or None."""
    recs = [r for r in read_records(Path(cell_dir) / METRICS_NAME) if r.get("kind") == "summary"]
    return recs[-1] if recs else None


def read_int(path: Union[str, Path], default: int = 0) -> int:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return default

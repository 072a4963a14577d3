"""Every file name shared between processes, and the one way to write a file atomically.

The layout of a run directory (which directory a name goes in) is `launch.launcher.rundir`'s; this module
only names the files, so that a trainer, a target and the report never spell a name twice.

    <run>/RUN_FILE            the run's identity (id, created), written once
    <run>/SWEEP_FILE          the cells of a sweep, in order
    <run>/JOBS_FILE           SLURM job ids per cell (launch.targets.slurm.target)
    <run>/SLURM_DIR/<job>/    submitit's files and the tasks' logs of one SLURM job, and each task's
                              TASK_OUTCOME (what became of it, as JSON: `status` reads that, never a pickle)
    <cell>/CONFIG_NAME        the cell's resolved config: all a trainer reads
    <cell>/METRICS_NAME       the trainer's records (launch.core.metrics)
    <cell>/LOGS_DIR/          the processes' output
    <cell>/REQUEUES_FILE      how often SLURM requeued the cell
    <cell>/LOCK_FILE          held by the launcher that runs the cell
    <run>/RUN_LOCK_FILE       held while a launcher creates the run's identity and writes its cells
    <checkpoint dir>/OWNER_FILE  which run a cell's checkpoints belong to
    <cell>/TPU_JOB_FILE       the cell's TPU slice and detached job (target=tpu)
    <cell>/ESTIMATE_NAME      what the fit check estimated (plan.check_fit; the report reads it)

`cell_dirs` lists a run's cells the one way the launcher, `status` and the report agree on. A run
directory may come from someone else: a name or path read from one of its files is used only through
`is_name` / `inside`, which keep it inside the run directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

RUN_FILE = "run.json"
SWEEP_FILE = "sweep.json"
JOBS_FILE = "jobs.json"
SLURM_DIR = "slurm"  # <run>/slurm/<job id>/: submitit's files, the tasks' logs and outcomes
TASK_OUTCOME = "{job}_{task}_outcome.json"  # in <run>/slurm/<job id>/, written by each task (launch.targets.slurm.job)
CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
LOGS_DIR = "logs"
REQUEUES_FILE = "requeues"
LOCK_FILE = ".lock"
RUN_LOCK_FILE = ".run.lock"  # <run>/: held while a launcher gives the run its identity and writes its cells
OWNER_FILE = "scaleout-run.json"
TENSORBOARD_DIR = "tensorboard"
TPU_JOB_FILE = "tpu-job.json"
ESTIMATE_NAME = "estimate.json"
TOPOLOGY_SUFFIX = ".topology.json"  # beside a cell YAML that `plan --compile` hands jaxrun.aot: the TPU slice


NAME_RE = re.compile(r"[A-Za-z0-9._-]+")


def is_remote(path: str) -> bool:
    """A URL (`gs://bucket/...`) rather than a path on this machine."""
    return "://" in path


def atomic_write(path: Union[str, Path], data: Union[str, bytes], exclusive: bool = False) -> bool:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part.

    With `exclusive`, the file is created only if it does not exist yet (a hard link of the finished
    temporary file, which fails if the name is taken, even when two processes race): returns False,
    writing nothing, when it already existed. Without, it returns True.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the file gets the permissions open() would give it
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            Path(tmp).unlink(missing_ok=True)
        return True
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: Union[str, Path], obj: Any, exclusive: bool = False) -> bool:
    """`atomic_write` of `obj` as indented JSON (with `exclusive`: only if `path` does not exist yet)."""
    return atomic_write(path, json.dumps(obj, indent=2) + "\n", exclusive=exclusive)


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


def is_name(value: Any) -> bool:
    """One path component of letters, digits, `.`, `_`, `-` (not `.` or `..`): safe to join to a directory."""
    return isinstance(value, str) and bool(NAME_RE.fullmatch(value)) and value not in (".", "..")


def inside(base: Union[str, Path], *parts: str) -> Optional[Path]:
    """`base/parts...` if it stays inside `base` once resolved (symbolic links followed), else None: the
    way to use a path read from a file of a run directory, which may have been written by anyone."""
    base = Path(base).resolve()
    path = base.joinpath(*parts).resolve()
    return path if path == base or base in path.parents else None


def holder() -> str:
    """How a lock file names this process (`launch.launcher.lock` writes it into <cell>/.lock)."""
    return f"PID {os.getpid()} on {socket.gethostname()}"


@contextlib.contextmanager
def flocked(path: Union[str, Path]) -> Iterator[None]:
    """An exclusive `flock` on `path` (created if missing) for the duration of the block; blocks until it is
    free. The kernel drops it when the holder dies."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def cell_dirs(run_dir: Union[str, Path]) -> List[Path]:
    """The run's cells in sweep order (or by name for single runs) that have a config; a name in sweep.json
    that is not one path component (`../elsewhere`, `/abs`) is not a cell of this run and is left out."""
    manifest = read_json(Path(run_dir) / SWEEP_FILE)
    if isinstance(manifest, dict) and isinstance(manifest.get("cells"), list):
        dirs = [Path(run_dir) / c["name"] for c in manifest["cells"] if isinstance(c, dict) and is_name(c.get("name"))]
    else:
        dirs = sorted(p.parent for p in Path(run_dir).glob(f"*/{CONFIG_NAME}"))
    # a cell is a directory of the run itself: not a link that leads out of it
    return [d for d in dirs if inside(run_dir, d.name, CONFIG_NAME) and (d / CONFIG_NAME).is_file()]

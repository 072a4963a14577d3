"""What every target is: the `Target` interface, the `Cell` it runs and the `Outcome` it reports.

The orchestrator (`launch.launcher.sweep`) sits above the targets: it expands and writes the cells, skips
finished ones, hands the rest to one target and writes the report. A target only knows how to
start a written cell on its machines (and, for schedulers, how to ask about its jobs); it never
imports the orchestrator, and it knows a framework only as the command line and environment a
trainer process needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol, Sequence

from launch.config.schema import Config


@dataclass
class Cell:
    """One contender x devices (x sweep.extra) combination of a run, already written to `dir`."""
    name: str
    framework: str
    devices: int
    extra: Dict[str, Any]
    cfg: Config  # the cell's own config as written to <dir>/config.yaml (absolute paths, run.id set)
    dir: Path
    contender: str = ""  # the contender's name (launch.config.contenders); cfg.contender holds it too


@dataclass
class Outcome:
    """What became of a cell the target was asked to run."""
    cell: str
    state: str  # "ok" | "failed" | "submitted" (a scheduler took it; results come later)
    code: int = 0  # the exit code a shell would show for this cell (0 for ok and submitted)
    detail: str = ""  # one line: the job id, or why it failed

    @property
    def final(self) -> bool:
        return self.state != "submitted"


@dataclass
class JobInfo:
    """A cell's job as the scheduler sees it (targets without jobs report none)."""
    job_id: str
    state: str  # the scheduler's word: RUNNING, PENDING (reason), COMPLETED, CANCELLED, ...
    live: bool  # still queued or running
    pending: bool = False
    error: List[str] = field(default_factory=list)  # the job's own error lines, if it failed outside the trainer
    timed_out: bool = False  # ended because it was requeued more than allowed
    requeues: int = 0


class Target(Protocol):
    name: str

    def validate(self, cfg: Config) -> None:
        """Config rules of this target (ConfigError); pure, needs no tool installed."""

    def preflight(self, cfg: Config) -> None:
        """Environment checks (SubmitError: tool missing, resource refused) before anything is written."""

    def plan_commands(self, cfg: Config, cell_dir: Path) -> List[str]:
        """Exactly what `run` would execute or submit for this cell, produced by the same code."""

    def run(self, cells: Sequence[Cell], run_dir: Path) -> List[Outcome]:
        """Start the cells (all of them; finished ones were already skipped) and report each."""

    def jobs(self, run_dir: Path) -> Dict[str, JobInfo]:
        """Job state per cell name, for `status`; {} for targets without a scheduler."""

    def log_files(self, run_dir: Path, cell: str) -> List[Path]:
        """Output files the target's jobs wrote for a cell besides <cell>/logs/ (scheduler logs)."""

    def cancel(self, run_dir: Path, cells: Sequence[str]) -> Dict[str, str]:
        """Stop the cells' jobs; returns {cell: what happened} ("cancelled job 12", "already finished")."""

    def wait(self, run_dir: Path, poll_s: float = 5.0, timeout_s: Optional[float] = None) -> None:
        """Block until no job of the run is live (no-op for targets that run in the foreground)."""


class ForegroundTarget:
    """Defaults for targets that run cells in the foreground and keep no jobs."""
    name = "?"

    def validate(self, cfg: Config) -> None:
        return None

    def preflight(self, cfg: Config) -> None:
        return None

    def jobs(self, run_dir: Path) -> Dict[str, JobInfo]:
        return {}

    def log_files(self, run_dir: Path, cell: str) -> List[Path]:
        return []

    def cancel(self, run_dir: Path, cells: Sequence[str]) -> Dict[str, str]:
        return {}

    def wait(self, run_dir: Path, poll_s: float = 5.0, timeout_s: Optional[float] = None) -> None:
        return None


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode

"""Weights & Biases runs from the metrics stream (`metrics.wandb.enabled=true`), through `wandb`'s public API.

One W&B run per cell, written by process 0's metrics writer (the one that writes metrics.jsonl):

    project / entity   metrics.wandb.project / .entity
    group              metrics.wandb.group (default: the scaleout run, `run.name`)
    name               the cell (`jax-d2`); id `<run.id>-<cell>`, so a resumed cell continues its run
    config             the resolved cell config (what `<cell>/config.yaml` holds)
    history            the TensorBoard scalars: `train/<field>` of each step record and `eval/loss`,
                       against the `step` metric (the training step, as in TensorBoard)
    summary            the `summary` record's fields at the end

The report's plots go to one more run of the group, named `report` (`log_report`). `mode=offline`
(the default) writes everything under `<cell>/wandb/` (the report's under `<run>/wandb/`) and needs
neither network nor account; `wandb sync <dir>/wandb/offline-run-*` uploads it later.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

log = logging.getLogger(__name__)

WANDB_DIR = "wandb"  # what wandb.init(dir=D) creates under D
MODES = ("offline", "online")
REPORT_RUN = "report"


def installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


def run_id(scaleout_run_id: Optional[str], name: str) -> str:
    """A W&B run id for a cell of a scaleout run: stable across resumes, only W&B's characters."""
    text = f"{scaleout_run_id}-{name}" if scaleout_run_id else name
    return re.sub(r"[^A-Za-z0-9_-]", "-", text)[:128]


def _settings():
    import wandb
    # console="off": the trainers' output already goes to <cell>/logs/, and wrapping stdout is not wanted there
    return wandb.Settings(console="off", silent=True)


def _numbers(values: Dict[str, Any]) -> Dict[str, float]:
    """The fields TensorBoard gets (launch.core.tensorboard): numbers, not booleans, not the wall time."""
    return {k: v for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("time", "step")}


class WandbWriter:
    """The W&B run of one cell."""

    def __init__(self, settings: Any, cell_dir: Path, config: Dict[str, Any], scaleout_run_id: Optional[str]):
        import wandb

        cell_dir = Path(cell_dir)
        self.run = wandb.init(project=settings.project, entity=settings.entity, group=settings.group,
                              name=cell_dir.name, id=run_id(scaleout_run_id, cell_dir.name), resume="allow",
                              job_type="train", dir=str(cell_dir), mode=settings.mode, config=config,
                              settings=_settings())
        self.run.define_metric("step")
        for prefix in ("train", "eval"):
            self.run.define_metric(f"{prefix}/*", step_metric="step")

    def scalars(self, step: int, values: Dict[str, Any], prefix: str) -> None:
        data = {f"{prefix}/{k}": v for k, v in _numbers(values).items()}
        if data:
            self.run.log({"step": step, **data})

    def summary(self, record: Dict[str, Any]) -> None:
        self.run.summary.update({k: v for k, v in record.items() if k not in ("kind", "time") and v is not None})

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def log_report(settings: Dict[str, Any], run_dir: Path, scaleout_run_id: Optional[str], plots: Iterable[Path],
               config: Optional[Dict[str, Any]] = None) -> Optional[str]:
    """The report's plots as images on the group's `report` run; its id, or None when wandb is missing."""
    if not installed():
        log.warning("metrics.wandb.enabled=true but wandb is not installed here: the report's plots are not logged to W&B")
        return None
    import wandb

    run = wandb.init(project=settings.get("project"), entity=settings.get("entity"), group=settings.get("group"),
                     name=REPORT_RUN, id=run_id(scaleout_run_id, REPORT_RUN), resume="allow", job_type="report",
                     dir=str(run_dir), mode=settings.get("mode"), config=config or {}, settings=_settings())
    try:
        run.log({f"report/{Path(p).stem}": wandb.Image(str(p)) for p in plots})
    finally:
        run.finish()
    return run.id

"""Targets start a cell's trainer processes: local (subprocesses), slurm (submitit), tpu (gcloud).

Each target module offers `plan_commands(cfg, cell_dir) -> list[str]`: exactly what it would run,
for `scaleout plan`, with nothing started.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import List

from launch.schema import Config


def plan_commands(cfg: Config, cell_dir: Path) -> List[str]:
    module = importlib.import_module(f"launch.targets.{cfg.target}")
    return module.plan_commands(cfg, cell_dir)


def preflight(cfg: Config) -> None:
    """Target checks that must pass before anything is written (ConfigError / SubmitError)."""
    module = importlib.import_module(f"launch.targets.{cfg.target}")
    if hasattr(module, "preflight"):
        module.preflight(cfg)


def submit_sweep(cfg: Config, cells, run_dir: Path) -> int:
    module = importlib.import_module(f"launch.targets.{cfg.target}")
    return module.submit_sweep(cfg, cells, run_dir)

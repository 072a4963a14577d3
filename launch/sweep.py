"""`scaleout sweep`: frameworks x devices (x sweep.extra) cells, written, run, then reported.

Weak scaling keeps the per-device batch fixed: `train.global_batch` is the global batch at the
smallest device count and grows in proportion. Strong scaling keeps `train.global_batch` for
every cell. Every cell is validated before anything is written or run. A rerun of the same
sweep skips finished cells and resumes unfinished ones from their checkpoints; a failing cell
does not stop the others.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

from launch import config as config_mod
from launch import metrics, rundir
from launch.config import ConfigError
from launch.schema import Config

SWEEP_FILE = "sweep.json"


@dataclass
class Cell:
    name: str
    framework: str
    devices: int
    extra: Dict[str, Any]
    cfg: Config  # the cell's resolved config, before rundir.cell_config paths
    dir: Path = field(default=Path("."))


def global_batch(cfg: Config, devices: int) -> int:
    if cfg.sweep.scaling == "strong":
        return cfg.train.global_batch
    nmin = min(cfg.sweep.devices)
    if cfg.train.global_batch % nmin:
        raise ConfigError(f"train.global_batch={cfg.train.global_batch} is not divisible by the smallest sweep device count {nmin}; "
                          f"with sweep.scaling=weak it is the global batch at {nmin} device(s) and must split evenly over them.")
    return cfg.train.global_batch // nmin * devices


def expand(cfg: Config) -> List[Cell]:
    """Every cell of the sweep, validated; raises ConfigError naming the first bad cell."""
    keys = list(cfg.sweep.extra)
    combos = list(itertools.product(*(cfg.sweep.extra[k] for k in keys))) if keys else [()]
    cells = []
    run_dir = rundir.run_dir(cfg)
    for fw in cfg.sweep.frameworks:
        for d in cfg.sweep.devices:
            for combo in combos:
                extra = dict(zip(keys, combo))
                name = rundir.cell_name(fw, d, extra)
                updates = {"framework": fw, "devices": d, "train.global_batch": global_batch(cfg, d), **extra}
                try:
                    cell_cfg = config_mod.replace(cfg, updates)
                except ConfigError as e:
                    raise ConfigError(f"sweep cell {name}: {e}") from None
                cells.append(Cell(name, fw, d, extra, cell_cfg, run_dir / name))
    if len({c.name for c in cells}) != len(cells):
        raise ConfigError("sweep.devices or sweep.frameworks lists a value twice; each cell must be unique.")
    return cells


def check_existing(cells: List[Cell]) -> None:
    """Refuse to reuse a run directory whose cells were written with different math."""
    for c in cells:
        path = c.dir / rundir.CONFIG_NAME
        if path.is_file():
            old = config_mod.load_resolved(path)
            if config_mod.math_hash(old) != config_mod.math_hash(c.cfg) or old.devices != c.devices:
                raise ConfigError(f"run directory {c.dir.parent} already holds cell {c.name} with a different config; "
                                  "pick another run.name (run.name=...) or remove that directory.")


def is_finished(c: Cell) -> bool:
    recs = [r for r in metrics.read(c.dir / rundir.METRICS_NAME) if r.get("kind") == "summary"]
    return bool(recs) and recs[-1].get("status") == "ok" and recs[-1].get("steps", 0) >= c.cfg.train.steps


def write(cfg: Config, cells: List[Cell]) -> Path:
    run_dir = rundir.run_dir(cfg)
    for c in cells:
        rundir.write_cell(c.cfg, c.name)
    manifest = {"scaling": cfg.sweep.scaling, "target": cfg.target, "model": cfg.model.name,
                "cells": [{"name": c.name, "framework": c.framework, "devices": c.devices, "extra": c.extra,
                           "global_batch": c.cfg.train.global_batch} for c in cells]}
    tmp = run_dir / (SWEEP_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(run_dir / SWEEP_FILE)
    return run_dir


def run_sweep(cfg: Config) -> int:
    from launch import targets
    cells = expand(cfg)
    for c in cells:
        targets.preflight(c.cfg)
    check_existing(cells)
    run_dir = write(cfg, cells)
    print(f"[scaleout] sweep of {len(cells)} cells ({cfg.sweep.scaling} scaling, target={cfg.target}) in {run_dir}", flush=True)
    if cfg.target == "local":
        failed = run_local(cells)
    else:
        from launch.targets import submit_sweep
        return submit_sweep(cfg, cells, run_dir)
    from launch import report
    out = report.write(run_dir)
    print(f"[scaleout] report: {out['md']}", flush=True)
    print(f"[scaleout] plots:  {', '.join(str(p) for p in out['plots'])}", flush=True)
    if failed:
        print(f"[scaleout] {len(failed)} cell(s) failed: {', '.join(failed)} (see the report and <cell>/logs/)", flush=True)
    return 1 if failed else 0


def run_local(cells: List[Cell]) -> List[str]:
    from launch.runner import run_cell
    failed = []
    for i, c in enumerate(cells, 1):
        if is_finished(c):
            print(f"[scaleout] cell {i}/{len(cells)} {c.name}: finished earlier, skipped", flush=True)
            continue
        print(f"[scaleout] cell {i}/{len(cells)} {c.name}: {c.framework} on {c.devices} device(s), "
              f"global batch {c.cfg.train.global_batch}", flush=True)
        code = run_cell(rundir.cell_config(c.cfg, c.name), c.dir)
        if code:
            failed.append(c.name)
    return failed

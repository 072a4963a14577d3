"""The orchestrator: `scaleout sweep` and `scaleout run` (a sweep of one cell), for every target.

    expand   frameworks x devices (x sweep.extra) into cells, each a fully resolved config
    check    every cell valid for the target, the environment ready (preflight), no cell of the
             run directory written with other math, no checkpoint directory of another run,
             no cell held by another launcher or a live job, and with `plan.check_fit` every
             cell's per-device memory estimated (launch.aot) within the device's -- all before
             anything is written
    write    run.json, each <cell>/config.yaml, sweep.json (and <cell>/estimate.json when estimated)
    run      skip finished cells, hand the rest to the target (launch.targets), once
    report   when the target's results are final (local, tpu, slurm with slurm.wait)

Weak scaling keeps the per-device batch fixed: `train.global_batch` is the global batch at the
smallest device count and grows in proportion. Strong scaling keeps `train.global_batch` for
every cell. A rerun of the same sweep skips finished cells and resumes unfinished ones from their
checkpoints; a failing cell does not stop the others.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from pathlib import Path
from typing import Any, Dict, List, Sequence

from launch import config as config_mod
from launch import files, rundir
from launch.config import ConfigError
from launch.lock import CellLocks
from launch.schema import Config
from launch.targets import Cell, Outcome, get as get_target
from launch.targets.errors import SubmitError

log = logging.getLogger(__name__)


def global_batch(cfg: Config, devices: int) -> int:
    if cfg.sweep.scaling == "strong":
        return cfg.train.global_batch
    nmin = min(cfg.sweep.devices)
    if cfg.train.global_batch % nmin:
        raise ConfigError(f"train.global_batch={cfg.train.global_batch} is not divisible by the smallest sweep device count {nmin}; "
                          f"with sweep.scaling=weak it is the global batch at {nmin} device(s) and must split evenly over them.")
    return cfg.train.global_batch // nmin * devices


def expand(cfg: Config, rid: str = "") -> List[Cell]:
    """Every cell of the sweep, each with its own resolved config; raises ConfigError naming the first bad cell."""
    keys = list(cfg.sweep.extra)
    combos = list(itertools.product(*(cfg.sweep.extra[k] for k in keys))) if keys else [()]
    cells = []
    for fw in cfg.sweep.frameworks:
        for d in cfg.sweep.devices:
            for combo in combos:
                extra = dict(zip(keys, combo))
                name = rundir.cell_name(fw, d, extra)
                updates = {"framework": fw, "devices": d, "train.global_batch": global_batch(cfg, d), **extra}
                try:
                    cell_cfg = rundir.cell_config(config_mod.replace(cfg, updates), name, rid or None)
                except ConfigError as e:
                    raise ConfigError(f"sweep cell {name}: {e}") from None
                cells.append(Cell(name, fw, d, extra, cell_cfg, rundir.cell_dir(cfg, name)))
    if len({c.name for c in cells}) != len(cells):
        raise ConfigError("sweep.devices or sweep.frameworks lists a value twice; each cell must be unique.")
    return cells


def single(cfg: Config, rid: str = "") -> List[Cell]:
    """`scaleout run`: the one cell of `framework` x `devices`."""
    name = rundir.cell_name(cfg.framework, cfg.devices)
    return [Cell(name, cfg.framework, cfg.devices, {}, rundir.cell_config(cfg, name, rid or None), rundir.cell_dir(cfg, name))]


def check(cfg: Config, cells: Sequence[Cell]) -> Dict[str, Dict[str, Any]]:
    """Everything that can refuse the run, before anything is written; returns the fit check's
    estimates per cell name (empty without `plan.check_fit`)."""
    rundir.check_identity(cfg)
    target = get_target(cfg.target)
    for c in cells:
        try:
            target.validate(c.cfg)
        except ConfigError as e:
            raise ConfigError(f"cell {c.name}: {e}" if len(cells) > 1 else str(e)) from None
    for c in cells:
        why = rundir.existing_conflict(c.cfg, c.name)
        if why:
            raise ConfigError(f"run directory {c.dir.parent} already holds cell {c.name} {why}; "
                              "pick another run.name (run.name=...) or remove that directory.")
        rundir.check_checkpoint_owner(c.cfg)
    for c in cells:
        target.preflight(c.cfg)
    live = {name: job for name, job in target.jobs(rundir.run_dir(cfg)).items() if job.live}
    for c in cells:
        if c.name in live:
            raise SubmitError(f"cell {c.name} already has a live job {live[c.name].job_id} ({live[c.name].state}); "
                              f"wait for it, or stop it with `scaleout cancel {c.dir.parent} {c.name}`.")
    if not cfg.plan.check_fit:
        return {}
    from launch import aot  # last: it compiles or traces every cell
    log.info(f"plan.check_fit: estimating the per-device memory of {len(cells)} cell(s)")
    return aot.check_fit(cfg, cells)


def is_finished(c: Cell) -> bool:
    s = files.last_summary(c.dir)
    return bool(s) and s.get("status") == "ok" and (s.get("steps") or 0) >= c.cfg.train.steps


def write(cfg: Config, cells: Sequence[Cell], rid: str, manifest: bool) -> Path:
    run_dir = rundir.write_run(cfg, rid)
    for c in cells:
        rundir.write_cell(c.cfg, c.name)
    if manifest:
        files.write_json(run_dir / files.SWEEP_FILE, {
            "scaling": cfg.sweep.scaling, "target": cfg.target, "model": cfg.model.name,
            "cells": [{"name": c.name, "framework": c.framework, "devices": c.devices, "extra": c.extra,
                       "global_batch": c.cfg.train.global_batch} for c in cells]})
    return run_dir


def execute(cfg: Config, cells: List[Cell], manifest: bool) -> List[Outcome]:
    """Check, write, skip finished cells and run the rest on the target; returns the outcomes of those run."""
    estimates = check(cfg, cells)
    target = get_target(cfg.target)
    todo = [c for c in cells if not is_finished(c)]
    foreground = cfg.target != "slurm"  # slurm's launcher hands the cells to jobs and leaves
    with CellLocks([c.dir for c in todo]) if foreground else contextlib.nullcontext():
        run_dir = write(cfg, cells, cells[0].cfg.run.id, manifest)
        if estimates:
            from launch import aot
            for c in cells:
                files.write_json(c.dir / aot.ESTIMATE_NAME, aot.timestamped(estimates)[c.name])
        if manifest:
            log.info(f"sweep of {len(cells)} cells ({cfg.sweep.scaling} scaling, target={cfg.target}) in {run_dir}")
        for c in cells:
            if c not in todo:
                log.info(f"cell {c.name}: finished earlier, skipped")
            elif not manifest:
                log.info(f"cell {c.name}: {c.dir}")
        return target.run(todo, run_dir) if todo else []


def run_sweep(cfg: Config) -> int:
    rid = rundir.planned_run_id(cfg)
    cells = expand(cfg, rid)
    outcomes = execute(cfg, cells, manifest=True)
    run_dir = rundir.run_dir(cfg)
    if not all(o.final for o in outcomes):
        log.info(f"follow with: scaleout status {run_dir}  |  scaleout logs {run_dir} CELL --follow  |  scaleout report {run_dir}")
        return 0
    from launch import report
    out = report.write(run_dir)
    log.info(f"report: {out['md']}")
    log.info(f"plots:  {', '.join(str(p) for p in out['plots'])}")
    failed = [o.cell for o in outcomes if o.state == "failed"]
    if failed:
        log.info(f"{len(failed)} cell(s) failed: {', '.join(failed)} (see the report and <cell>/logs/)")
    return 1 if failed else 0


def run_single(cfg: Config) -> int:
    rid = rundir.planned_run_id(cfg)
    outcomes = execute(cfg, single(cfg, rid), manifest=False)
    if not outcomes:
        return 0
    o = outcomes[0]
    if o.state == "submitted":
        run_dir = rundir.run_dir(cfg)
        log.info(f"follow with: scaleout status {run_dir}  |  scaleout logs {run_dir} {o.cell} --follow")
    return o.code

"""The orchestrator: `scaleout sweep` and `scaleout run` (a sweep of one cell), for every target.

    expand   contenders x devices (x sweep.extra) into cells, each a fully resolved config; a contender
             (launch.config.contenders) is a framework plus its own settings, `sweep.contenders` or one
             per `sweep.frameworks`
    check    every cell valid for the target, the environment ready (preflight), no cell of the
             run directory written with other math, no checkpoint directory of another run,
             no cell held by another launcher or a live job, and with `plan.check_fit` every
             cell's per-device memory estimated (launch.launcher.aot) within the device's -- all before
             anything is written
    write    under the run lock: run.json (created once), each <cell>/config.yaml, sweep.json (and
             <cell>/estimate.json when estimated) -- the run directory object (launch.launcher.rundir)
             answers every question about names, places, identity and ownership
    run      skip finished cells, hand the rest to the target (launch.targets), once
    report   when the target's results are final (local, tpu, slurm with slurm.wait)

Weak scaling keeps the per-device batch fixed: `train.global_batch` is the global batch at the
smallest device count and grows in proportion. Strong scaling keeps `train.global_batch` for
every cell. A rerun of the same sweep skips finished cells and resumes unfinished ones from their
checkpoints; a failing cell does not stop the others.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Dict, List, Optional, Sequence

from launch.common import files
from launch.config import ConfigError, contenders
from launch.config.schema import Config
from launch.core.loop import at_stop_message, stop_step
from launch.launcher import gpu_preflight, inputs, rundir
from launch.launcher.rundir import RunDir
from launch.launcher.lock import CellLocks
from launch.targets import Cell, Outcome, get as get_target
from launch.targets.errors import SubmitError

log = logging.getLogger(__name__)


def global_batch(cfg: Config, devices: int, base: Optional[int] = None) -> int:
    """A cell's global batch at `devices`; `base` is train.global_batch (a contender may set its own)."""
    base = cfg.train.global_batch if base is None else base
    if cfg.sweep.scaling == "strong":
        return base
    nmin = min(cfg.sweep.devices)
    if base % nmin:
        raise ConfigError(f"train.global_batch={base} is not divisible by the smallest sweep device count {nmin}; "
                          f"with sweep.scaling=weak it is the global batch at {nmin} device(s) and must split evenly over them.")
    return base // nmin * devices


def expand(cfg: Config, run: Optional[RunDir] = None) -> List[Cell]:
    """Every cell of the sweep, each with its own resolved config; raises ConfigError naming the first bad cell."""
    run = run or RunDir(cfg)
    keys = list(cfg.sweep.extra)
    combos = list(itertools.product(*(cfg.sweep.extra[k] for k in keys))) if keys else [()]
    cells = []
    for c in contenders.of_sweep(cfg):  # their settings were checked with the config (launch.config.loader)
        for d in cfg.sweep.devices:
            for combo in combos:
                extra = dict(zip(keys, combo))
                try:
                    batch = global_batch(cfg, d, c.overrides.get("train.global_batch"))
                    cells.append(run.cell(c, d, extra, {"train.global_batch": batch}))
                except ConfigError as e:
                    raise ConfigError(f"sweep cell {rundir.cell_name(c.name, d, extra)}: {e}") from None
    if len({c.name for c in cells}) != len(cells):
        raise ConfigError("sweep.devices, sweep.frameworks or sweep.contenders lists a value twice; each cell must be unique.")
    return cells


def single(cfg: Config, run: Optional[RunDir] = None) -> List[Cell]:
    """`scaleout run`: the one cell of the contender (`contender`, else the framework's) x `devices`."""
    return [(run or RunDir(cfg)).cell(contenders.of_run(cfg), cfg.devices)]


def check(cfg: Config, run: RunDir, cells: Sequence[Cell]) -> Dict[str, Dict[str, Any]]:
    """Everything that can refuse the run, before anything is written; returns the fit check's
    estimates per cell name (empty without `plan.check_fit`)."""
    run.check_identity()
    target = get_target(cfg.target)
    platform = gpu_preflight.platform_of(cfg)
    for c in cells:
        try:
            target.validate(c.cfg)  # the target's own rules first: a file check cannot fix a wrong place
            inputs.check_cell(c.cfg)
            gpu_preflight.check_attention(c.cfg, platform)
        except ConfigError as e:
            raise ConfigError(f"cell {c.name}: {e}" if len(cells) > 1 else str(e)) from None
    for warning in dict.fromkeys(w for c in cells for w in gpu_preflight.warnings(c.cfg)):
        log.warning(warning)
    run.check(cells)
    for c in cells:
        target.preflight(c.cfg)
    check_no_live_job(target, run, cells)
    if not cfg.plan.check_fit:
        return {}
    from launch.launcher import aot  # last: it compiles or traces every cell
    log.info(f"plan.check_fit: estimating the per-device memory of {len(cells)} cell(s)")
    return aot.check_fit(cfg, cells)


def check_no_live_job(target, run: RunDir, cells: Sequence[Cell]) -> None:
    """Refuse cells that already have a live job (a SLURM job queued or running, a TPU slice's detached trainers)."""
    live = {name: job for name, job in target.jobs(run.path).items() if job.live}
    for c in cells:
        if c.name in live:
            raise SubmitError(f"cell {c.name} already has a live job {live[c.name].job_id} ({live[c.name].state}); "
                              f"wait for it, or stop it with `scaleout cancel {run.path} {c.name}`.")


def is_finished(c: Cell) -> bool:
    s = files.last_summary(c.dir)
    return bool(s) and s.get("status") == "ok" and (s.get("steps") or 0) >= c.cfg.train.steps


def at_stop(c: Cell) -> Optional[int]:
    """The step an unfinished cell already ended at cleanly when its config would stop it there again
    (`train.stop_after` at or below it), else None: rerunning it would train nothing."""
    s = files.last_summary(c.dir)
    step = s.get("steps") if s and s.get("status") in ("ok", "stopped") else None
    if not isinstance(step, int) or is_finished(c):
        return None
    return step if stop_step(c.cfg.train, step) <= step else None


def manifest(cfg: Config, cells: Sequence[Cell]) -> Dict[str, Any]:
    """sweep.json: the contenders of a sweep and its cells, in order, with what distinguishes them."""
    return {"scaling": cfg.sweep.scaling, "target": cfg.target, "model": cfg.model.name,
            "contenders": [c.as_dict() for c in contenders.of_sweep(cfg)],
            "cells": [{"name": c.name, "contender": c.contender, "framework": c.framework, "devices": c.devices,
                       "extra": c.extra, "global_batch": c.cfg.train.global_batch} for c in cells]}


def execute(cfg: Config, run: RunDir, cells: List[Cell], is_sweep: bool) -> List[Outcome]:
    """Check, write, skip finished cells and run the rest on the target; returns the outcomes of those run."""
    estimates = check(cfg, run, cells)
    target = get_target(cfg.target)
    stopped = {c.name: step for c in cells if (step := at_stop(c)) is not None}
    todo = [c for c in cells if not is_finished(c) and c.name not in stopped]
    # One owner per cell, on every target: from here until the cell has run (local, tpu) or its job id is in
    # jobs.json (slurm), no other launcher can check, write or start it. What was checked before the lock is
    # checked again under it: another launcher may have finished the cell or submitted a job meanwhile.
    with CellLocks([c.dir for c in todo]):
        if todo:
            check_no_live_job(target, run, todo)
        todo = [c for c in todo if not is_finished(c)]
        cells = run.write(cells, manifest(cfg, cells) if is_sweep else None)
        todo = [c for c in cells if c.name in {t.name for t in todo}]
        if estimates:
            from launch.launcher import aot
            for c in cells:
                files.write_json(c.dir / files.ESTIMATE_NAME, aot.timestamped(estimates)[c.name])
        if is_sweep:
            log.info(f"sweep of {len(cells)} cells ({cfg.sweep.scaling} scaling, target={cfg.target}) in {run.path}")
        for c in cells:
            if c.name in stopped:
                log.info(f"cell {c.name}: {at_stop_message(c.cfg.train, stopped[c.name])}")
            elif c not in todo:
                log.info(f"cell {c.name}: finished earlier, skipped")
            elif not is_sweep:
                log.info(f"cell {c.name}: {c.dir}")
        outcomes = target.run(todo, run.path) if todo else []
    explain_failures(cfg, run, outcomes)
    return outcomes


def explain_failures(cfg: Config, run: RunDir, outcomes: Sequence[Outcome]) -> None:
    """A failed cell's own error on the console. Local and TPU cells print theirs as they fail (their processes'
    last lines); a SLURM cell's are in its job's files, which `status` reads: the same lines, here."""
    failed = {o.cell for o in outcomes if o.state == "failed"}
    if cfg.target != "slurm" or not failed:
        return
    from launch.launcher import status
    for st in status.cell_states(run.path):
        if st.cell in failed:
            lines = (status.trainer_errors(run.path, st.cell) or st.error  # the trainers' own sentences first
                     or [f"no error was recorded (job state {st.state}, status {st.status})"])
            log.error(f"cell {st.cell} failed (SLURM job {st.job_id}, {st.state}):" + "".join(f"\n  | {line}" for line in lines)
                      + f"\n  all of its output: scaleout logs {run.path} {st.cell}")


def follow_hint(run: RunDir, cells: Sequence[str]) -> str:
    """What to do after a submission that this command does not wait for (slurm.wait=false)."""
    one = cells[0] if len(cells) == 1 else "CELL"
    return (f"{'the job runs' if len(cells) == 1 else 'the jobs run'} without this command (slurm.wait=false); follow "
            f"with `scaleout status {run.path}` and `scaleout logs {run.path} {one} --follow`, stop with "
            f"`scaleout cancel {run.path}`" + (f", and write the report with `scaleout report {run.path}` once they have "
                                                 "ended" if len(cells) > 1 else ""))


def run_sweep(cfg: Config) -> int:
    run = RunDir(cfg)
    outcomes = execute(cfg, run, expand(cfg, run), is_sweep=True)
    if not all(o.final for o in outcomes):
        log.info(follow_hint(run, [o.cell for o in outcomes]))
        return 0
    from launch.report import report
    out = report.write(run.path)
    log.info(f"report: {out['md']}")
    log.info(f"plots:  {', '.join(str(p) for p in out['plots'])}")
    first, then = report.READ_FIRST
    log.info(f"read first: {out['md']}, its sections '{first}' (which contender finishes a "
             f"report.horizon_steps run first, with and without torch.compile) then '{then}' (throughput ratios, when "
             f"the slower start pays back); the Cells table has every figure")
    failed = [o.cell for o in outcomes if o.state == "failed"]
    if failed:
        log.info(f"{len(failed)} cell(s) failed: {', '.join(failed)} (see the report and `scaleout logs {run.path} CELL`)")
    return 1 if failed else 0


def run_single(cfg: Config) -> int:
    run = RunDir(cfg)
    outcomes = execute(cfg, run, single(cfg, run), is_sweep=False)
    if not outcomes:
        return 0
    o = outcomes[0]
    if o.state == "submitted":
        log.info(follow_hint(run, [o.cell]))
    return o.code

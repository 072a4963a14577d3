"""`scaleout run`: write one cell and start it on the target."""

from __future__ import annotations

import sys

from launch import rundir
from launch.schema import Config


def run_single(cfg: Config) -> int:
    from launch import targets
    targets.preflight(cfg)
    name = rundir.cell_name(cfg.framework, cfg.devices)
    cell_dir = rundir.write_cell(cfg, name)
    print(f"[scaleout] cell {name}: {cell_dir}", flush=True)
    return run_cell(rundir.cell_config(cfg, name), cell_dir)


def run_cell(cell_cfg: Config, cell_dir) -> int:
    """Start one written cell on its target and wait; returns the exit code."""
    if cell_cfg.target == "local":
        from launch.targets import local
        result = local.launch(local.build(cell_cfg, cell_dir))
        if result.returncode:
            print(f"[scaleout] cell {cell_dir.name} failed: process {result.failed} exited with code {result.returncode}",
                  file=sys.stderr)
            for line in _error_lines(result.tail):
                print(f"  | {line}", file=sys.stderr)
        return result.returncode
    import importlib
    return importlib.import_module(f"launch.targets.{cell_cfg.target}").run_cell(cell_cfg, cell_dir)


def _error_lines(tail, n: int = 6):
    """The last lines of a failing process's output, traceback frames trimmed to the error."""
    lines = [l for l in tail if l.strip()]
    return lines[-n:]

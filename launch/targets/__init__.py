"""Targets start written cells on machines: local (subprocesses), slurm (submitit), tpu (gcloud).

Each implements `launch.targets.base.Target`; `get(name)` returns one. `local` is one module;
`slurm/` (target, the job a task runs, the queue) and `tpu/` (target, gcloud commands, slice shapes,
the follower that runs on worker 0) are packages of their own. The modules are imported
on demand, so `scaleout plan` and `report` load only what they use.
"""

from __future__ import annotations

import importlib

from launch.targets.base import Cell, JobInfo, Outcome, Target

NAMES = {"local": "LocalTarget", "slurm": "SlurmTarget", "tpu": "TpuTarget"}
MODULES = {"local": "launch.targets.local", "slurm": "launch.targets.slurm.target", "tpu": "launch.targets.tpu.target"}

__all__ = ["Cell", "JobInfo", "Outcome", "Target", "get", "NAMES"]


def get(name: str) -> Target:
    """The target called `name` (one of NAMES; the config has already checked it)."""
    module = importlib.import_module(MODULES[name])
    return getattr(module, NAMES[name])()

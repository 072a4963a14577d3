"""Run directories: where a run's cells, configs, metrics, logs, checkpoints and reports live.

    <run.dir>/<run.name>/
        run.json                     the run's identity: {"id", "created"}; written once
        sweep.json                   the cells of a sweep, in order, with their overrides
        jobs.json                    SLURM job ids per cell (target=slurm)
        <cell>/config.yaml           the fully resolved config the trainer reads
        <cell>/metrics.jsonl         the trainer's metrics (launch.metrics)
        <cell>/logs/                 stdout/stderr of the cell's processes
        <cell>/checkpoints/          the cell's checkpoints (unless checkpoint.dir is set)
        report.md, report.json, report.csv, *.png

A cell is named <framework>-d<devices>[-<key>_<value>...]. Checkpoints belong to a run: by
default they live inside the cell's directory, so a fresh run directory always starts fresh; with
`checkpoint.dir=ROOT` they go to ROOT/<run.name>/<cell>, which holds an owner file naming the run,
and a different run that would land there is refused. In the cell's config.yaml `checkpoint.dir`
is already that directory (absolute) and `run.id` is set, so a trainer needs nothing but the path.
"""

from __future__ import annotations

import datetime
import re
import uuid
from pathlib import Path
from typing import Any, Dict, Optional

from launch import config as config_mod
from launch import files
from launch.config import ConfigError
from launch.schema import Config

CHECKPOINTS_DIR = "checkpoints"


def run_dir(cfg: Config) -> Path:
    return Path(cfg.run.dir).expanduser().resolve() / cfg.run.name


def cell_dir(cfg: Config, name: str) -> Path:
    return run_dir(cfg) / name


def _slug(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", str(value)).strip("_")


def cell_name(framework: str, devices: int, extra: Optional[Dict[str, Any]] = None) -> str:
    parts = [f"{framework}-d{devices}"]
    for key, value in (extra or {}).items():
        parts.append(f"{key.rsplit('.', 1)[-1]}_{_slug(value)}")
    return "-".join(parts)


def is_remote(path: str) -> bool:
    return "://" in path


def _abs(path: str) -> str:
    return path if is_remote(path) else str(Path(path).expanduser().resolve())


def checkpoint_dir(cfg: Config, name: str) -> str:
    """Where cell `name` of this run keeps its checkpoints (absolute path or URL)."""
    if cfg.checkpoint.dir is None:
        return str(cell_dir(cfg, name) / CHECKPOINTS_DIR)
    root = cfg.checkpoint.dir
    if is_remote(root):
        return "/".join([root.rstrip("/"), cfg.run.name, name])
    return str(Path(root).expanduser().resolve() / cfg.run.name / name)


def run_id(cfg: Config) -> Optional[str]:
    """The identity of the run directory, if it has been created."""
    data = files.read_json(run_dir(cfg) / files.RUN_FILE)
    return data.get("id") if isinstance(data, dict) else None


def planned_run_id(cfg: Config) -> str:
    """The run directory's id, or a new one for a run directory not written yet (nothing is written)."""
    return run_id(cfg) or uuid.uuid4().hex[:12]


def write_run(cfg: Config, rid: str) -> Path:
    """Give the run directory its identity if it has none; returns the run directory."""
    d = run_dir(cfg)
    if run_id(cfg) is None:
        files.write_json(d / files.RUN_FILE, {
            "id": rid, "name": cfg.run.name,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    return d


def cell_config(cfg: Config, name: str, rid: Optional[str] = None) -> Config:
    """The cell's config: paths made absolute, checkpoint.dir pointing at the cell's own directory."""
    return config_mod.replace(cfg, {
        "checkpoint.dir": checkpoint_dir(cfg, name),
        "run.dir": str(Path(cfg.run.dir).expanduser().resolve()),
        "run.id": rid if rid is not None else cfg.run.id,
        "jax.cache_dir": _abs(cfg.jax.cache_dir),
        **({"data.path": _abs(cfg.data.path)} if cfg.data.path else {}),
        **({"model.init": "hf:" + _abs(cfg.model.init[3:])} if cfg.model.init.startswith("hf:") else {}),
        **({"checkpoint.load_from": _abs(cfg.checkpoint.load_from)} if cfg.checkpoint.load_from else {}),
    })


def check_checkpoint_owner(cell_cfg: Config) -> None:
    """Refuse a local checkpoint directory that holds another run's checkpoints (nothing is written)."""
    path = cell_cfg.checkpoint.dir
    if is_remote(path):
        return  # the trainer checks the run id recorded in each checkpoint's metadata
    ckpt = Path(path)
    owner = files.read_json(ckpt / files.OWNER_FILE)
    if isinstance(owner, dict) and owner.get("run_id") == cell_cfg.run.id:
        return
    others = [p for p in ckpt.iterdir() if p.name != files.OWNER_FILE] if ckpt.is_dir() else []
    if not others:
        return
    whose = (f"run {owner.get('run_id')} in {owner.get('run_dir')}" if isinstance(owner, dict)
             else "no recorded run (written by another run or by hand)")
    raise ConfigError(f"checkpoint.dir: {ckpt} already holds checkpoints of {whose}, not of this run "
                      f"({run_dir_of(cell_cfg)}); set checkpoint.dir elsewhere (or leave it unset to keep checkpoints "
                      "inside the run directory), remove that directory, or start from it on purpose with checkpoint.load_from.")


def run_dir_of(cell_cfg: Config) -> Path:
    return Path(cell_cfg.run.dir) / cell_cfg.run.name


def claim_checkpoints(cell_cfg: Config) -> None:
    """Record in a local checkpoint directory which run it belongs to."""
    if is_remote(cell_cfg.checkpoint.dir):
        return
    path = Path(cell_cfg.checkpoint.dir) / files.OWNER_FILE
    if not path.is_file():
        files.write_json(path, {"run_id": cell_cfg.run.id, "run_dir": str(run_dir_of(cell_cfg))})


def write_cell(cell_cfg: Config, name: str) -> Path:
    """Write <run>/<cell>/config.yaml (and claim the cell's checkpoint directory); returns the cell directory."""
    d = cell_dir(cell_cfg, name)
    config_mod.save(cell_cfg, d / files.CONFIG_NAME)
    claim_checkpoints(cell_cfg)
    return d


def existing_conflict(cell_cfg: Config, name: str) -> Optional[str]:
    """Why an existing cell of the same name cannot be reused for this config, or None."""
    path = cell_dir(cell_cfg, name) / files.CONFIG_NAME
    if not path.is_file():
        return None
    try:
        old = config_mod.load_resolved(path)
    except ConfigError as e:
        return f"whose config.yaml cannot be read ({e})"
    if config_mod.math_hash(old) != config_mod.math_hash(cell_cfg) or old.devices != cell_cfg.devices:
        return "with a different config (model, train, data or devices)"
    return None


def check_identity(cfg: Config) -> None:
    """A run.id given by hand must be this run directory's."""
    if cfg.run.id is not None and run_id(cfg) not in (None, cfg.run.id):
        raise ConfigError(f"run.id={cfg.run.id!r} is not the id of {run_dir(cfg)} ({run_id(cfg)}); leave run.id unset: scaleout sets it.")

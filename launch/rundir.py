"""Run directories: where a run's cells, configs, metrics, logs and reports live.

    <run.dir>/<run.name>/
        sweep.json                   the cells of the sweep, in order, with their overrides
        <cell>/config.yaml           the fully resolved config the trainer reads
        <cell>/metrics.jsonl         the trainer's metrics (launch.metrics)
        <cell>/logs/                 stdout/stderr of the cell's processes
        report.md, report.json, report.csv, *.png

A cell is named <framework>-d<devices>[-<key>-<value>...]; its checkpoints go to
<checkpoint.dir>/<run.name>/<cell>, and in the cell's config.yaml `checkpoint.dir` is already that
directory (absolute), so a trainer needs nothing but the config path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict

from launch import config as config_mod
from launch.schema import Config

CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"


def run_dir(cfg: Config) -> Path:
    return Path(cfg.run.dir).expanduser().resolve() / cfg.run.name


def _slug(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", str(value)).strip("_")


def cell_name(framework: str, devices: int, extra: Dict[str, Any] | None = None) -> str:
    parts = [f"{framework}-d{devices}"]
    for key, value in (extra or {}).items():
        parts.append(f"{key.rsplit('.', 1)[-1]}_{_slug(value)}")
    return "-".join(parts)


def _join(root: str, *parts: str) -> str:
    if "://" in root:
        return "/".join([root.rstrip("/"), *parts])
    return str(Path(root).expanduser().resolve().joinpath(*parts))


def cell_config(cfg: Config, name: str) -> Config:
    """The cell's config: paths made absolute, checkpoint.dir pointing at the cell's own directory."""
    return config_mod.replace(cfg, {
        "checkpoint.dir": _join(cfg.checkpoint.dir, cfg.run.name, name),
        "run.dir": str(Path(cfg.run.dir).expanduser().resolve()),
        "jax.cache_dir": _join(cfg.jax.cache_dir),
        **({"data.path": _join(cfg.data.path)} if cfg.data.path else {}),
        **({"checkpoint.load_from": _join(cfg.checkpoint.load_from)} if cfg.checkpoint.load_from else {}),
    })


def write_cell(cfg: Config, name: str) -> Path:
    """Write <run>/<cell>/config.yaml and return the cell directory."""
    cell_dir = run_dir(cfg) / name
    config_mod.save(cell_config(cfg, name), cell_dir / CONFIG_NAME)
    return cell_dir

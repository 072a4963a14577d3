"""The run directory: one object with one identity, asked for everything about where a run lives.

    <run.dir>/<run.name>/
        run.json                     the run's identity: {"id", "name", "created"}; created once, atomically
        .run.lock                    held while a launcher gives the run its identity and writes its cells
        sweep.json                   the cells of a sweep, in order, with their overrides
        jobs.json                    SLURM job ids per cell (target=slurm)
        <cell>/config.yaml           the fully resolved config the trainer reads
        <cell>/metrics.jsonl         the trainer's metrics (launch.core.metrics)
        <cell>/logs/                 stdout/stderr of the cell's processes
        <cell>/checkpoints/          the cell's checkpoints (unless checkpoint.dir is set)
        report.md, report.json, report.csv, *.png

A cell is named <contender>-d<devices>[-<key>_<value>...] (`launch.config.contenders`: jax, torch,
torch-compile or a name of yours). Checkpoints belong to a run: by
default they live inside the cell's directory, so a fresh run directory always starts fresh; with
`checkpoint.dir=ROOT` they go to ROOT/<run.name>/<cell>, which holds an owner file naming the run,
and a different run that would land there is refused. In the cell's config.yaml `checkpoint.dir`
is already that directory (absolute) and `run.id` is set, so a trainer needs nothing but the path.

The orchestrator builds one `RunDir` from the config and asks it: the cells' names, directories and
configs (`cell`), whether any of them clashes with what is on disk (`check`), and, once everything
has been checked, to take the run lock, create or read the identity and write the cells (`write`).
Reading the identity never creates it; `plan` and a refused run write nothing.
"""

from __future__ import annotations

import datetime
import re
import uuid
from pathlib import Path
from typing import Any, ContextManager, Dict, List, Optional, Sequence, Tuple

from launch import config as config_mod
from launch.common import files
from launch.config import ConfigError
from launch.config.contenders import Contender, inferred_name, of_run
from launch.config.schema import Config
from launch.targets import Cell

CHECKPOINTS_DIR = "checkpoints"

def _slug(value: Any) -> str:
    if value in ([], {}, None, ""):
        return "none"
    return re.sub(r"[^A-Za-z0-9.]+", "_", str(value)).strip("_")


def cell_name(contender: str, devices: int, extra: Optional[Dict[str, Any]] = None) -> str:
    """<contender>-d<devices>[-<key>_<value>...]; `contender` is a contender's name (for a cell that
    names none, its framework's built-in name: jax, torch or torch-compile)."""
    parts = [f"{contender}-d{devices}"]
    for key, value in (extra or {}).items():
        parts.append(f"{key.rsplit('.', 1)[-1]}_{_slug(value)}")
    return "-".join(parts)


def applied(cfg: Config) -> Config:
    """`cfg` with the settings of its `contender` applied (`scaleout run`/`plan contender=NAME`); itself
    when it names none."""
    if cfg.contender is None:
        return cfg
    return config_mod.replace(cfg, of_run(cfg).settings())


def _abs(path: str) -> str:
    return path if files.is_remote(path) else str(Path(path).expanduser().resolve())


class RunDir:
    """`<run.dir>/<run.name>` of a config: its identity, its cells, their checkpoint places, writing."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.path = Path(cfg.run.dir).expanduser().resolve() / cfg.run.name

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ----------------------------------------------------------------------- identity

    @property
    def id(self) -> Optional[str]:
        """The identity recorded in run.json, or None for a run directory not created yet."""
        data = files.read_json(self.path / files.RUN_FILE)
        return data.get("id") if isinstance(data, dict) and isinstance(data.get("id"), str) else None

    def check_identity(self) -> None:
        """A run.id given by hand must be this run directory's."""
        rid, given = self.id, self.cfg.run.id
        if given is not None and rid not in (None, given):
            raise ConfigError(f"run.id={given!r} is not the id of {self.path} ({rid}); leave run.id unset: scaleout sets it.")

    def _locked(self) -> ContextManager[None]:
        """The run lock: one launcher at a time creates the identity, writes cells or jobs.json (blocks, briefly)."""
        return files.flocked(self.path / files.RUN_LOCK_FILE)

    def _establish(self) -> Tuple[str, bool]:
        """The run's id, creating run.json if it does not exist (exactly once, whoever races); and whether this
        call created it."""
        rid = self.id
        if rid is not None:
            return rid, False
        rid = self.cfg.run.id or uuid.uuid4().hex[:12]
        created = files.write_json(self.path / files.RUN_FILE, {
            "id": rid, "name": self.cfg.run.name,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}, exclusive=True)
        rid = self.id
        if rid is None:
            raise ConfigError(f"{self.path / files.RUN_FILE} exists but holds no run id; it was damaged or written by "
                              "hand: remove it (or the run directory) and run again.")
        return rid, created

    # ----------------------------------------------------------------------- cells

    def cell_dir(self, name: str) -> Path:
        return self.path / name

    def checkpoint_dir(self, name: str) -> str:
        """Where cell `name` of this run keeps its checkpoints (absolute path or URL)."""
        root = self.cfg.checkpoint.dir
        if root is None:
            return str(self.cell_dir(name) / CHECKPOINTS_DIR)
        if files.is_remote(root):
            return "/".join([root.rstrip("/"), self.cfg.run.name, name])
        return str(Path(root).expanduser().resolve() / self.cfg.run.name / name)

    def cell_config(self, cfg: Config, name: str, rid: Optional[str] = None) -> Config:
        """The config cell `name` reads (`cfg`: the run's config with the cell's own keys set): paths made
        absolute, checkpoint.dir pointing at the cell's own directory, run.id the run's (when known)."""
        return config_mod.replace(cfg, {
            "checkpoint.dir": self.checkpoint_dir(name),
            "run.dir": str(self.path.parent),
            "run.id": rid or self.cfg.run.id or self.id,
            "jax.cache_dir": _abs(cfg.jax.cache_dir),
            **({"data.path": _abs(cfg.data.path)} if cfg.data.path else {}),
            **({"model.init": "hf:" + _abs(cfg.model.init[3:])} if cfg.model.init.startswith("hf:") else {}),
            **({"checkpoint.load_from": _abs(cfg.checkpoint.load_from)} if cfg.checkpoint.load_from else {}),
        })

    def cell(self, contender: "Contender | str", devices: int, extra: Optional[Dict[str, Any]] = None,
             updates: Optional[Dict[str, Any]] = None) -> Cell:
        """The cell contender x devices (x extra) of this run, with its resolved config: the contender's
        settings, then `updates` (keys the sweep sets per cell, e.g. its global batch), then `extra`. A
        framework name for `contender` means the contender that framework and torch.compile name."""
        if isinstance(contender, str):
            contender = Contender(inferred_name(contender, self.cfg.torch.compile), contender)
        extra = dict(extra or {})
        name = cell_name(contender.name, devices, extra)
        cfg = config_mod.replace(self.cfg, {**contender.settings(), "devices": devices, **(updates or {}), **extra})
        return Cell(name, contender.framework, devices, extra, self.cell_config(cfg, name), self.cell_dir(name),
                    contender.name)

    def check(self, cells: Sequence[Cell]) -> None:
        """Refuse cells that clash with what the run directory or their checkpoint places hold (nothing is written)."""
        self.check_identity()
        for c in cells:
            why = existing_conflict(c)
            if why:
                raise ConfigError(f"run directory {self.path} already holds cell {c.name} {why}; "
                                  "pick another run.name (run.name=...) or remove that directory.")
            check_checkpoint_owner(c.cfg, self.path)

    # ----------------------------------------------------------------------- writing

    def write(self, cells: Sequence[Cell], manifest: Optional[Dict[str, Any]] = None) -> List[Cell]:
        """Under the run lock: create or read the identity, check the cells again against what another
        launcher may have written meanwhile, write each <cell>/config.yaml (and claim its checkpoint
        place), and sweep.json when given. Returns the cells as written (their configs carry the id)."""
        with self._locked():
            rid, created = self._establish()
            claimed: List[Path] = []
            try:
                cells = [c if c.cfg.run.id == rid else
                         Cell(c.name, c.framework, c.devices, c.extra, config_mod.replace(c.cfg, {"run.id": rid}), c.dir,
                              c.contender)
                         for c in cells]
                self.check(cells)
                for c in cells:
                    if claim_checkpoints(c.cfg, self.path):
                        claimed.append(Path(c.cfg.checkpoint.dir) / files.OWNER_FILE)
            except BaseException:  # refused (another run won a checkpoint place meanwhile): leave nothing behind
                for owner in claimed:
                    owner.unlink(missing_ok=True)
                if created:
                    (self.path / files.RUN_FILE).unlink(missing_ok=True)
                raise
            for c in cells:
                config_mod.save(c.cfg, c.dir / files.CONFIG_NAME)
            if manifest is not None:
                files.write_json(self.path / files.SWEEP_FILE, manifest)
        return cells


# --------------------------------------------------------------------------- one cell's checks

def existing_conflict(c: Cell) -> Optional[str]:
    """Why an existing cell of the same name cannot be reused for this config, or None."""
    path = c.dir / files.CONFIG_NAME
    if not path.is_file():
        return None
    try:
        old = config_mod.load_resolved(path)
    except ConfigError as e:
        return f"whose config.yaml cannot be read ({e})"
    if config_mod.math_hash(old) != config_mod.math_hash(c.cfg) or old.devices != c.cfg.devices:
        return "with a different config (model, train, data or devices)"
    if c.cfg.run.id is not None and old.run.id not in (None, c.cfg.run.id):
        return f"of another run ({old.run.id}, not this run directory's {c.cfg.run.id})"
    return None


def _owner_refusal(ckpt: Path, owner: Any, run_path: Path) -> ConfigError:
    whose = (f"run {owner.get('run_id')} in {owner.get('run_dir')}" if isinstance(owner, dict)
             else "no recorded run (written by another run or by hand)")
    held = ckpt.is_dir() and any(p.name != files.OWNER_FILE for p in ckpt.iterdir())
    what = f"already holds checkpoints of {whose}" if held else f"is already claimed by {whose} ({files.OWNER_FILE})"
    return ConfigError(f"checkpoint.dir: {ckpt} {what}, not of this run ({run_path}); set checkpoint.dir elsewhere "
                       "(or leave it unset to keep checkpoints inside the run directory), remove that directory, or "
                       "start from it on purpose with checkpoint.load_from.")


def check_checkpoint_owner(cell_cfg: Config, run_path: Path) -> None:
    """Refuse a local checkpoint directory that another run claimed, or that holds checkpoints no run
    claimed (nothing is written)."""
    path = cell_cfg.checkpoint.dir
    if files.is_remote(path):
        return  # the trainer checks the run id recorded in each checkpoint's metadata
    ckpt = Path(path)
    owner = files.read_json(ckpt / files.OWNER_FILE)
    rid = cell_cfg.run.id
    if isinstance(owner, dict) and (rid is not None and owner.get("run_id") == rid
                                    or rid is None and owner.get("run_dir") == str(run_path)):
        return  # ours (before the identity exists, known by the run directory; checked again under the lock)
    if owner is None and not (ckpt.is_dir() and any(p.name != files.OWNER_FILE for p in ckpt.iterdir())):
        return  # nobody's and empty: this run will claim it
    raise _owner_refusal(ckpt, owner, run_path)


def claim_checkpoints(cell_cfg: Config, run_path: Path) -> bool:
    """Record in a local checkpoint directory which run it belongs to; refuse it if another run got there
    first (two run directories racing for one checkpoint.dir root: exactly one wins). True when this call
    made the claim (False: it was this run's already, or the place is remote)."""
    if files.is_remote(cell_cfg.checkpoint.dir):
        return False
    ckpt = Path(cell_cfg.checkpoint.dir)
    mine = {"run_id": cell_cfg.run.id, "run_dir": str(run_path)}
    if files.write_json(ckpt / files.OWNER_FILE, mine, exclusive=True):
        return True
    owner = files.read_json(ckpt / files.OWNER_FILE)
    if not (isinstance(owner, dict) and owner.get("run_id") == cell_cfg.run.id):
        raise _owner_refusal(ckpt, owner, run_path)
    return False


def cell_config(cfg: Config, name: str) -> Config:
    """The config of cell `name` of `cfg`'s own run, for tools and tests that build one cell by hand."""
    return RunDir(cfg).cell_config(cfg, name)

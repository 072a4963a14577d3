"""The files a config names, checked before anything runs: a `data.source=file` token file and its
sidecar, a `model.init=hf:DIR` Hugging Face directory, and (for a cell) the `checkpoint.load_from`
directory it would start from; and the `wandb` package `metrics.wandb` needs.

`launch.config` checks the keys themselves (types, ranges, rules between keys) and never opens a
file of another part's format; the formats belong to `launch.data` (the token file's sidecar) and
`launch.core` (Hugging Face weights). The launcher asks both here, for the config a user gave and
for every cell of a sweep, so a wrong file is one sentence before a cell is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from launch.common import files
from launch.config import Config, ConfigError
from launch.launcher import rundir


def check(cfg: Config) -> None:
    """Raise ConfigError, in one sentence, when a file the config names cannot serve it."""
    m = cfg.model
    if m.init.startswith("hf:"):
        from launch.core import hf_weights, params
        problem = hf_weights.init_problem(m.init, m, params.param_shapes(m))
        if problem:
            raise ConfigError(problem)
    if cfg.metrics.wandb.enabled:
        from launch.core import wandb_run
        if not wandb_run.installed():
            raise ConfigError("metrics.wandb.enabled=true needs the wandb package, which is not installed here; "
                              "pip install wandb (or scaleout[wandb]), or set metrics.wandb.enabled=false.")
    if cfg.data.source == "file" and cfg.data.path and "://" not in cfg.data.path:
        from launch.data.tokenizer import file_problem  # the sidecar's vocabulary, dtype, length and largest token
        problem = file_problem(cfg)
        if problem:
            raise ConfigError(problem)


def check_cell(cell_cfg: Config) -> None:
    """`check`, and what only a cell's config says: where its own checkpoints are, so whether it would
    start from `checkpoint.load_from`, which must then hold a complete checkpoint of its framework."""
    check(cell_cfg)
    problem = load_from_problem(cell_cfg)
    if problem:
        raise ConfigError(problem)


def load_from_problem(cell_cfg: Config) -> Optional[str]:
    """Why the cell cannot start from `checkpoint.load_from` (one sentence), or None: also when it has its own
    checkpoint to continue from (load_from is then not read) or load_from is remote (the trainer checks)."""
    from launch import config as config_mod
    from launch.interop.export import Source, complete_steps
    ck = cell_cfg.checkpoint
    if not ck.load_from or files.is_remote(ck.load_from):
        return None
    fw = cell_cfg.framework
    if ck.dir and not files.is_remote(ck.dir) and complete_steps(Source(fw, Path(ck.dir), cell_cfg))[0]:
        return None
    where = f"checkpoint.load_from={ck.load_from!r}"
    path = Path(ck.load_from)
    if not path.exists():
        return f"{where} does not exist; give the checkpoint directory of a {fw} cell (<run.dir>/<run.name>/<cell>/checkpoints)."
    if not path.is_dir():
        return f"{where} is not a directory; give the checkpoint directory of a {fw} cell (<run.dir>/<run.name>/<cell>/checkpoints)."
    done, partial = complete_steps(Source(fw, path, cell_cfg))
    if done:
        return None
    other = next(f for f in config_mod.FRAMEWORKS if f != fw)
    theirs = complete_steps(Source(other, path, cell_cfg))[0]
    if theirs:
        return (f"{where} holds {other} checkpoints (steps {', '.join(map(str, theirs))}), which a framework={fw} cell "
                f"cannot load; give the checkpoint directory of a {fw} cell.")
    inner = path / rundir.CHECKPOINTS_DIR
    if complete_steps(Source(fw, inner, cell_cfg))[0]:
        return f"{where} is a cell directory; give its checkpoint directory, checkpoint.load_from={inner}."
    why = f" (only incomplete saves: {', '.join(partial)})" if partial else ""
    return (f"{where} holds no complete {fw} checkpoint{why}; give the checkpoint directory of a {fw} cell that saved one "
            "(<run.dir>/<run.name>/<cell>/checkpoints).")


def load(overrides=(), config_files=()) -> Config:
    """`launch.config.load` and then the files it names: what every verb of the command line reads."""
    from launch import config
    cfg = config.load(overrides, config_files)
    check(cfg)
    return cfg

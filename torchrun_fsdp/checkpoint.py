"""Distributed Checkpoint (DCP) saves of the PyTorch trainer, made visible atomically.

    <checkpoint.dir>/step_<N>/       DCP shards + .metadata + meta.json + COMMIT
    <checkpoint.dir>/.tmp-step_<N>/  a save in flight (or one that was interrupted)

Every rank writes its shards into `.tmp-step_<N>`; when DCP reports the save complete, rank 0
writes meta.json and the COMMIT marker and renames the directory to `step_<N>`. A directory
without COMMIT is never loaded (a warning names it). `checkpoint.async` uses `dcp.async_save`
on a separate gloo group, with at most one save in flight. Loading goes through
`get_state_dict`/`set_state_dict`, so a checkpoint written by 4 ranks loads on 2 (DCP reshards).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from launch.config import math_hash
from launch.schema import Config

COMMIT = "COMMIT"
STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointMismatch(RuntimeError):
    pass


def complete_steps(root: Path, warn: bool = False) -> List[Tuple[int, Path]]:
    """Committed checkpoints, oldest first; incomplete ones are skipped (with a warning if asked)."""
    out = []
    if not root.is_dir():
        return out
    for p in sorted(root.iterdir()):
        m = STEP_RE.match(p.name)
        if m and (p / COMMIT).is_file():
            out.append((int(m.group(1)), p))
        elif warn and (m or p.name.startswith(".tmp-step_")):
            warnings.warn(f"ignoring incomplete checkpoint {p} (no {COMMIT} marker: the save was interrupted)", stacklevel=2)
    return sorted(out)


class Checkpointer:
    def __init__(self, cfg: Config, model, optimizer, rank: int):
        self.cfg, self.model, self.optimizer, self.rank = cfg, model, optimizer, rank
        self.root = Path(cfg.checkpoint.dir)
        self.pending: Optional[Tuple[Any, int, Path, Dict[str, Any]]] = None
        self.group = dist.new_group(backend="gloo") if cfg.checkpoint.async_ else None

    # ------------------------------------------------------------------ save
    def save(self, step: int, meta: Dict[str, Any]) -> None:
        self.wait()
        tmp = self.root / f".tmp-step_{step}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.group is not None:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
            self.pending = (future, step, tmp, meta)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self._commit(step, tmp, meta)

    def poll(self) -> None:
        """Commit a finished async save without waiting for one that is still writing."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        future, step, tmp, meta = self.pending
        self.pending = None
        future.result()
        self._commit(step, tmp, meta)

    def _commit(self, step: int, tmp: Path, meta: Dict[str, Any]) -> None:
        if self.rank != 0:
            return
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}))
        with open(tmp / COMMIT, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        final = self.root / f"step_{step}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in complete_steps(self.root)[:-self.cfg.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def restore_latest(self) -> int:
        """Load the latest committed step of this cell, else of `checkpoint.load_from`; 0 if none."""
        steps = complete_steps(self.root, warn=self.rank == 0)
        if not steps and self.cfg.checkpoint.load_from:
            steps = complete_steps(Path(self.cfg.checkpoint.load_from), warn=self.rank == 0)
            if not steps:
                raise FileNotFoundError(f"checkpoint.load_from={self.cfg.checkpoint.load_from!r} holds no committed checkpoint")
        if not steps:
            return 0
        step, path = steps[-1]
        meta = json.loads((path / "meta.json").read_text())
        want = math_hash(self.cfg)
        if meta.get("config_hash") != want:
            raise CheckpointMismatch(
                f"the checkpoint at step {step} in {path.parent} was written by a different model/train/data config "
                f"(hash {meta.get('config_hash')}, this run {want}); use another run.name or remove that directory")
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return step

    def close(self) -> None:
        self.wait()

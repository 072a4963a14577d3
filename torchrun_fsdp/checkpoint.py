"""Distributed Checkpoint (DCP) saves of the PyTorch trainer, made visible atomically.

    <checkpoint.dir>/step_<N>/       DCP shards + .metadata + meta.json + COMMIT
    <checkpoint.dir>/.tmp-step_<N>/  a save in flight (or one that was interrupted)

Every rank writes its shards into `.tmp-step_<N>`; when DCP reports the save complete, rank 0
writes meta.json and the COMMIT marker and renames the directory to `step_<N>`. A directory
without COMMIT is never loaded (a warning names it). `checkpoint.async` uses `dcp.async_save`
on a separate gloo group, with at most one save in flight. Loading goes through
`get_state_dict`/`set_state_dict`, so a checkpoint written by 4 ranks loads on 2 (DCP reshards).
Which checkpoint to load, and whether this cell may continue from it, is `launch.core.engine`'s rule.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from launch.config.schema import Config
from launch.core import engine

log = logging.getLogger(__name__)

COMMIT = "COMMIT"
META = "meta.json"
STEP_RE = re.compile(r"^step_(\d+)$")


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
            log.warning(f"ignoring incomplete checkpoint {p} (no {COMMIT} marker: the save was interrupted)")
    return sorted(out)


def _last_line(e: BaseException) -> str:
    """What a DCP failure was (the last line of the ranks' tracebacks it carries), without the tracebacks."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


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
        (tmp / META).write_text(json.dumps(meta))
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
        """Load the checkpoint `launch.core.engine.restore_latest` picks; the step it holds, 0 if none.
        Damaged newer steps of this cell's own directory that it skipped are set aside
        (`step_<N>.corrupt`, by rank 0) so keep-N and the next save of those steps do not trip over them."""
        got = engine.restore_latest(self.cfg, self._steps, self._read_meta, self._load,
                                    describe=lambda f: f"step {f.step} ({Path(f.root) / f'step_{f.step}'})")
        if got.skipped and not got.load_from:
            if self.rank == 0:
                for step, _ in got.skipped:
                    engine.set_aside(Path(got.root) / f"step_{step}")
            dist.barrier()
        return got.step

    def _steps(self, root: str) -> List[int]:
        return [step for step, _ in complete_steps(Path(root), warn=self.rank == 0)]

    def _read_meta(self, found: engine.Found) -> Dict[str, Any]:
        return json.loads((Path(found.root) / f"step_{found.step}" / META).read_text())

    def _load(self, found: engine.Found) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        try:
            dcp.load(state, checkpoint_id=str(Path(found.root) / f"step_{found.step}"))
        except CheckpointException as e:  # a BaseException holding every failing rank's traceback as text
            raise RuntimeError(_last_line(e)) from e
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def close(self) -> None:
        self.wait()

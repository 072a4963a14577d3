"""Distributed Checkpoint (DCP) saves of the PyTorch trainer, made visible atomically.

    <checkpoint.dir>/step_<N>/       DCP shards + .metadata + meta.json + COMMIT
    <checkpoint.dir>/.tmp-step_<N>/  a save in flight (or one that was interrupted; local disk)

Every rank writes its shards where `torchrun_fsdp.storage.StepStore` says (`.tmp-step_<N>` on disk,
`step_<N>` itself on gs://, which has no rename); when DCP reports the save complete, rank 0
writes meta.json and, last, the COMMIT marker (and on disk renames the directory to `step_<N>`). A
directory without COMMIT is never loaded (a warning names it). `checkpoint.async` saves through
`torchrun_fsdp.async_save.AsyncSaver` (DCP's checkpoint process, staged in reused shared memory),
with at most one save in flight. Loading goes through
`get_state_dict`/`set_state_dict`, so a checkpoint written by 4 ranks loads on 2 (DCP reshards).
Which checkpoint to load, and whether this cell may continue from it, is `launch.core.engine`'s rule.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from launch.config.schema import Config
from launch.core import engine
from torchrun_fsdp.async_save import AsyncSaver
from torchrun_fsdp.storage import StepStore

log = logging.getLogger(__name__)


def _last_line(e: BaseException) -> str:
    """What a DCP failure was (the last line of the ranks' tracebacks it carries), without the tracebacks."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


class Checkpointer:
    def __init__(self, cfg: Config, model, optimizer, rank: int, device_type: str = "cpu"):
        self.cfg, self.model, self.optimizer, self.rank = cfg, model, optimizer, rank
        self.store = StepStore(cfg.checkpoint.dir)
        self.pending: Optional[Tuple[Any, int, str, Dict[str, Any]]] = None
        self.saver = AsyncSaver(device_type) if cfg.checkpoint.async_ else None
        if self.saver is not None and 0 < cfg.checkpoint.every < cfg.train.steps:  # saves before the last one
            self.saver.start_process()

    # ------------------------------------------------------------------ save
    def save(self, step: int, meta: Dict[str, Any], final: bool = False) -> None:
        """Save the state after `step` steps. `final`: the run's last save, which the trainer waits for next; when
        no async save has started DCP's checkpoint process yet, it is written here, in the trainer (starting a
        process per rank, with its interpreter, torch and a gloo group, only to wait for it would cost seconds)."""
        self.wait()
        tmp = self.store.staging_path(step)
        if self.rank == 0:
            self.store.prepare(step)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.saver is not None and not (final and not self.saver.started):
            future = self.saver.start(state, **self.store.dcp_args(tmp))
            self.pending = (future, step, tmp, meta)
        else:
            dcp.save(state, **self.store.dcp_args(tmp))
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

    def _commit(self, step: int, tmp: str, meta: Dict[str, Any]) -> None:
        if self.rank != 0:
            return
        self.store.commit(step, meta)
        self.store.prune(self.cfg.checkpoint.keep)

    # ------------------------------------------------------------------ load
    def restore_latest(self) -> int:
        """Load the checkpoint `launch.core.engine.restore_latest` picks; the step it holds, 0 if none.
        Damaged newer steps of this cell's own directory that it skipped are set aside
        (`step_<N>.corrupt`, by rank 0) so keep-N and the next save of those steps do not trip over them."""
        got = engine.restore_latest(self.cfg, self._steps, self._read_meta, self._load,
                                    describe=lambda f: f"step {f.step} ({StepStore(f.root).step_path(f.step)})")
        if got.skipped and not got.load_from:
            if self.rank == 0:
                for step, _ in got.skipped:
                    self.store.set_aside(step)
            dist.barrier()
        return got.step

    def _steps(self, root: str) -> List[int]:
        return [step for step, _ in StepStore(root).complete(warn=self.rank == 0)]

    def _read_meta(self, found: engine.Found) -> Dict[str, Any]:
        return StepStore(found.root).read_meta(found.step)

    def _load(self, found: engine.Found) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        try:
            dcp.load(state, checkpoint_id=StepStore(found.root).step_path(found.step))
        except CheckpointException as e:  # a BaseException holding every failing rank's traceback as text
            raise RuntimeError(_last_line(e)) from e
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def before_update(self) -> None:
        """The optimizer is about to change the weights: an async save's staged copy must be complete."""
        if self.saver is not None:
            self.saver.wait_for_staging()

    def close(self) -> None:
        self.wait()
        if self.saver is not None:
            self.saver.close()

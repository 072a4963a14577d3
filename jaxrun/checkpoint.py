"""Orbax checkpoints of the JAX trainer.

A `CheckpointManager` under the cell's checkpoint directory (a local path or gs://) keeps
`checkpoint.keep` steps, each holding `state` (params + optimizer state, sharded) and `meta`
(JSON: config hash, mesh, framework, versions). Saves are async when `checkpoint.async`.
Orbax writes each step to a temporary directory and finalises it atomically, so only complete
steps are listed. Restoring reads into the abstract state of the *current* mesh, so a checkpoint
written on 4 devices continues on 2.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import orbax.checkpoint as ocp

from launch.config import math_hash
from launch.schema import Config

log = logging.getLogger(__name__)


class CheckpointMismatch(RuntimeError):
    pass


class Checkpointer:
    def __init__(self, cfg: Config, abstract_state: Dict[str, Any]):
        self.cfg, self.abstract = cfg, abstract_state
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.checkpoint.keep,
                                               enable_async_checkpointing=cfg.checkpoint.async_, create=True)
        self.manager = ocp.CheckpointManager(cfg.checkpoint.dir, options=options, item_names=("state", "meta"))

    def restore_latest(self) -> Tuple[Optional[Dict[str, Any]], int]:
        step = self.manager.latest_step()
        if step is None:
            return None, 0
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        want = math_hash(self.cfg)
        if meta.get("config_hash") != want:
            raise CheckpointMismatch(
                f"the checkpoint at step {step} in {self.cfg.checkpoint.dir} was written by a different model/train/data "
                f"config (hash {meta.get('config_hash')}, this run {want}); use another run.name or remove that directory")
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(self.abstract)))
        return restored["state"], step

    def save(self, step: int, state: Dict[str, Any], meta: Dict[str, Any]) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave({**meta, "step": step})))

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

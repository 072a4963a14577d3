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
        """The latest complete state of this cell, else of `checkpoint.load_from`, else (None, 0)."""
        manager, where = self.manager, self.cfg.checkpoint.dir
        step = manager.latest_step()
        if step is None and self.cfg.checkpoint.load_from:
            where = self.cfg.checkpoint.load_from
            manager = ocp.CheckpointManager(where, options=ocp.CheckpointManagerOptions(read_only=True),
                                            item_names=("state", "meta"))
            step = manager.latest_step()
            if step is None:
                raise FileNotFoundError(f"checkpoint.load_from={where!r} holds no complete checkpoint")
        if step is None:
            return None, 0
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        want = math_hash(self.cfg)
        if meta.get("config_hash") != want:
            raise CheckpointMismatch(
                f"the checkpoint at step {step} in {where} was written by a different model/train/data "
                f"config (hash {meta.get('config_hash')}, this run {want}); use another run.name or remove that directory")
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(self.abstract)))
        return restored["state"], step

    def save(self, step: int, state: Dict[str, Any], meta: Dict[str, Any]) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave({**meta, "step": step})))

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def load_params_numpy(ckpt_dir, step: int) -> Dict[str, Any]:
    """The params of a saved step as host numpy arrays keyed by stacked name (`layers.attention.wq`).

    Needs no mesh: for converters (`launch.params.unstack` -> PyTorch) and tests.
    """
    import jax
    import numpy as np

    item = f"{ckpt_dir}/{step}/state"
    meta = ocp.PyTreeCheckpointer().metadata(item)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = ocp.PyTreeCheckpointer().restore(item, restore_args=restore_args)
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state["params"])[0]:
        flat[".".join(str(getattr(k, "key", k)) for k in path if str(getattr(k, "key", k)) != "value")] = np.asarray(leaf)
    return flat

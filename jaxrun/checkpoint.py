"""Orbax checkpoints of the JAX trainer.

A `CheckpointManager` under the cell's checkpoint directory (a local path or gs://) keeps
`checkpoint.keep` steps, each holding `state` (params + optimizer state, sharded) and `meta`
(JSON: `launch.core.engine.checkpoint_metadata`: config hash, run id, mesh, framework, versions). Saves are async when `checkpoint.async`.
Orbax writes each step to a temporary directory and finalises it atomically, so only complete
steps are listed. Restoring reads into the abstract state of the *current* mesh, so a checkpoint
written on 4 devices continues on 2. Which checkpoint to restore, and whether this cell may
continue from it, is `launch.core.engine`'s rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import orbax.checkpoint as ocp

from launch.config.schema import Config
from launch.core import engine

ITEMS = ("state", "meta")


class Checkpointer:
    def __init__(self, cfg: Config, abstract_state: Dict[str, Any]):
        self.cfg, self.abstract = cfg, abstract_state
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.checkpoint.keep,
                                               enable_async_checkpointing=cfg.checkpoint.async_, create=True)
        self.manager = ocp.CheckpointManager(cfg.checkpoint.dir, options=options, item_names=ITEMS)
        self._readers: Dict[str, ocp.CheckpointManager] = {cfg.checkpoint.dir: self.manager}

    def _manager(self, root: str) -> ocp.CheckpointManager:
        """This cell's manager, or a read-only one for another directory (`checkpoint.load_from`)."""
        if root not in self._readers:
            self._readers[root] = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True),
                                                        item_names=ITEMS)
        return self._readers[root]

    def restore_latest(self) -> Tuple[Optional[Dict[str, Any]], int]:
        """The state `launch.core.engine.restore_latest` picks, restored onto the current mesh, and its
        step; (None, 0) when the cell starts fresh. Damaged newer steps of this cell's own directory
        that it skipped are set aside (`<step>.corrupt`, by process 0) so keep-N and the next save of
        those steps do not trip over them."""
        got = engine.restore_latest(self.cfg, lambda root: sorted(self._manager(root).all_steps()),
                                    self._read_meta, self._load,
                                    describe=lambda f: f"step {f.step} ({f.root}/{f.step})")
        if got.skipped and not got.load_from:
            import jax
            from jax.experimental import multihost_utils
            if jax.process_index() == 0:
                for step, _ in got.skipped:
                    engine.set_aside(f"{got.root}/{step}" if "://" in got.root else Path(got.root) / str(step))
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("scaleout-set-aside-damaged-checkpoints")
            self.manager.reload()
        return got.state, got.step

    def _read_meta(self, found: engine.Found) -> Dict[str, Any]:
        return self._manager(found.root).restore(found.step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def _load(self, found: engine.Found) -> Dict[str, Any]:
        restored = self._manager(found.root).restore(
            found.step, args=ocp.args.Composite(state=ocp.args.StandardRestore(self.abstract)))
        return restored["state"]

    def save(self, step: int, state: Dict[str, Any], meta: Dict[str, Any]) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)))

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def load_params_numpy(ckpt_dir, step: int) -> Dict[str, Any]:
    """The params of a saved step as host numpy arrays keyed by stacked name (`layers.attention.wq`).

    Needs no mesh: for converters (`launch.core.params.unstack` -> PyTorch) and tests.
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

"""Where a PyTorch cell's DCP steps live, and how one becomes visible: a local directory or gs://.

    <root>/step_<N>/          DCP shards + .metadata + meta.json + COMMIT (a complete step)
    <root>/.tmp-step_<N>/     local disk only: a save in flight, renamed to step_<N> once committed
    <root>/step_<N>.corrupt   a damaged step set aside (launch.core.engine's rule), ignored by keep-N

A step is complete when it holds COMMIT, written by rank 0 after DCP reported every rank's shards
written and after meta.json. On local disk the step is also written to `.tmp-step_<N>` and made
visible by an atomic rename (a reader never sees the directory half there). Cloud Storage has no
rename (gcsfs copies and deletes object by object), so on gs:// the step is written in place and
COMMIT, written last, is the only thing that makes it visible: a step without it is never listed,
whatever else it holds. DCP's own `.metadata` is written as `.metadata.tmp` and renamed; on gs://
that rename is a server-side copy then a delete (`no_rename_writer`), what gcsfs falls back to anyway.

Directories on gs:// are prefixes: listing one lists the objects under it, an empty "directory"
does not exist, and removing a step removes its objects. Listings are read fresh (gcsfs caches
them per process, and other ranks or an earlier run wrote them).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Tuple

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

from launch.common import files

log = logging.getLogger(__name__)

COMMIT = "COMMIT"
META = "meta.json"
STEP_RE = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-step_"


class CopyRename(FileSystem):
    """DCP's fsspec adapter with rename as a copy and a delete, which is what a rename is on Cloud Storage."""

    def rename(self, path: Any, new_path: Any) -> None:
        self.fs.copy(os.fspath(path), os.fspath(new_path))
        self.fs.rm(os.fspath(path))


class NoRenameWriter(FsspecWriter):
    """DCP's fsspec writer, whose one rename (`.metadata.tmp` -> `.metadata`) goes through `CopyRename`.
    A module-level class, so picklable: `checkpoint.async`'s checkpoint process receives it through a pipe."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        fs = CopyRename()
        fs.fs = self.fs.fs
        self.fs = fs


def no_rename_writer(path: str) -> NoRenameWriter:
    """The storage writer of a DCP save to object storage. (torch 2.13 exports `FsspecWriter` only from
    its `_fsspec_filesystem` module, which is what `dcp.save(checkpoint_id="gs://...")` picks.)"""
    return NoRenameWriter(path)


class StepStore:
    """The steps of one checkpoint directory (`checkpoint.dir` or `checkpoint.load_from`)."""

    def __init__(self, root: str):
        self.root = str(root).rstrip("/")
        self.remote = files.is_remote(self.root)
        self.fs = None
        if self.remote:
            import fsspec
            self.fs, _ = fsspec.core.url_to_fs(self.root)

    # ------------------------------------------------------------------ paths
    def step_path(self, step: int) -> str:
        return f"{self.root}/step_{step}"

    def staging_path(self, step: int) -> str:
        """Where DCP writes step `step`: in place on gs://, a temporary directory on local disk."""
        return self.step_path(step) if self.remote else f"{self.root}/{TMP_PREFIX}{step}"

    def dcp_args(self, path: str) -> Dict[str, Any]:
        """The keyword arguments of dcp.save / dcp.async_save that write to `path`."""
        if self.remote:
            return {"checkpoint_id": path, "storage_writer": no_rename_writer(path)}
        return {"checkpoint_id": path}

    # ------------------------------------------------------------------ writing (rank 0)
    def prepare(self, step: int) -> None:
        """Make room for a save of `step`: no old files of that step left where DCP writes (rank 0)."""
        path = self.staging_path(step)
        if self.remote:
            self._rm(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
            Path(path).mkdir(parents=True)

    def commit(self, step: int, meta: Dict[str, Any]) -> None:
        """Write meta.json, then COMMIT (last), and make the step visible (rank 0)."""
        path = self.staging_path(step)
        if self.remote:
            self.fs.pipe_file(f"{path}/{META}", json.dumps(meta).encode())
            self.fs.pipe_file(f"{path}/{COMMIT}", str(step).encode())
            return
        (Path(path) / META).write_text(json.dumps(meta))
        with open(Path(path) / COMMIT, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        final = self.step_path(step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(path, final)

    def prune(self, keep: int) -> None:
        """Keep the newest `keep` complete steps (rank 0)."""
        for _, old in self.complete()[:-keep]:
            if self.remote:
                self._rm(old)
            else:
                shutil.rmtree(old, ignore_errors=True)

    def _rm(self, path: str) -> None:
        """Remove a step's objects, COMMIT first: a removal cut short leaves an incomplete step, never a
        complete-looking one with files missing."""
        from launch.core import objstore
        objstore.remove(path)

    # ------------------------------------------------------------------ reading
    def _names(self) -> List[str]:
        if self.remote:
            self.fs.invalidate_cache(self.root)
            try:
                return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False))
            except FileNotFoundError:
                return []
        root = Path(self.root)
        return sorted(p.name for p in root.iterdir()) if root.is_dir() else []

    def _has_commit(self, step_path: str) -> bool:
        return self.fs.exists(f"{step_path}/{COMMIT}") if self.remote else (Path(step_path) / COMMIT).is_file()

    def complete(self, warn: bool = False) -> List[Tuple[int, str]]:
        """Committed steps, oldest first; incomplete ones are skipped (with a warning if asked)."""
        out = []
        for name in self._names():
            m = STEP_RE.match(name)
            path = f"{self.root}/{name}"
            if m and self._has_commit(path):
                out.append((int(m.group(1)), path))
            elif warn and (m or name.startswith(TMP_PREFIX)):
                log.warning(f"ignoring incomplete checkpoint {path} (no {COMMIT} marker: the save was interrupted)")
        return sorted(out)

    def read_meta(self, step: int) -> Dict[str, Any]:
        path = f"{self.step_path(step)}/{META}"
        if self.remote:
            return json.loads(self.fs.cat_file(path))
        return json.loads(Path(path).read_text())

    def set_aside(self, step: int) -> str:
        """Move a damaged step out of the way as `step_<N>.corrupt` (rank 0): launch.core.engine's rule (on
        gs:// a copy of its objects, then their removal, COMMIT first)."""
        from launch.core import engine
        path = self.step_path(step)
        return str(engine.set_aside(path if self.remote else Path(path)))

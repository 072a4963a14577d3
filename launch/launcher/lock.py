"""One owner per cell: an exclusive `fcntl` lock on <cell>/.lock for the life of a launcher.

The lock file names the holder (PID and host). The kernel drops the lock when the holder dies,
however it dies, so a stale lock is simply taken over.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Dict, Iterable

from launch.common import files
from launch.targets.errors import SubmitError


class CellBusy(SubmitError):
    """Another live launcher holds the cell."""


class CellLocks:
    """Locks on several cell directories, taken together, released together."""

    def __init__(self, cell_dirs: Iterable[Path]):
        self.dirs = [Path(d) for d in cell_dirs]
        self._fds: Dict[Path, int] = {}

    def __enter__(self) -> "CellLocks":
        try:
            for d in self.dirs:
                self._take(d)
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _take(self, d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        path = d / files.LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CellBusy(f"cell {d.name} is being run by {holder} (lock {path}); wait for it to finish "
                           "or stop it, then run again.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{files.holder()}\n".encode(), 0)
        self._fds[d] = fd

    def release(self) -> None:
        for fd in self._fds.values():
            try:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self._fds.clear()

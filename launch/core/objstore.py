"""Checkpoint directories on object storage (gs://), where a "directory" is a prefix of object names.

Cloud Storage has no rename: moving a directory copies and deletes its objects one by one, so a
move cut short leaves both halves. The helpers here order their steps so that what a crash leaves
is never taken for a complete checkpoint: the completion marker (Orbax's `commit_success.txt`,
DCP's `COMMIT`) goes first when a step is removed or set aside. fsspec (gcsfs) is imported where
used; nothing here runs for a local path.
"""

from __future__ import annotations

import logging
from typing import Sequence

log = logging.getLogger(__name__)

# The files whose presence makes a step complete on object storage: Orbax's (on gs:// it does not
# rename a temporary directory but writes this file last) and the PyTorch trainer's.
MARKERS = ("commit_success.txt", "COMMIT")


def _fs(url: str):
    import fsspec
    fs, _ = fsspec.core.url_to_fs(url)
    return fs


def _key(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


def remove(url: str, markers: Sequence[str] = MARKERS) -> None:
    """Remove a step's objects, its completion markers first."""
    fs = _fs(url)
    for m in markers:
        try:
            fs.rm_file(f"{_key(url)}/{m}")
        except FileNotFoundError:
            pass
    try:
        fs.rm(_key(url), recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(_key(url))


def set_aside(url: str, markers: Sequence[str] = MARKERS) -> str:
    """`<step>` -> `<step>.corrupt` (`.corrupt-2`, ... if taken): its objects copied without the completion
    markers, then removed (markers first). Returns the new URL."""
    fs = _fs(url)
    src = _key(url)
    scheme = url.split("://", 1)[0]
    parent, name = src.rsplit("/", 1)
    fs.invalidate_cache(parent)
    taken = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(parent, detail=False)}
    target, n = f"{name}.corrupt", 2
    while target in taken:
        target, n = f"{name}.corrupt-{n}", n + 1
    for key in fs.find(src):
        rel = key[len(src):].lstrip("/")
        if rel not in markers:
            fs.copy(key, f"{parent}/{target}/{rel}")
    remove(url, markers)
    dest = f"{scheme}://{parent}/{target}"
    log.warning(f"damaged checkpoint {url} kept for inspection as {dest}")
    return dest

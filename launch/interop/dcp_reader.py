"""Reading a PyTorch Distributed Checkpoint that someone else may have written, without running its code.

DCP's `.metadata` file is a pickle, and `FileSystemReader.read_metadata` loads it with `pickle.load`, which
runs whatever the file names. `scaleout export` reads checkpoints of shared or copied run directories, so
it reads `.metadata` with an unpickler that resolves only the classes DCP's metadata consists of (its
dataclasses, torch dtypes, `torch.Size`, paths) and refuses any other name; tensors are then loaded by
DCP itself, which uses `torch.load(weights_only=True)` for them. Only tensor entries are ever requested
(a `BytesStorageMetadata` entry would be loaded with `weights_only=False`).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

METADATA_NAME = ".metadata"  # what torch.distributed.checkpoint.FileSystemWriter names it


class UnsafeMetadata(Exception):
    """The metadata names something a DCP checkpoint does not hold."""


# (module, name) pairs a DCP `.metadata` pickle may name; torch dtypes are checked by type.
ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
}
DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
               "torch.distributed.checkpoint.planner")


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in DCP_MODULES and not name.startswith("__"):
            found = super().find_class(module, name)
            if isinstance(found, type):  # DCP's dataclasses and enums, never a function
                return found
        raise UnsafeMetadata(f"{module}.{name}")


def load_metadata(data: bytes):
    """The `Metadata` of a DCP `.metadata` file's bytes; UnsafeMetadata when it names anything else."""
    from torch.distributed.checkpoint.metadata import Metadata
    md = _Unpickler(io.BytesIO(data)).load()
    if not isinstance(md, Metadata):
        raise UnsafeMetadata(f"a {type(md).__name__}, not DCP metadata")
    return md


def reader(path: str):
    """A `FileSystemReader` of the checkpoint at `path` whose metadata is read by `load_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            md = load_metadata((Path(path) / METADATA_NAME).read_bytes())
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader(path)

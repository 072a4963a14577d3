"""The files a TPU cell reads that live on the launcher's machine, shipped to every worker.

The workers see none of the launcher's disk: a `data.source=file` token file (with its sidecar
`<path>.meta.json`) and a `model.init=hf:DIR` Hugging Face directory are copied to each worker
(`tpu-vm scp`, one per worker, before tpu.setup) into

    ~/scaleout/inputs/<name>-<fingerprint>/<name>

and the workers' config points there. The fingerprint is of the local path, size and modification
time, so a changed file lands in a new directory and a worker never reads a stale copy. URLs are
refused by the config before anything is created (`launch.config`): the trainers memory-map the
token file and read the HF directory from local disk.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

from launch.config.schema import Config
from launch.data.tokenizer import sidecar_path

INPUTS_DIR = "inputs"  # under ~/scaleout on every worker
HF_PREFIX = "hf:"


@dataclass(frozen=True)
class Shipped:
    local: str  # on the launcher's machine
    remote: str  # relative to ~/scaleout on every worker
    recurse: bool = False  # a directory


def _fingerprint(path: Path) -> str:
    h = hashlib.sha256(str(path.resolve()).encode())
    for p in ([path] + sorted(path.rglob("*")) if path.is_dir() else [path]):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def _home(path: Path) -> str:
    return f"{INPUTS_DIR}/{path.name}-{_fingerprint(path)}"


def shipped(cfg: Config) -> List[Shipped]:
    """What to copy to every worker for this cell (empty: it reads nothing from the launcher's disk)."""
    out: List[Shipped] = []
    if cfg.data.source == "file" and cfg.data.path:
        data = Path(cfg.data.path).expanduser()
        home = _home(data)
        out.append(Shipped(str(data), f"{home}/{data.name}"))
        sidecar = sidecar_path(data)
        if sidecar.is_file():
            out.append(Shipped(str(sidecar), f"{home}/{sidecar.name}"))
    if cfg.model.init.startswith(HF_PREFIX):
        d = Path(cfg.model.init[len(HF_PREFIX):]).expanduser()
        out.append(Shipped(str(d), f"{_home(d)}/{d.name}", recurse=True))
    return out


def remote_values(cfg: Config, root: str) -> Dict[str, str]:
    """The config keys whose value changes on the workers, `root` being ~/scaleout there."""
    values: Dict[str, str] = {}
    items = iter(shipped(cfg))
    if cfg.data.source == "file" and cfg.data.path:
        values["data.path"] = f"{root}/{next(items).remote}"
        if sidecar_path(Path(cfg.data.path).expanduser()).is_file():
            next(items)
    if cfg.model.init.startswith(HF_PREFIX):
        values["model.init"] = f"{HF_PREFIX}{root}/{next(items).remote}"
    return values

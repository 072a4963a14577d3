"""Read a PyTorch cell's DCP checkpoint back as numpy, without a process group."""

from pathlib import Path
from typing import Dict

import numpy as np


def load_dcp_model(step_dir: Path) -> Dict[str, np.ndarray]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v.numpy() for k, v in state["model"].items()}

"""Read a JAX cell's checkpoint back as numpy (for tests comparing weights)."""

from pathlib import Path
from typing import Dict

import numpy as np


def final_params(ckpt_dir: Path, step: int) -> Dict[str, np.ndarray]:
    from jaxrun.checkpoint import load_params_numpy
    return load_params_numpy(ckpt_dir, step)

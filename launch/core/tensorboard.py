"""TensorBoard event files from the metrics stream (`metrics.tensorboard=true`), via tensorboardX.

Only process 0's writer exists (the same one that writes metrics.jsonl), so every scalar in
TensorBoard is also a field of a `step` record (`train/...`) or an `eval` record (`eval/loss`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict


class EventWriter:
    def __init__(self, logdir: Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:  # pragma: no cover - tensorboardX is a dependency
            raise RuntimeError("metrics.tensorboard=true needs tensorboardX (pip install tensorboardX)") from e
        self._w = SummaryWriter(logdir=str(logdir))

    def scalars(self, step: int, values: Dict[str, Any], prefix: str = "train") -> None:
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "time":
                self._w.add_scalar(f"{prefix}/{key}", value, global_step=step)

    def close(self) -> None:
        self._w.close()

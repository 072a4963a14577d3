"""The one metrics writer both trainers use, and the figures derived from step times.

`<cell>/metrics.jsonl` holds one JSON object per line with a `kind`:
  start    framework, devices, processes, device_kind, host_cores, config_hash, versions
  compile  seconds (lowering + compiling the train step; torch.compile time)
  step     step, loss, grad_norm, lr, step_time_s, tokens_per_s, tokens_per_s_per_device, mfu
  checkpoint  step, seconds (time the training loop was blocked)
  summary  framework, devices, processes, status, error, steps, final_loss, compile_s,
           time_to_first_step_s, step_time_p50_s, step_time_p90_s, tokens_per_s,
           tokens_per_s_per_device, mfu, flops_per_token, peak_flops_per_device, params,
           bytes_per_device, peak_memory_bytes, resumed_from_step, loop_tokens_per_s
           (tokens/s over the wall clock of the steady steps, including what intermediate
           checkpoint saves cost the loop; the final save is left out, as a long run amortises it)
A resumed cell appends; readers take the last summary and the step records of every segment.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

import numpy as np


class MetricsWriter:
    def __init__(self, path: Path, enabled: bool = True, tensorboard_dir: Optional[Path] = None):
        self.path, self.enabled = Path(path), enabled
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", buffering=1)
            if tensorboard_dir is not None:
                from launch.tensorboard import EventWriter
                self._tb = EventWriter(tensorboard_dir)

    def write(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        rec = {"kind": kind, "time": round(time.time(), 3), **fields}
        self._f.write(json.dumps(rec, default=_jsonable) + "\n")
        if self._tb is not None and kind == "step":
            self._tb.scalars(fields["step"], {k: v for k, v in fields.items() if k != "step"})

    def close(self) -> None:
        if self.enabled:
            self._f.close()
            if self._tb is not None:
                self._tb.close()


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return str(x)


def read(path: Path) -> List[Dict[str, Any]]:
    """Every record of a metrics file; a torn last line (process killed mid-write) is skipped."""
    out = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def steady(step_times: List[float], warmup_exclude: int) -> List[float]:
    """Step times without the warm-up steps (keeps at least the last half if the run is short)."""
    if len(step_times) > warmup_exclude:
        return step_times[warmup_exclude:]
    return step_times[len(step_times) // 2:]


def percentile(xs: Iterable[float], q: float) -> Optional[float]:
    xs = list(xs)
    return float(np.percentile(xs, q)) if xs else None


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB, macOS bytes)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def calibrate_matmul(run: Callable[[int], Callable[[], None]], n: int = 1024, repeats: int = 5) -> float:
    """Peak FLOP/s of an n x n fp32 matmul: `run(n)` returns a closure doing one synced matmul."""
    fn = run(n)
    fn()  # warm-up / compile
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best

"""The one metrics writer both trainers use, and the figures derived from step times.

`<cell>/metrics.jsonl` holds one JSON object per line with a `kind`:
  start    framework, devices, processes, device_kind, host_cores, config_hash, versions, settings
           (what the framework was set to: matmul precision, XLA flags)
  compile  one per compilation (launch.core.compiles): step, scope (train | eval | setup), seconds,
           reason, recompile, and the framework's own fields (JAX: function, cache hit/miss/off;
           torch.compile: compile_id, what, graph_breaks, recompile_reason)
  step     step, loss, grad_norm, lr, step_time_s, tokens_per_s, tokens_per_s_per_device, mfu (real
           tokens: with data.seq_lens also seq_len and padded_len); compiled: true when the train step
           compiled during it
  eval     step, loss (mean over train.eval_batches fixed held-out batches), batches, tokens, seconds
           (left out of loop_tokens_per_s)
  checkpoint  step, seconds (time the training loop was blocked)
  checkpoint_wait  seconds (waiting for in-flight saves at the end)
  summary  framework, devices, processes, status (ok | stopped | failed), error, steps, final_loss,
           matmul_precision,
           compile_s, compiles, recompiles, cache_hits, cache_misses, other_compile_s, other_compiles
           (launch.core.compiles; torch.compile also graphs, graph_breaks), warmup_excess_s (the
           warm-up steps' time over the steady median: start-up cost that is not a compile),
           time_to_first_step_s, step_time_p50_s, step_time_p90_s, tokens_per_s,
           tokens_per_s_per_device, mfu (steady steps: after the warm-up, none that compiled; real
           tokens only), flops_per_token, peak_flops_per_device, params,
           bytes_per_device, peak_memory_bytes, resumed_from_step, loop_tokens_per_s
           (real tokens/s over the wall clock of the steady steps, including what intermediate
           checkpoint saves and compiles during steps cost the loop; the final save is left out, as
           a long run amortises it), checkpoint_saves, checkpoint_blocked_s (all saves' blocking
           time), checkpoint_wait_s (the final wait), post_save_step_ratio (median steady step after
           the first intermediate save / before it),
           with data.seq_lens or data.pad_to: seq_len_mean, padding_share,
           stopped_by (the signal name, "launcher gone", or "peer" when another process stopped),
           final_eval_loss (the last eval record's loss; null without train.eval_every)
A resumed cell appends; readers take the last summary and the step records of every segment.
TensorBoard (`metrics.tensorboard`) and W&B (`metrics.wandb`) get the same scalars: `train/<field>`
of each step record and `eval/loss`; W&B also the config and the summary (`launch.core.wandb_run`).

Every line is strict JSON: a NaN or infinite value is written as `null`, and the record then has
`non_finite`, the list of its fields that were not finite (nested ones as `a.b`, list entries as
`a[0]`), so the fact is kept.
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

from launch.common.files import read_records


class MetricsWriter:
    """metrics.jsonl, and the same scalars to TensorBoard (`tensorboard_dir`) and W&B (`wandb`: a
    callable making the `launch.core.wandb_run.WandbWriter`, called only where the writer is enabled)."""

    def __init__(self, path: Path, enabled: bool = True, tensorboard_dir: Optional[Path] = None,
                 wandb: Optional[Callable[[], Any]] = None):
        self.path, self.enabled = Path(path), enabled
        self._tb = None
        self._wandb = None
        self._failed = False
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", buffering=1)
            if tensorboard_dir is not None:
                from launch.core.tensorboard import EventWriter
                self._tb = EventWriter(tensorboard_dir)
            if wandb is not None:
                self._wandb = wandb()

    def write(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        bad: List[str] = []
        clean = {k: _finite_or_none(v, k, bad) for k, v in fields.items()}
        rec = {"kind": kind, "time": round(time.time(), 3), **clean}
        if bad:
            rec["non_finite"] = bad
        self._f.write(json.dumps(rec, default=str, allow_nan=False) + "\n")
        for sink in (self._tb, self._wandb):
            if sink is not None and kind == "step":
                sink.scalars(clean["step"], {k: v for k, v in clean.items() if k != "step"}, prefix="train")
            if sink is not None and kind == "eval":
                sink.scalars(clean["step"], {"loss": clean["loss"]}, prefix="eval")
        if self._wandb is not None and kind == "summary":
            self._wandb.summary(clean)
            self._failed = clean.get("status") == "failed"

    def close(self) -> None:
        if self.enabled:
            self._f.close()
            if self._tb is not None:
                self._tb.close()
            if self._wandb is not None:
                self._wandb.close(failed=self._failed)


def _finite_or_none(value: Any, path: str, bad: List[str]) -> Any:
    """`value` as plain JSON data: numpy scalars as Python numbers, NaN/inf as None (path noted in `bad`)."""
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        bad.append(path)
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v, f"{path}.{k}", bad) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v, f"{path}[{i}]", bad) for i, v in enumerate(value)]
    return value


def read(path: Path) -> List[Dict[str, Any]]:
    """Every record of a metrics file; torn or non-object lines (a process killed mid-write) are skipped."""
    return read_records(path)


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

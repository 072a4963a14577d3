"""Profiler traces of a window of steps, and the step-time breakdown computed from them.

`profile.steps=[START, END]` makes every cell trace its steps START..END (inclusive, counted
from 1 like the step records) on process 0 (`profile.all_processes`: on every process). Each
framework writes its own format under `CELL/profile/process-<i>/` (`jaxrun.profile`,
`torchrun_fsdp.profile`); this module is the framework-neutral part: the window, the files'
place, and the breakdown of each traced step into five categories that partition its wall time:

    collectives       any collective op running (all-gather, reduce-scatter, all-reduce, ...)
    matmul_attention  else any matmul / attention kernel running
    other_compute     else any other op running (elementwise, norms, softmax, optimizer, copies)
    host_data         else the trainer building the batch (`scaleout/data` annotation)
    idle              none of the above: dispatch, Python, synchronisation, waiting

Each instant of a step counts once, for the first category in that order that is active at
that instant (over every thread of the device examined), so the five sum to the step's traced
duration exactly, and that duration is the `scaleout/step` annotation around the same call the
step timer measures. What counts as an op, and which op is which, is framework-specific and
stated in each framework's module and in docs/profiling.md.
"""

from __future__ import annotations

import gzip
import json
import re
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

CATEGORIES = ("matmul_attention", "other_compute", "collectives", "host_data", "idle")
PRIORITY = ("collectives", "matmul_attention", "other_compute", "host_data")  # idle: the rest
STEP_SPAN = "scaleout/step"  # the annotation around each profiled step (the step's number in it)
DATA_SPAN = "scaleout/data"  # the annotation around building each batch
PROFILE_DIR = "profile"
BREAKDOWN_NAME = "breakdown.json"
# PyTorch: every rank's trace file in one directory of the cell and nothing else there (HTA reads each
# *.json/*.gz of a directory as a trace; torch-tb-profiler makes one run, with its Distributed view, of
# a directory holding several workers' traces); each rank's breakdown.json stays in process-<i>/
TRACES_DIR = "traces"

# names of collective ops and kernels in either framework's trace (aten/c10d ops, gloo/NCCL
# kernels, FSDP2's annotations, HLO opcodes)
COLLECTIVE = re.compile(r"all[-_]?gather|reduce[-_]?scatter|all[-_]?reduce|all[-_]?to[-_]?all|collective[-_]permute"
                        r"|nccl|gloo|c10d::|record_param_comms", re.I)


@dataclass(frozen=True)
class Window:
    """The steps to trace, START..END inclusive."""
    start: int
    end: int
    all_processes: bool = False

    @staticmethod
    def of(cfg: Any) -> Optional["Window"]:
        steps = list(cfg.profile.steps)
        return Window(steps[0], steps[1], cfg.profile.all_processes) if steps else None

    def covers(self, step: int) -> bool:
        return self.start <= step <= self.end

    def traced_by(self, process: int) -> bool:
        return self.all_processes or process == 0

    @property
    def steps(self) -> List[int]:
        return list(range(self.start, self.end + 1))


def process_dir(cell_dir: Path, process: int) -> Path:
    return Path(cell_dir) / PROFILE_DIR / f"process-{process}"


def traces_dir(process_directory: Path) -> Path:
    """`CELL/profile/traces/`, beside the `process-<i>` directory given."""
    return Path(process_directory).parent / TRACES_DIR


class Capture(Protocol):
    """What a framework's profiler gives the loop: start, a span per step, stop, the breakdown."""

    directory: Path

    def start(self, first: int) -> None: ...  # `first`: the window's first step, about to run
    def next_step(self, n: int) -> None: ...  # step n (after the first) is about to run, outside its timing
    def step(self, n: int) -> Any: ...  # a context manager around the step's call
    def data(self) -> Any: ...  # a context manager around building a batch
    def stop(self) -> List[Path]: ...  # writes the trace; its files
    def breakdown(self) -> List[Dict[str, Any]]: ...  # per traced step: see `breakdown`


# --------------------------------------------------------------------------- reading traces

def load_trace(path: Path) -> Tuple[List[Dict[str, Any]], Dict[Any, str]]:
    """The complete ('X') events of a Chrome/Perfetto JSON trace (plain or gzipped), and the
    names of its processes (pid -> name, from the `process_name` metadata)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    names = {e.get("pid"): str((e.get("args") or {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e], names


def step_number(event: Dict[str, Any]) -> Optional[int]:
    """The step a `scaleout/step` span stands for (`args.step_num`, or `#N` in the name), else None."""
    name = str(event.get("name", ""))
    if not name.startswith(STEP_SPAN) or event.get("cat") == "gpu_user_annotation":  # Kineto's GPU-side copy of a span
        return None
    args = event.get("args") or {}
    for key in ("step_num", "step"):
        if key in args:
            try:
                return int(args[key])
            except (TypeError, ValueError):
                pass
    m = re.search(r"#(\d+)", name)
    return int(m.group(1)) if m else None


Interval = Tuple[float, float, int]  # start, end (µs), index into PRIORITY


def breakdown(events: Iterable[Dict[str, Any]], classify: Callable[[Dict[str, Any]], Optional[str]]) -> List[Dict[str, Any]]:
    """Per traced step, seconds in each of CATEGORIES (they sum to `trace_s`, the step span).

    `classify(event)` names the category an event stands for while it runs (one of PRIORITY), or
    None for events that are not ops (runtime bookkeeping, Python frames, the step span itself).
    """
    events = list(events)
    steps = sorted((n, float(e["ts"]), float(e["ts"]) + float(e["dur"]))
                   for e in events for n in [step_number(e)] if n is not None)
    rank = {c: i for i, c in enumerate(PRIORITY)}
    spans: List[Interval] = []
    for e in events:
        cat = classify(e)
        if cat is not None and float(e["dur"]) > 0:
            t0 = float(e["ts"])
            spans.append((t0, t0 + float(e["dur"]), rank[cat]))
    spans.sort()
    starts = [s[0] for s in spans]
    longest = max((b - a for a, b, _ in spans), default=0.0)
    out = []
    for n, t0, t1 in steps:
        # spans that overlap [t0, t1]: they start before t1 and end after t0 (none is longer than `longest`)
        lo, hi = bisect_left(starts, t0 - longest), bisect_left(starts, t1)
        inside = [(max(a, t0), min(b, t1), c) for a, b, c in spans[lo:hi] if b > t0 and a < t1]
        seconds = partition(inside, t0, t1)
        out.append({"step": n, "trace_s": (t1 - t0) / 1e6, **{c: seconds[c] / 1e6 for c in CATEGORIES}})
    return out


def partition(spans: Sequence[Interval], t0: float, t1: float) -> Dict[str, float]:
    """Time in [t0, t1] given to each category: the highest-priority one active at each instant."""
    points = []
    for a, b, c in spans:
        points.append((a, 1, c))
        points.append((b, -1, c))
    points.sort()
    active = [0] * len(PRIORITY)
    got = {c: 0.0 for c in CATEGORIES}
    last = t0
    for t, delta, c in points:
        if t > last:
            top = next((i for i, k in enumerate(active) if k > 0), None)
            got[PRIORITY[top] if top is not None else "idle"] += t - last
            last = t
        active[c] += delta
    if t1 > last:
        top = next((i for i, k in enumerate(active) if k > 0), None)
        got[PRIORITY[top] if top is not None else "idle"] += t1 - last
    return got


def mean_breakdown(steps: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """The mean seconds per category (and of `trace_s`, `measured_s`) over traced steps."""
    keys = ("trace_s", "measured_s", *CATEGORIES)
    return {k: sum(s[k] for s in steps) / len(steps) for k in keys if steps and all(s.get(k) is not None for s in steps)}


def write_breakdown(directory: Path, record: Dict[str, Any]) -> None:
    from launch.common.files import atomic_write
    atomic_write(Path(directory) / BREAKDOWN_NAME, json.dumps(record, indent=1) + "\n")

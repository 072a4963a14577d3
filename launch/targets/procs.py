"""Run a group of processes that form one job: stream their output, stop all when one fails.

Used by the local target (trainer processes) and the TPU target (one `gcloud ... ssh` per
worker). A peer's failure makes the others fail too (closed connections, an aborted runtime), so
the failure reported is the process that ended first, preferring an error of its own (a positive
exit code) over death by a signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Deque, Dict, List, Optional


@dataclass
class Spec:
    name: str  # used in log file names and in the failure report
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)  # added to this process's environment
    prefix: str = ""  # put before each console line


@dataclass
class Result:
    returncode: int
    failed: Optional[str] = None
    tail: List[str] = field(default_factory=list)


def _pump(proc: subprocess.Popen, prefix: str, log_path: Path, tail: Deque[str], echo: bool) -> None:
    with open(log_path, "a", buffering=1) as log:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            tail.append(line)
            log.write(line + "\n")
            if echo:
                print(prefix + line, flush=True)


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_group(specs: List[Spec], log_dir: Path, echo: bool = True,
              on_failure: Optional[Callable[[], None]] = None) -> Result:
    log_dir.mkdir(parents=True, exist_ok=True)
    running = []
    ended: Dict[int, float] = {}
    for spec in specs:
        proc = subprocess.Popen(spec.argv, env={**os.environ, **spec.env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        tail: Deque[str] = deque(maxlen=40)
        t = threading.Thread(target=_pump, args=(proc, spec.prefix, log_dir / f"{spec.name}.log", tail, echo), daemon=True)
        t.start()
        threading.Thread(target=lambda p=proc: (p.wait(), ended.setdefault(p.pid, time.monotonic())), daemon=True).start()
        running.append((spec, proc, t, tail))
    result = Result(0)
    try:
        while True:
            codes = [p.poll() for _, p, _, _ in running]
            if any(c not in (None, 0) for c in codes):
                time.sleep(0.5)  # let the consequences of the first failure land, then pick the cause
                failed = [r for r in running if r[1].poll() not in (None, 0)]
                failed.sort(key=lambda r: (r[1].returncode < 0, ended.get(r[1].pid, float("inf"))))
                spec, proc, t, tail = failed[0]
                t.join(timeout=5)
                result = Result(proc.returncode, spec.name, list(tail))
                if on_failure is not None:
                    on_failure()
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        result = Result(130, "interrupted")
    finally:
        for _, proc, _, _ in running:
            if proc.poll() is None:
                stop(proc)
        for _, _, t, _ in running:
            t.join(timeout=5)
    return result

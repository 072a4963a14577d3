"""Run a group of processes that form one job: stream their output, stop all when one fails.

Used by the local target (trainer processes) and the TPU target (one `gcloud ... ssh` per
worker). A peer's failure makes the others fail too (closed connections, an aborted runtime), so
the failure reported is the process that ended first, preferring an error of its own (a positive
exit code) over death by a signal. Each process gets its own session, so stopping it stops its
children too (torchrun's workers); SIGTERM first, SIGKILL after a grace period, so a hung
process cannot keep the group alive. If the launcher itself is interrupted (Ctrl-C, SIGTERM),
the group is stopped the same way before the interruption propagates.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Deque, Dict, List, Optional

log = logging.getLogger(__name__)
TAIL_LINES = 200
# what a process says when it failed because a peer went away (gloo/NCCL/TCP), not for a reason of its own
PEER_LOST = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|Socket closed"
                       r"|NCCL.*(remote process exited|Connection closed)|heartbeat.*(timeout|failed)", re.I)
GRACE_S = 10.0
# DCP's checkpoint process (torchrun_fsdp.async_save) logs every save at INFO through the root logger into
# the trainer's stderr ("[0] 2026-01-01 10:00:00,000 - root - INFO - Waiting for checkpoint save request...");
# those lines go to the cell's log file, not to the console
DCP_PROCESS_INFO = re.compile(r"^\[\d+\] \d{4}-\d{2}-\d{2} [\d:,]+ - root - INFO - ")
# What the processes' native libraries print that says nothing is wrong: gloo's connection notice, glog/absl INFO
# lines (`I1201 09:00:00.000000 ...`) and their "logging before init" banners. With `-q` (the launcher's logging
# above INFO) these stay in the log files and off the console.
CHATTER = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks|I\d{4} \d\d:\d\d:\d\d\.\d+ "
                     r"|WARNING: All log messages before absl::InitializeLog\(\)|WARNING: Logging before InitGoogle\(\)")


class Terminated(BaseException):
    """The launcher received SIGTERM (raised by the handler `install_sigterm` installs)."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum


def install_sigterm() -> None:
    """Turn SIGTERM into `Terminated`, so that `finally` blocks stop children and delete resources."""
    def handler(signum, frame):
        raise Terminated(signum)
    signal.signal(signal.SIGTERM, handler)


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


def quiet() -> bool:
    """Whether the launcher runs with `-q`: then CHATTER is not echoed."""
    return not log.isEnabledFor(logging.INFO)


def _pump(proc: subprocess.Popen, prefix: str, log_path: Path, tail: Deque[str], echo: bool, hush: bool) -> None:
    with open(log_path, "a", buffering=1) as out:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            tail.append(line)
            out.write(line + "\n")
            if echo and not DCP_PROCESS_INFO.match(line) and not (hush and CHATTER.match(line)):
                sys.stdout.write(prefix + line + "\n")
                sys.stdout.flush()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(procs: List[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """SIGTERM every process's group at once (peers must all hear it: a trainer that stops alone waits in a
    collective for the others), SIGKILL what is left after `grace_s`."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)  # also members of a group that outlived its leader (torchrun's workers)
        proc.wait()


def run_group(specs: List[Spec], log_dir: Path, echo: bool = True,
              on_failure: Optional[Callable[[], None]] = None, env: Optional[Dict[str, str]] = None) -> Result:
    log_dir.mkdir(parents=True, exist_ok=True)
    hush = quiet()
    running = []
    ended: Dict[int, float] = {}
    try:
        for spec in specs:
            proc = subprocess.Popen(spec.argv, env={**os.environ, **(env or {}), **spec.env}, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            tail: Deque[str] = deque(maxlen=TAIL_LINES)
            t = threading.Thread(target=_pump, args=(proc, spec.prefix, log_dir / f"{spec.name}.log", tail, echo, hush), daemon=True)
            t.start()
            threading.Thread(target=lambda p=proc: (p.wait(), ended.setdefault(p.pid, time.monotonic())), daemon=True).start()
            running.append((spec, proc, t, tail))
        while True:
            codes = [p.poll() for _, p, _, _ in running]
            if any(c not in (None, 0) for c in codes):
                time.sleep(0.5)  # let the consequences of the first failure land, then pick the cause
                failed = [r for r in running if r[1].poll() not in (None, 0)]
                # the cause: not killed by a signal, not failing for a lost peer, then the first to end
                failed.sort(key=lambda r: (r[1].returncode < 0, lost_peer(r[3]), ended.get(r[1].pid, float("inf"))))
                spec, proc, t, tail = failed[0]
                t.join(timeout=5)
                if on_failure is not None:
                    on_failure()
                return Result(proc.returncode, spec.name, list(tail))
            if all(c == 0 for c in codes):
                return Result(0)
            time.sleep(0.1)
    finally:
        stop_all([proc for _, proc, _, _ in running])
        for _, _, t, _ in running:
            t.join(timeout=5)


def lost_peer(tail) -> bool:
    """Whether a failed process's last lines say it failed because a peer went away."""
    return any(PEER_LOST.search(line) for line in list(tail)[-40:])


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def error_lines(tail: List[str], n: int = 6) -> List[str]:
    """The lines that say why a process failed: the trainer's own error lines if it printed any
    (torchrun's boilerplate follows them), else the last lines of its output."""
    lines = [line for line in tail if line.strip()]
    own = [line for line in lines if "[scaleout] error" in line]
    if own:
        return list(dict.fromkeys(own))[-n:]
    return lines[-n:]


def report_failure(headline: str, tail: List[str]) -> None:
    log.error(headline + "".join(f"\n  | {line}" for line in error_lines(tail)))

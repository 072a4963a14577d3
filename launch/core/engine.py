"""The trainer layer both frameworks share: everything that must be the same in `jaxrun` and
`torchrun_fsdp` for the comparison to be fair, written once.

A trainer supplies only what is framework-specific (a matmul, a broadcast, how to list, read and
load its checkpoints); the rules live here:

- process life: `Stopper` (SIGUSR2/SIGTERM/SIGINT end training cleanly after the current step; a
  second SIGTERM/SIGINT ends the process at once) and `die_with_launcher` (parent-death signal
  plus a watchdog on the launcher's PID), both installed first thing by the entry points;
- the entry points' plumbing: `run_trainer` (the order of everything a trainer process does),
  `read_cell`, `early_failure` (a failed summary for a failure before the loop), `exit_on_error`,
  `threads_per_process`;
- checkpoints: `checkpoint_metadata`, `find_checkpoint` (this cell's latest, else
  `checkpoint.load_from`'s latest, else none), `check_checkpoint` (same math, same run) and
  `restore_latest` which chains them, skipping damaged checkpoints for the previous one
  (`set_aside` moves them out of keep-N's way); `CheckpointMismatch`, `CheckpointUnreadable`;
- measurement plumbing: `bytes_per_device` (also used by `launch.launcher.plan`), `cpu_peak_per_device`
  (process 0 measures, everyone gets its number), `peak_memory_bytes` (device peak, else RSS).

Nothing here imports jax or torch, and importing it does nothing but define names: the entry
points import it before anything slow, so the signal handlers are in place within milliseconds
of the process starting. `launch.config`, `launch.core.metrics` and `launch.core.loop` are imported where
used (`launch.core.loop` does not import this module: no cycle).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple

from launch.common import envvars

if TYPE_CHECKING:  # pragma: no cover
    from launch.config.schema import Config

log = logging.getLogger(__name__)

# A trainer whose launcher is gone gets this long to stop cleanly (finish the step, save) before it
# ends itself: as long as a live launcher gives its trainers between SIGTERM and SIGKILL.
LAUNCHER_GONE_GRACE_S = 10.0
WATCHDOG_POLL_S = 0.5


# --------------------------------------------------------------------------- process life

class Stopper:
    """Ends training cleanly after the current step on SIGUSR2, SIGTERM or SIGINT.

    The loop reads `requested` between steps (and once before the first), saves and exits 0. A
    second SIGTERM or SIGINT ends the process at once with exit code 128 + signal, without saving:
    the way out of a trainer stuck in a step or a collective. SIGUSR2 (SLURM's preemption warning)
    never counts as a second signal.
    """

    STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
    HARD_SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested: Optional[str] = None
        self._hard_seen = 0

    def install(self) -> "Stopper":
        for s in self.STOP_SIGNALS:
            try:
                signal.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def request(self, reason: str) -> None:
        """Ask the loop to stop after the current step (from any thread)."""
        if self.requested is None:
            self.requested = reason

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if signum in self.HARD_SIGNALS:
            if self._hard_seen:
                _exit_now(128 + signum, f"second {name}: exiting now without saving")
            self._hard_seen += 1
        self.request(name)


def _exit_now(code: int, why: str) -> None:
    """End this process at once (no atexit hooks: they would wait for peers stuck in a collective)."""
    try:
        os.write(2, f"[scaleout] {why}\n".encode())
    except OSError:
        pass
    os._exit(code)


PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Linux: have the kernel send `sig` to this process when its parent dies. False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _start_time(pid: int) -> Optional[str]:
    """The process's start time from /proc (tells a live process from a new one with a reused PID)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if fields and fields[0] in ("Z", "X"):  # a zombie is dead, just not yet reaped
        return None
    return fields[19] if len(fields) > 19 else ""


def pid_alive(pid: int, started: Optional[str] = None) -> bool:
    """True while `pid` runs (and, given `started`, is still the process that started then)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if Path("/proc").is_dir():
        now = _start_time(pid)
        if now is None or (started is not None and now != started):
            return False
    return True


def die_with_launcher(stopper: Stopper, grace_s: float = LAUNCHER_GONE_GRACE_S) -> Optional[threading.Thread]:
    """Make this trainer end when whoever started it is gone: no orphaned trainers.

    Two mechanisms, because torchrun sits between the launcher and the PyTorch workers:
    `PR_SET_PDEATHSIG` (SIGTERM when the parent process dies: the launcher, or torchrun; a first
    SIGTERM asks for a clean stop), and, when a launcher says who it is (`SCALEOUT_PARENT_PID`), a
    watchdog thread on that PID and on this process's parent. When either is gone the loop is asked
    to stop after the current step (so a checkpoint is written); if the process is still alive
    `grace_s` later (stuck in a step or a collective) it ends itself. Returns the watchdog thread.
    """
    set_parent_death_signal(signal.SIGTERM)
    launcher = os.environ.get(envvars.PARENT_PID, "").strip()
    if not (launcher.isdigit() and int(launcher) > 1):
        return None  # started by hand: the parent-death signal alone
    watched: Dict[int, Optional[str]] = {int(launcher): _start_time(int(launcher))}
    ppid = os.getppid()
    if ppid > 1:
        watched[ppid] = _start_time(ppid)

    def watch() -> None:
        while True:
            gone = [pid for pid, started in watched.items() if not pid_alive(pid, started)]
            if gone:
                break
            time.sleep(WATCHDOG_POLL_S)
        log.warning(f"pid {gone[0]}, which started this trainer, is gone: stopping after this step")
        stopper.request("launcher gone")
        time.sleep(grace_s)
        _exit_now(128 + signal.SIGTERM, f"the launcher is gone and training did not stop within {grace_s:.0f} s: exiting")

    thread = threading.Thread(target=watch, name="scaleout-launcher-watchdog", daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------- entry points

def run_trainer(framework: str, prog: str, build: Callable[["Config", Path], Any], *, argv=None,
                process_start: Optional[float] = None, teardown: Optional[Callable[[], None]] = None) -> int:
    """The life of a trainer process around its framework's part, the same for both frameworks:

    1. the stop-signal handlers and `die_with_launcher`, before anything slow (a signal during
       distributed init or model build then ends the trainer cleanly, not by the signal);
    2. logging (`launch.common.log`; process 0 talks, the others only warn);
    3. the cell's config from `--config`;
    4. `build(cfg, cell_dir)`: distributed init and the `Engine` (a failure leaves a failed summary);
    5. `launch.core.loop.run`, then `teardown` (e.g. destroying the process group).

    `process_start` is the `time.perf_counter()` the entry point took as its first statement (the
    time to first step counts from it).
    """
    if process_start is None:
        process_start = time.perf_counter()
    stopper = Stopper().install()
    die_with_launcher(stopper)
    from launch.common import log as log_setup
    from launch.core import loop

    rank = envvars.process_index()
    log_setup.setup(process_index=rank)
    cfg, cell_dir = read_cell(prog, argv)
    with early_failure(framework, cfg, cell_dir, rank):
        trainer = build(cfg, cell_dir)
    try:
        loop.run(trainer, cfg, cell_dir, process_start=process_start, stopper=stopper)
    finally:
        if teardown is not None:
            teardown()
    return 0


def read_cell(prog: str, argv=None) -> Tuple["Config", Path]:
    """A trainer's command line, `--config CELL/config.yaml`, as (config, cell directory)."""
    import argparse

    from launch import config as config_mod

    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--config", required=True, help="a cell's resolved config.yaml")
    args = ap.parse_args(argv)
    return config_mod.load_resolved(args.config), Path(args.config).resolve().parent


def usable_cores(env: Optional[Mapping[str, str]] = None) -> int:
    """The cores this process may run on: a SLURM task's allocation (SLURM_CPUS_PER_TASK), else its CPU affinity
    (a cgroup or taskset limit), else the host's count."""
    env = os.environ if env is None else env
    given = env.get("SLURM_CPUS_PER_TASK", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def sharing_processes(world: int, env: Optional[Mapping[str, str]] = None) -> int:
    """How many trainer processes share this one's cores: 1 in a SLURM task with cores of its own
    (SLURM_CPUS_PER_TASK), else the ranks torchrun started on this host (LOCAL_WORLD_SIZE), else `world`."""
    env = os.environ if env is None else env
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return 1
    local = env.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 0 else max(1, world)


def threads_per_process(cfg: "Config", processes: int, env: Optional[Mapping[str, str]] = None) -> int:
    """Intra-op CPU threads for each of `processes` trainer processes that share this process's cores (the
    processes of one host, or 1 for a SLURM task, whose SLURM_CPUS_PER_TASK are its own)."""
    if cfg.local.threads > 0:
        return cfg.local.threads
    return max(1, usable_cores(env) // processes)


@contextlib.contextmanager
def early_failure(framework: str, cfg: "Config", cell_dir: Path, process_index: int) -> Iterator[None]:
    """Around a trainer's start-up (distributed init, model build): a failure there still leaves a
    failed summary in metrics.jsonl (written by process 0), then propagates."""
    try:
        yield
    except Exception as e:
        if process_index == 0:
            from launch.common import files
            from launch.core import metrics
            w = metrics.MetricsWriter(cell_dir / files.METRICS_NAME)
            w.write("summary", framework=framework, devices=cfg.devices, status="failed",
                    error=f"{type(e).__name__}: {e}", steps=0, traceback=traceback.format_exc(limit=8))
            w.close()
        raise


def exit_on_error(main_fn: Callable[[], int], where: str) -> None:
    """Run a trainer's main and exit with its code; on an error log it and exit 1 at once.

    Exiting at once matters: atexit hooks (jax.distributed.shutdown, process-group teardown) would
    wait for peers blocked in a collective with us, and the launcher must see the failure.
    """
    try:
        code = main_fn()
    except SystemExit:
        raise
    except BaseException as e:
        traceback.print_exc()
        log.error(f"error ({where}): {type(e).__name__}: {e}")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)
    sys.exit(code)


# --------------------------------------------------------------------------- checkpoints

class CheckpointMismatch(RuntimeError):
    """A checkpoint this cell must not continue from: other math, or another run's."""


def run_id(cfg: "Config") -> Optional[str]:
    """The run this cell belongs to (`run.id`, set by the launcher); None when started by hand."""
    return cfg.run.id


def checkpoint_metadata(cfg: "Config", framework: str, processes: int, versions: Dict[str, str],
                        step: int) -> Dict[str, Any]:
    """What every checkpoint records next to the state (JSON), identical in both frameworks; `data` is
    the token file's identity (`launch.data.tokenizer.token_file_identity`; None for synthetic data)."""
    from launch import config as config_mod
    from launch.data.tokenizer import token_file_identity
    return {"framework": framework, "config_hash": config_mod.math_hash(cfg), "run_id": run_id(cfg),
            "mesh": config_mod.mesh_shape(cfg), "devices": cfg.devices, "processes": processes,
            "versions": versions, "step": step, "data": token_file_identity(cfg.data)}


@dataclass(frozen=True)
class Found:
    """A complete checkpoint a cell can start from."""
    root: str  # the checkpoint directory it is in: this cell's `checkpoint.dir` or `checkpoint.load_from`
    step: int
    load_from: bool  # True when it comes from `checkpoint.load_from` (another run's, on purpose)


def find_checkpoint(cfg: "Config", latest_step: Callable[[str], Optional[int]]) -> Optional[Found]:
    """This cell's latest complete checkpoint, else `checkpoint.load_from`'s latest, else None.

    `latest_step(root)` is the framework's: the newest complete step under `root`, or None.
    """
    own = cfg.checkpoint.dir
    step = latest_step(own)
    if step is not None:
        return Found(own, step, load_from=False)
    other = cfg.checkpoint.load_from
    if not other:
        return None
    step = latest_step(other)
    if step is None:
        raise FileNotFoundError(f"checkpoint.load_from={other!r} holds no complete checkpoint; "
                                "point it at a cell's checkpoint directory that has one")
    return Found(other, step, load_from=True)


def check_checkpoint(meta: Dict[str, Any], cfg: "Config", found: Found) -> None:
    """Refuse a checkpoint of another run (unless it comes from `checkpoint.load_from`), of other math, or
    trained on a token file that is no longer the one at `data.path` (rewritten since: other data)."""
    ours = run_id(cfg)
    theirs = meta.get("run_id")
    if not found.load_from and ours is not None and theirs != ours:
        owner = f"run {theirs}" if theirs else "no recorded run"
        raise CheckpointMismatch(
            f"the checkpoint at step {found.step} in {found.root} belongs to {owner}, not to this run {ours}; "
            f"start from it on purpose with checkpoint.load_from={found.root}, or give this run its own checkpoint.dir")
    from launch import config as config_mod
    want = config_mod.math_hash(cfg)
    if meta.get("config_hash") != want:
        raise CheckpointMismatch(
            f"the checkpoint at step {found.step} in {found.root} was written by a different model/train/data "
            f"config (hash {meta.get('config_hash')}, this run {want}); use another run.name or remove that directory")
    from launch.data import tokenizer
    now = tokenizer.token_file_identity(cfg.data)
    if not tokenizer.same_token_file(meta.get("data"), now):
        raise CheckpointMismatch(
            f"the checkpoint at step {found.step} in {found.root} was trained on data.path={cfg.data.path} when it was "
            f"{tokenizer.describe_identity(meta.get('data'))}, but that file is now {tokenizer.describe_identity(now)} "
            "(it was rewritten since); put back the tokens it trained on, or train on the new ones in another run.name")


class CheckpointUnreadable(RuntimeError):
    """No checkpoint in the directory a cell continues from could be read (damaged files)."""


@dataclass(frozen=True)
class Restored:
    """What `restore_latest` found: the step continued from (0 = fresh), what `load` returned, and
    the damaged checkpoints (newer than it) it skipped, as (step, reason)."""
    step: int
    state: Any
    root: Optional[str] = None
    load_from: bool = False
    skipped: Tuple[Tuple[int, str], ...] = ()


def _reason(e: BaseException) -> str:
    """An exception as one short line (a TensorStore error is pages long: its first line says what)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    if len(first) > 200:
        first = first[:197] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def restore_latest(cfg: "Config", steps: Callable[[str], Sequence[int]],
                   read_meta: Callable[[Found], Dict[str, Any]],
                   load: Callable[[Found], Any], describe: Callable[[Found], str] = lambda f: f"step {f.step} in {f.root}",
                   ) -> Restored:
    """Find, check and load the checkpoint a cell continues from (`Restored.step` 0 and state None
    when there is none and the cell starts fresh).

    `steps(root)` lists the complete (committed) steps under `root`. The newest is tried first; one
    whose metadata or state cannot be read (a truncated or deleted file) is skipped with a warning
    naming it (`describe(found)`, its path) and the next older one is tried: a damaged latest
    checkpoint must not block every rerun. The skipped ones are reported in `Restored.skipped` so the
    framework can move them out of the way of keep-N and the next save (for inspection, not deleted).
    A checkpoint of other math or another run (`check_checkpoint`) is refused, not skipped. When none
    can be read, `CheckpointUnreadable` says so in one sentence naming the directory.
    """
    def latest(root: str) -> Optional[int]:
        listed = list(steps(root))
        return max(listed) if listed else None

    found = find_checkpoint(cfg, latest)
    if found is None:
        return Restored(0, None)
    skipped = []
    for step in sorted(steps(found.root), reverse=True):
        candidate = Found(found.root, step, found.load_from)
        try:
            meta = read_meta(candidate)
        except Exception as e:
            meta, why = None, _reason(e)
        else:
            if not isinstance(meta, dict):  # valid JSON, but not what checkpoint_metadata writes
                meta, why = None, f"its metadata is {json.dumps(meta)[:40]}, not a JSON object"
        if meta is not None:
            check_checkpoint(meta, cfg, candidate)
            try:
                state = load(candidate)
            except Exception as e:
                why = _reason(e)
            else:
                if found.load_from:
                    log.info(f"starting from step {step} of {found.root} (checkpoint.load_from)")
                return Restored(step, state, found.root, found.load_from, tuple(skipped))
        log.warning(f"checkpoint {describe(candidate)} is damaged and is skipped ({why}); "
                    "trying the previous one")
        skipped.append((step, why))
    listed = "; ".join(f"step {s}: {why}" for s, why in skipped)
    raise CheckpointUnreadable(f"no checkpoint in {found.root} can be read ({listed}); move the damaged step "
                               f"directories out of {found.root} to start fresh")


def set_aside(step_dir: "Path | str") -> "Path | str":
    """Rename a damaged checkpoint directory to `<name>.corrupt` (`.corrupt-2`, ... if taken): kept for
    inspection, but no longer a step that keep-N counts or that the next save of that step collides with.
    On gs:// (a URL string) the objects are copied and removed, completion marker first (launch.core.objstore)."""
    if isinstance(step_dir, str) and "://" in step_dir:
        from launch.core import objstore
        return objstore.set_aside(step_dir)
    step_dir = Path(step_dir)
    target = step_dir.with_name(step_dir.name + ".corrupt")
    n = 2
    while target.exists():
        target = step_dir.with_name(f"{step_dir.name}.corrupt-{n}")
        n += 1
    os.replace(step_dir, target)
    log.warning(f"damaged checkpoint {step_dir} kept for inspection as {target}")
    return target


# --------------------------------------------------------------------------- measurement plumbing

def bytes_per_device(weights: int, optimizer: int) -> Dict[str, int]:
    """Bytes one device holds: fp32 weights, their fp32 gradients (as many bytes), optimizer state."""
    return {"weights": weights, "grads": weights, "optimizer": optimizer, "total": 2 * weights + optimizer}


def cpu_peak_per_device(devices: int, process_index: int, process_count: int,
                        matmul: Callable[[int], Callable[[], None]],
                        barrier: Callable[[], None], broadcast: Callable[[float], float]) -> float:
    """The host's fp32 matmul peak, measured now, per simulated device.

    Process 0 times `matmul` (see `launch.core.metrics.calibrate_matmul`) while the other processes wait
    at `broadcast`, which hands every process process 0's number; `barrier` first, so nobody is
    still busy starting up while it is measured. A peak measured in another run would be wrong:
    shared machines drift.
    """
    from launch.core import metrics
    if process_count == 1:
        return metrics.calibrate_matmul(matmul) / devices
    barrier()
    peak = metrics.calibrate_matmul(matmul) if process_index == 0 else 0.0
    return float(broadcast(peak)) / devices


def mfu_peak_basis(on_cpu: bool, device_kind: str, precision: str) -> str:
    """What the cell's MFU is measured against (start record's settings.mfu_peak, named in the report)."""
    if on_cpu:
        return "the host's fp32 matmul, calibrated in this run"
    from launch.core import flops
    return flops.peak_basis(device_kind, precision)


def peak_memory_bytes(device_peak: Optional[int]) -> int:
    """The accelerator's own peak when its runtime reports one, else this process's peak RSS (CPU)."""
    if device_peak is not None:
        return int(device_peak)
    from launch.core import metrics
    return metrics.peak_rss_bytes()

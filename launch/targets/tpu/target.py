"""The Cloud TPU target, through the `gcloud` CLI (JAX, and PyTorch through TorchTPU).

Lifecycle of a cell (`tpu.mode=queued`):
  1. queued-resources create (capacity flag from tpu.capacity; `best-effort` through
     `gcloud alpha`), 2. describe until ACTIVE (transient describe failures are retried;
     FAILED/SUSPENDED or a timeout: one-sentence error, then delete), 3. scp an archive of the
     project's tracked files plus the cell's config to every worker (one scp per worker, in
     parallel: `--worker=all` fails when an ssh-agent lacks gcloud's key), and the cell's input
     files (token file, HF directory: launch.targets.tpu.inputs), unpack it into a versioned
     directory, run tpu.setup (by default: a Python 3.11 venv made with uv, the pinned
     dependencies and jax[tpu]), 4. free the chips (kill whatever holds /dev/accel* or
     /dev/vfio/*, wait for it, remove libtpu's lock file), 5. check the workers' Python, 6. start
     the trainer on every worker detached from ssh (`setsid nohup`, output, pid and exit status in
     job files on the worker) and follow each worker's log over ssh (`CELL/logs/worker-<i>.log`,
     `[w<i>]` on the console), reconnecting when a connection drops; when one worker fails, stop
     the others and report it with its last lines, 7. copy metrics.jsonl back from worker 0
     (checkpoints stay where the trainer wrote them: gs:// on a multi-host slice), 8.
     queued-resources delete (unless tpu.keep), retried, with the manual command printed if it
     still fails. `tpu.mode=existing` uses a TPU VM the user already has (checked by preflight).

Ctrl-C or SIGTERM stops the trainers, collects what they wrote and deletes the slice. A launcher
that goes away without cleaning up (its machine disconnects, SIGKILL, SIGHUP) leaves the
trainers running: the cell's record file (JOB_RECORD) lets `scaleout status` / `logs` /
`cancel` find them again, and once they have ended `status` collects metrics.jsonl and the
worker logs and deletes the slice.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from launch import config as config_mod
from launch.common import files
from launch.common.files import CONFIG_NAME, METRICS_NAME
from launch.config import ConfigError
from launch.config.schema import Config
from launch.core import profile, wandb_run
from launch.targets import procs, shell
from launch.targets.base import Cell, ForegroundTarget, JobInfo, Outcome, exit_code
from launch.targets.errors import SubmitError
from launch.targets.tpu.commands import STATE_MARK, Commands, build_archive, gcloud_error
from launch.targets.tpu.shapes import Slice, check_runtime_and_zone, runtime_version, slice_of, zone

log = logging.getLogger(__name__)
NAME_RE = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")  # GCP resource names (RFC 1035)
ZONE_RE = re.compile(r"[a-z]+-[a-z]+[0-9]+-[a-z0-9]+")  # us-west4-a, and Cloud TPU's AI zones: us-central1-ai1a
PROJECT_RE = re.compile(r"[a-z][-a-z0-9]{4,28}[a-z0-9]")
VERSION_RE = re.compile(r"[a-z0-9][-a-z0-9._]*")
PLACEHOLDER_RE = re.compile(r"change-?me", re.IGNORECASE)
JOB_RECORD = files.TPU_JOB_FILE  # <cell>/JOB_RECORD: the cell's slice and detached job
FOLLOW = Path(__file__).with_name("follow.py")
VERSION_ID_RE = re.compile(r"[0-9a-f]{12}")  # commands.build_archive: the archive's content hash
JOB_ID_RE = re.compile(r"\d{8}T\d{6}-[0-9a-f]{4}")  # new_job_id()
FLAG_RE = re.compile(r"--[a-z][a-z0-9-]*")
# Flags scaleout writes itself: a tpu.ssh_args / tpu.create_args entry may not set them again.
OWN_SSH_FLAGS = {"--zone", "--project", "--worker", "--command", "--recurse"}
OWN_CREATE_FLAGS = {"--zone", "--project", "--node-id", "--accelerator-type", "--runtime-version", "--spot", "--reserved",
                    "--best-effort", "--guaranteed", "--valid-until-duration", "--valid-until-time"}
DESCRIBE_RETRIES = 5  # consecutive failed `describe` calls tolerated while waiting for ACTIVE
DELETE_ATTEMPTS = 4
FOLLOW_RETRIES = 5  # consecutive lost ssh connections tolerated per worker while following
PROBE_TTL_S = 5.0  # `status` / `logs --follow` ask the workers at most this often


# --------------------------------------------------------------------------- validation

def validate(cfg: Config, checkpoints: bool = True) -> None:
    """Every config rule of the TPU target (`run` and `sweep` refuse before anything is created);
    `plan` skips the checkpoint rules and shows their sentence as a note instead."""
    t = cfg.tpu
    if not NAME_RE.fullmatch(t.name):
        raise ConfigError(f"tpu.name={t.name!r} is not a valid TPU name: lower-case letters, digits and hyphens, starting with a letter, at most 63 characters.")
    if t.zone is not None and not ZONE_RE.fullmatch(t.zone):
        raise ConfigError(f"tpu.zone={t.zone!r} is not a valid zone; write e.g. us-west4-a or europe-west4-b.")
    if t.project is not None and not PROJECT_RE.fullmatch(t.project):
        raise ConfigError(f"tpu.project={t.project!r} is not a valid GCP project id: 6-30 lower-case letters, digits and hyphens, starting with a letter.")
    if t.runtime_version is not None and not VERSION_RE.fullmatch(t.runtime_version):
        raise ConfigError(f"tpu.runtime_version={t.runtime_version!r} is not valid; write e.g. v2-alpha-tpuv5-lite.")
    if t.python:
        shell.check_interpreter("tpu.python", t.python)
    for i, entry in enumerate(t.setup or []):
        try:
            shlex.split(entry)
        except ValueError as e:
            raise ConfigError(f"tpu.setup[{i}]={entry!r} is not valid: {e}; write one command per entry.") from None
    for key, own in (("ssh_args", OWN_SSH_FLAGS), ("create_args", OWN_CREATE_FLAGS)):
        for i, arg in enumerate(getattr(t, key)):
            flag = str(arg).split("=", 1)[0]
            if not FLAG_RE.fullmatch(flag):
                raise ConfigError(f"tpu.{key}[{i}]={arg!r} is not a gcloud flag; write each as one --flag or --flag=value entry.")
            if flag in own:
                raise ConfigError(f"tpu.{key}[{i}]={arg} is a flag scaleout sets itself ({', '.join(sorted(own))}); "
                                  "set it through its tpu.* key instead.")
    s = slice_of(cfg)
    check_runtime_and_zone(cfg)
    if checkpoints:
        check_checkpoints(cfg, s)


def check_checkpoints(cfg: Config, s: Slice) -> None:
    """Refuse, before anything is created, checkpoint locations the workers could not share or read."""
    ck = cfg.checkpoint.dir
    if ck and PLACEHOLDER_RE.search(ck):
        raise ConfigError(f"checkpoint.dir={ck} is the placeholder of configs/target/tpu.yaml; set checkpoint.dir to a "
                          "gs:// bucket of yours that the TPU workers can write (checkpoint.dir=gs://BUCKET/PATH).")
    if s.workers > 1 and not (ck or "").startswith("gs://"):
        raise ConfigError(f"checkpoint.dir={ck or 'null'} is not shared storage, but a {s.accelerator_type} slice has "
                          f"{s.workers} workers that all write one checkpoint; set checkpoint.dir to a gs:// bucket "
                          "(checkpoint.dir=gs://BUCKET/PATH).")
    src = cfg.checkpoint.load_from
    if src and not src.startswith("gs://"):
        raise ConfigError(f"checkpoint.load_from={src} is not on gs://, so the TPU workers cannot read it; copy that "
                          "checkpoint to a gs:// bucket and point checkpoint.load_from there.")


# --------------------------------------------------------------------------- plan

def plan_commands(cfg: Config, cell_dir: Path) -> List[str]:
    validate(cfg, checkpoints=False)
    c = Commands(cfg, "<code-hash>", cell_dir.name)
    s = slice_of(cfg)
    job = "<job-id>"
    out = []
    try:
        check_checkpoints(cfg, s)
    except ConfigError as e:  # the plan still shows the commands (e.g. with the group file's placeholder)
        out.append(f"# `scaleout run` refuses this config: {e}")
    if cfg.tpu.mode == "queued":
        out += [shlex.join(c.create()),
                shlex.join(c.describe_queued()) + f"   # repeated every {cfg.tpu.poll_interval_s:g} s until ACTIVE (at most {cfg.tpu.timeout_s:g} s)"]
        if cfg.framework == "torch":
            out.append(shlex.join(c.describe_vm()) + "   # the workers' internal IPs (networkEndpoints) for TorchTPU")
    else:
        out.append(shlex.join(c.describe_vm()))
    concurrently = "   # concurrently, one per worker"
    out += [shlex.join(a) + concurrently for a in c.ship_code(f"{cell_dir.parent}/tpu/{c.archive}", s.workers)]
    out += [shlex.join(a) + ("" if "ssh" in a else concurrently) for a in c.ship_inputs(s.workers)]
    out += [shlex.join(c.unpack_and_setup()), shlex.join(c.free_chips()), shlex.join(c.check_python())]
    starts = c.start(job)
    out += [shlex.join(a) + "   # detached: the trainers outlive this ssh and this launcher"
            + (", one torchrun per worker, concurrently" if len(starts) > 1 or cfg.framework == "torch" else "")
            for a in starts]
    out += [shlex.join(c.follow(i, job)) + "   # concurrently for every worker, reconnecting from the last byte received"
            for i in range(s.workers)]
    out.append(shlex.join(c.copy_back(f"{c.remote_cell}/{METRICS_NAME}", str(cell_dir / METRICS_NAME))))
    out += [shlex.join(c.copy_back(f"{c.remote_cell}/{profile.PROFILE_DIR}", str(cell_dir), worker=i, recurse=True))
            for i in profile_workers(cfg, s.workers)]
    if cfg.metrics.wandb.enabled:
        out.append(shlex.join(c.copy_back(f"{c.remote_cell}/{wandb_run.WANDB_DIR}", str(cell_dir), recurse=True)))
    if cfg.tpu.mode == "queued" and not cfg.tpu.keep:
        out.append(shlex.join(c.delete()))
    return out


# --------------------------------------------------------------------------- gcloud calls

def _run_all(argvs: Sequence[List[str]], what: str, timeout: Optional[float] = None) -> List[str]:
    """Run gcloud commands concurrently (one per worker); the first failure, in order, is raised."""
    if len(argvs) <= 1:
        return [_run(a, what, timeout) for a in argvs]
    with ThreadPoolExecutor(max_workers=min(len(argvs), 16)) as pool:
        futures = [pool.submit(_run, a, what, timeout) for a in argvs]
        return [f.result() for f in futures]


def worker_hosts(c: Commands, workers: int) -> List[str]:
    """The workers' internal IPs, in worker order (`tpu-vm describe`'s networkEndpoints)."""
    try:
        desc = json.loads(_run(c.describe_vm(), f"describing TPU VM {c.node}", timeout=300))
    except ValueError:
        raise SubmitError(f"describing TPU VM {c.node} returned no JSON") from None
    hosts = [e.get("ipAddress") for e in desc.get("networkEndpoints", [])]
    if len(hosts) != workers or not all(hosts):
        raise SubmitError(f"TPU VM {c.node} lists {len(hosts)} worker address(es), but the slice has {workers} workers")
    return hosts


def _run(argv: List[str], what: str, timeout: Optional[float] = None) -> str:
    """Run a gcloud command; a failure is a SubmitError: the remote `[scaleout] error:` sentence if
    the command printed one, else `what` and gcloud's last line."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SubmitError(f"{what} timed out after {timeout:g} s: {shlex.join(argv)}") from None
    if p.returncode:
        lines = (p.stdout + "\n" + p.stderr).splitlines()
        own = [line.split("[scaleout] error: ", 1)[1] for line in lines if "[scaleout] error: " in line]
        if own:
            raise SubmitError(own[-1])
        raise SubmitError(f"{what} failed: {gcloud_error(p.stderr, p.stdout, p.returncode)}")
    return p.stdout


def wait_active(c: Commands, cfg: Config) -> None:
    deadline = time.monotonic() + cfg.tpu.timeout_s
    last = None
    failures = 0
    while True:
        try:
            state = _run(c.describe_queued(), "describing the queued resource", timeout=300).strip()
        except SubmitError as e:
            failures += 1
            if failures > DESCRIBE_RETRIES:
                raise SubmitError(f"describing queued resource {c.node} failed {failures} times in a row; the last: {e}") from None
            if time.monotonic() > deadline:
                raise SubmitError(f"queued resource {c.node} did not become ACTIVE within tpu.timeout_s={cfg.tpu.timeout_s:g} s "
                                  f"(the last describe failed: {e})") from None
            pause = min(cfg.tpu.poll_interval_s * 2 ** (failures - 1), 300.0)
            log.warning(f"{e}; retrying in {pause:g} s ({failures}/{DESCRIBE_RETRIES})")
            time.sleep(pause)
            continue
        failures = 0
        if state != last:
            log.info(f"queued resource {c.node}: {state}")
            last = state
        if state == "ACTIVE":
            return
        if state in ("FAILED", "SUSPENDED", "SUSPENDING"):
            raise SubmitError(f"queued resource {c.node} is {state}: the slice could not be provided "
                              f"(capacity {cfg.tpu.capacity} in {zone(cfg)}); try another zone or tpu.capacity")
        if time.monotonic() > deadline:
            raise SubmitError(f"queued resource {c.node} did not become ACTIVE within tpu.timeout_s={cfg.tpu.timeout_s:g} s (last state {state})")
        time.sleep(cfg.tpu.poll_interval_s)


def delete_queued(c: Commands, cfg: Config) -> bool:
    """Delete the queued resource (and its slice), retrying; on final failure say how to do it by hand."""
    err = ""
    for attempt in range(1, DELETE_ATTEMPTS + 1):
        try:
            p = subprocess.run(c.delete(), capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
            if p.returncode == 0:
                log.info(f"deleted queued resource {c.node}")
                return True
            if "NOT_FOUND" in p.stderr:
                log.info(f"queued resource {c.node} is already gone")
                return True
            err = gcloud_error(p.stderr, p.stdout, p.returncode)
        except subprocess.TimeoutExpired:
            err = "timed out after 600 s"
        if attempt < DELETE_ATTEMPTS:
            pause = min(cfg.tpu.poll_interval_s * 2 ** (attempt - 1), 60.0)
            log.warning(f"deleting queued resource {c.node} failed ({err}); retrying in {pause:g} s")
            time.sleep(pause)
    log.error(f"could not delete queued resource {c.node} after {DELETE_ATTEMPTS} attempts ({err}); the slice keeps "
              f"running, and costing money, until you delete it: {shlex.join(c.delete())}")
    return False


def check_existing(c: Commands, cfg: Config) -> None:
    """tpu.mode=existing: the TPU VM must be READY and have this cell's shape."""
    s = slice_of(cfg)
    try:
        desc = json.loads(_run(c.describe_vm(), f"describing TPU VM {c.node}", timeout=300))
    except ValueError:
        raise SubmitError(f"describing TPU VM {c.node} returned no JSON") from None
    found = len(desc.get("networkEndpoints", []))
    if desc.get("state") not in (None, "READY"):
        raise SubmitError(f"TPU VM {c.node} is {desc.get('state')}, not READY")
    if found != s.workers:
        raise SubmitError(f"TPU VM {c.node} has {found} worker(s) but devices={cfg.devices} on {s.generation} needs {s.workers}")
    acc = desc.get("acceleratorType")
    if acc and acc != s.accelerator_type:
        raise SubmitError(f"TPU VM {c.node} is a {acc}, but devices={cfg.devices} on {s.generation} needs a {s.accelerator_type}")


# --------------------------------------------------------------------------- the cell's record

class Record:
    """<cell>/JOB_RECORD: which slice and which detached job a cell has, for a later `status`."""

    def __init__(self, cell_dir: Path, data: Optional[Dict[str, Any]] = None):
        self.path = Path(cell_dir) / JOB_RECORD
        self.data: Dict[str, Any] = dict(data or {})

    @staticmethod
    def load(cell_dir: Path) -> Optional["Record"]:
        """The cell's record, or None when there is none or it is not one this target wrote (a run directory
        may come from anyone: its values reach gcloud commands and remote paths only once checked here)."""
        path = Path(cell_dir) / JOB_RECORD
        data = files.read_json(path)
        if data is None:
            return None
        why = Record.damage(data)
        if why:
            log.warning(f"{path}: ignored, {why}")
            return None
        return Record(cell_dir, data)

    @staticmethod
    def damage(data: Any) -> Optional[str]:
        """Why `data` is not a record this target wrote, or None."""
        if not isinstance(data, dict):
            return "not a JSON object"
        if not (isinstance(data.get("version"), str) and VERSION_ID_RE.fullmatch(data["version"])):
            return "its version is not a code version"
        if data.get("job") is not None and not (isinstance(data["job"], str) and JOB_ID_RE.fullmatch(data["job"])):
            return "its job is not a job id"
        if type(data.get("workers")) is not int or data["workers"] < 1:
            return "its workers is not a positive number"
        offsets = data.get("log_offsets")
        if offsets is not None and not (isinstance(offsets, list) and all(type(o) is int and o >= 0 for o in offsets)):
            return "its log_offsets are not byte offsets"
        return None

    def save(self, **updates: Any) -> None:
        self.data.update(updates)
        files.write_json(self.path, self.data)

    def __getattr__(self, name: str) -> Any:
        if name in ("path", "data"):
            raise AttributeError(name)
        return self.data.get(name)


def new_job_id() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:4]


def _local_log(cell_dir: Path, i: int) -> Path:
    return cell_dir / files.LOGS_DIR / f"worker-{i}.log"


def collect_logs(c: Commands, rec: Record, cell_dir: Path) -> None:
    """Each worker's log of the job, fetched from the worker, replaces what this machine has of it
    (the part the launcher streamed before it went away); earlier jobs' lines are kept."""
    offsets = rec.log_offsets or []
    tmp_dir = cell_dir / files.LOGS_DIR / ".fetch"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    try:
        for i in range(int(rec.workers or 0)):
            tmp = tmp_dir / f"worker-{i}.log"
            remote = f"{c.remote_dir}/{c.job_file(rec.job, 'log')}"
            p = subprocess.run(c.copy_back(remote, str(tmp), worker=i), capture_output=True, text=True, timeout=600,
                               stdin=subprocess.DEVNULL)
            if p.returncode or not tmp.is_file():
                log.warning(f"could not copy worker {i}'s log back: {gcloud_error(p.stderr, p.stdout, p.returncode)}")
                continue
            local = _local_log(cell_dir, i)
            old = local.read_bytes() if local.is_file() else b""
            keep = offsets[i] if i < len(offsets) else len(old)
            files.atomic_write(local, old[:keep] + tmp.read_bytes())
            tmp.unlink()
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def copy_metrics_back(c: Commands, cell_dir: Path) -> None:
    """metrics.jsonl from worker 0, appending only the records this machine does not have yet."""
    local_metrics = cell_dir / METRICS_NAME
    tmp = cell_dir / (METRICS_NAME + ".worker0")
    p = subprocess.run(c.copy_back(f"{c.remote_cell}/{METRICS_NAME}", str(tmp)), capture_output=True, text=True,
                       timeout=600, stdin=subprocess.DEVNULL)
    if p.returncode == 0 and tmp.is_file():
        seen = max((r.get("time", 0) for r in files.read_records(local_metrics)), default=0)
        new = []
        for line in tmp.read_text().splitlines():
            try:
                if json.loads(line).get("time", 0) > seen:
                    new.append(line)
            except (json.JSONDecodeError, AttributeError):  # a torn last line
                continue
        with open(local_metrics, "a") as out:  # only what is new (a reused VM keeps older records)
            out.writelines(line + "\n" for line in new)
        tmp.unlink()
    else:
        log.warning(f"could not copy metrics.jsonl back from worker 0: {gcloud_error(p.stderr, p.stdout, p.returncode)}")


def profile_workers(cfg: Config, workers: int) -> List[int]:
    """The workers whose trainers trace `profile.steps` (process i runs on worker i)."""
    if not cfg.profile.steps:
        return []
    return list(range(workers)) if cfg.profile.all_processes else [0]


def copy_profile_back(c: Commands, cfg: Config, cell_dir: Path, workers: int) -> None:
    """CELL/profile/ from each worker that traced (a worker that never reached the window has none)."""
    for i in profile_workers(cfg, workers):
        try:
            p = subprocess.run(c.copy_back(f"{c.remote_cell}/{profile.PROFILE_DIR}", str(cell_dir), worker=i, recurse=True),
                               capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            log.warning(f"copying worker {i}'s profile back took over 30 minutes; skipped (it stays on the worker)")
            continue
        if p.returncode:
            log.warning(f"could not copy worker {i}'s profile back: {gcloud_error(p.stderr, p.stdout, p.returncode)}")


def copy_wandb_back(c: Commands, cfg: Config, cell_dir: Path) -> None:
    """CELL/wandb/ from worker 0, where process 0 wrote the cell's W&B run (offline: the only copy)."""
    if not cfg.metrics.wandb.enabled:
        return
    try:
        p = subprocess.run(c.copy_back(f"{c.remote_cell}/{wandb_run.WANDB_DIR}", str(cell_dir), recurse=True),
                           capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        log.warning("copying the W&B run back from worker 0 took over 30 minutes; skipped (it stays on the worker)")
        return
    if p.returncode:
        log.warning(f"could not copy the W&B run back from worker 0: {(p.stderr or '').strip()[-300:]}")


def stop_workers(c: Commands, job: str) -> None:
    try:
        _run(c.stop(job), "stopping the trainers on the workers", timeout=300)
    except SubmitError as e:
        log.warning(str(e))


@contextlib.contextmanager
def shielded(what: str) -> Iterator[None]:
    """Let `what` (stopping trainers, deleting the slice) finish despite another Ctrl-C or SIGTERM."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum, frame):
        log.warning(f"{what}: wait for it to finish (stopping now would leave the slice running)")

    old = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# --------------------------------------------------------------------------- running a cell

def _describe_status(code: int) -> str:
    if code > 128:
        try:
            return procs.describe_exit(-signal.Signals(code - 128).value)
        except ValueError:
            pass
    return procs.describe_exit(code)


def follow_workers(c: Commands, job: str, workers: int, cell_dir: Path, cfg: Config) -> procs.Result:
    """Follow every worker's trainer; on the first failure stop all of them (they run detached, so
    stopping the local followers alone would leave them running)."""
    specs = []
    for i in range(workers):
        spec = {"worker": i, "argv": c.follow(i, job, offset="@OFFSET@"), "retries": FOLLOW_RETRIES,
                "backoff_s": min(cfg.tpu.poll_interval_s, 5.0)}
        specs.append(procs.Spec(f"worker-{i}", [sys.executable, str(FOLLOW), json.dumps(spec)], prefix=f"[w{i}] "))
    return procs.run_group(specs, cell_dir / files.LOGS_DIR, on_failure=lambda: stop_workers(c, job))


def run_cell(cell: Cell) -> Outcome:
    cfg, cell_dir = cell.cfg, cell.dir
    s = slice_of(cfg)
    archive, version = build_archive(cfg, cell.name, cell_dir.parent / "tpu")
    c = Commands(cfg, version, cell.name)
    rec = Record(cell_dir, {"version": version, "node": c.node, "workers": s.workers, "mode": cfg.tpu.mode,
                            "keep": bool(cfg.tpu.keep), "created": False, "job": None})
    outcome: Optional[Outcome] = None
    interrupted = False
    try:
        if cfg.tpu.mode == "queued":
            log.info(f"creating queued resource {c.node} ({s.accelerator_type}, {s.workers} worker(s), {cfg.tpu.capacity}, "
                     f"{runtime_version(cfg)} in {zone(cfg)})")
            _run(c.create(), "creating the queued resource", timeout=600)
            rec.save(created=True, state="creating")
            wait_active(c, cfg)
        log.info(f"shipping {archive.name} to {s.workers} worker(s) and running tpu.setup")
        _run_all(c.ship_code(str(archive), s.workers), "copying the code to the workers")
        shipping = c.ship_inputs(s.workers)
        if shipping:
            log.info(f"shipping the cell's input files to {s.workers} worker(s)")
            _run(shipping[0], "making the input directories on the workers", timeout=300)
            _run_all(shipping[1:], "copying the cell's input files to the workers")
        hosts = worker_hosts(c, s.workers) if cfg.framework == "torch" else None
        _run(c.unpack_and_setup(), "unpacking the code and running tpu.setup")
        for line in _run(c.free_chips(), "freeing the TPU chips", timeout=600).splitlines():
            log.info(line)
        _run(c.check_python(), "checking the workers' Python", timeout=300)
        job = new_job_id()
        offsets = [(_local_log(cell_dir, i).stat().st_size if _local_log(cell_dir, i).is_file() else 0) for i in range(s.workers)]
        rec.save(job=job, state="running", log_offsets=offsets,
                 started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        log.info(f"starting the trainers (job {job}); they run detached: if this launcher goes away, "
                 f"`scaleout status {cell_dir.parent}` finds them again")
        _run_all(c.start(job, hosts), "starting the trainers on the workers", timeout=300)
        r = follow_workers(c, job, s.workers, cell_dir, cfg)
        copy_metrics_back(c, cell_dir)
        copy_profile_back(c, cfg, cell_dir, s.workers)
        copy_wandb_back(c, cfg, cell_dir)
        if r.returncode:
            i = int(r.failed.rsplit("-", 1)[1])
            how = _describe_status(r.returncode)
            procs.report_failure(f"cell {cell.name} failed: worker {i} {how}; the other workers were stopped. "
                                 f"Last lines of worker {i}:", r.tail)
            outcome = Outcome(cell.name, "failed", exit_code(r.returncode) or 1, f"worker {i} {how}")
        else:
            outcome = Outcome(cell.name, "ok")
    except SubmitError as e:
        print(f"scaleout: error: {e}", file=sys.stderr, flush=True)  # the CLI's form for a refusal
        outcome = Outcome(cell.name, "failed", 2, str(e))
    except BaseException:
        interrupted = True
        raise
    finally:
        with shielded("stopping the trainers and deleting the slice"):
            if interrupted and rec.job:
                log.info("interrupted: stopping the trainers on the workers")
                stop_workers(c, rec.job)
                copy_metrics_back(c, cell_dir)
                copy_profile_back(c, cfg, cell_dir, s.workers)
                copy_wandb_back(c, cfg, cell_dir)
                collect_logs(c, rec, cell_dir)
            deleted = True
            if rec.created and not cfg.tpu.keep:
                log.info(f"deleting queued resource {c.node}")
                deleted = delete_queued(c, cfg)
            result = "CANCELLED" if interrupted else "COMPLETED" if outcome and outcome.state == "ok" else "FAILED"
            rec.save(state="ended", result=result, deleted=bool(rec.created and deleted and not cfg.tpu.keep))
    if not deleted and outcome.state == "ok":
        outcome = Outcome(cell.name, "failed", 1, f"queued resource {c.node} was not deleted")
    return outcome


# --------------------------------------------------------------------------- a later `status`

def _attached(cell_dir: Path) -> Optional[str]:
    """Who holds the cell's lock (a launcher that still follows the cell), or None; this process's own lock
    (a launcher checking, under the lock it just took, that no job of the cell is live) does not count."""
    path = cell_dir / files.LOCK_FILE
    if not path.is_file():
        return None
    with open(path, "r+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = f.read().strip()
            return None if who == files.holder() else who or "another launcher"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


_PROBES: Dict[Tuple[str, str], Tuple[float, List[str]]] = {}


def probe(c: Commands, job: str, workers: int) -> List[str]:
    """Each worker's word for the job: running, exit N, none (gone without a status) or gone."""
    key = (c.node, job)
    hit = _PROBES.get(key)
    if hit and time.monotonic() - hit[0] < PROBE_TTL_S:
        return hit[1]
    out = _run(c.probe(job), f"asking TPU {c.node}'s workers about job {job}", timeout=300)
    words = [line.split(STATE_MARK, 1)[1].strip() for line in out.splitlines() if line.startswith(STATE_MARK)]
    if len(words) != workers:
        raise SubmitError(f"{len(words)} of the {workers} workers of TPU {c.node} answered about job {job}")
    _PROBES[key] = (time.monotonic(), words)
    return words


def _cell_commands(cell_dir: Path, rec: Record) -> Tuple[Commands, Config]:
    """The commands of a cell found in a run directory (`status`, `logs`, `cancel`): its tpu.gcloud must be a
    program outside that run directory, which may have been written by anyone."""
    cfg = config_mod.load_resolved(cell_dir / CONFIG_NAME)
    found = shutil.which(cfg.tpu.gcloud)
    if found is None or Path(cell_dir).parent.resolve() in Path(found).resolve().parents:
        raise SubmitError(f"tpu.gcloud={cfg.tpu.gcloud!r} of cell {cell_dir.name} is not a program on PATH outside "
                          f"the run directory; scaleout does not run programs a run directory names.")
    return Commands(cfg, rec.version, cell_dir.name), cfg


def _finish(cell_dir: Path, rec: Record, result: str, stop: bool = False) -> List[str]:
    """The launcher is gone: stop (if asked), collect, delete the slice, mark the record ended."""
    c, cfg = _cell_commands(cell_dir, rec)
    done = []
    if rec.job:
        if stop:
            stop_workers(c, rec.job)
            done.append(f"stopped the trainers on {rec.workers} worker(s)")
        copy_metrics_back(c, cell_dir)
        copy_profile_back(c, cfg, cell_dir, int(rec.workers or 0))
        copy_wandb_back(c, cfg, cell_dir)
        collect_logs(c, rec, cell_dir)
        done.append("collected metrics.jsonl, the worker logs and the profile" if cfg.profile.steps
                    else "collected metrics.jsonl and the worker logs")
    deleted = False
    if rec.created and not rec.keep:
        deleted = delete_queued(c, cfg)
        done.append(f"deleted queued resource {c.node}" if deleted else f"could not delete queued resource {c.node}")
    rec.save(state="ended", result=result, deleted=deleted)
    return done


def job_info(cell_dir: Path, rec: Record) -> JobInfo:
    jid = str(rec.job or rec.node or "?")[:64]
    if rec.state == "ended":
        return JobInfo(jid, str(rec.result or "ENDED"), live=False)
    if _attached(cell_dir):
        return JobInfo(jid, "RUNNING", live=True)  # its launcher follows it
    try:
        _cell_commands(cell_dir, rec)
    except (SubmitError, ConfigError) as e:
        return JobInfo(jid, "UNKNOWN", live=False, error=[str(e)])
    if not rec.job:
        done = _finish(cell_dir, rec, "ABANDONED")
        log.info(f"cell {cell_dir.name}: its launcher went away before the trainers started; {'; '.join(done) or 'nothing to do'}")
        return JobInfo(jid, "ABANDONED", live=False, error=["the launcher went away before the trainers started"])
    c, _ = _cell_commands(cell_dir, rec)
    try:
        words = probe(c, rec.job, int(rec.workers))
    except SubmitError as e:
        return JobInfo(jid, "UNREACHABLE", live=False, error=[str(e)])
    if "running" in words:
        return JobInfo(jid, "RUNNING", live=True)
    codes = [int(w.split()[1]) for w in words if w.startswith("exit ") and w.split()[1].lstrip("-").isdigit()]
    failed = len(codes) != len(words) or any(codes)
    result = "FAILED" if failed else "COMPLETED"
    done = _finish(cell_dir, rec, result)
    log.info(f"cell {cell_dir.name}: the trainers have ended ({', '.join(f'worker {i}: {w}' for i, w in enumerate(words))}); "
             f"{'; '.join(done)}")
    return JobInfo(jid, result, live=False,
                   error=[f"worker {i}: {w}" for i, w in enumerate(words) if w != "exit 0"] if failed else [])


def _records(run_dir: Path) -> Iterator[Tuple[Path, Record]]:
    if not Path(run_dir).is_dir():
        return
    for d in sorted(Path(run_dir).iterdir()):
        rec = Record.load(d) if d.is_dir() else None
        if rec is not None:
            yield d, rec


class TpuTarget(ForegroundTarget):
    """TPU cells run one after another, each on its own slice; their trainers run detached."""
    name = "tpu"

    def validate(self, cfg: Config) -> None:
        validate(cfg)

    def preflight(self, cfg: Config) -> None:
        if shutil.which(cfg.tpu.gcloud) is None:
            raise SubmitError(f"tpu.gcloud={cfg.tpu.gcloud!r} is not on PATH: target=tpu needs the Google Cloud CLI "
                              "(https://cloud.google.com/sdk), logged in.")
        if cfg.tpu.mode == "existing":
            check_existing(Commands(cfg, "-", "-"), cfg)

    def plan_commands(self, cfg: Config, cell_dir: Path) -> List[str]:
        return plan_commands(cfg, cell_dir)

    def run(self, cells: Sequence[Cell], run_dir: Path) -> List[Outcome]:
        outcomes = []
        for i, c in enumerate(cells, 1):
            log.info(f"cell {i}/{len(cells)} {c.name}: {slice_of(c.cfg).accelerator_type}")
            outcomes.append(run_cell(c))
        return outcomes

    def jobs(self, run_dir: Path) -> Dict[str, JobInfo]:
        return {d.name: job_info(d, rec) for d, rec in _records(run_dir)}

    def log_files(self, run_dir: Path, cell: str) -> List[Path]:
        """A detached job's logs are fetched from the workers into <cell>/logs/ (which `logs` shows)."""
        d = Path(run_dir) / cell
        rec = Record.load(d)
        if rec is not None and rec.state == "running" and rec.job and not _attached(d):
            try:
                c, _ = _cell_commands(d, rec)
            except (SubmitError, ConfigError) as e:
                log.warning(f"cell {cell}: the workers' logs are not fetched: {e}")
                return []
            collect_logs(c, rec, d)
        return []

    def cancel(self, run_dir: Path, cells: Sequence[str]) -> Dict[str, str]:
        out = {}
        for d, rec in _records(run_dir):
            if d.name not in cells:
                continue
            holder = _attached(d)
            if rec.state == "ended":
                out[d.name] = f"already finished ({rec.result})"
            elif holder:
                out[d.name] = f"its launcher ({holder}) is still running it: stop that launcher (Ctrl-C), which stops the trainers"
            else:
                out[d.name] = "; ".join(_finish(d, rec, "CANCELLED", stop=True)) or "nothing was running"
        return out

    def wait(self, run_dir: Path, poll_s: float = 5.0, timeout_s: Optional[float] = None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(j.live for j in self.jobs(run_dir).values()):
            if deadline is not None and time.monotonic() > deadline:
                raise SubmitError(f"the TPU jobs of {run_dir} are still running after {timeout_s:g} s")
            time.sleep(poll_s)

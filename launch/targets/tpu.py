"""The Cloud TPU target, through the `gcloud` CLI (JAX only).

Lifecycle of a cell (`tpu.mode=queued`):
  1. queued-resources create (capacity flag from tpu.capacity), 2. describe until ACTIVE
  (FAILED/SUSPENDED or a timeout: clear error, then delete), 3. scp an archive of the project's
  tracked files plus the cell's config to every worker, unpack it into a versioned directory,
  run `tpu.setup` once per worker, 4. free the chips (stale trainers, /tmp/libtpu_lockfile),
  5. start the trainer on every worker (one ssh each), streaming each worker's output to
  `CELL/logs/worker-<i>.log` with `[w<i>]` on the console; when one worker fails, stop the others
  and report it with its last lines, 6. copy metrics.jsonl back from worker 0 (checkpoints stay
  where the trainer wrote them: gs:// on a real slice), 7. queued-resources delete (unless tpu.keep). `tpu.mode=existing` uses a TPU VM the
  user already has (tpu-vm describe; no create/delete).

Every command is an argv list (no local shell); the remote `--command` strings are built from
quoted words only, and names are validated against GCP's rules before anything runs.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from launch import config as config_mod
from launch import files
from launch.config import ConfigError
from launch.files import CONFIG_NAME, METRICS_NAME
from launch.schema import Config
from launch.targets import procs
from launch.targets.base import Cell, ForegroundTarget, Outcome, exit_code
from launch.targets.errors import SubmitError

log = logging.getLogger(__name__)
REMOTE_RUN_DIR = "runs"  # run.dir on the workers, inside the unpacked code
NAME_RE = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")  # GCP resource names (RFC 1035)
ZONE_RE = re.compile(r"[a-z]+-[a-z]+[0-9]+-[a-z]")
PROJECT_RE = re.compile(r"[a-z][-a-z0-9]{4,28}[a-z0-9]")
VERSION_RE = re.compile(r"[a-z0-9][-a-z0-9._]*")
TYPE_RE = re.compile(r"(v4|v5p|v5litepod|v6e)-(\d+)")
CAPACITY_FLAGS = {"on-demand": [], "spot": ["--spot"], "reserved": ["--reserved"], "best-effort": ["--best-effort"]}
REMOTE_ROOT = "scaleout"


# --------------------------------------------------------------------------- slice shapes

@dataclass(frozen=True)
class Slice:
    accelerator_type: str
    chips: int  # JAX devices (one per chip; v4/v5p megacore)
    workers: int  # hosts, one JAX process each


GENERATIONS = {
    # generation: (type prefix, TensorCores per chip in the name, valid chip counts, chips per host)
    "v5e": ("v5litepod", 1, (1, 4, 8, 16, 32, 64, 128, 256), 4),
    "v6e": ("v6e", 1, (1, 4, 8, 16, 32, 64, 128, 256), 4),
    "v4": ("v4", 2, tuple(2 ** k for k in range(2, 12)), 4),
    "v5p": ("v5p", 2, tuple(2 ** k for k in range(2, 13)), 4),
}
PREFIX_GEN = {v[0]: k for k, v in GENERATIONS.items()}


def _slice_for(gen: str, chips: int) -> Slice:
    prefix, cores, _, per_host = GENERATIONS[gen]
    single_host = chips <= (8 if cores == 1 else 4)
    return Slice(f"{prefix}-{chips * cores}", chips, 1 if single_host else chips // per_host)


def slice_of(cfg: Config) -> Slice:
    t = cfg.tpu
    if t.accelerator_type:
        m = TYPE_RE.fullmatch(t.accelerator_type)
        if not m:
            raise ConfigError(f"tpu.accelerator_type={t.accelerator_type!r} is not valid; write e.g. v5litepod-16, v6e-8, v4-32 or v5p-8.")
        gen = PREFIX_GEN[m.group(1)]
        cores = GENERATIONS[gen][1]
        chips = int(m.group(2)) // cores
        if chips not in GENERATIONS[gen][2]:
            raise ConfigError(f"tpu.accelerator_type={t.accelerator_type!r} is not a {gen} slice shape.")
        s = _slice_for(gen, chips)
        if chips != cfg.devices:
            raise ConfigError(f"tpu.accelerator_type={t.accelerator_type} has {chips} chips but devices={cfg.devices}; make them agree.")
        return s
    valid = GENERATIONS[t.generation][2]
    if cfg.devices not in valid:
        raise ConfigError(f"devices={cfg.devices} is not a {t.generation} slice size; valid chip counts: {', '.join(map(str, valid))}.")
    return _slice_for(t.generation, cfg.devices)


# --------------------------------------------------------------------------- validation

def validate(cfg: Config) -> None:
    t = cfg.tpu
    if cfg.framework != "jax":
        raise ConfigError("framework=torch with target=tpu is not supported: PyTorch on TPU needs torch_xla, which scaleout does not drive; use framework=jax on TPU.")
    if not NAME_RE.fullmatch(t.name):
        raise ConfigError(f"tpu.name={t.name!r} is not a valid TPU name: lower-case letters, digits and hyphens, starting with a letter, at most 63 characters.")
    if not ZONE_RE.fullmatch(t.zone):
        raise ConfigError(f"tpu.zone={t.zone!r} is not a valid zone; write e.g. us-west4-a or europe-west4-b.")
    if t.project is not None and not PROJECT_RE.fullmatch(t.project):
        raise ConfigError(f"tpu.project={t.project!r} is not a valid GCP project id: 6-30 lower-case letters, digits and hyphens, starting with a letter.")
    if not VERSION_RE.fullmatch(t.runtime_version):
        raise ConfigError(f"tpu.runtime_version={t.runtime_version!r} is not valid; write e.g. v2-alpha-tpuv5-lite.")
    for i, entry in enumerate(t.setup):
        try:
            shlex.split(entry)
        except ValueError as e:
            raise ConfigError(f"tpu.setup[{i}]={entry!r} is not valid: {e}; write one command per entry.") from None
    slice_of(cfg)


# --------------------------------------------------------------------------- commands

def _scope(cfg: Config) -> List[str]:
    return [f"--zone={cfg.tpu.zone}"] + ([f"--project={cfg.tpu.project}"] if cfg.tpu.project else [])


def one_command(words: str) -> str:
    """A config string as exactly one remote command with quoted words."""
    return shlex.join(shlex.split(words))


class Commands:
    """Every gcloud command of a cell, as argv lists (the plan prints exactly these)."""

    def __init__(self, cfg: Config, version: str, cell: str):
        self.cfg, self.t = cfg, cfg.tpu
        self.node = cfg.tpu.name
        self.remote_dir = f"{REMOTE_ROOT}/{version}"
        self.archive = f"scaleout-{version}.tar.gz"
        self.cell_rel = remote_cell_path(cfg, cell)  # relative to remote_dir
        self.remote_cell = f"{self.remote_dir}/{self.cell_rel}"

    def tpus(self, *args: str) -> List[str]:
        """`gcloud compute tpus ARGS...`"""
        return [self.t.gcloud, "compute", "tpus", *args]

    def create(self) -> List[str]:
        s = slice_of(self.cfg)
        return self.tpus("queued-resources", "create", self.node, f"--node-id={self.node}", f"--accelerator-type={s.accelerator_type}",
                      f"--runtime-version={self.t.runtime_version}", *_scope(self.cfg), *CAPACITY_FLAGS[self.t.capacity])

    def describe_queued(self) -> List[str]:
        return self.tpus("queued-resources", "describe", self.node, *_scope(self.cfg), "--format=value(state.state)")

    def delete(self) -> List[str]:
        return self.tpus("queued-resources", "delete", self.node, *_scope(self.cfg), "--force", "--quiet")

    def describe_vm(self) -> List[str]:
        return self.tpus("tpu-vm", "describe", self.node, *_scope(self.cfg), "--format=json")

    def ssh(self, worker: str, command: str) -> List[str]:
        return self.tpus("tpu-vm", "ssh", self.node, f"--worker={worker}", *_scope(self.cfg), f"--command={command}")

    def scp_to_all(self, local: str) -> List[str]:
        return self.tpus("tpu-vm", "scp", local, f"{self.node}:{self.archive}", "--worker=all", *_scope(self.cfg))

    def unpack_and_setup(self) -> List[str]:
        steps = [shlex.join(["mkdir", "-p", self.remote_dir]), shlex.join(["tar", "-xzf", self.archive, "-C", self.remote_dir]),
                 shlex.join(["cd", self.remote_dir])] + [one_command(s) for s in self.t.setup if s.strip()]
        return self.ssh("all", " && ".join(steps))

    def free_chips(self) -> List[str]:
        return self.ssh("all", "pkill -f '[m] jaxrun --config' ; rm -f /tmp/libtpu_lockfile ; true")

    def train(self, worker: int) -> List[str]:
        cmd = " ".join([shlex.join(["cd", self.remote_dir]), "&&", "SCALEOUT_DISTRIBUTED=tpu PYTHONUNBUFFERED=1",
                        shlex.join([self.t.python, "-m", "jaxrun", "--config", f"{self.cell_rel}/{CONFIG_NAME}"])])
        return self.ssh(str(worker), cmd)

    def stop_all(self) -> List[str]:
        return self.ssh("all", "pkill -f '[m] jaxrun --config' ; true")

    def copy_back(self, remote: str, local: str, recurse: bool = False) -> List[str]:
        return self.tpus("tpu-vm", "scp", f"{self.node}:{remote}", local, "--worker=0", *_scope(self.cfg), *(["--recurse"] if recurse else []))


def remote_cell_path(cfg: Config, cell: str) -> str:
    """A cell's directory on the workers, relative to the unpacked code (the layout of launch.rundir)."""
    return f"{REMOTE_RUN_DIR}/{cfg.run.name}/{cell}"


def remote_config(cell_cfg: Config) -> Config:
    """The cell config as the workers see it: run dir and compilation cache inside the unpacked code."""
    return config_mod.replace(cell_cfg, {"run.dir": REMOTE_RUN_DIR, "jax.cache_dir": ".jax_cache"})


def plan_commands(cfg: Config, cell_dir: Path) -> List[str]:
    validate(cfg)
    c = Commands(cfg, "<code-hash>", cell_dir.name)
    s = slice_of(cfg)
    out = []
    if cfg.tpu.mode == "queued":
        out += [shlex.join(c.create()),
                shlex.join(c.describe_queued()) + f"   # repeated every {cfg.tpu.poll_interval_s:g} s until ACTIVE (at most {cfg.tpu.timeout_s:g} s)"]
    else:
        out.append(shlex.join(c.describe_vm()))
    out += [shlex.join(c.scp_to_all(f"{cell_dir.parent}/tpu/{c.archive}")), shlex.join(c.unpack_and_setup()),
            shlex.join(c.free_chips())]
    out += [shlex.join(c.train(i)) + "   # concurrently on every worker" for i in range(s.workers)]
    out.append(shlex.join(c.copy_back(f"{c.remote_cell}/{METRICS_NAME}", str(cell_dir / METRICS_NAME))))
    if cfg.tpu.mode == "queued" and not cfg.tpu.keep:
        out.append(shlex.join(c.delete()))
    return out


# --------------------------------------------------------------------------- running

def project_root() -> Path:
    return Path(__file__).resolve().parents[2]


def tracked_files(root: Path) -> List[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
        names = [f for f in out.decode().split("\0") if f]
        if names:
            return [f for f in names if (root / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        pass
    names = []
    for top in ("launch", "jaxrun", "torchrun_fsdp", "configs"):
        names += [str(p.relative_to(root)) for p in (root / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return names + [f for f in ("pyproject.toml", "README.md", "constraints.txt") if (root / f).is_file()]


def build_archive(cell_cfg: Config, cell_name: str, out_dir: Path) -> Tuple[Path, str]:
    """A tar.gz of the project's tracked files plus the cell's config; named by its content hash."""
    root = project_root()
    names = sorted(tracked_files(root))
    h = hashlib.sha256()
    for f in names:
        h.update(f.encode())
        h.update((root / f).read_bytes())
    cfg_text = config_mod.OmegaConf.to_yaml(config_mod.OmegaConf.create(config_mod.to_dict(remote_config(cell_cfg))))
    h.update(cfg_text.encode())
    version = h.hexdigest()[:12]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in names:
            tar.add(root / f, arcname=f)
        data = cfg_text.encode()
        info = tarfile.TarInfo(f"{remote_cell_path(cell_cfg, cell_name)}/{CONFIG_NAME}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    path = files.atomic_write(out_dir / f"scaleout-{version}.tar.gz", buf.getvalue())
    return path, version


def _run(argv: List[str], what: str, timeout: Optional[float] = None) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SubmitError(f"{what} timed out after {timeout:g} s: {shlex.join(argv)}") from None
    if p.returncode:
        last = (p.stderr.strip() or p.stdout.strip() or f"exit code {p.returncode}").splitlines()[-1]
        raise SubmitError(f"{what} failed: {last}")
    return p.stdout


def wait_active(c: Commands, cfg: Config) -> None:
    deadline = time.monotonic() + cfg.tpu.timeout_s
    last = None
    while True:
        state = _run(c.describe_queued(), "describing the queued resource").strip()
        if state != last:
            log.info(f"queued resource {c.node}: {state}")
            last = state
        if state == "ACTIVE":
            return
        if state in ("FAILED", "SUSPENDED", "SUSPENDING"):
            raise SubmitError(f"queued resource {c.node} is {state}: the slice could not be provided "
                              f"(capacity {cfg.tpu.capacity} in {cfg.tpu.zone}); try another zone or tpu.capacity")
        if time.monotonic() > deadline:
            raise SubmitError(f"queued resource {c.node} did not become ACTIVE within tpu.timeout_s={cfg.tpu.timeout_s:g} s (last state {state})")
        time.sleep(cfg.tpu.poll_interval_s)


def run_workers(c: Commands, workers: int, cell_dir: Path) -> procs.Result:
    """Start the trainer on every worker; on the first failure stop the others."""
    specs = [procs.Spec(f"worker-{i}", c.train(i), prefix=f"[w{i}] ") for i in range(workers)]
    return procs.run_group(specs, cell_dir / files.LOGS_DIR,
                           on_failure=lambda: subprocess.run(c.stop_all(), capture_output=True, timeout=120))


class TpuTarget(ForegroundTarget):
    """TPU cells run one after another, each on its own slice."""
    name = "tpu"

    def validate(self, cfg: Config) -> None:
        validate(cfg)

    def preflight(self, cfg: Config) -> None:
        if shutil.which(cfg.tpu.gcloud) is None:
            raise SubmitError(f"tpu.gcloud={cfg.tpu.gcloud!r} is not on PATH: target=tpu needs the Google Cloud CLI "
                              "(https://cloud.google.com/sdk), logged in.")

    def plan_commands(self, cfg: Config, cell_dir: Path) -> List[str]:
        return plan_commands(cfg, cell_dir)

    def run(self, cells: Sequence[Cell], run_dir: Path) -> List[Outcome]:
        outcomes = []
        for i, c in enumerate(cells, 1):
            log.info(f"cell {i}/{len(cells)} {c.name}: {slice_of(c.cfg).accelerator_type}")
            outcomes.append(run_cell(c))
        return outcomes


def run_cell(cell: Cell) -> Outcome:
    cell_cfg, cell_dir = cell.cfg, cell.dir
    s = slice_of(cell_cfg)
    archive, version = build_archive(cell_cfg, cell.name, cell_dir.parent / "tpu")
    c = Commands(cell_cfg, version, cell.name)
    queued = cell_cfg.tpu.mode == "queued"
    created = False
    try:
        if queued:
            log.info(f"creating queued resource {c.node} ({s.accelerator_type}, {s.workers} worker(s), {cell_cfg.tpu.capacity})")
            _run(c.create(), "creating the queued resource")
            created = True
            wait_active(c, cell_cfg)
        else:
            desc = json.loads(_run(c.describe_vm(), f"describing TPU VM {c.node}"))
            found = len(desc.get("networkEndpoints", []))
            if desc.get("state") not in (None, "READY"):
                raise SubmitError(f"TPU VM {c.node} is {desc.get('state')}, not READY")
            if found != s.workers:
                raise SubmitError(f"TPU VM {c.node} has {found} worker(s) but devices={cell_cfg.devices} on {cell_cfg.tpu.generation} needs {s.workers}")
        log.info(f"shipping {archive.name} to {s.workers} worker(s) and running tpu.setup")
        _run(c.scp_to_all(str(archive)), "copying the code to the workers")
        _run(c.unpack_and_setup(), "unpacking the code and running tpu.setup")
        _run(c.free_chips(), "freeing the TPU chips")
        r = run_workers(c, s.workers, cell_dir)
        _copy_back(c, cell_dir)
        if r.returncode:
            i = int(r.failed.rsplit("-", 1)[1])
            procs.report_failure(f"cell {cell.name} failed: worker {i} {procs.describe_exit(r.returncode)}; "
                                 f"the other workers were stopped. Last lines of worker {i}:", r.tail)
            return Outcome(cell.name, "failed", exit_code(r.returncode) or 1, f"worker {i} {procs.describe_exit(r.returncode)}")
        return Outcome(cell.name, "ok")
    except SubmitError as e:
        print(f"scaleout: error: {e}", file=sys.stderr, flush=True)  # the CLI's form for a refusal
        return Outcome(cell.name, "failed", 2, str(e))
    finally:
        if created and not cell_cfg.tpu.keep:
            log.info(f"deleting queued resource {c.node}")
            subprocess.run(c.delete(), capture_output=True, timeout=600)


def _copy_back(c: Commands, cell_dir: Path) -> None:
    """metrics.jsonl from worker 0, appending only the records this run added."""
    local_metrics = cell_dir / METRICS_NAME
    tmp = cell_dir / (METRICS_NAME + ".worker0")
    p = subprocess.run(c.copy_back(f"{c.remote_cell}/{METRICS_NAME}", str(tmp)), capture_output=True, text=True, timeout=600)
    if p.returncode == 0 and tmp.is_file():
        seen = max((r.get("time", 0) for r in files.read_records(local_metrics)), default=0)
        new = []
        for line in tmp.read_text().splitlines():
            try:
                if json.loads(line).get("time", 0) > seen:
                    new.append(line)
            except (json.JSONDecodeError, AttributeError):  # a torn last line
                continue
        with open(local_metrics, "a") as out:  # only what this run added (a reused VM keeps older records)
            out.writelines(line + "\n" for line in new)
        tmp.unlink()
    else:
        log.warning(f"could not copy metrics.jsonl back from worker 0: {(p.stderr or '').strip()[-300:]}")

"""Every gcloud command of a TPU cell, the remote shell scripts they carry, and the code archive.

Commands are argv lists (no local shell); the remote `--command` strings are built from quoted
words only. `scaleout plan` prints exactly these. On each worker, under its home directory:

    scaleout/<code version>/             the unpacked archive (code + the cell's config.yaml)
        runs/<run>/<cell>/config.yaml    what the trainer reads
        runs/<run>/<cell>/metrics.jsonl  what it writes (copied back from worker 0)
        runs/<run>/<cell>/job/<job>.log  the detached trainer's output, .pid its session, .exit its status
    scaleout/venv/                       the Python environment the default tpu.setup makes for JAX (Python 3.11, uv)
    scaleout/venv-torch/                 the one it makes for PyTorch (torch from the CPU index + torch_tpu + libtpu)
    scaleout/inputs/<name>-<hash>/       the cell's input files shipped from the launcher (token file, HF directory)
    scaleout/checkpoints/<run>/<cell>/   checkpoints of a single-host slice without a gs:// checkpoint.dir

The trainer runs detached from the ssh session that starts it (`setsid nohup`), so a launcher
that loses its connection, or goes away, leaves it running; the launcher follows each worker's
log with `tail --pid` over ssh, and the job files let `scaleout status` find it again later.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shlex
import subprocess
import tarfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf

from launch import config as config_mod
from launch.common import envvars, files
from launch.common.files import CONFIG_NAME
from launch.config.schema import Config
from launch.core import torch_tpu_env
from launch.targets import shell
from launch.targets.tpu import inputs as tpu_inputs
from launch.targets.tpu.shapes import MIN_PYTHON, VENV_PYTHON, VENV_TORCH_PYTHON, is_unset, runtime_version, slice_of, zone

REMOTE_ROOT = "scaleout"  # under the worker's home
REMOTE_RUN_DIR = "runs"  # run.dir on the workers, inside the unpacked code
JOB_DIR = "job"  # <cell>/job/<job id>.{log,pid,exit} on every worker
# The chip-freeing command acts on ${SCALEOUT_TPU_SYSROOT}/dev/accel*, /dev/vfio/* and /tmp/libtpu_lockfile:
# unset on a TPU VM (the real paths); the gcloud emulation points it at each worker's sandbox.
SYSROOT_ENV = envvars.TPU_SYSROOT
EXIT_MARK = "scaleout-exit:"  # last stderr line of a follow command: the trainer's exit status
STATE_MARK = "scaleout-job:"  # one stdout line per worker of a probe command
STOP_GRACE_S = 10  # SIGTERM, then SIGKILL after this long (a trainer stops after its current step)
START_WAIT_S = 60  # how long a follower waits for a trainer's pid file

MAX_ERROR_CHARS = 1200  # a gcloud error message longer than this is cut (from the end)


def gcloud_error(stderr: str, stdout: str = "", returncode: int = 1) -> str:
    """What a failed gcloud command said, in one line: its last `ERROR: (gcloud...) ...` message with every line
    that follows it (gcloud's message goes on after the first line: "Please run: $ gcloud auth login ..."), else
    the output's last line, else the exit code."""
    lines = [line.strip() for line in (stderr or "").splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("ERROR:")]
    if starts:
        text = " ".join(line for line in lines[starts[-1]:] if line)
    else:
        text = ((stderr or "").strip() or (stdout or "").strip() or f"exit code {returncode}").splitlines()[-1].strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


CAPACITY_FLAGS = {"on-demand": [], "spot": ["--spot"], "reserved": ["--reserved"], "best-effort": ["--best-effort"]}
ALPHA_CAPACITY = {"best-effort"}  # `--best-effort` exists only in `gcloud alpha compute tpus queued-resources create`
# `tpu-vm ssh` / `scp` flags that GA lacks ("IAP and Batching are not available for GA" in gcloud's source):
# with one of them in tpu.ssh_args every ssh and scp goes through `gcloud alpha`.
ALPHA_SSH_FLAGS = ("--tunnel-through-iap", "--batch-size")

_NEED = ".".join(map(str, MIN_PYTHON))
# The default tpu.setup: TPU VM images ship Python 3.10, so uv makes a Python 3.11 venv in
# ~/scaleout/venv (downloading that Python if the image lacks it) and installs the project's
# dependencies at the tested pins plus jax[tpu]; the project itself is not installed: the trainer
# imports the unpacked archive only.
# The gcs extra (gcsfs, google-cloud-storage) is what Orbax/etils and DCP need for gs:// checkpoints.
DEFAULT_SETUP = [
    "python3 -m pip install --user --quiet uv",
    f"python3 -m uv venv --python {_NEED} --allow-existing ../venv",
    f"python3 -m uv pip install --python {VENV_PYTHON} --quiet -r pyproject.toml --extra jax --extra gcs -c constraints.txt jax[tpu]",
]
# PyTorch on TPU is TorchTPU (torch_tpu): its own venv, because torch_tpu needs a newer libtpu than the one
# jax[tpu] pins (constraints.txt), and because it hooks every `import torch` of the environment it is in.
# torch comes from PyTorch's CPU index (the PyPI wheel is a CUDA build); torch-tpu.txt pins torch_tpu and
# its libtpu over constraints.txt's.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_TPU_PINS = "torch-tpu.txt"
DEFAULT_TORCH_SETUP = [
    "python3 -m pip install --user --quiet uv",
    f"python3 -m uv venv --python {_NEED} --allow-existing ../venv-torch",
    f"python3 -m uv pip install --python {VENV_TORCH_PYTHON} --quiet --extra-index-url {TORCH_CPU_INDEX} "
    f"--index-strategy unsafe-best-match -r pyproject.toml --extra torch --extra gcs -c constraints.txt "
    f"--override {TORCH_TPU_PINS} -r {TORCH_TPU_PINS}",
]


def python_of(cfg: Config) -> str:
    """The interpreter that runs the trainer on the workers: tpu.python, or the default setup's venv."""
    if not is_unset(cfg, "python"):
        return cfg.tpu.python
    return VENV_TORCH_PYTHON if cfg.framework == "torch" else VENV_PYTHON


def setup_of(cfg: Config) -> List[str]:
    if is_unset(cfg, "setup"):
        return list(DEFAULT_TORCH_SETUP if cfg.framework == "torch" else DEFAULT_SETUP)
    return [s for s in cfg.tpu.setup if s.strip()]


def valid_until(cfg: Config) -> str:
    """tpu.timeout_s as a gcloud duration: the queued resource expires when the launcher stops waiting."""
    return f"{max(1, math.ceil(cfg.tpu.timeout_s))}s"


def one_command(words: str) -> str:
    """A config string as exactly one remote command with quoted words."""
    return shlex.join(shlex.split(words))


def remote_cell_path(cfg: Config, cell: str) -> str:
    """A cell's directory on the workers, relative to the unpacked code (the layout of launch.launcher.rundir)."""
    return f"{REMOTE_RUN_DIR}/{cfg.run.name}/{cell}"


def remote_config_text(cell_cfg: Config, cell: str) -> str:
    """The cell config as the workers see it: run dir and compilation cache inside the unpacked code;
    a local checkpoint.dir (single-host slices only) becomes ~/scaleout/checkpoints/<run>/<cell> on the
    worker, resolved there by the config loader (`${oc.env:HOME}`); gs:// stays as it is."""
    data = config_mod.to_dict(config_mod.replace(cell_cfg, {"run.dir": REMOTE_RUN_DIR, "jax.cache_dir": ".jax_cache"}))
    for key, value in tpu_inputs.remote_values(cell_cfg, f"${{oc.env:HOME}}/{REMOTE_ROOT}").items():
        section, name = key.split(".")
        data[section][name] = value  # paths on the workers (checked there when the trainer loads its config)
    if not files.is_remote(cell_cfg.checkpoint.dir):
        data["checkpoint"]["dir"] = f"${{oc.env:HOME}}/{REMOTE_ROOT}/checkpoints/{cell_cfg.run.name}/{cell}"
    return OmegaConf.to_yaml(OmegaConf.create(data))


def q(s: str) -> str:
    return shlex.quote(s)


class Commands:
    """Every gcloud command of a cell, as argv lists."""

    def __init__(self, cfg: Config, version: str, cell: str):
        self.cfg, self.t = cfg, cfg.tpu
        self.node = cfg.tpu.name
        self.remote_dir = f"{REMOTE_ROOT}/{version}"
        self.archive = f"scaleout-{version}.tar.gz"
        self.cell_rel = remote_cell_path(cfg, cell)  # relative to remote_dir
        self.remote_cell = f"{self.remote_dir}/{self.cell_rel}"
        self.job_dir = f"{self.cell_rel}/{JOB_DIR}"  # relative to remote_dir
        self.python = python_of(cfg)

    # ------------------------------------------------------------------ gcloud

    def tpus(self, *args: str, alpha: bool = False) -> List[str]:
        """`gcloud [alpha] compute tpus ARGS...`"""
        return [self.t.gcloud, *(["alpha"] if alpha else []), "compute", "tpus", *args]

    def scope(self) -> List[str]:
        return [f"--zone={zone(self.cfg)}"] + ([f"--project={self.t.project}"] if self.t.project else [])

    def create(self) -> List[str]:
        s = slice_of(self.cfg)
        return self.tpus("queued-resources", "create", self.node, f"--node-id={self.node}",
                         f"--accelerator-type={s.accelerator_type}", f"--runtime-version={runtime_version(self.cfg)}",
                         *self.scope(), *CAPACITY_FLAGS[self.t.capacity], f"--valid-until-duration={valid_until(self.cfg)}",
                         *self.t.create_args, alpha=self.t.capacity in ALPHA_CAPACITY)

    def _vm(self, *args: str, last: Sequence[str] = ()) -> List[str]:
        """`gcloud [alpha] compute tpus tpu-vm ssh|scp ARGS --zone.. [tpu.ssh_args] LAST` (alpha when one of
        tpu.ssh_args exists only there)."""
        extra = list(self.t.ssh_args)
        alpha = any(a.split("=", 1)[0] in ALPHA_SSH_FLAGS for a in extra)
        return self.tpus("tpu-vm", *args, *self.scope(), *extra, *last, alpha=alpha)

    def describe_queued(self) -> List[str]:
        return self.tpus("queued-resources", "describe", self.node, *self.scope(), "--format=value(state.state)")

    def delete(self) -> List[str]:
        return self.tpus("queued-resources", "delete", self.node, *self.scope(), "--force", "--quiet")

    def describe_vm(self) -> List[str]:
        return self.tpus("tpu-vm", "describe", self.node, *self.scope(), "--format=json")

    def ssh(self, worker: str, command: str) -> List[str]:
        return self._vm("ssh", self.node, f"--worker={worker}", last=[f"--command={command}"])

    def scp_to(self, worker: int, local: str, remote: str, recurse: bool = False) -> List[str]:
        """Copy to ONE worker. `--worker=all` with several workers makes gcloud check that an ssh-agent that
        is running holds its key (VerifyKeyInAgent) and fail otherwise; one scp per worker, run in
        parallel, never asks (what MaxText's multihost_runner does)."""
        return self._vm("scp", local, f"{self.node}:{remote}", f"--worker={worker}", last=["--recurse"] if recurse else [])

    def ship_code(self, local: str, workers: int) -> List[List[str]]:
        """The code archive to every worker, one scp each (run concurrently)."""
        return [self.scp_to(i, local, self.archive) for i in range(workers)]

    def ship_inputs(self, workers: int) -> List[List[str]]:
        """The cell's input files (launch.targets.tpu.inputs) to every worker: mkdir, then one scp per file and worker."""
        items = tpu_inputs.shipped(self.cfg)
        if not items:
            return []
        dirs = sorted({str(Path(REMOTE_ROOT, it.remote).parent) for it in items})
        out = [self.ssh("all", shlex.join(["mkdir", "-p", *dirs]))]
        for it in items:
            remote = f"{REMOTE_ROOT}/{it.remote}"
            out += [self.scp_to(i, it.local, str(Path(remote).parent) if it.recurse else remote, recurse=it.recurse)
                    for i in range(workers)]
        return out

    def copy_back(self, remote: str, local: str, worker: int = 0, recurse: bool = False) -> List[str]:
        return self._vm("scp", f"{self.node}:{remote}", local, f"--worker={worker}", last=["--recurse"] if recurse else [])

    # ------------------------------------------------------------------ remote scripts

    def _in_code(self, script: str) -> str:
        return f"cd {q(self.remote_dir)} || exit 1; {script}"

    def unpack_and_setup(self) -> List[str]:
        steps = [shlex.join(["mkdir", "-p", self.remote_dir]), shlex.join(["tar", "-xzf", self.archive, "-C", self.remote_dir]),
                 shlex.join(["cd", self.remote_dir])] + [one_command(s) for s in setup_of(self.cfg)]
        return self.ssh("all", " && ".join(steps))

    def check_python(self) -> List[str]:
        """One sentence and exit 2 unless tpu.python exists on every worker and is new enough."""
        py = self.python
        missing = (f"[scaleout] error: tpu.python={py} is not on the workers; keep the default tpu.setup, "
                   "which creates it, or install that interpreter in tpu.setup.")
        old = (f"[scaleout] error: tpu.python={py} is Python @VERSION@ on the workers, but scaleout needs Python {_NEED} or newer; "
               f"keep the default tpu.setup and tpu.python (a Python {_NEED} venv made with uv) or point tpu.python at a "
               f"Python {_NEED}+ interpreter.")
        code = (f"import sys; v = sys.version_info[:2]; "
                f'sys.exit(0 if v >= {MIN_PYTHON!r} else {json.dumps(old)}.replace("@VERSION@", "%d.%d" % v))')
        return self.ssh("all", self._in_code(
            f"command -v {shell.word(py)} >/dev/null 2>&1 || {{ echo {q(missing)} >&2; exit 2; }}; {shell.word(py)} -c {q(code)}"))

    def free_chips(self) -> List[str]:
        """What MaxText's runner does: kill whatever holds the TPU chips, wait until it is gone, remove
        libtpu's lock file (on v5e and later the chips are /dev/vfio/*, before that /dev/accel*)."""
        script = "; ".join([
            "shopt -s nullglob",
            f'R="${{{SYSROOT_ENV}:-}}"',
            'devs=("$R"/dev/accel* "$R"/dev/vfio/*)',
            'pids=""',
            '[ ${#devs[@]} -eq 0 ] || pids=$(sudo lsof -t -w "${devs[@]}" 2>/dev/null | sort -u)',
            'for p in $pids; do echo "freeing the TPU chips: killing PID $p: $(ps -o args= -p "$p" 2>/dev/null | cut -c1-160)"; '
            'sudo kill -9 "$p" 2>/dev/null; done',
            'for p in $pids; do timeout 60 tail --pid="$p" -f /dev/null; done',
            'sudo rm -f "$R"/tmp/libtpu_lockfile',
            "true",
        ])
        return self.ssh("all", script)

    def job_file(self, job: str, ext: str) -> str:
        return f"{self.job_dir}/{job}.{ext}"  # relative to remote_dir

    def start(self, job: str, hosts: Optional[Sequence[str]] = None) -> List[List[str]]:
        """Start the trainer on every worker in its own session, detached from ssh: the session
        leader records its PID, ignores SIGTERM itself (so it outlives a stop and records the exit
        status) and runs the trainer with default signal handling.

        JAX: one `--worker=all` ssh, one process per worker (jax.distributed finds the slice).
        PyTorch: one ssh per worker (run concurrently), each starting `torchrun` with one process per
        chip and the environment TorchTPU's `python -m torch.tpu.distributed` would compute for that
        worker (launch.core.torch_tpu_env), `hosts` being the workers' internal IPs in worker order."""
        if self.cfg.framework != "torch":
            return [self._start_on("all", job, {}, ["-m", "jaxrun"])]
        s = slice_of(self.cfg)
        hosts = list(hosts or [f"<worker-{i}-ip>" for i in range(s.workers)])
        per_host = s.chips // s.workers
        out = []
        for i in range(s.workers):
            env = torch_tpu_env.launch_env(hosts, per_host, i, master_port=torch_tpu_env.master_port(job),
                                           session=torch_tpu_env.session_id(job))
            out.append(self._start_on(str(i), job, env, torch_tpu_env.torchrun_args(env) + ["-m", "torchrun_fsdp"]))
        return out

    def _start_on(self, worker: str, job: str, extra_env: Dict[str, str], program: List[str]) -> List[str]:
        pid, exit_, log = (q(self.job_file(job, e)) for e in ("pid", "exit", "log"))
        env = {envvars.DISTRIBUTED: "tpu", "PYTHONUNBUFFERED": "1",
               envvars.LOG_LEVEL: os.environ.get(envvars.LOG_LEVEL, "INFO"), **extra_env}
        trainer = shell.word(self.python) + " " + shlex.join([*program, "--config", f"{self.cell_rel}/{CONFIG_NAME}"])
        leader = "; ".join([f"echo $$ > {pid}", "trap '' TERM",
                            f"( trap - TERM; exec env {' '.join(f'{k}={q(v)}' for k, v in env.items())} {trainer} )",
                            f"echo $? > {exit_}.tmp", f"mv {exit_}.tmp {exit_}"])
        return self.ssh(worker, self._in_code(
            f"mkdir -p {q(self.job_dir)} || exit 1; rm -f {pid} {exit_}; "
            f"setsid nohup bash -c {q(leader)} > {log} 2>&1 < /dev/null & echo started"))

    def follow(self, worker: int, job: str, offset: str = "1") -> List[str]:
        """Stream a worker's trainer log from byte `offset` until the trainer ends; the last stderr
        line is `scaleout-exit: <status>` (a number, `none` if it was killed outright, `nostart`)."""
        pid, exit_, log = (q(self.job_file(job, e)) for e in ("pid", "exit", "log"))
        script = "; ".join([
            f"i=0; while [ ! -s {pid} ] && [ $i -lt {START_WAIT_S * 10} ]; do sleep 0.1; i=$((i+1)); done",
            f"[ -s {pid} ] || {{ echo '{EXIT_MARK} nostart' >&2; exit 0; }}",
            f'tail -c +{offset} -s 0.5 --pid="$(cat {pid})" -f {log}',
            f"if [ -f {exit_} ]; then echo \"{EXIT_MARK} $(cat {exit_})\" >&2; else echo '{EXIT_MARK} none' >&2; fi",
        ])
        return self.ssh(str(worker), self._in_code(script))

    def probe(self, job: str) -> List[str]:
        """One line per worker: `scaleout-job: running | exit N | none | gone`."""
        pid, exit_ = (q(self.job_file(job, e)) for e in ("pid", "exit"))
        script = (f"cd {q(self.remote_dir)} 2>/dev/null || {{ echo '{STATE_MARK} gone'; exit 0; }}; "
                  f"if [ -f {exit_} ]; then echo \"{STATE_MARK} exit $(cat {exit_})\"; "
                  f"elif [ -s {pid} ] && kill -0 \"$(cat {pid})\" 2>/dev/null; then echo '{STATE_MARK} running'; "
                  f"else echo '{STATE_MARK} none'; fi")
        return self.ssh("all", script)

    def stop(self, job: str) -> List[str]:
        """SIGTERM every worker's trainer session (it stops after the current step), SIGKILL what is
        left after STOP_GRACE_S. Only the job's own process group is touched: nothing is signalled once the
        job has recorded its exit, or when the recorded PID now belongs to another process (PIDs are reused)."""
        pid, exit_ = q(self.job_file(job, "pid")), q(self.job_file(job, "exit"))
        script = "; ".join([
            f"cd {q(self.remote_dir)} 2>/dev/null || exit 0",
            f"[ -s {pid} ] && [ ! -f {exit_} ] || exit 0",
            f"p=$(cat {pid})",
            f"grep -qaF -- {q(self.job_file(job, 'pid'))} /proc/$p/cmdline 2>/dev/null || exit 0",
            'kill -TERM -- "-$p" 2>/dev/null || exit 0',
            f'i=0; while kill -0 -- "-$p" 2>/dev/null && [ $i -lt {STOP_GRACE_S * 10} ]; do sleep 0.1; i=$((i+1)); done',
            'kill -KILL -- "-$p" 2>/dev/null; exit 0',
        ])
        return self.ssh("all", script)


# --------------------------------------------------------------------------- the code archive

def project_root() -> Path:
    return Path(__file__).resolve().parents[3]


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
    cfg_text = remote_config_text(cell_cfg, cell_name)
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
    path = out_dir / f"scaleout-{version}.tar.gz"
    files.atomic_write(path, buf.getvalue())
    return path, version

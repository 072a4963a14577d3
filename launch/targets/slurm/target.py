"""The SLURM target, through submitit.

One task per device: `tasks_per_node = min(devices, slurm.devices_per_node)`, `nodes = devices /
tasks_per_node`. Each task runs `launch.targets.slurm.job.CellJob`. Cells with the same resource
shape go into one job array (`executor.batch()`); job ids are recorded in `<run>/jobs.json`
(`launch.targets.slurm.queue`).

One code path renders and submits: `build_executor(cfg, folder)` makes the submitit executor
both for `scaleout plan` (which prints the script the executor renders) and for submission, and
before anything is written `sbatch --test-only` is asked whether the cluster would take that
script, so a refusal is one sentence from sbatch itself and nothing has been submitted.

Everything that lands in the sbatch script is checked or quoted: submitit quotes `#SBATCH`
values; names must be one line of SLURM-name characters; each `slurm.setup` entry becomes exactly
one command whose words are quoted (no `;`, `$(...)` or expansion reaches the shell).
"""

from __future__ import annotations

import logging
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from launch.common import files
from launch.config import ConfigError
from launch.config.schema import Config
from launch.targets import shell
from launch.targets.base import Cell, JobInfo, Outcome
from launch.targets.errors import SubmitError
from launch.targets.slurm import queue, submitit_api

log = logging.getLogger(__name__)
NAME_RE = re.compile(r"[A-Za-z0-9_.,:=+@%/\-\[\]&|*!]+")  # partitions, accounts, QOS, constraints, features
KEY_RE = re.compile(r"[a-z][a-z0-9_-]*")
FOLDER = files.SLURM_DIR  # <run>/slurm/<job id>/: submitit's files, the tasks' logs and outcomes


# --------------------------------------------------------------------------- validation + parameters

def _check_name(key: str, value: Optional[str]) -> None:
    if value is not None and not NAME_RE.fullmatch(str(value)):
        raise ConfigError(f"{key}={value!r} is not valid: SLURM names are one line of letters, digits and -_.,:=+@%/[]&|*! "
                          "(no spaces, quotes, ;, $ or newlines).")


def shape(cfg: Config) -> Tuple[int, int]:
    """(nodes, tasks_per_node) for one task per device."""
    per_node = min(cfg.devices, cfg.slurm.devices_per_node)
    if cfg.devices % per_node:
        raise ConfigError(f"devices={cfg.devices} does not fill whole nodes of slurm.devices_per_node={cfg.slurm.devices_per_node}; "
                          f"use a multiple of {per_node} or change slurm.devices_per_node.")
    return cfg.devices // per_node, per_node


shell_word = shell.word  # `~/...` still expands on the node


def setup_lines(cfg: Config) -> List[str]:
    """Each `slurm.setup` entry as exactly one command with its words quoted (`~/...` still expands);
    then `source` of `slurm.setup_script`, the user's own file, run verbatim."""
    lines = []
    for i, entry in enumerate(cfg.slurm.setup):
        try:
            words = shlex.split(entry)
        except ValueError as e:
            raise ConfigError(f"slurm.setup[{i}]={entry!r} is not valid: {e}; write one command per entry.") from None
        if words:
            lines.append(" ".join(shell_word(w) for w in words))
    if cfg.slurm.setup_script:
        lines.append(f"source {shell_word(cfg.slurm.setup_script)}")
    return lines


def gpu_request(cfg: Config) -> Dict[str, Any]:
    """The GPUs a cell asks for: one per task on each node it uses (never a whole node's for a small cell)."""
    s = cfg.slurm
    if not s.gpus_per_node:
        return {}
    _, per_node = shape(cfg)
    if s.gpus_per_node < per_node:
        raise ConfigError(f"slurm.gpus_per_node={s.gpus_per_node} is less than the {per_node} tasks per node this cell runs "
                          f"(one per device, slurm.devices_per_node={s.devices_per_node}); set slurm.devices_per_node={s.gpus_per_node} "
                          "or fewer so every task has its own GPU.")
    return {"gpus_per_task": 1} if s.gpu_binding == "task" else {"gpus_per_node": per_node}


# sbatch options scaleout sets itself (or must not be changed behind its back), as slurm.additional keys
# (dashes as underscores), with what decides them instead. sbatch takes any unambiguous prefix of a long
# option, so a key that is a prefix of one of these is refused too.
OWN_OPTIONS = {
    **dict.fromkeys(("nodes", "ntasks", "ntasks_per_node", "ntasks_per_core", "ntasks_per_socket", "ntasks_per_gpu",
                     "array"), "devices and slurm.devices_per_node (one task per device; a sweep's cells of one shape "
                               "share a job array)"),
    **dict.fromkeys(("gpus", "gpus_per_node", "gpus_per_task", "gpus_per_socket", "gres", "cpus_per_gpu"),
                    "slurm.gpus_per_node and slurm.gpu_binding"),
    "cpus_per_task": "slurm.cpus_per_task",
    **dict.fromkeys(("mem", "mem_per_cpu", "mem_per_gpu"), "slurm.mem_gb"),
    "time": "slurm.time_min", "signal": "slurm.signal_delay_s", "job_name": "run.name",
    **dict.fromkeys(("partition", "account", "qos", "constraint", "exclusive", "wckey"), "slurm.{key}"),
    **dict.fromkeys(("requeue", "no_requeue"), "scaleout itself (it submits with --requeue so that a preempted or "
                                               "timed-out job resumes from its checkpoint)"),
    **dict.fromkeys(("output", "error", "open_mode", "wrap", "parsable", "test_only"),
                    "scaleout itself (where the tasks' logs go, what is run)"),
}


def _additional(s: Any) -> Dict[str, Any]:
    """slurm.additional as submitit's additional_parameters: keys checked against OWN_OPTIONS, true as a bare
    flag, false and null left out (sbatch's meaning: the option not given)."""
    extra: Dict[str, Any] = {}
    for k, v in s.additional.items():
        if not KEY_RE.fullmatch(str(k)):
            raise ConfigError(f"slurm.additional key {k!r} is not valid: sbatch options are lower-case words like 'reservation'.")
        norm = str(k).replace("-", "_")
        own = next((o for o in OWN_OPTIONS if o == norm), None) or next((o for o in OWN_OPTIONS if o.startswith(norm)), None)
        if own:
            by = OWN_OPTIONS[own].format(key=own)
            raise ConfigError(f"slurm.additional.{k} is not valid: scaleout sets --{own.replace('_', '-')} itself, from {by}; "
                              "remove it from slurm.additional.")
        if v is None or v is False:
            continue
        if isinstance(v, (list, dict)):
            raise ConfigError(f"slurm.additional.{k}={v!r} is not valid: give a string, a number, or true for a flag "
                              "(false or null leaves the option out).")
        if v is not True:
            _check_name(f"slurm.additional.{k}", str(v))
        extra[k] = v
    return extra


def executor_params(cfg: Config) -> Dict[str, Any]:
    """The parameters of submitit's SlurmExecutor for this cell (sbatch's own names)."""
    s = cfg.slurm
    for key in ("partition", "account", "qos", "constraint"):
        _check_name(f"slurm.{key}", getattr(s, key))
    extra = _additional(s)
    _python(cfg)
    nodes, per_node = shape(cfg)
    params: Dict[str, Any] = {
        "job_name": f"scaleout-{cfg.run.name}",
        "time": s.time_min,
        "nodes": nodes,
        "ntasks_per_node": per_node,
        "cpus_per_task": s.cpus_per_task,
        # SLURM >= 22.05 no longer passes sbatch's --cpus-per-task on to srun: give it to the step too.
        # --kill-on-bad-exit: a task that fails ends the step, instead of its peers waiting in a collective
        # for the job's time limit (srun's default unless the cluster sets KillOnBadExit).
        "srun_args": [f"--cpus-per-task={s.cpus_per_task}", "--kill-on-bad-exit=1"],
        "setup": setup_lines(cfg),
        **gpu_request(cfg),
    }
    if s.mem_gb:
        params["mem"] = f"{s.mem_gb}GB"
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(s, key):
            params[key] = getattr(s, key)
    if s.exclusive:
        params["exclusive"] = True
    params["signal_delay_s"] = s.signal_delay_s
    params["wckey"] = s.wckey or None  # None: no --wckey line (submitit would send --wckey=submitit)
    # --requeue: on a cluster with JobRequeue=0 a job is otherwise not requeueable, and submitit's
    # `scontrol requeue` after USR2 fails: the job would end at its time limit instead of resuming.
    params["additional_parameters"] = {"requeue": True, **extra}
    return params


def resource_key(cfg: Config) -> str:
    """Cells with equal keys can share one job array: the same sbatch parameters, and the same executor settings
    besides them (the interpreter, the requeue budget), which an array has once for all its cells."""
    p = executor_params(cfg)
    p.pop("job_name", None)
    p.update(python=_python(cfg), max_requeues=cfg.slurm.max_requeues)
    return repr(sorted(p.items()))


def _python(cfg: Config) -> str:
    """The interpreter the tasks run: slurm.python (a leading ~/ expands on the node) or this one."""
    if cfg.slurm.python:
        shell.check_interpreter("slurm.python", cfg.slurm.python)
        return shell.word(cfg.slurm.python)
    return shlex.quote(sys.executable)


def build_executor(cfg: Config, folder: Path):
    """The submitit executor of a cell: used to render the plan and to submit (one code path)."""
    ex = submitit_api.executor(folder, cfg.slurm.max_requeues, _python(cfg))
    ex.update_parameters(**executor_params(cfg))
    return ex


def render_script(cfg: Config, folder: Path) -> str:
    """The sbatch script the cell's executor submits (submitit's own rendering of it)."""
    return submitit_api.render(build_executor(cfg, folder))


def check_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch is not on PATH: target=slurm must run on a SLURM login node (or use target=local).")


def sbatch_refusal(text: str) -> str:
    """The most telling line of sbatch's complaint."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    errors = [l for l in lines if l.lower().startswith("sbatch: error") and "submission failed" not in l.lower()]
    failures = [l for l in lines if l.lower().startswith(("allocation failure", "sbatch: error"))]
    return (errors or failures or lines or ["no reason given"])[0]


GRES_ITEM = re.compile(r"gpu(?::[^:(),]+)?:(\d+)(?:\([^()]*\))?")  # gpu:4, gpu:a100:4, gpu:a100:4(S:0,2)


def gres_gpus(gres: str) -> int:
    """The GPUs one node's `sinfo -o %G` entry names (`gpu:a100:4(S:0,2),nvme:1` -> 4); commas inside a socket
    list `(S:0,2)` do not separate entries."""
    return sum(int(m.group(1)) for m in (GRES_ITEM.fullmatch(item.strip()) for item in re.split(r",(?![^()]*\))", gres)) if m)


def sinfo_cpus(field: str) -> int:
    """sinfo's %c: `2`, or `8+` when the nodes differ (the smallest count, then `+`)."""
    digits = field.strip().rstrip("+")
    return int(digits) if digits.isdigit() else 0


def parse_shape(text: str, partition: Optional[str]) -> Tuple[int, int, int]:
    """(nodes, the most GPUs on one node, the most CPUs on one node) from `sinfo -h -o %D|%G|%P|%c` lines;
    without a partition only the default one (marked *) counts."""
    nodes = gpus = cpus = 0
    for line in text.splitlines():
        count, gres, part, cpu = (line.strip().split("|") + ["", "", ""])[:4]
        if not partition and not part.endswith("*"):
            continue  # without slurm.partition the job goes to the default partition (marked *)
        nodes += int(count) if count.isdigit() else 0
        gpus = max(gpus, gres_gpus(gres))
        cpus = max(cpus, sinfo_cpus(cpu))
    return nodes, gpus, cpus


def partition_shape(partition: Optional[str]) -> Optional[Tuple[int, int, int]]:
    """(nodes, the most GPUs (GRES gpu) on one node, the most CPUs on one node) of the partition, or of the
    default one, per `sinfo`; None when sinfo cannot tell."""
    argv = ["sinfo", "-h", "-o", "%D|%G|%P|%c"] + (["-p", partition] if partition else [])
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode or not p.stdout.strip():
        return None
    return parse_shape(p.stdout, partition)


def check_partition(cfg: Config) -> None:
    """Nodes, CPUs and GPUs asked for against what the partition has, in words that name the keys
    (sbatch would say "Requested node configuration is not available", or queue the job forever)."""
    shape_now = partition_shape(cfg.slurm.partition)
    if shape_now is None:
        return
    have_nodes, have_gpus, have_cpus = shape_now
    nodes, per_node = shape(cfg)
    where = f"partition {cfg.slurm.partition}" if cfg.slurm.partition else "the default partition"
    if have_nodes and nodes > have_nodes:
        raise SubmitError(f"devices={cfg.devices} needs {nodes} nodes of slurm.devices_per_node={cfg.slurm.devices_per_node} "
                          f"but {where} has {have_nodes}; use fewer devices or more tasks per node.")
    if gpu_request(cfg):
        check_gpus(cfg, where, have_gpus, per_node)
    want_cpus = cfg.slurm.cpus_per_task * per_node
    if have_cpus and want_cpus > have_cpus:
        fit = have_cpus // per_node
        fix = (f"set slurm.cpus_per_task={fit}" if fit >= 1 else
               f"set slurm.cpus_per_task=1 and slurm.devices_per_node={have_cpus} or fewer")
        raise SubmitError(f"slurm.cpus_per_task={cfg.slurm.cpus_per_task} x {per_node} task(s) per node needs {want_cpus} CPUs "
                          f"on each node but the nodes of {where} have at most {have_cpus} (sinfo); {fix}.")


def check_gpus(cfg: Config, where: str, have_gpus: int, per_node: int) -> None:
    if have_gpus == 0:
        raise SubmitError(f"slurm.gpus_per_node={cfg.slurm.gpus_per_node} but the nodes of {where} have no GPUs (GRES gpu) "
                          "according to sinfo; pick a GPU partition with slurm.partition=... or set slurm.gpus_per_node=0.")
    if have_gpus < per_node:
        raise SubmitError(f"slurm.gpus_per_node={cfg.slurm.gpus_per_node}: this cell needs {per_node} GPUs on each node but the "
                          f"nodes of {where} have at most {have_gpus}; set slurm.devices_per_node={have_gpus} (and slurm.gpus_per_node={have_gpus}).")


def sinfo_minutes(limit: str) -> Optional[int]:
    """sinfo's %l (`30:00`, `2:00:00`, `1-12:00:00`, `infinite`) in whole minutes, rounded up; None = no limit."""
    days, _, clock = limit.strip().rpartition("-")
    parts = clock.split(":")
    if (days and not days.isdigit()) or not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3:
        return None
    h, m, s = ((0, int(parts[0]), 0) if len(parts) == 1 else (0, int(parts[0]), int(parts[1])) if len(parts) == 2
               else tuple(int(p) for p in parts))
    return (int(days or 0) * 24 + h) * 60 + m + (1 if s else 0)


def partition_limits(partition: Optional[str]) -> Optional[Tuple[Optional[int], Optional[int]]]:
    """(MaxTime in minutes, MaxNodes per job) of the partition, or of the default one; None = sinfo cannot tell."""
    argv = ["sinfo", "-h", "-o", "%l|%s|%P"] + (["-p", partition] if partition else [])
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode:
        return None
    for line in p.stdout.splitlines():
        limit, size, part = (line.strip().split("|") + ["", ""])[:3]
        if partition or part.endswith("*"):
            top = size.strip().rpartition("-")[2]  # %s: `1-infinite`, `1-4`, `2`
            return sinfo_minutes(limit), (int(top) if top.isdigit() else None)
    return None


def check_partition_limits(cfg: Config) -> None:
    """MaxTime and MaxNodes: SLURM (EnforcePartLimits=NO, the default) accepts a job over them and leaves it
    pending forever."""
    limits = partition_limits(cfg.slurm.partition)
    if limits is None:
        return
    max_time, max_nodes = limits
    where = f"partition {cfg.slurm.partition}" if cfg.slurm.partition else "the default partition"
    if max_time is not None and cfg.slurm.time_min > max_time:
        raise SubmitError(f"slurm.time_min={cfg.slurm.time_min} is more than the {max_time} minutes {where} allows (MaxTime), "
                          f"so SLURM would leave the job pending forever; set slurm.time_min={max_time} or less.")
    nodes, _ = shape(cfg)
    if max_nodes is not None and nodes > max_nodes:
        raise SubmitError(f"devices={cfg.devices} needs {nodes} nodes of slurm.devices_per_node={cfg.slurm.devices_per_node} "
                          f"but {where} takes at most {max_nodes} per job (MaxNodes); use fewer devices or more tasks per node.")


def check_setup_script(cfg: Config) -> None:
    path = cfg.slurm.setup_script
    if path and not Path(path).expanduser().is_file():
        raise SubmitError(f"slurm.setup_script={path!r} does not exist here; give a file on the shared filesystem "
                          "(it is sourced on the first node of every job).")


def test_submit(cfg: Config, folder: Path, cell: str) -> None:
    """`sbatch --test-only` on the cell's script: the cluster's verdict, nothing submitted."""
    with tempfile.TemporaryDirectory(prefix="scaleout-sbatch-") as tmp:
        script = Path(tmp) / "job.sh"
        script.write_text(render_script(cfg, folder))
        p = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60)
    if p.returncode:
        raise SubmitError(f"sbatch refused the job for cell {cell}: {sbatch_refusal(p.stderr + p.stdout)}")


# --------------------------------------------------------------------------- what became of a job

OUTCOME_STATES = {"ok": "COMPLETED", "stopped": "COMPLETED", "failed": "FAILED", "timed out": "TIMEOUT"}


def _tasks(run_dir: Path, cell: str) -> int:
    """The cell's tasks (one per device), from its config; 1 when that cannot be read."""
    from launch import config as config_mod
    try:
        return max(1, config_mod.load_resolved(Path(run_dir) / cell / files.CONFIG_NAME).devices)
    except ConfigError:
        return 1


def ended_job(run_dir: Path, cell: str, job_id: str, final: Optional[str], cancelled: bool, requeues: int) -> JobInfo:
    """A job that left the queue, judged from accounting (`final`, if it works) and what its tasks wrote:
    their JSON outcomes or, for tasks that failed before Python started, the error lines of their logs."""
    tasks = _tasks(run_dir, cell)
    outcomes = [queue.outcome(run_dir, job_id, t) for t in range(tasks)]
    first = outcomes[0] or next((o for o in outcomes if o), None)
    errors = [str(o["error"]) for o in outcomes if o and o["state"] == "failed" and o.get("error")]
    timed_out = bool(first) and first["state"] == "timed out"
    if first is None and not cancelled:
        errors = queue.log_errors(run_dir, job_id, tasks)
    if cancelled:
        word = "CANCELLED"
    elif first is None:
        word = "FAILED" if errors else "ENDED"
    else:
        word = OUTCOME_STATES.get(first["state"], "ENDED")
        word = "FAILED" if errors and word == "COMPLETED" else word
    return JobInfo(job_id, final or word, False, requeues=requeues, timed_out=timed_out,
                   error=[] if timed_out else list(dict.fromkeys(errors))[-4:])


# --------------------------------------------------------------------------- the target

class SlurmTarget:
    name = "slurm"

    def __init__(self) -> None:
        self._tested: set = set()  # resource shapes sbatch --test-only already accepted

    def validate(self, cfg: Config) -> None:
        executor_params(cfg)

    def preflight(self, cfg: Config) -> None:
        check_sbatch()
        check_setup_script(cfg)
        check_partition(cfg)
        check_partition_limits(cfg)
        key = resource_key(cfg)
        if key not in self._tested:
            test_submit(cfg, Path(tempfile.gettempdir()) / FOLDER / "%j", f"{cfg.framework}-d{cfg.devices}")
            self._tested.add(key)

    def plan_commands(self, cfg: Config, cell_dir: Path) -> List[str]:
        return [render_script(cfg, cell_dir.parent / FOLDER / "%j")]

    def run(self, cells: Sequence[Cell], run_dir: Path) -> List[Outcome]:
        ids = submit(cells, run_dir)
        for name, job_id in ids.items():
            log.info(f"cell {name}: submitted as SLURM job {job_id}" + (", waiting for it (slurm.wait=true)" if cells[0].cfg.slurm.wait else ""))
        cfg = cells[0].cfg
        if not cfg.slurm.wait:
            return [Outcome(c.name, "submitted", 0, f"job {ids[c.name]}") for c in cells]
        self.wait(run_dir)
        jobs = self.jobs(run_dir)
        out = []
        for c in cells:
            s = files.last_summary(c.dir) or {}
            ok = s.get("status") == "ok" and (s.get("steps") or 0) >= c.cfg.train.steps
            out.append(Outcome(c.name, "ok" if ok else "failed", 0 if ok else 1, jobs[c.name].state if c.name in jobs else ""))
        return out

    def jobs(self, run_dir: Path) -> Dict[str, JobInfo]:
        recorded = queue.read_jobs(run_dir)
        ids = [j["job_id"] for j in recorded.values()]
        live = queue.squeue_states(ids)
        gone = [i for i in ids if i not in live]
        final = queue.sacct_states(gone)
        out = {}
        for name, j in recorded.items():
            job_id = j["job_id"]
            requeues = files.read_int(Path(run_dir) / name / files.REQUEUES_FILE)
            if job_id in live:
                state = live[job_id]
                out[name] = JobInfo(job_id, state, True, pending=state.split()[0] in queue.LIVE_PENDING, requeues=requeues)
                continue
            out[name] = ended_job(run_dir, name, job_id, final.get(job_id), j["cancelled"], requeues)
        return out

    def log_files(self, run_dir: Path, cell: str) -> List[Path]:
        j = queue.read_jobs(run_dir).get(cell)
        if not j:
            return []
        paths: List[Path] = []
        for job_id in j["history"]:
            paths += queue.log_paths(run_dir, job_id, _tasks(run_dir, cell))
        return paths

    def cancel(self, run_dir: Path, cells: Sequence[str]) -> Dict[str, str]:
        jobs = self.jobs(run_dir)
        live = {c: jobs[c].job_id for c in cells if c in jobs and jobs[c].live}
        queue.scancel(list(live.values()))
        queue.mark_cancelled(run_dir, list(live))
        out = {c: f"cancelled job {live[c]}" for c in live}
        out.update({c: f"job {jobs[c].job_id} had already ended ({jobs[c].state})" for c in cells if c in jobs and c not in live})
        return out

    def wait(self, run_dir: Path, poll_s: float = 5.0, timeout_s: Optional[float] = None) -> None:
        start = time.monotonic()
        ids = [j["job_id"] for j in queue.read_jobs(run_dir).values()]
        while queue.squeue_states(ids):
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise TimeoutError(f"jobs of {run_dir} still queued after {timeout_s:.0f} s")
            time.sleep(poll_s)


def submit(cells: Sequence[Cell], run_dir: Path) -> Dict[str, str]:
    """Submit every cell; cells of one resource shape share a job array. Returns {cell: job id}."""
    from launch.targets.slurm.job import CellJob
    check_sbatch()
    groups: Dict[str, List[Cell]] = {}
    for c in cells:
        groups.setdefault(resource_key(c.cfg), []).append(c)
    folder = Path(run_dir) / FOLDER / "%j"
    ids: Dict[str, str] = {}
    try:
        for group in groups.values():
            ex = build_executor(group[0].cfg, folder)
            try:
                with ex.batch():
                    jobs = [ex.submit(CellJob(str(c.dir), c.framework, c.cfg.slurm.signal_delay_s)) for c in group]
            except Exception as e:  # submitit wraps sbatch's refusal (FailedJobError / CalledProcessError)
                raise SubmitError(f"sbatch refused the job for cell(s) {', '.join(c.name for c in group)}: "
                                  f"{sbatch_refusal(str(e))}") from None
            ids.update({c.name: job.job_id for c, job in zip(group, jobs)})
    finally:
        if ids:
            queue.record(run_dir, ids)
    return ids

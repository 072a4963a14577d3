"""Two nodes, two tasks each: GPU selection (launch.core.gpus) and the SLURM target end to end on the `gpu` partition.

The first part needs no cluster: `launch.core.gpus` decided from plain environments, for every way a task can be given
its GPUs. The rest runs on the 2-node cluster of scripts/slurm-local.sh (partition `gpu`: nodes n1, n2, two CPUs and
two fake GPUs each), from inside real SLURM tasks and through the CLI as a user runs it:

- what each trainer would select in both binding modes (`--gpus-per-task=1` and `--gpus-per-node=2`);
- a JAX + PyTorch sweep on 4 devices over 2 nodes (no GPU request: the trainers run on the CPU), whose losses
  agree with each other and with a local 4-device run;
- a preempted 2-node cell that is requeued, resumes from its checkpoint and ends with the uninterrupted loss;
- a JAX cell given (fake) GPUs while its jaxlib is CPU-only must fail at once with one sentence.

Skipped with a reason when the cluster is not here; failed instead when CI is set. Every job a test submits is
cancelled in a `finally`.
"""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import in_ci, losses, run_cli, summary

from launch.core import gpus, metrics
from launch.targets.slurm import queue as slurm_queue

PROBE = [sys.executable, str(Path(__file__).resolve().parent / "gpu_probe.py"), "--select"]
GPU_NODES = ["n1", "n2"]
TWO_NODES = ["target=slurm", "slurm.partition=gpu", "slurm.gpus_per_node=0", "slurm.devices_per_node=2",
             "devices=4", "slurm.cpus_per_task=1", "slurm.time_min=20"]
QUEUE_WAIT_S = 600  # a job may queue behind other engineers' jobs on the same two nodes
REQUEUE_WAIT_S = 900  # SLURM holds a requeued job ~30 s here before it starts again
RACE_STEPS = 20  # the preemption test's cell (the trainers hold before HOLD_AT until USR2 arrives)
HOLD_AT = 5
# Asks the trainers to wait before step HOLD_AT until a stop signal arrives, so the test cannot lose the race.
HOLD = f"hold@{HOLD_AT}"


# --------------------------------------------------------------------------- launch.core.gpus, no cluster needed

def slurm_task(localid, visible=None, step=None, **more):
    """The environment of a SLURM task as CellJob hands it to a trainer."""
    env = {"SCALEOUT_DISTRIBUTED": "slurm", "SLURM_LOCALID": str(localid), "SLURM_PROCID": str(localid),
           "PATH": "/nonexistent"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if step is not None:
        env["SLURM_STEP_GPUS"] = step
    env.update(more)
    return env


def test_visible_gpus_follow_cuda_then_slurm_variables():
    assert gpus.visible_gpus({}) == []
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}) == ["0", "1"]
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": " 2, 3 "}) == ["2", "3"]
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8f1c,GPU-77aa"}) == ["GPU-8f1c", "GPU-77aa"]
    assert gpus.visible_gpus({"SLURM_STEP_GPUS": "1"}) == ["1"]
    assert gpus.visible_gpus({"GPU_DEVICE_ORDINAL": "0,1"}) == ["0", "1"]
    # CUDA_VISIBLE_DEVICES wins over SLURM's own list, even when it hides every GPU
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "1", "SLURM_STEP_GPUS": "0,1"}) == ["1"]
    for hidden in ("", "-1", "NoDevFiles"):
        assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": hidden, "SLURM_STEP_GPUS": "0"}) == [], hidden
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == ["0"]  # CUDA stops at the first invalid entry


def test_gpus_per_task_each_task_uses_its_only_gpu():
    """--gpus-per-task=1: every task sees one GPU; local index 0 whatever its local id (issue 12.1)."""
    for localid, gpu in ((0, "0"), (1, "1")):
        env = slurm_task(localid, visible=gpu, step=gpu)
        assert gpus.local_gpu_index(env) == 0
        assert gpus.jax_local_device_ids(env) == [0]  # jax's own SLURM detection would say [localid]
        assert gpus.physical_gpu(env) == gpu


def test_gpus_per_node_each_task_uses_the_gpu_of_its_local_rank():
    for localid in (0, 1):
        env = slurm_task(localid, visible="0,1", step="0,1")
        assert gpus.local_gpu_index(env) == localid
        assert gpus.jax_local_device_ids(env) == [localid]
        assert gpus.physical_gpu(env) == str(localid)
    # indices are positions in the task's own view; physical_gpu names the node's GPU
    env = slurm_task(1, visible="2,3", step="2,3")
    assert (gpus.local_gpu_index(env), gpus.physical_gpu(env)) == (1, "3")
    # a view renumbered by the cgroup (ConstrainDevices): CUDA says 0,1, SLURM's node numbering says 4,5
    env = slurm_task(0, visible="0,1", step="4,5")
    assert (gpus.local_gpu_index(env), gpus.physical_gpu(env)) == (0, "4")


def test_torch_tasks_use_local_rank():
    """A torch task under SLURM carries LOCAL_RANK (= SLURM_LOCALID, from submitit); under torchrun only LOCAL_RANK."""
    env = slurm_task(1, visible="0,1", LOCAL_RANK="1", RANK="3")
    assert gpus.local_gpu_index(env) == 1
    env = {"SCALEOUT_DISTRIBUTED": "local", "LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert gpus.local_gpu_index(env) == 3
    # a local run inside an interactive `srun` shell inherits SLURM_LOCALID=0 for every process: not used
    env = {"SCALEOUT_DISTRIBUTED": "local", "LOCAL_RANK": "2", "SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert gpus.local_gpu_index(env) == 2
    env = {"SCALEOUT_DISTRIBUTED": "local", "SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert gpus.local_rank(env) is None and gpus.local_gpu_index(env) == 0 and gpus.jax_local_device_ids(env) is None
    # the local target's JAX processes: their process id is their local rank
    env = {"SCALEOUT_DISTRIBUTED": "local", "SCALEOUT_PROCESS_ID": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert gpus.jax_local_device_ids(env) == [1]


def test_no_gpu_means_none():
    for env in (slurm_task(1), slurm_task(1, visible=""), slurm_task(0, visible="NoDevFiles"), {"PATH": "/nonexistent"}):
        assert gpus.local_gpu_index(env) is None, env
        assert gpus.jax_local_device_ids(env) is None, env
        assert gpus.physical_gpu(env) is None, env
        assert not gpus.gpus_expected(env), env


def test_unrestricted_process_counts_with_the_framework_or_nvidia_smi(tmp_path):
    """No visibility variable set: the process sees every GPU of the host (device_count, else nvidia-smi -L)."""
    lone = {"PATH": "/nonexistent"}
    assert gpus.local_gpu_index(lone, device_count=4) == 0
    assert gpus.jax_local_device_ids(lone, device_count=4) is None  # a lone JAX process drives all of them
    assert gpus.local_gpu_index({**lone, "LOCAL_RANK": "2"}, device_count=4) == 2
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)'\necho 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2)'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": str(bin_dir), "SCALEOUT_DISTRIBUTED": "slurm", "SLURM_LOCALID": "1"}
    assert len(gpus.nvidia_smi_gpus(env)) == 2
    assert gpus.gpu_count(env) == 2 and gpus.jax_local_device_ids(env) == [1]
    assert gpus.gpus_expected(env)
    assert not gpus.gpus_expected({**env, "CUDA_VISIBLE_DEVICES": ""})  # hidden on purpose
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert gpus.nvidia_smi_gpus(env) == [] and not gpus.gpus_expected(env)


def test_a_rank_past_the_visible_gpus_is_refused():
    with pytest.raises(gpus.GpuBindingError, match=r"local rank 2 of its node but sees only 2 GPUs \(CUDA_VISIBLE_DEVICES=0,1\)"):
        gpus.local_gpu_index(slurm_task(2, visible="0,1"))


def test_several_devices_per_process():
    env = {"SCALEOUT_DISTRIBUTED": "local", "SCALEOUT_PROCESS_ID": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert gpus.jax_local_device_ids(env, devices_per_process=2) == [2, 3]
    with pytest.raises(gpus.GpuBindingError):
        gpus.jax_local_device_ids({**env, "SCALEOUT_PROCESS_ID": "2"}, devices_per_process=2)


def test_check_platform_refuses_cpu_when_gpus_are_there():
    env = slurm_task(1, visible="1", step="1")
    with pytest.raises(RuntimeError) as e:
        gpus.check_platform("jax", "cpu", env)
    msg = str(e.value)
    assert "pip install 'jax[cuda13]==0.10.2'" in msg and "CUDA_VISIBLE_DEVICES=1" in msg
    assert "\n" not in msg and msg.count(". ") == 0 and msg.endswith(".")  # one sentence
    with pytest.raises(RuntimeError, match=r"pip install 'torch==2\.13\.0'"):
        gpus.check_platform("torch", "cpu", env)
    for platform in ("gpu", "cuda", "rocm", "tpu"):
        gpus.check_platform("jax", platform, env)  # on an accelerator: fine
    gpus.check_platform("jax", "cpu", slurm_task(1))  # no GPUs: CPU is right
    gpus.check_platform("jax", "cpu", slurm_task(1, visible=""))  # GPUs hidden on purpose


def test_launch_gpus_imports_no_framework():
    code = "import sys, launch.core.gpus; print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'torch')))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


# --------------------------------------------------------------------------- the 2-node cluster

def _unavailable(msg):
    if in_ci():
        pytest.fail(msg + " (CI is set, so these tests must run: .ci/run starts the cluster)")
    pytest.skip(msg)


@pytest.fixture(scope="module")
def gpu_partition():
    if not all(shutil.which(t) for t in ("sinfo", "srun", "sbatch", "squeue", "scancel")):
        _unavailable("no SLURM here (sinfo/srun/sbatch not on PATH): run `bash scripts/slurm-local.sh start`")
    p = subprocess.run(["sinfo", "-h", "-N", "-p", "gpu", "-o", "%N %T"], capture_output=True, text=True, timeout=60)
    nodes = sorted(line.split()[0] for line in p.stdout.splitlines() if line.strip())
    if p.returncode or nodes != GPU_NODES:
        _unavailable(f"partition gpu is not nodes {GPU_NODES} (sinfo: {p.stdout.strip() or p.stderr.strip()}): "
                     "run `bash scripts/slurm-local.sh start`")
    return True


def _cancel_run_jobs(run_dir: Path) -> None:
    """scancel every job a run recorded (the test's `finally`)."""
    ids = [j["job_id"] for j in slurm_queue.read_jobs(run_dir).values()] if run_dir.is_dir() else []
    live = list(slurm_queue.squeue_states(ids)) if ids else []
    if live:
        subprocess.run(["scancel", *live], capture_output=True)


def _cancel_by_name(name: str) -> None:
    p = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True)
    ids = p.stdout.split()
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True)


def _srun_select(tmp_path, *opts):
    """Every task's probe record (one file per task: long lines from several tasks interleave on srun's stdout)."""
    name = f"test-mn-select-{os.getpid()}"
    out = tmp_path / "select"
    out.mkdir(exist_ok=True)
    try:
        p = subprocess.run(["srun", "-p", "gpu", "-N2", "--ntasks-per-node=2", "--time=5", "-J", name,
                            f"--output={out}/%t.out", f"--error={out}/%t.err", *opts, *PROBE],
                           capture_output=True, text=True, timeout=QUEUE_WAIT_S, cwd=tmp_path)
    finally:
        _cancel_by_name(name)
    logs = "".join(f.read_text() for f in sorted(out.iterdir()))
    assert p.returncode == 0, p.stdout + p.stderr + logs
    recs = [json.loads(line) for f in sorted(out.glob("*.out")) for line in f.read_text().splitlines() if line.startswith("{")]
    assert len(recs) == 4, logs
    return sorted(recs, key=lambda r: int(r["env"]["SLURM_PROCID"]))


def _assert_distinct_gpus(recs, framework):
    pairs = []
    for r in recs:
        s = r["select"][framework]
        assert "error" not in s, (framework, s)
        node = r["env"]["SLURMD_NODENAME"]
        # the selected GPU is one of this node's (fake) device files, and it is the one the task's view names
        assert s["physical_gpu"] is not None and os.path.exists(f"/dev/fakegpu/{node}/gpu{s['physical_gpu']}"), (node, s)
        assert s["visible"][s["local_gpu_index"]] == s["physical_gpu"], s
        pairs.append((node, s["physical_gpu"]))
    assert sorted(pairs) == [(n, g) for n in GPU_NODES for g in ("0", "1")], (framework, pairs)


@pytest.mark.slow
@pytest.mark.parametrize("binding", ["task", "node"])
def test_each_task_selects_its_own_gpu(gpu_partition, tmp_path, binding):
    """From inside real tasks of `srun -N2 --ntasks-per-node=2`, with the environment CellJob gives each trainer:
    every task of both frameworks uses a distinct (node, GPU) pair, in both binding modes (issue 12.1)."""
    recs = _srun_select(tmp_path, "--gpus-per-task=1" if binding == "task" else "--gpus-per-node=2")
    for framework in ("jax", "torch"):
        _assert_distinct_gpus(recs, framework)
    for r in recs:
        localid = int(r["env"]["SLURM_LOCALID"])
        jax_sel, torch_sel = r["select"]["jax"], r["select"]["torch"]
        assert torch_sel["env"]["LOCAL_RANK"] == str(localid)  # submitit's rendezvous, as the torch trainer gets it
        assert jax_sel["env"]["LOCAL_RANK"] is None and jax_sel["env"]["SCALEOUT_DISTRIBUTED"] == "slurm"
        if binding == "task":
            assert len(jax_sel["visible"]) == 1 and jax_sel["jax_local_device_ids"] == [0], r
            assert torch_sel["local_gpu_index"] == 0, r
        else:
            assert jax_sel["visible"] == ["0", "1"] and jax_sel["jax_local_device_ids"] == [localid], r
            assert torch_sel["local_gpu_index"] == localid, r
    # what jax's own SLURM detection would pass ([SLURM_LOCALID]) names a GPU the task does not have
    if binding == "task":
        assert any(int(r["env"]["SLURM_LOCALID"]) >= len(r["select"]["jax"]["visible"]) for r in recs)


def _cli_args(tmp_path, *extra):
    return [f"run.dir={tmp_path}/runs", f"jax.cache_dir={tmp_path}/jc", *TWO_NODES, *extra]


def _records(path: Path):
    return metrics.read(path) if path.is_file() else []


def _steps_written(path: Path) -> int:
    try:
        return path.read_text().count('"kind": "step"')
    except OSError:
        return 0


def _task_placements(run, job):
    """(node, local rank) of every task of a job, from submitit's `Starting with JobEnvironment(...)` log lines."""
    out = []
    for path in slurm_queue.log_paths(run, job["job_id"], 4):
        text = path.read_text() if path.is_file() else ""
        out += [(int(n), int(r)) for r, n in re.findall(r"JobEnvironment\(.*local_rank=(\d+)\(2\), node=(\d+)\(2\)", text)]
    return sorted(out)


@pytest.mark.slow
def test_sweep_of_jax_and_torch_on_two_nodes(gpu_partition, tmp_path):
    """Both frameworks on 4 devices over 2 nodes (2 tasks each): both ok, 4 processes, the same loss as each other and
    as a local 4-device run of the same config."""
    common = ["sweep.devices=[4]", "train.steps=8", "checkpoint.async=false", "checkpoint.every=0"]
    run = tmp_path / "runs" / "mn"
    try:
        p = run_cli(["sweep", *_cli_args(tmp_path, *common, "run.name=mn", "slurm.wait=true")], cwd=tmp_path,
                    timeout=QUEUE_WAIT_S + 600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        _cancel_run_jobs(run)
    jobs = json.loads((run / "jobs.json").read_text())["cells"]
    assert set(jobs) == {"jax-d4", "torch-d4"}
    finals = {}
    for name in jobs:
        s = summary(_records(run / name / "metrics.jsonl"))
        assert s["status"] == "ok" and s["steps"] == 8 and s["processes"] == 4, (name, s)
        finals[name] = s["final_loss"]
    np.testing.assert_allclose(finals["jax-d4"], finals["torch-d4"], rtol=1e-4)
    for name, j in jobs.items():  # 2 tasks on each of 2 nodes, as submitit saw them
        assert _task_placements(run, j) == [(0, 0), (0, 1), (1, 0), (1, 1)], name

    local = ["sweep", f"run.dir={tmp_path}/runs", f"jax.cache_dir={tmp_path}/jc", "target=local", "devices=4",
             "run.name=local", *common]
    p = run_cli(local, cwd=tmp_path, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for name in jobs:
        ref = summary(_records(tmp_path / "runs" / "local" / name / "metrics.jsonl"))
        assert ref["status"] == "ok", (name, ref)
        np.testing.assert_allclose(finals[name], ref["final_loss"], rtol=1e-5, err_msg=name)


@pytest.mark.slow
def test_preempted_two_node_cell_is_requeued_and_resumes(gpu_partition, tmp_path):
    """USR2 to a running 2-node cell (what SLURM sends before a preemption or the time limit, with
    `PreemptParameters=send_user_signal`): all 4 trainers stop at the same step and save, the job is requeued,
    resumes from that step on both nodes and ends with the final loss of an uninterrupted run. The trainers hold
    before step HOLD_AT until the signal arrives (HOLD), so the test never races them."""
    steps = RACE_STEPS
    common = [f"train.steps={steps}", "checkpoint.every=0", "checkpoint.async=false", "train.log_every=1"]
    run = tmp_path / "runs" / "pre"
    try:
        p = run_cli(["run", *_cli_args(tmp_path, *common, "run.name=pre")], cwd=tmp_path, env={"SCALEOUT_FAULT": HOLD})
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        job_id = json.loads((run / "jobs.json").read_text())["cells"]["jax-d4"]["job_id"]
        m = run / "jax-d4" / "metrics.jsonl"
        deadline = time.time() + QUEUE_WAIT_S
        while _steps_written(m) < HOLD_AT - 1:
            assert time.time() < deadline, f"job {job_id} wrote no {HOLD_AT - 1} steps in {QUEUE_WAIT_S} s: {slurm_queue.squeue_states([job_id])}"
            assert slurm_queue.squeue_states([job_id]), f"job {job_id} left the queue early: {m.read_text()[-2000:] if m.is_file() else ''}"
            time.sleep(0.3)
        at_signal = _steps_written(m)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, capture_output=True)
        deadline = time.time() + REQUEUE_WAIT_S
        while slurm_queue.squeue_states([job_id]):
            assert time.time() < deadline, f"job {job_id} still queued {REQUEUE_WAIT_S} s after USR2"
            time.sleep(2)
    finally:
        _cancel_run_jobs(run)
    recs = _records(m)
    sums = [r for r in recs if r["kind"] == "summary"]
    assert len(sums) == 2, (f"the cell ended {len(sums)} time(s); it had written {at_signal} of {steps} steps when USR2 "
                            f"was sent (if it finished first, the test lost the race: raise RACE_STEPS)", sums)
    first, last = sums
    assert first["status"] == "stopped" and first["stopped_by"] in ("SIGUSR2", "peer") and first["processes"] == 4, first
    saved = first["steps"]
    assert saved == HOLD_AT, (at_signal, saved)  # held before HOLD_AT, ran it, stopped
    assert last["status"] == "ok" and last["resumed_from_step"] == saved and last["steps"] == steps, last
    assert last["processes"] == 4
    assert min(losses(recs, since=saved)) == saved + 1
    states = run_cli(["status", str(run)], cwd=tmp_path)
    assert states.returncode == 0 and "requeued 1x" in states.stdout and " ok " in states.stdout, states.stdout

    ref_args = ["run", f"run.dir={tmp_path}/runs", f"jax.cache_dir={tmp_path}/jc", "target=local", "devices=4",
                "run.name=ref", *common]
    p = run_cli(ref_args, cwd=tmp_path, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    ref = summary(_records(tmp_path / "runs" / "ref" / "jax-d4" / "metrics.jsonl"))
    np.testing.assert_allclose(last["final_loss"], ref["final_loss"], rtol=1e-5)


@pytest.mark.slow
def test_jax_on_cpu_with_gpus_fails_at_once(gpu_partition, tmp_path):
    """A JAX cell given (fake) GPUs by SLURM while its jaxlib is CPU-only: every task fails before the first step
    with the one sentence of launch.core.gpus.check_platform (issue 12.4), never a JAX-on-CPU run next to torch-on-GPU."""
    run = tmp_path / "runs" / "cpujax"
    args = _cli_args(tmp_path, "run.name=cpujax", "slurm.gpus_per_node=2", "slurm.wait=true", "train.steps=4",
                     "checkpoint.async=false")
    try:
        p = run_cli(["run", *args], cwd=tmp_path, timeout=QUEUE_WAIT_S + 300)
    finally:
        _cancel_run_jobs(run)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    recs = _records(run / "jax-d4" / "metrics.jsonl")
    assert not [r for r in recs if r["kind"] == "step"], "the trainer ran steps on the CPU"
    s = summary(recs)
    assert s["status"] == "failed" and s["steps"] == 0, s
    assert "pip install 'jax[cuda13]==0.10.2'" in s["error"] and "CUDA_VISIBLE_DEVICES=" in s["error"], s["error"]
    status = run_cli(["status", str(run)], cwd=tmp_path)
    assert "pip install 'jax[cuda13]==0.10.2'" in status.stdout, status.stdout

"""The two-node GPU cluster of scripts/slurm-local.sh, seen from inside real SLURM tasks (no mocks).

Pins what the launcher may rely on: partition `gpu` = nodes n1, n2 with two fake GPUs each (GRES gpu:2), next
to the one-node CPU partition `debug`; how `--gpus-per-task` and `--gpus-per-node` bind GPUs to tasks (through
srun directly and through sbatch + a plain srun, which is how submitit runs); the rank variables of a 2-node
job; node names that resolve from inside tasks; and the SLURM 22.05 behaviours a launcher must work around.

Skipped with a reason when SLURM is not here; failed instead when CI is set (any non-empty value).
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

PROBE = [sys.executable, str(Path(__file__).resolve().parent / "gpu_probe.py")]
GPU_NODES = ["n1", "n2"]
USABLE = {"idle", "mixed", "allocated", "completing"}
WAIT_S = 300  # a job may queue behind other tests' jobs
JOB_NAME = f"test-cluster-{os.getpid()}"  # this pytest's jobs only: cancelled after every test


def _unavailable(msg):
    if os.environ.get("CI"):
        pytest.fail(msg + " (CI is set, so these tests must run: .ci/run starts the cluster)")
    pytest.skip(msg)


@pytest.fixture(scope="module")
def gpu_cluster():
    if shutil.which("sinfo") is None or shutil.which("srun") is None or shutil.which("sbatch") is None:
        _unavailable("no SLURM here (sinfo/srun/sbatch not on PATH): run `bash scripts/slurm-local.sh start`")
    p = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %P %T"], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        _unavailable(f"sinfo does not answer ({p.stderr.strip()}): run `bash scripts/slurm-local.sh start`")
    rows = [line.split() for line in p.stdout.splitlines()]
    gpu = {n: s for n, part, s in rows if part == "gpu"}
    if sorted(gpu) != GPU_NODES:
        _unavailable(f"partition gpu is not nodes {GPU_NODES} (sinfo: {rows}): run `bash scripts/slurm-local.sh start`")
    return {n: s for n, _, s in rows}


@pytest.fixture(autouse=True)
def cancel_own_jobs():
    """Whatever a test leaves queued (a timed-out srun/sbatch --wait) is cancelled, by this pytest's job name."""
    yield
    ids = subprocess.run(["squeue", "-h", "-n", JOB_NAME, "-o", "%i"], capture_output=True, text=True).stdout.split()
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True)


def _run(cmd, cwd=None, timeout=WAIT_S):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout)


def _probe_records(stdout):
    recs = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return sorted(recs, key=lambda r: int(r["env"]["SLURM_PROCID"]))


def _srun_probe(tmp_path, *opts):
    """One output file per task: on srun's own stdout, lines of several tasks interleave past ~1 KiB."""
    out = tmp_path / "srun-probe"
    out.mkdir(exist_ok=True)
    p = _run(["srun", "-p", "gpu", "-N2", "--ntasks-per-node=2", "--time=5", "-J", JOB_NAME,
              f"--output={out}/%t.out", f"--error={out}/%t.err", *opts, *PROBE], cwd=tmp_path)
    logs = "".join(f.read_text() for f in sorted(out.iterdir()))
    assert p.returncode == 0, p.stdout + p.stderr + logs
    return _probe_records("".join(f.read_text() for f in sorted(out.glob("*.out"))))


def _sbatch_probe(tmp_path, *opts):
    """sbatch with the GPU options in the allocation and a plain `srun` in the script, as submitit renders it."""
    script = tmp_path / "probe.sh"
    script.write_text("#!/bin/bash\nsrun " + " ".join(f"'{a}'" for a in PROBE) + "\n")
    out = tmp_path / "probe.out"
    p = _run(["sbatch", "--wait", "-p", "gpu", "-N2", "--ntasks-per-node=2", "--time=5", "-J", JOB_NAME,
              f"--output={out}", *opts, str(script)], cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr + (out.read_text() if out.exists() else "")
    return _probe_records(out.read_text())


def _assert_two_node_ranks(recs):
    """The rank variables of a 2-node x 2-task job, as on a real cluster."""
    assert len(recs) == 4, recs
    for i, r in enumerate(recs):
        e = r["env"]
        assert (e["SLURM_PROCID"], e["SLURM_NODEID"], e["SLURM_LOCALID"]) == (str(i), str(i // 2), str(i % 2)), e
        assert e["SLURMD_NODENAME"] == GPU_NODES[i // 2], e
        assert (e["SLURM_NTASKS"], e["SLURM_NNODES"]) == ("4", "2"), e
        assert e["SLURM_JOB_NODELIST"] == "n[1-2]" and r["nodes"] == GPU_NODES, r
        # What MASTER_ADDR / the JAX coordinator will use: the first node of the list, resolvable from every task.
        assert r["resolved"] == {"n1": "127.0.0.1", "n2": "127.0.0.1"}, r
        assert all(r["devices"].values()), r  # every visible GPU index is one of this node's device files


def _assert_one_gpu_per_task(recs):
    for node in GPU_NODES:
        on_node = [r["env"] for r in recs if r["env"]["SLURMD_NODENAME"] == node]
        assert all(e["CUDA_VISIBLE_DEVICES"] == e["SLURM_STEP_GPUS"] for e in on_node), on_node
        # each task sees exactly one GPU, and the two tasks of a node see different ones
        assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in on_node) == ["0", "1"], on_node


def _assert_both_gpus_per_task(recs):
    for r in recs:
        e = r["env"]
        assert (e["CUDA_VISIBLE_DEVICES"], e["SLURM_STEP_GPUS"]) == ("0,1", "0,1"), e


# --------------------------------------------------------------------------- the cluster itself

def test_every_node_is_usable_and_gpu_partition_shows_its_gres(gpu_cluster):
    assert set(gpu_cluster) >= {*GPU_NODES} and len(gpu_cluster) >= 3, gpu_cluster  # n1, n2 + the debug node
    assert all(s in USABLE for s in gpu_cluster.values()), gpu_cluster
    # what the launcher's preflight reads
    assert _run(["sinfo", "-h", "-p", "gpu", "-o", "%G"]).stdout.split() == ["gpu:2"]
    assert _run(["sinfo", "-h", "-p", "debug", "-o", "%G"]).stdout.split() == ["(null)"]
    default = [line.split()[0] for line in _run(["sinfo", "-h", "-o", "%P"]).stdout.split() if line.endswith("*")]
    assert default == ["debug*"]
    ports = set()
    for n in GPU_NODES:
        show = _run(["scontrol", "show", "node", n]).stdout
        assert "Gres=gpu:2" in show and "CPUTot=2" in show and "Partitions=gpu" in show, show
        ports.add(show.split("Port=", 1)[1].split()[0])
    assert len(ports) == 2, ports


# --------------------------------------------------------------------------- GPU binding, rank variables

def test_srun_gpus_per_task_gives_each_task_its_own_gpu(gpu_cluster, tmp_path):
    recs = _srun_probe(tmp_path, "--gpus-per-task=1")
    _assert_two_node_ranks(recs)
    _assert_one_gpu_per_task(recs)


def test_srun_gpus_per_node_gives_every_task_both_gpus(gpu_cluster, tmp_path):
    recs = _srun_probe(tmp_path, "--gpus-per-node=2")
    _assert_two_node_ranks(recs)
    _assert_both_gpus_per_task(recs)


def test_sbatch_gpus_per_task_reaches_a_plain_srun(gpu_cluster, tmp_path):
    recs = _sbatch_probe(tmp_path, "--gpus-per-task=1")
    _assert_two_node_ranks(recs)
    _assert_one_gpu_per_task(recs)
    assert all(r["env"]["SLURM_JOB_GPUS"] == "0,1" for r in recs), recs  # the job holds both; the step binds one


def test_sbatch_gpus_per_node_reaches_a_plain_srun(gpu_cluster, tmp_path):
    recs = _sbatch_probe(tmp_path, "--gpus-per-node=2")
    _assert_two_node_ranks(recs)
    _assert_both_gpus_per_task(recs)


def test_gpus_per_node_below_tasks_per_node_makes_tasks_share_a_gpu(gpu_cluster, tmp_path):
    """SLURM does not refuse `--gpus-per-node=1 --ntasks-per-node=2`: both tasks of a node see GPU 0."""
    recs = _srun_probe(tmp_path, "--gpus-per-node=1")
    _assert_two_node_ranks(recs)
    assert [r["env"]["CUDA_VISIBLE_DEVICES"] for r in recs] == ["0"] * 4, recs


# --------------------------------------------------------------------------- scheduling

def test_two_node_gpu_job_runs_while_the_debug_node_is_full(gpu_cluster, tmp_path):
    """n1 and n2 declare their own CPUs: a job filling the debug node does not hold up the gpu partition."""
    blocker = _run(["sbatch", "--parsable", "-p", "debug", "-N1", "-n1", "--cpus-per-task=2", "--time=5",
                    "-J", JOB_NAME, f"--output={tmp_path}/blocker.out", "--wrap", "sleep 300"]).stdout.strip()
    assert blocker.isdigit(), blocker
    try:
        deadline = time.time() + WAIT_S
        while _run(["squeue", "-h", "-j", blocker, "-o", "%T"]).stdout.strip() != "RUNNING":
            assert time.time() < deadline, "the blocker job never started on debug (other jobs held it too long)"
            time.sleep(1)
        recs = _srun_probe(tmp_path, "--gpus-per-task=1", "--immediate=120")
        _assert_two_node_ranks(recs)
        assert _run(["squeue", "-h", "-j", blocker, "-o", "%T"]).stdout.strip() == "RUNNING"
    finally:
        subprocess.run(["scancel", blocker], capture_output=True)


# --------------------------------------------------------------------------- SLURM 22.05 facts the launcher must handle

def test_cpus_per_task_is_not_passed_from_sbatch_to_srun(gpu_cluster, tmp_path):
    """Since 22.05 a plain `srun` does not inherit sbatch's --cpus-per-task (though SLURM_CPUS_PER_TASK is in
    the environment): two 1-CPU tasks fit a 2-CPU allocation made with -c2, two 2-CPU tasks do not."""
    script = tmp_path / "cpt.sh"
    script.write_text("#!/bin/bash\n"
                      "echo CPT=$SLURM_CPUS_PER_TASK\n"
                      "srun -n2 true && echo plain-ok\n"
                      "srun -n2 --cpus-per-task=$SLURM_CPUS_PER_TASK true || echo explicit-refused\n")
    out = tmp_path / "cpt.out"
    p = _run(["sbatch", "--wait", "-p", "gpu", "-N1", "-n1", "--cpus-per-task=2", "--time=5", "-J", JOB_NAME,
              f"--output={out}", str(script)], cwd=tmp_path)
    text = out.read_text() if out.exists() else ""
    assert p.returncode == 0, p.stdout + p.stderr + text
    assert "CPT=2" in text and "plain-ok" in text and "explicit-refused" in text, text
    assert "More processors requested than permitted" in text, text


def test_gpus_on_a_partition_without_gres_are_refused(gpu_cluster):
    """With GresTypes=gpu in slurm.conf, asking `debug` (no GRES) for GPUs is refused with a generic message;
    an unknown GRES name gets 'Invalid generic resource'. The launcher's preflight should say it first."""
    p = _run(["sbatch", "-p", "debug", "--gpus-per-node=1", "--wrap", "true"])
    assert p.returncode != 0 and "Requested node configuration is not available" in p.stderr, p.stderr
    p = _run(["sbatch", "-p", "gpu", "--gpus-per-node=3", "--wrap", "true"])
    assert p.returncode != 0 and "Requested node configuration is not available" in p.stderr, p.stderr
    p = _run(["sbatch", "-p", "gpu", "--gres=nosuchgres:1", "--wrap", "true"])
    assert p.returncode != 0 and "Invalid generic resource (gres) specification" in p.stderr, p.stderr


def test_more_nodes_than_the_partition_has_is_accepted_and_pends_forever(gpu_cluster):
    """sbatch does not refuse -N3 on a 2-node partition: the job pends (reason PartitionNodeLimit or
    PartitionConfig, seen both) until cancelled. The launcher's preflight must count the nodes itself."""
    p = _run(["sbatch", "--parsable", "-p", "gpu", "-N3", "--time=1", "-J", JOB_NAME, "--wrap", "true"])
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    try:
        deadline = time.time() + 30
        while (reason := _run(["squeue", "-h", "-j", job, "-o", "%T %r"]).stdout.strip()) in ("", "PENDING None"):
            assert time.time() < deadline, reason
            time.sleep(0.5)
        assert reason in ("PENDING PartitionNodeLimit", "PENDING PartitionConfig"), reason
    finally:
        subprocess.run(["scancel", job], capture_output=True)

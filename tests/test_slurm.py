"""The SLURM target against a real one-node cluster (scripts/slurm-local.sh start; .ci/run starts it)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import in_ci, losses, run_cell, run_cli, status_rows, summary

from launch import config
from launch.config import ConfigError
from launch.targets.slurm import queue as slurm_queue, target as slurm

CLUSTER = ["target=slurm", "slurm.gpus_per_node=0", "slurm.cpus_per_task=1", "slurm.time_min=10", "slurm.devices_per_node=2"]


@pytest.fixture(scope="module")
def cluster():
    if shutil.which("sbatch") is None or subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        msg = "no SLURM cluster here (sbatch/sinfo missing or not answering): run `bash scripts/slurm-local.sh start`"
        if in_ci():
            pytest.fail(msg + " (CI must run these tests; .ci/run starts the cluster)")
        pytest.skip(msg)
    return True


def _args(tmp_path, *extra):
    return [f"run.dir={tmp_path}/runs", f"checkpoint.dir={tmp_path}/ckpt", f"jax.cache_dir={tmp_path}/jc", *CLUSTER, *extra]


def _status(tmp_path, run):
    p = run_cli(["status", str(tmp_path / "runs" / run)], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    return {line.split()[0]: line for line in status_rows(p.stdout)}, p.stdout


# --------------------------------------------------------------------------- no cluster needed

@pytest.mark.parametrize("value", ["debug;rm -rf /", "$(touch /tmp/x)", "de'bug", 'de"bug', "debug\nrm -rf /", "a b"])
def test_names_that_could_inject_are_refused(tmp_path, value):
    for key in ("slurm.partition", "slurm.account", "slurm.qos", "slurm.constraint"):
        with pytest.raises(ConfigError, match=re.escape(key) + r"=.* is not valid: (SLURM names|it must not contain a newline)"):
            slurm.executor_params(config.replace(config.load(["target=slurm"]), {key: value}))


def test_setup_lines_are_one_quoted_command_each(tmp_path):
    cfg = config.replace(config.load(["target=slurm"]), {"slurm.setup": [
        "source /opt/venv/bin/activate", "echo $(whoami); touch /tmp/pwned", "echo 'a' \"b\"", "echo one\nrm -rf /"]})
    script = slurm.render_script(cfg, tmp_path / "%j")
    setup = script.split("# setup\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert setup == ["source /opt/venv/bin/activate", "echo '$(whoami);' touch /tmp/pwned", "echo a b", "echo one rm -rf /"]
    with pytest.raises(ConfigError, match=r"slurm\.setup\[0\]=.* is not valid"):
        slurm.setup_lines(config.replace(cfg, {"slurm.setup": ["echo 'unterminated"]}))


def test_plan_prints_the_sbatch_script_submitit_renders(tmp_path, scaleout):
    code, out, err = scaleout("plan", "--json", "target=slurm", "devices=16", "train.global_batch=32",
                                 "slurm.partition=gpu", "slurm.account=proj")
    assert code == 0, err
    script = json.loads(out)["commands"][0]
    assert script.startswith("#!/bin/bash")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --account=proj", "#SBATCH --signal=USR2@90", "#SBATCH --time=60", "#SBATCH --open-mode=append"):
        assert line in script
    assert "-m submitit.core._submit" in script and "srun --unbuffered" in script


def test_devices_must_fill_whole_nodes(scaleout):
    code, _, err = scaleout("plan", "target=slurm", "devices=12", "train.global_batch=24", "slurm.devices_per_node=8",
                            "parallel.fsdp=1", "parallel.data=-1")  # fsdp=12 would not divide d_model=64
    assert code == 2 and "devices=12 does not fill whole nodes of slurm.devices_per_node=8" in err


def test_small_cells_ask_for_their_own_gpus_only(tmp_path):
    """A 2-device cell on 8-GPU nodes asks for 2 GPUs, not the node's 8 (issue 12.2); per-task binding asks one per task."""
    base = ["target=slurm", "slurm.gpus_per_node=8", "slurm.devices_per_node=8"]
    script = slurm.render_script(config.load([*base, "devices=2"]), tmp_path / "%j")
    assert "#SBATCH --gpus-per-node=2" in script and "--gpus-per-node=8" not in script
    script = slurm.render_script(config.load([*base, "devices=16", "train.global_batch=16", "slurm.gpu_binding=task"]), tmp_path / "%j")
    assert "#SBATCH --gpus-per-task=1" in script and "--gpus-per-node" not in script
    with pytest.raises(ConfigError, match=r"slurm\.gpus_per_node=4 is less than the 8 tasks per node .* slurm\.devices_per_node=4"):
        slurm.executor_params(config.load(["target=slurm", "slurm.gpus_per_node=4", "slurm.devices_per_node=8", "devices=8"]))


def test_the_step_gets_cpus_per_task(tmp_path):
    """SLURM >= 22.05 does not pass sbatch's --cpus-per-task on to srun: the srun line carries it (issue 12.3)."""
    script = slurm.render_script(config.load(["target=slurm", "slurm.cpus_per_task=6"]), tmp_path / "%j")
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--cpus-per-task=6" in srun and "#SBATCH --cpus-per-task=6" in script


def test_home_paths_in_setup_and_a_setup_script(tmp_path):
    """`~/venv/bin/activate` still expands in a setup entry; slurm.setup_script is sourced as the user wrote it (issue 12.9)."""
    own = tmp_path / "my env.sh"
    own.write_text("export A=1\n")
    cfg = config.load(["target=slurm", 'slurm.setup=["source ~/venv/bin/activate", "echo ~user $(x)"]', f"slurm.setup_script={own}"])
    setup = slurm.render_script(cfg, tmp_path / "%j").split("# setup\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert setup == ["source ~/venv/bin/activate", "echo '~user' '$(x)'", f"source '{own}'"]
    home = subprocess.run(["bash", "-c", f"{setup[0].replace('source', 'echo')}"], capture_output=True, text=True).stdout.strip()
    assert home == os.path.expanduser("~/venv/bin/activate")
    with pytest.raises(Exception, match=r"slurm\.setup_script='/nonexistent\.sh' does not exist"):
        slurm.check_setup_script(config.load(["target=slurm", "slurm.setup_script=/nonexistent.sh"]))


def test_values_reaching_the_script_are_quoted_or_refused(tmp_path):
    """A trailing newline, a venv path with a space, wckey (issue 12.10/12.11)."""
    with pytest.raises(ConfigError, match=r"slurm\.partition="):
        slurm.executor_params(config.replace(config.load(["target=slurm"]), {"slurm.partition": "gpu\n"}))
    cfg = config.load(["target=slurm", "slurm.python=/opt/my env/bin/python"])
    script = slurm.render_script(cfg, tmp_path / "%j")
    assert "'/opt/my env/bin/python' -u -m submitit.core._submit" in script
    assert "--wckey" not in script
    assert "#SBATCH --wckey=proj" in slurm.render_script(config.load(["target=slurm", "slurm.wckey=proj"]), tmp_path / "%j")


def test_no_sbatch_on_path(tmp_path):
    env = {"PATH": os.path.dirname(sys.executable)}
    p = run_cli(["run", *_args(tmp_path)], cwd=tmp_path, env=env)
    assert p.returncode == 2 and "sbatch is not on PATH" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("key", ["ntasks_per_node", "ntasks-per-node", "ntasks_per_n", "nodes", "signal", "time", "array",
                                 "gpus_per_node", "gres", "cpus_per_task", "mem", "requeue", "no_requeue", "output", "partition"])
def test_additional_cannot_set_what_scaleout_sets(key):
    """slurm.additional of an sbatch option scaleout sets itself (or an abbreviation sbatch would take for one) is
    refused naming the key that decides it (issue 24.13: it broke one task per device and the MaxTime/signal checks)."""
    with pytest.raises(ConfigError, match=rf"slurm\.additional\.{re.escape(key)} is not valid: scaleout sets --[a-z-]+ itself, from "):
        slurm.executor_params(config.load(["target=slurm", f"slurm.additional={{{key}: 2}}"]))


def test_additional_flags_and_nulls_render_as_sbatch_means_them(tmp_path):
    """true is a bare flag; false and null leave the option out (they rendered as --hold=False, --comment=None)."""
    cfg = config.load(["target=slurm", "slurm.additional={reservation: r1, hold: true, comment: null, overcommit: false, nice: 5}"])
    lines = slurm.render_script(cfg, tmp_path / "%j").splitlines()
    assert {"#SBATCH --reservation=r1", "#SBATCH --hold", "#SBATCH --nice=5"} <= set(lines)
    assert not [l for l in lines if "comment" in l or "overcommit" in l or "None" in l or "False" in l], lines
    with pytest.raises(ConfigError, match=r"slurm\.additional\.reservation=\[1, 2\] is not valid: give a string"):
        slurm.executor_params(config.replace(cfg, {"slurm.additional": {"reservation": [1, 2]}}))


def test_jobs_are_requeueable_and_signalled_as_configured(tmp_path):
    """--requeue always (a cluster with JobRequeue=0 refuses submitit's `scontrol requeue` otherwise, issue 24.17),
    and --signal follows slurm.signal_delay_s, not only at its default (issue 24.24)."""
    script = slurm.render_script(config.load(["target=slurm", "slurm.signal_delay_s=45"]), tmp_path / "%j").splitlines()
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=USR2@45" in script
    assert not [l for l in script if "@90" in l], script


def test_a_home_interpreter_expands_on_the_node(tmp_path):
    """slurm.python=~/... reaches the script with ~/ unquoted, so bash expands it on the node (it was quoted, and the
    job died with `execve(): ~/...: No such file`); ~user/... is refused (issue 24.12)."""
    script = slurm.render_script(config.load(["target=slurm", "slurm.python=~/my venv/bin/python"]), tmp_path / "%j")
    srun = next(l for l in script.splitlines() if l.startswith("srun "))
    assert " ~/'my venv/bin/python' -u -m submitit.core._submit " in srun, srun
    home = subprocess.run(["bash", "-c", "printf %s ~/'my venv/bin/python'"], capture_output=True, text=True).stdout
    assert home == os.path.expanduser("~/my venv/bin/python"), home
    with pytest.raises(ConfigError, match=r"slurm\.python='~bob/venv/bin/python' is not valid: only a leading ~/"):
        slurm.executor_params(config.load(["target=slurm", "slurm.python=~bob/venv/bin/python"]))


def test_cells_with_another_interpreter_or_requeue_budget_get_their_own_array():
    """A job array has one interpreter and one requeue budget for all its cells: cells that differ in them are not
    grouped (a sweep over slurm.python ran every cell with the first cell's)."""
    base = config.load(["target=slurm"])
    keys = {slurm.resource_key(config.replace(base, u)) for u in
            ({}, {"slurm.python": "~/py"}, {"slurm.python": "~/other"}, {"slurm.max_requeues": 7})}
    assert len(keys) == 4


def test_sinfo_gres_with_socket_lists(monkeypatch):
    """`sinfo -o %G` of a node whose GPUs are bound to sockets, `gpu:a100:4(S:0,2)`: four GPUs, not a false
    "no GPUs" refusal (the comma inside the parentheses split the entry; issue 24.18)."""
    assert [slurm.gres_gpus(g) for g in ("gpu:a100:4(S:0,2)", "gpu:a100:4(S:0,2),nvme:1", "gpu:2,gpu:v100:2(S:0-1)",
                                          "(null)", "gpu:h100:8(S:0-1),gpu:1")] == [4, 4, 4, 0, 9]
    lines = "2|gpu:a100:4(S:0,2)|gpu|64\n1|gpu:a100:4(S:0,2),nvme:1|gpu|64\n"
    assert slurm.parse_shape(lines, "gpu") == (3, 4, 64)
    assert slurm.parse_shape(lines + "4|(null)|cpu*|8+\n", None) == (4, 0, 8)
    monkeypatch.setattr(slurm, "partition_shape", lambda partition: slurm.parse_shape(lines, partition))
    slurm.check_partition(config.load(["target=slurm", "slurm.partition=gpu", "devices=4", "slurm.devices_per_node=4",
                                       "slurm.gpus_per_node=4", "slurm.cpus_per_task=16"]))


def test_submitit_internals_are_touched_in_one_module_and_bounded():
    """submitit's private API (its script rendering, JobPaths, its exceptions, result pickles) is used in
    launch/targets/slurm/submitit_api.py only, and pyproject bounds submitit to the minor version tested, with the
    pin inside the bound and installed (issue 24.19)."""
    import importlib.metadata
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.version import Version
    root = Path(__file__).resolve().parents[1]
    private = ("_make_submission_file_text", "_submitit_command_str", "submitit.core", "JobPaths", "UncompletedJobError",
               "def affinity", "result_pickle", "_result.pkl")
    used = {(str(p.relative_to(root)), n) for p in (root / "launch").rglob("*.py") for n in private if n in p.read_text()}
    assert {f for f, _ in used} == {"launch/targets/slurm/submitit_api.py"}, used
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    req = Requirement(next(d for d in deps if d.startswith("submitit")))
    pin = next(l.split("==")[1].strip() for l in (root / "constraints.txt").read_text().splitlines() if l.startswith("submitit=="))
    installed = importlib.metadata.version("submitit")
    assert Version(pin) in req.specifier and installed == pin, (req, pin, installed)
    assert Version("1.6.0") not in req.specifier and Version(f"{Version(pin).major}.{Version(pin).minor + 1}") not in req.specifier


# --------------------------------------------------------------------------- the real cluster

@pytest.mark.slow
def test_sweep_of_four_cells_as_job_arrays(cluster, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    setup = f'slurm.setup=["touch {marks}/setup-ran", "echo $(touch {marks}/pwned1); touch {marks}/pwned2"]'
    p = run_cli(["sweep", *_args(tmp_path, "sweep.devices=[1,2]", "train.steps=8", "run.name=arr", "slurm.wait=true",
                                 "checkpoint.async=false", "profile.steps=[5,6]", "profile.all_processes=true", setup)],
                cwd=tmp_path, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = tmp_path / "runs" / "arr"
    jobs = json.loads((run / "jobs.json").read_text())["cells"]
    assert set(jobs) == {"jax-d1", "jax-d2", "torch-d1", "torch-d2"}
    arrays = {}
    for name, j in jobs.items():
        array_id, _, index = j["job_id"].partition("_")
        assert index.isdigit(), j  # every cell is a task of a job array
        arrays.setdefault(array_id, set()).add(name)
    assert sorted(map(sorted, arrays.values())) == [["jax-d1", "torch-d1"], ["jax-d2", "torch-d2"]]  # one array per shape
    for name in jobs:
        recs = [json.loads(l) for l in (run / name / "metrics.jsonl").read_text().splitlines()]
        s = summary(recs)
        assert s["status"] == "ok" and s["steps"] == 8, (name, s)
        assert s["processes"] == (2 if name.endswith("d2") else 1), (name, s)
        # every task traced its steps 5-6 into the cell on the shared filesystem
        assert s["profiled_steps"] == [5, 6], (name, s)
        assert [r["error"] for r in recs if r["kind"] == "profile"] == [None], name
        for i in range(s["processes"]):
            b = json.loads((run / name / "profile" / f"process-{i}" / "breakdown.json").read_text())
            assert b["error"] is None and [r["step"] for r in b["breakdown"]] == [5, 6], (name, i, b)
            assert all(r["matmul_attention"] > 0 and r["other_compute"] > 0 for r in b["breakdown"]), (name, i, b)
    states, _ = _status(tmp_path, "arr")
    assert all(" ok " in line and "step 8/8" in line for line in states.values()), states
    assert (marks / "setup-ran").exists()
    assert not (marks / "pwned1").exists() and not (marks / "pwned2").exists()
    assert (run / "report.md").is_file()
    p = run_cli(["logs", str(run), "torch-d2"], cwd=tmp_path)
    assert p.returncode == 0 and "_1_log.out" in p.stdout and "[scaleout] ok: 8 steps" in p.stdout


@pytest.mark.slow
def test_crashing_cell_is_reported_failed_and_others_finish(cluster, tmp_path):
    p = run_cli(["sweep", *_args(tmp_path, "sweep.devices=[1]", "train.steps=6", "run.name=crash", "slurm.wait=true")],
                cwd=tmp_path, env={"SCALEOUT_FAULT": "crash@3:cell=torch-d1"}, timeout=600)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    states, text = _status(tmp_path, "crash")
    assert " ok " in states["jax-d1"] and "step 6/6" in states["jax-d1"]
    assert " failed " in states["torch-d1"] and "FAILED" in states["torch-d1"]
    assert "injected crash at step 3" in text.split("torch-d1", 1)[1]


@pytest.mark.slow
def test_preemption_checkpoints_requeues_and_resumes(cluster, tmp_path):
    common = ["devices=2", "train.steps=60", "checkpoint.every=0", "checkpoint.async=false"]
    _, ref = run_cell(tmp_path, *common, "run.name=ref", "target=local")
    p = run_cli(["run", *_args(tmp_path, *common, "run.name=pre")], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    run = tmp_path / "runs" / "pre"
    job_id = json.loads((run / "jobs.json").read_text())["cells"]["jax-d2"]["job_id"]
    metrics = run / "jax-d2" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.is_file() or metrics.read_text().count('"kind": "step"') < 5):
        time.sleep(0.3)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    deadline = time.time() + 600
    while time.time() < deadline and slurm_queue.squeue_states([job_id]):
        time.sleep(2)
    recs = [json.loads(l) for l in metrics.read_text().splitlines()]
    sums = [r for r in recs if r["kind"] == "summary"]
    assert len(sums) == 2, sums
    assert sums[0]["status"] == "stopped" and sums[0]["stopped_by"] in ("SIGUSR2", "peer")
    saved = sums[0]["steps"]
    assert 0 < saved < 60
    assert sums[1]["status"] == "ok" and sums[1]["resumed_from_step"] == saved and sums[1]["steps"] == 60
    assert min(losses(recs, since=saved)) and min(s for s in losses(recs, since=saved)) == saved + 1
    np.testing.assert_allclose(sums[1]["final_loss"], summary(ref)["final_loss"], rtol=1e-5)
    states, _ = _status(tmp_path, "pre")
    assert "requeued 1x" in states["jax-d2"] and " ok " in states["jax-d2"]


@pytest.mark.slow
def test_sbatch_refusals_are_one_sentence(cluster, tmp_path):
    p = run_cli(["run", *_args(tmp_path, "slurm.partition=nosuchpartition", "run.name=b1")], cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip() == "scaleout: error: sbatch refused the job for cell jax-d1: sbatch: error: invalid partition specified: nosuchpartition"
    p = run_cli(["run", *_args(tmp_path, "slurm.gpus_per_node=4", "run.name=b2")], cwd=tmp_path)  # the node has no GPUs
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1
    assert p.stderr.startswith("scaleout: error: slurm.gpus_per_node=4 but the nodes of the default partition have no GPUs"), p.stderr
    p = run_cli(["run", *_args(tmp_path, "devices=6", "train.global_batch=6", "parallel.fsdp=1", "parallel.data=-1",
                                "slurm.partition=gpu", "run.name=b3")], cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == ("scaleout: error: devices=6 needs 3 nodes of slurm.devices_per_node=2 "
                                                      "but partition gpu has 2; use fewer devices or more tasks per node."), p.stderr
    p = run_cli(["run", *_args(tmp_path, "devices=4", "train.global_batch=4", "slurm.partition=gpu", "slurm.gpus_per_node=4",
                                "slurm.devices_per_node=4", "run.name=b4")], cwd=tmp_path)
    assert p.returncode == 2 and "needs 4 GPUs on each node but the nodes of partition gpu have at most 2" in p.stderr, p.stderr
    for b in ("b1", "b2", "b3", "b4"):
        assert not (tmp_path / "runs" / b).exists()


def test_partition_time_and_node_limits(monkeypatch):
    """SLURM accepts a job over the partition's MaxTime/MaxNodes and leaves it pending forever: refuse it first."""
    assert [slurm.sinfo_minutes(x) for x in ("30:00", "2:00:00", "1-12:00:00", "infinite", "5", "0:30")] == [30, 120, 2160, None, 5, 1]
    monkeypatch.setattr(slurm, "partition_limits", lambda partition: (30, 1))
    with pytest.raises(slurm.SubmitError, match=r"slurm\.time_min=60 is more than the 30 minutes partition p allows"):
        slurm.check_partition_limits(config.load(["target=slurm", "slurm.partition=p", "slurm.time_min=60"]))
    with pytest.raises(slurm.SubmitError, match=r"needs 2 nodes .* takes at most 1 per job \(MaxNodes\)"):
        slurm.check_partition_limits(config.load(["target=slurm", "slurm.partition=p", "slurm.time_min=10", "devices=4",
                                                  "slurm.devices_per_node=2"]))
    slurm.check_partition_limits(config.load(["target=slurm", "slurm.partition=p", "slurm.time_min=30"]))


def _submit(tmp_path, name, *extra, env=None):
    p = run_cli(["sweep", *_args(tmp_path, f"run.name={name}", *extra)], cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return tmp_path / "runs" / name, json.loads((tmp_path / "runs" / name / "jobs.json").read_text())["cells"]


def _cancel_all(run):
    ids = [j["job_id"] for j in json.loads((run / "jobs.json").read_text())["cells"].values()]
    subprocess.run(["scancel", *ids], capture_output=True)
    deadline = time.time() + 120
    while time.time() < deadline and slurm_queue.squeue_states(ids):
        time.sleep(1)


@pytest.mark.slow
def test_live_status_and_cancel_one_cell(cluster, tmp_path):
    """`status` while jobs run, `cancel` of one cell leaves the other running, a second cancel says it had ended
    (issue 19 uncovered 3, issue 13.12: CANCELLED rather than UNKNOWN)."""
    run, jobs = _submit(tmp_path, "live", "sweep.devices=[1]", "train.steps=50", env={"SCALEOUT_FAULT": "hang@3"})
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            states, _ = _status(tmp_path, "live")
            if all(" running " in line and "step 2/50" in line for line in states.values()):
                break
            time.sleep(1)
        assert all(" running " in line and "RUNNING" in line for line in states.values()), states
        p = run_cli(["cancel", str(run), "jax-d1"], cwd=tmp_path)
        assert p.returncode == 0 and p.stdout.strip() == f"jax-d1: cancelled job {jobs['jax-d1']['job_id']}", p.stdout
        deadline = time.time() + 120
        while time.time() < deadline and slurm_queue.squeue_states([jobs["jax-d1"]["job_id"]]):
            time.sleep(1)
        states, _ = _status(tmp_path, "live")
        assert "CANCELLED" in states["jax-d1"] and " cancelled " in states["jax-d1"], states
        assert " running " in states["torch-d1"], states
        p = run_cli(["cancel", str(run), "jax-d1"], cwd=tmp_path)
        assert p.stdout.strip() == f"jax-d1: job {jobs['jax-d1']['job_id']} had already ended (CANCELLED)", p.stdout
    finally:
        _cancel_all(run)


@pytest.mark.slow
def test_requeues_exhausted_is_timed_out_with_the_checkpoint_kept(cluster, tmp_path):
    """A real time limit with slurm.max_requeues=0: SLURM signals USR2 slurm.signal_delay_s before the limit, the
    trainer (held before step 3 until then) finishes that step, saves and stops, submitit does not requeue: status "timed out", the checkpoint
    kept (issue 19 uncovered 4)."""
    run, jobs = _submit(tmp_path, "tmo", "sweep.devices=[1]", "sweep.frameworks=[jax]", "train.steps=50",
                        "slurm.time_min=1", "slurm.signal_delay_s=10", "slurm.max_requeues=0", "checkpoint.async=false",
                        env={"SCALEOUT_FAULT": "hold@3"})
    job_id = jobs["jax-d1"]["job_id"]
    try:
        deadline = time.time() + 300
        while time.time() < deadline and slurm_queue.squeue_states([job_id]):
            time.sleep(1)
        states, text = _status(tmp_path, "tmo")
        assert " timed out " in states["jax-d1"] and "step 3/50" in states["jax-d1"], text  # held before 3, ran it, stopped
        assert "the checkpoint at step 3 is kept" in text
        assert (tmp_path / "ckpt" / "tmo" / "jax-d1" / "3").is_dir()
        s = [json.loads(l) for l in (run / "jax-d1" / "metrics.jsonl").read_text().splitlines()][-1]
        assert s["kind"] == "summary" and s["status"] == "stopped" and s["stopped_by"] == "SIGUSR2"
    finally:
        _cancel_all(run)


@pytest.mark.slow
def test_one_failing_task_ends_the_whole_job(cluster, tmp_path):
    """Task 1 crashes at step 3 of a 2-task cell: the job ends within a bound, status names the error, no
    process is left (issue 19 uncovered 5; srun --kill-on-bad-exit)."""
    t0 = time.time()
    p = run_cli(["sweep", *_args(tmp_path, "run.name=ff", "sweep.devices=[2]", "train.steps=200", "slurm.wait=true")],
                cwd=tmp_path, env={"SCALEOUT_FAULT": "crash@3:p1"}, timeout=600)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert time.time() - t0 < 240
    states, text = _status(tmp_path, "ff")
    for cell in ("jax-d2", "torch-d2"):
        assert " failed " in states[cell], text
        assert "steps" not in states[cell].split("failed", 1)[1] or "step 200/200" not in states[cell]
    assert "injected crash at step 3" in text


def _jobs_named(name):
    """Ids of the queued or running jobs called `name` (scaleout names a run's jobs scaleout-<run.name>)."""
    p = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True)
    return sorted(set(p.stdout.split()))


@pytest.mark.slow
def test_two_sweeps_at_once_submit_one_job_per_cell(cluster, tmp_path):
    """Two `scaleout sweep` of the same run started together: one submits each cell, the other is refused in one
    sentence, and exactly one job per cell is queued and recorded (issue 24.3: jobs.json kept one of two jobs and
    `cancel` left the other pending). The winner says plainly that the job runs without it and how to follow it."""
    name = f"race{os.getpid()}"  # the job name scaleout-<run.name> is unique to this test on the shared cluster
    argv = [sys.executable, "-m", "launch", "sweep", *_args(tmp_path, f"run.name={name}", "sweep.devices=[1]",
                                                             "sweep.frameworks=[jax]", "train.steps=50")]
    env = {**os.environ, "SCALEOUT_FAULT": "hang@2"}
    try:
        procs = [subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for _ in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
        codes = sorted(p.returncode for p in procs)
        queued = _jobs_named(f"scaleout-{name}")
    finally:
        subprocess.run(["scancel", "-n", f"scaleout-{name}"], capture_output=True)
    assert codes == [0, 2], outs
    assert len(queued) == 1, (queued, outs)
    won, lost = (outs[0], outs[1]) if procs[0].returncode == 0 else (outs[1], outs[0])
    err = lost[1].strip().splitlines()
    assert len(err) == 1 and ("cell jax-d1 is being run by PID" in err[0] or "cell jax-d1 already has a live job" in err[0]), lost
    run = tmp_path / "runs" / name
    assert json.loads((run / "jobs.json").read_text())["cells"]["jax-d1"]["job_id"] == queued[0]
    assert (config.load_resolved(run / "jax-d1" / "config.yaml").run.id == json.loads((run / "run.json").read_text())["id"])
    assert f"cell jax-d1: submitted as SLURM job {queued[0]}" in won[0], won
    assert "the job runs without this command (slurm.wait=false); follow with `scaleout status" in won[0], won


@pytest.mark.slow
def test_home_interpreter_and_a_task_that_fails_before_python(cluster, tmp_path):
    """slurm.python=~/py runs (HOME is the job's; the trainer starts and fails with its own error), slurm.python=~/missing
    fails before Python starts. `run ... slurm.wait=true` prints both cells' errors and exits 1; `status` shows them
    (issue 24.12: the job died with `execve(): ~/...`, the launcher exited 1 saying nothing and status said
    "ENDED unknown"; issue 30.7: the trainer's sentence only inside `logs`)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "py").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (home / "py").chmod(0o755)
    p = run_cli(["sweep", *_args(tmp_path, "run.name=tilde", "sweep.devices=[1]", "sweep.frameworks=[jax]", "train.steps=3",
                                 "slurm.wait=true", "sweep.extra={slurm.python: [~/py, ~/missing]}")],
                cwd=tmp_path, env={"HOME": str(home), "SCALEOUT_FAULT": "crash@2:cell=jax-d1-python_py"}, timeout=600)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    own = p.stderr.split("cell jax-d1-python_py failed (SLURM job ", 1)
    assert len(own) == 2 and "injected crash at step 2" in own[1].split("cell jax-d1-python_missing", 1)[0], p.stderr
    missing = p.stderr.split("cell jax-d1-python_missing failed (SLURM job ", 1)
    assert len(missing) == 2 and f"execve(): {home}/missing: No such file or directory" in missing[1], p.stderr
    states, text = _status(tmp_path, "tilde")
    assert " failed " in states["jax-d1-python_py"] and " failed " in states["jax-d1-python_missing"], text
    assert "injected crash at step 2" in text.split("jax-d1-python_py", 1)[1].split("jax-d1-python_missing", 1)[0], text
    assert f"execve(): {home}/missing: No such file or directory" in text.split("jax-d1-python_missing", 1)[1], text


@pytest.mark.slow
def test_cpus_per_task_beyond_the_nodes_is_one_sentence(cluster, tmp_path):
    """target=slurm's defaults ask 8 CPUs per task; on 2-CPU nodes the refusal names slurm.cpus_per_task and what
    fits (issue 30.9: sbatch's "Requested node configuration is not available"). Nothing is written or submitted."""
    p = run_cli(["run", "target=slurm", "slurm.gpus_per_node=0", f"run.dir={tmp_path}/runs", "run.name=cpu"], cwd=tmp_path)
    cpus = int(subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True).stdout.split()[0].rstrip("+"))
    assert p.returncode == 2 and p.stderr.strip() == (
        f"scaleout: error: slurm.cpus_per_task=8 x 1 task(s) per node needs 8 CPUs on each node but the nodes of the "
        f"default partition have at most {cpus} (sinfo); set slurm.cpus_per_task={cpus}."), p.stderr
    p = run_cli(["run", *_args(tmp_path, "run.name=cpu", "devices=2", "slurm.cpus_per_task=2")], cwd=tmp_path)
    assert p.returncode == 2 and "needs 4 CPUs on each node" in p.stderr and "set slurm.cpus_per_task=1." in p.stderr, p.stderr
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- a cluster of its own with JobRequeue=0

NOREQUEUE_PORTS = (6917, 6918)  # its slurmctld and slurmd; scripts/slurm-local.sh uses 6817, 6818, 6821, 6822


@pytest.fixture(scope="module")
def norequeue_cluster(cluster, tmp_path_factory):
    """A second, private SLURM cluster on this host whose slurm.conf says JobRequeue=0 (a job is requeueable only if
    submitted with --requeue), for the tests that need it. JobRequeue is a controller-wide setting, and changing it on
    the shared cluster would make every other user's jobs non-requeueable meanwhile, so this cluster has its own
    slurmctld and slurmd (its own ports, state, spool, logs and pid files under a temporary directory; the shared
    munged), reached through SLURM_CONF by the test's commands and the jobs they submit. Both daemons run in the
    foreground as this fixture's children and are stopped by it."""
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    d = tmp_path_factory.mktemp("norequeue")
    mem = int(open("/proc/meminfo").read().split("MemTotal:")[1].split()[0]) // 1024 // 2
    conf = d / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=scaleout-norequeue", f"SlurmctldHost={host}", f"SlurmctldPort={NOREQUEUE_PORTS[0]}",
        "AuthType=auth/munge", "AuthInfo=cred_expire=10", "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n", f"SlurmctldLogFile={d}/slurmctld.log",
        f"SlurmdLogFile={d}/slurmd-%n.log", f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "ReturnToService=2", "MpiDefault=none", "KillWait=10",
        "SchedulerParameters=defer_batch=0",
        "JobRequeue=0",
        f"NodeName={host} Port={NOREQUEUE_PORTS[1]} CPUs={os.cpu_count()} RealMemory={mem} State=UNKNOWN",
        f"PartitionName=norequeue Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", ""]))
    (d / "state").mkdir()
    (d / "spool" / host).mkdir(parents=True)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=d)
               for argv in (["slurmctld", "-D", "-f", str(conf)], ["slurmd", "-D", "-N", host, "-f", str(conf)])]
    try:
        deadline = time.time() + 60
        while True:
            p = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            if p.returncode == 0 and p.stdout.strip() in ("idle", "mixed", "allocated"):
                break
            if time.time() > deadline or any(x.poll() is not None for x in daemons):
                pytest.fail(f"the JobRequeue=0 cluster did not come up: {p.stdout} {p.stderr}; see {d}/*.log")
            time.sleep(0.5)
        yield {"SLURM_CONF": str(conf)}
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True)  # only this private cluster's jobs
        for x in daemons:
            x.terminate()
        for x in daemons:
            try:
                x.wait(timeout=30)
            except subprocess.TimeoutExpired:
                x.kill()


@pytest.mark.slow
def test_preemption_resumes_on_a_cluster_with_jobrequeue_0(norequeue_cluster, tmp_path):
    """On a cluster with JobRequeue=0, a job is requeueable only when submitted with --requeue; scaleout's is, so
    USR2 (a preemption or the time limit coming) makes the trainer save and stop, submitit's `scontrol requeue`
    succeeds, and the cell resumes from its checkpoint (issue 24.17: without the flag the requeue fails with
    ESLURM_DISABLED and the job dies instead)."""
    env = norequeue_cluster
    p = run_cli(["run", *_args(tmp_path, "run.name=nrq", "train.steps=6", "checkpoint.every=0", "checkpoint.async=false")],
                cwd=tmp_path, env={**env, "SCALEOUT_FAULT": "hold@3"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    run = tmp_path / "runs" / "nrq"
    job_id = json.loads((run / "jobs.json").read_text())["cells"]["jax-d1"]["job_id"]
    metrics = run / "jax-d1" / "metrics.jsonl"
    show = subprocess.run(["scontrol", "show", "job", job_id], env={**os.environ, **env}, capture_output=True, text=True).stdout
    assert "Requeue=1" in show, show
    deadline = time.time() + 300
    while not metrics.is_file() or metrics.read_text().count('"kind": "step"') < 2:
        assert time.time() < deadline, "the job wrote no 2 steps in 300 s"
        time.sleep(0.3)
    subprocess.run(["scancel", "--signal=USR2", job_id], env={**os.environ, **env}, check=True)
    deadline = time.time() + 600
    while subprocess.run(["squeue", "-h", "-j", job_id], env={**os.environ, **env}, capture_output=True, text=True).stdout.strip():
        assert time.time() < deadline, "the job was still queued 600 s after USR2"
        time.sleep(2)
    sums = [json.loads(l) for l in metrics.read_text().splitlines() if '"kind": "summary"' in l]
    status = run_cli(["status", str(run)], cwd=tmp_path, env=env).stdout
    assert len(sums) == 2, (sums, status)
    assert sums[0]["status"] == "stopped" and sums[0]["steps"] == 3, sums
    assert sums[1]["status"] == "ok" and sums[1]["resumed_from_step"] == 3 and sums[1]["steps"] == 6, sums
    assert "requeued 1x" in status and " ok " in status, status

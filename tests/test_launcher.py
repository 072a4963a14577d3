"""The launcher's promises: modules that import alone, one orchestrator for every target,
checkpoints owned by their run, one owner per cell, children that die with their launcher."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, processes_mentioning, run_cli, wait_for
from test_layering import modules as _modules

PACKAGES = ("launch", "jaxrun", "torchrun_fsdp")
SLOW_HANG = ["train.steps=40", "checkpoint.every=0"]


def test_every_module_imports_alone_and_launch_needs_no_framework():
    """Each `launch` module imports alone in a fresh interpreter (an import cycle that only bites in one
    order fails here) without loading jax or torch; the trainers' modules import too."""
    heavy = "sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'torch', 'flax', 'orbax'))"
    for name, _ in _modules("launch"):
        if name.endswith("__main__"):
            continue
        p = subprocess.run([sys.executable, "-c", f"import importlib, json, sys; importlib.import_module({name!r}); print(json.dumps({heavy}))"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (name, p.stderr[-2000:])
        assert json.loads(p.stdout.strip().splitlines()[-1]) == [], name
    names = [m for pkg in PACKAGES[1:] for m, _ in _modules(pkg) if not m.endswith("__main__")]
    p = subprocess.run([sys.executable, "-c", f"import importlib\nfor n in {names!r}:\n    importlib.import_module(n)"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]


def test_plan_slurm_without_slurm_installed(tmp_path):
    """`plan target=slurm` renders submitit's script on a machine without srun/sbatch (exit 0)."""
    bare = tmp_path / "bin"
    bare.mkdir()
    os.symlink(sys.executable, bare / "python")
    env = {"PATH": str(bare)}
    p = run_cli(["plan", "target=slurm", "devices=4", "slurm.devices_per_node=2", f"run.dir={tmp_path}/runs"], tmp_path, env=env)
    assert p.returncode == 0, p.stderr
    assert "#SBATCH --nodes=2" in p.stdout and "#SBATCH --ntasks-per-node=2" in p.stdout
    assert "srun --unbuffered" in p.stdout and "submitit.core._submit" in p.stdout
    assert not (tmp_path / "runs").exists()


def test_plan_script_is_the_one_submitted(tmp_path):
    """The plan's script and the submitted script come from one executor (only the job folder differs)."""
    from launch import config
    from launch.targets.slurm import submitit_api, target as slurm
    cfg = config.load(["target=slurm", "devices=2", "slurm.devices_per_node=2", "slurm.partition=debug"])
    folder = tmp_path / "slurm" / "%j"
    ex = slurm.build_executor(cfg, folder)
    assert slurm.render_script(cfg, folder) == submitit_api.render(ex)
    assert "--wckey" not in slurm.render_script(cfg, folder) or cfg.slurm.wckey


def test_same_run_name_in_another_run_dir_starts_fresh(tmp_path):
    """Checkpoints default to the run directory: a fresh run.dir never resumes another run's checkpoint."""
    common = ["run.name=same", "train.steps=4", "checkpoint.every=2", f"jax.cache_dir={tmp_path}/jc"]
    a = run_cli(["run", f"run.dir={tmp_path}/a", *common], tmp_path)
    assert a.returncode == 0, a.stderr[-2000:]
    assert list((tmp_path / "a" / "same" / "jax-d1" / "checkpoints").iterdir())
    b = run_cli(["run", f"run.dir={tmp_path}/b", *common], tmp_path)
    assert b.returncode == 0, b.stderr[-2000:]
    recs = [json.loads(l) for l in (tmp_path / "b" / "same" / "jax-d1" / "metrics.jsonl").read_text().splitlines()]
    s = [r for r in recs if r["kind"] == "summary"][-1]
    assert s["resumed_from_step"] is None and [r["step"] for r in recs if r["kind"] == "step"][0] == 1


def test_shared_checkpoint_dir_of_another_run_is_refused(tmp_path):
    """An explicit checkpoint.dir that holds another run's checkpoints: one sentence, exit 2, nothing touched."""
    common = ["run.name=same", "train.steps=2", f"checkpoint.dir={tmp_path}/ckpt", f"jax.cache_dir={tmp_path}/jc"]
    a = run_cli(["run", f"run.dir={tmp_path}/a", *common], tmp_path)
    assert a.returncode == 0, a.stderr[-2000:]
    before = sorted(str(p) for p in (tmp_path / "ckpt").rglob("*"))
    b = run_cli(["run", f"run.dir={tmp_path}/b", *common], tmp_path)
    assert b.returncode == 2
    err = b.stderr.strip().splitlines()
    assert len(err) == 1 and "checkpoint.dir" in err[0] and "already holds checkpoints of run" in err[0], b.stderr
    assert not (tmp_path / "b").exists()
    assert sorted(str(p) for p in (tmp_path / "ckpt").rglob("*")) == before


def test_checkpoint_load_from_is_checked_before_the_cell_is_written(tmp_path, scaleout):
    """Issue 24.11: a checkpoint.load_from that does not exist, holds the other framework's checkpoints, only
    incomplete ones, or is a cell directory is one sentence (exit 2, nothing written); the trainer said only
    "holds no complete checkpoint" after the cell was written. A cell with its own checkpoint does not read it."""
    src = tmp_path / "src"
    (src / "step_4").mkdir(parents=True)
    (src / "step_4" / "COMMIT").write_text("4")  # a committed PyTorch (DCP) step
    (src / "6.orbax-checkpoint-tmp-1700000000").mkdir()  # an unfinished Orbax one
    (tmp_path / "cell" / "checkpoints" / "3" / "state").mkdir(parents=True)  # a cell directory with a JAX step
    run = ["run", f"run.dir={tmp_path / 'runs'}"]
    cases = [
        ([f"checkpoint.load_from={tmp_path / 'nope'}"], f"checkpoint.load_from={str(tmp_path / 'nope')!r} does not exist; "
                                                       "give the checkpoint directory of a jax cell"),
        ([f"checkpoint.load_from={src}"], f"checkpoint.load_from={str(src)!r} holds torch checkpoints (steps 4), which a "
                                          "framework=jax cell cannot load"),
        ([f"checkpoint.load_from={src}", "framework=torch", "checkpoint.async=false"], None),
        ([f"checkpoint.load_from={tmp_path / 'cell'}"], f"checkpoint.load_from={str(tmp_path / 'cell')!r} is a cell "
                                                       f"directory; give its checkpoint directory, checkpoint.load_from="
                                                       f"{tmp_path / 'cell' / 'checkpoints'}."),
        ([f"checkpoint.load_from={tmp_path / 'cell' / 'checkpoints'}"], None),
    ]
    for extra, message in cases:
        for verb in ("plan", "run"):
            if verb == "run" and message is None:
                continue
            code, out, err = scaleout(*([verb] + run[1:] if verb == "plan" else run), *extra)
            if message is None:
                assert code == 0, err
                continue
            assert code == 2 and out == "" and err.count("\n") == 1 and message in err, (verb, extra, err)
            assert not (tmp_path / "runs").exists()
    (src / "step_4").rename(src / "step_4.corrupt")
    code, _, err = scaleout(*run, f"checkpoint.load_from={src}")
    assert code == 2 and "holds no complete jax checkpoint (only incomplete saves: 6.orbax-checkpoint-tmp-1700000000)" in err
    # a cell that has its own checkpoint continues from it: load_from is not read, so not checked
    own = tmp_path / "ck" / "tiny" / "jax-d1"
    (own / "2" / "state").mkdir(parents=True)
    code, _, err = scaleout("plan", f"run.dir={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ck'}",
                            f"checkpoint.load_from={tmp_path / 'nope'}")
    assert code == 0, err


def test_run_refuses_a_finished_cell_with_other_math(tmp_path):
    """`scaleout run` with different math on an existing cell is refused before anything is written (issue 13.4)."""
    args = ["run", f"run.dir={tmp_path}/runs", "run.name=r", "train.steps=2", f"jax.cache_dir={tmp_path}/jc"]
    assert run_cli(args, tmp_path).returncode == 0
    cell = tmp_path / "runs" / "r" / "jax-d1"
    config_before, metrics_before = (cell / "config.yaml").read_text(), (cell / "metrics.jsonl").read_text()
    ckpt_before = sorted((str(p), p.stat().st_mtime_ns) for p in (cell / "checkpoints").rglob("*"))
    assert ckpt_before
    p = run_cli([*args, "model.d_model=32"], tmp_path)
    assert p.returncode == 2 and "already holds cell jax-d1 with a different config" in p.stderr, p.stderr
    assert (cell / "config.yaml").read_text() == config_before and (cell / "metrics.jsonl").read_text() == metrics_before
    assert sorted((str(p), p.stat().st_mtime_ns) for p in (cell / "checkpoints").rglob("*")) == ckpt_before
    p = run_cli(["status", str(tmp_path / "runs" / "r")], tmp_path)
    assert " ok " in p.stdout, p.stdout


def _steps(cell):
    path = cell / "metrics.jsonl"
    return path.is_file() and any('"kind": "step"' in l for l in path.read_text().splitlines())


def _pids_with(text):
    return [pid for pid, _ in processes_mentioning(text)]


def _launch(tmp_path, *extra, env=None):
    args = [sys.executable, "-m", "launch", "run", f"run.dir={tmp_path}/runs", "run.name=r", f"jax.cache_dir={tmp_path}/jc", *extra]
    return subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_second_launcher_on_a_running_cell_is_refused(tmp_path):
    """One owner per cell: a second `scaleout run` on a cell being run is refused naming the holder (issue 13.1)."""
    first = _launch(tmp_path, *SLOW_HANG, env={"SCALEOUT_FAULT": "hang@3"})
    cell = tmp_path / "runs" / "r" / "jax-d1"
    try:
        wait_for(lambda: _steps(cell), what="the first run's steps")
        second = run_cli(["run", f"run.dir={tmp_path}/runs", "run.name=r", f"jax.cache_dir={tmp_path}/jc", *SLOW_HANG], tmp_path)
        assert second.returncode == 2
        assert f"cell jax-d1 is being run by PID {first.pid}" in second.stderr, second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
    assert not _pids_with(str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_sigterm_to_the_launcher_stops_its_trainers(tmp_path, framework):
    """SIGTERM to `scaleout run` stops every trainer process, even a hung one, and exits 143 (issue 13.2/13.3)."""
    p = _launch(tmp_path, f"framework={framework}", "devices=2", *SLOW_HANG, env={"SCALEOUT_FAULT": "hang@3"})
    cell = tmp_path / "runs" / "r" / f"{framework}-d2"
    wait_for(lambda: _steps(cell), what="steps")
    assert _pids_with(str(cell)), "no trainer running?"
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 143
    wait_for(lambda: not _pids_with(str(cell)), timeout=30, what="trainers to exit")
    assert time.monotonic() - t0 < 40


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_sigkill_of_the_launcher_takes_its_trainers_down(tmp_path, framework):
    """A launcher killed with SIGKILL leaves no trainer behind (issue 13.2)."""
    p = _launch(tmp_path, f"framework={framework}", "devices=2", *SLOW_HANG, env={"SCALEOUT_FAULT": "hang@3"})
    cell = tmp_path / "runs" / "r" / f"{framework}-d2"
    wait_for(lambda: _steps(cell), what="steps")
    p.kill()
    p.wait()
    wait_for(lambda: not _pids_with(str(cell)), timeout=30, what="orphaned trainers to exit")


@pytest.mark.slow
def test_trainer_killed_by_a_signal_exits_like_a_shell(tmp_path):
    """A trainer killed by SIGKILL makes `scaleout run` exit 137 (128 + 9), not 247 (issue 13.12)."""
    p = _launch(tmp_path, *SLOW_HANG, env={"SCALEOUT_FAULT": "hang@3"})
    cell = tmp_path / "runs" / "r" / "jax-d1"
    wait_for(lambda: _steps(cell), what="steps")
    for pid in _pids_with(f"{cell}/config.yaml"):
        os.kill(pid, signal.SIGKILL)
    assert p.wait(timeout=60) == 137
    assert "was killed by SIGKILL" in p.stderr.read()


@pytest.mark.slow
@pytest.mark.parametrize("framework,extra", [("jax", ["local.processes=2"]), ("torch", [])])
def test_sigterm_lets_multiprocess_trainers_save_and_stop(tmp_path, framework, extra):
    """SIGTERM to the launcher: every trainer process (two JAX processes joined by jax.distributed, whose runtime
    installs its own SIGTERM handler; two torch ranks) finishes its step, saves and writes a `stopped` summary."""
    p = _launch(tmp_path, f"framework={framework}", "devices=2", *extra, "train.steps=40", "checkpoint.every=0",
                "checkpoint.async=false", env={"SCALEOUT_FAULT": "hold@3"})
    cell = tmp_path / "runs" / "r" / f"{framework}-d2"
    wait_for(lambda: _steps(cell), what="steps")
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=90) == 143
    recs = [json.loads(l) for l in (cell / "metrics.jsonl").read_text().splitlines()]
    s = [r for r in recs if r["kind"] == "summary"][-1]
    assert s["status"] == "stopped" and s["steps"] == 3 and s["stopped_by"] in ("SIGTERM", "peer"), s
    assert any(r["kind"] == "checkpoint" and r["step"] == 3 for r in recs)


def test_the_cause_of_a_group_failure_is_not_the_peer_that_lost_it(tmp_path):
    """Two processes fail; the one that ends first only lost its peer (what gloo says when the other
    side died). The report names the other one, whose failure is its own."""
    import sys as _sys

    from launch.targets import procs
    victim = "import sys; print('Gather failed: [gloo/transport/tcp/pair.cc:538] Read error: Connection reset by peer', flush=True); sys.exit(1)"
    cause = "import sys, time; time.sleep(0.2); print('RuntimeError: injected crash at step 3', flush=True); sys.exit(1)"
    r = procs.run_group([procs.Spec("worker-0", [_sys.executable, "-c", victim]),
                         procs.Spec("worker-1", [_sys.executable, "-c", cause])], tmp_path, echo=False)
    assert r.returncode == 1 and r.failed == "worker-1", r
    assert any("injected crash" in line for line in r.tail)

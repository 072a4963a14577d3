"""What a new user meets in the first hour (issue 30): chunked runs that advance and say when they are at
their stop, CPU runs that never load libtpu, a quiet `-q`, gcloud's whole error, a `status` header, SLURM
cells' logs under CELL/logs/, the report's warning on the plots, `plan` of a sweep, `plan --compile` of
a PyTorch cell."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import run_cell, run_cli, summary
from test_slurm import CLUSTER, cluster  # noqa: F401 -- the real cluster's fixture (skips here, fails in CI, without one)

from launch import config
from launch.common import envvars
from launch.core import gpus
from launch.core.loop import stop_step
from launch.targets import procs

# --------------------------------------------------------------------------- train.stop_every / stop_after (30.4)


def test_stop_step_is_the_next_chunk_boundary_or_stop_after_or_the_end():
    t = config.load(["train.steps=25", "train.stop_every=10"]).train
    assert [stop_step(t, s) for s in (0, 9, 10, 15, 20, 24, 25)] == [10, 10, 20, 20, 25, 25, 25]
    t = config.load(["train.steps=25", "train.stop_every=10", "train.stop_after=12"]).train
    assert [stop_step(t, s) for s in (0, 10, 12)] == [10, 12, 12]
    assert stop_step(config.load(["train.steps=25"]).train, 3) == 25


def test_stop_every_is_not_math():
    a, b = config.load([]), config.load(["train.stop_every=5", "train.stop_after=3"])
    assert config.math_hash(a) == config.math_hash(b)


@pytest.mark.slow
def test_a_cell_at_its_stop_after_trains_nothing_and_says_so(tmp_path):
    base = ["run.name=stop", "train.steps=3", "checkpoint.async=false"]
    p, recs = run_cell(tmp_path, *base, "train.stop_after=1")
    assert (summary(recs)["status"], summary(recs)["steps"]) == ("stopped", 1)
    start = next(r for r in recs if r["kind"] == "start")
    assert start["settings"]["jax_platforms"] == "cpu"  # no accelerator here: jax never looked for a TPU (30.8)
    log = (tmp_path / "runs" / "stop" / "jax-d1" / "logs" / "jax.log").read_text()
    assert "libtpu" not in log and "TPU" not in log, log
    metrics = tmp_path / "runs" / "stop" / "jax-d1" / "metrics.jsonl"
    before = metrics.read_text()
    p, _ = run_cell(tmp_path, *base, "train.stop_after=1")  # the same command again
    assert "cell jax-d1: already at step 1 of 3, where train.stop_after=1 stops it: nothing to train" in p.stdout, p.stdout
    assert "train.stop_every=N" in p.stdout and "steps 2..1" not in p.stdout
    assert metrics.read_text() == before, "a rerun at its stop wrote records (a summary of 0 tokens/s)"
    p, recs = run_cell(tmp_path, *base)  # without the stop: the same math, so it resumes and finishes
    s = summary(recs)
    assert (s["status"], s["steps"], s["resumed_from_step"]) == ("ok", 3, 1), s


# --------------------------------------------------------------------------- no libtpu on CPU, a quiet -q (30.8)


def test_cpu_only_reads_the_device_files_and_the_gpu_restriction(tmp_path):
    dev = tmp_path / "dev"
    (dev / "vfio").mkdir(parents=True)
    (dev / "vfio" / "vfio").touch()  # the VFIO control node alone is no TPU
    assert gpus.cpu_only({}, dev)
    (dev / "nvidia0").touch()
    assert not gpus.cpu_only({}, dev)
    assert gpus.cpu_only({"CUDA_VISIBLE_DEVICES": ""}, dev)  # GPUs hidden on purpose
    assert not gpus.cpu_only({"CUDA_VISIBLE_DEVICES": "0,1"}, tmp_path / "none")  # SLURM gave GPUs (fake ones too)
    (dev / "nvidia0").unlink()
    (dev / "vfio" / "0").touch()  # a v5e chip
    assert not gpus.cpu_only({}, dev)
    (dev / "vfio" / "0").unlink()
    (dev / "accel0").touch()  # a v4 chip
    assert not gpus.cpu_only({"CUDA_VISIBLE_DEVICES": ""}, dev)


def test_local_jax_cells_on_this_cpu_machine_get_jax_platforms_cpu(tmp_path, monkeypatch):
    from launch.targets import local
    monkeypatch.delenv(envvars.JAX_PLATFORMS, raising=False)
    for var in gpus.VISIBILITY_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    assert gpus.cpu_only(os.environ), "this test needs a machine without GPU or TPU devices"
    for extra in ([], ["local.processes=2"]):
        cfg = config.load(["devices=2", *extra])
        envs = [p.env for p in local.build(cfg, tmp_path).processes]
        assert all(e[envvars.JAX_PLATFORMS] == "cpu" for e in envs), envs
    torch_env = local.build(config.load(["framework=torch"]), tmp_path).processes[0].env
    assert envvars.JAX_PLATFORMS not in torch_env
    monkeypatch.setenv(envvars.JAX_PLATFORMS, "cuda")  # the user's own choice is kept
    assert envvars.JAX_PLATFORMS not in local.build(config.load([]), tmp_path).processes[0].env


def test_with_that_environment_jax_never_loads_libtpu(tmp_path, monkeypatch):
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed here (the tpu-aot extra; `make test` installs it): nothing could load it")
    from launch.targets import local
    monkeypatch.delenv(envvars.JAX_PLATFORMS, raising=False)
    env = {k: v for k, v in os.environ.items() if k != envvars.JAX_PLATFORMS}
    probe = "import jax; jax.devices(); print('libtpu.so' in open('/proc/self/maps').read())"
    spec = local.build(config.load([]), tmp_path).processes[0]
    with_env = subprocess.run([sys.executable, "-c", probe], env={**env, **spec.env}, capture_output=True, text=True)
    without = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert with_env.stdout.strip() == "False", with_env.stderr
    assert without.stdout.strip() == "True", "jax did not load an installed libtpu without JAX_PLATFORMS: the check proves nothing"


def test_the_jax_trainer_restricts_itself_to_the_cpu(monkeypatch):
    import jaxrun.__main__ as entry
    for var in (envvars.JAX_PLATFORMS, envvars.DISTRIBUTED, *gpus.VISIBILITY_VARIABLES):
        monkeypatch.delenv(var, raising=False)
    entry.setup_platform()
    assert os.environ[envvars.JAX_PLATFORMS] == "cpu"
    monkeypatch.delenv(envvars.JAX_PLATFORMS)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # GPUs given: jax must find them (or check_platform refuses)
    entry.setup_platform()
    assert envvars.JAX_PLATFORMS not in os.environ
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv(envvars.DISTRIBUTED, "tpu")  # a TPU worker
    entry.setup_platform()
    assert envvars.JAX_PLATFORMS not in os.environ


def test_slurm_jax_tasks_on_a_cpu_node_get_jax_platforms_cpu(monkeypatch):
    from launch.targets.slurm.job import CellJob
    for var in (envvars.JAX_PLATFORMS, *gpus.VISIBILITY_VARIABLES):
        monkeypatch.delenv(var, raising=False)
    env = CellJob("/nonexistent/cell", "jax").trainer_env()
    assert env[envvars.JAX_PLATFORMS] == "cpu" and env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert envvars.JAX_PLATFORMS not in CellJob("/nonexistent/cell", "jax").trainer_env()


CHATTY = ("import sys; print('[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1'); "
          "print('I1201 09:00:00.123456  4242 cpu_client.cc:1] initialised'); "
          "print('[scaleout] warning: something to see', file=sys.stderr)")


@pytest.mark.parametrize("level,shown", [(logging.WARNING, False), (logging.INFO, True)])
def test_quiet_keeps_native_chatter_off_the_console_but_in_the_log(tmp_path, capsys, level, shown):
    logger = logging.getLogger("launch")
    old = logger.level
    logger.setLevel(level)
    try:
        r = procs.run_group([procs.Spec("p", [sys.executable, "-c", CHATTY])], tmp_path)
    finally:
        logger.setLevel(old)
    assert r.returncode == 0
    out = capsys.readouterr().out
    assert "[scaleout] warning: something to see" in out  # warnings and errors always
    assert ("[Gloo] Rank 0" in out) is shown and ("cpu_client.cc" in out) is shown, out
    logged = (tmp_path / "p.log").read_text()
    assert "[Gloo] Rank 0" in logged and "cpu_client.cc" in logged


# --------------------------------------------------------------------------- gcloud's whole error (30.10)

NO_ACCOUNT = """ERROR: (gcloud.compute.tpus.queued-resources.create) You do not currently have an active account selected.
Please run:

  $ gcloud auth login

to obtain new credentials.

If you have already authenticated with a different account, run:

  $ gcloud config set account ACCOUNT

to select an already authenticated account to use.
"""


def test_gcloud_error_is_the_whole_error_message():
    from launch.targets.tpu.commands import gcloud_error
    text = gcloud_error("WARNING: something first\n" + NO_ACCOUNT)
    assert text.startswith("ERROR: (gcloud.compute.tpus.queued-resources.create) You do not currently have an active "
                           "account selected. Please run: $ gcloud auth login to obtain new credentials."), text
    assert text.endswith("to select an already authenticated account to use."), text
    assert gcloud_error("", "", 3) == "exit code 3"
    assert gcloud_error("a\nlast words\n") == "last words"
    assert len(gcloud_error("ERROR: " + "x" * 5000)) <= 1200


def test_a_gcloud_refusal_reaches_the_user_whole(tmp_path):
    from test_tpu import Fake, _args
    fake = Fake(tmp_path)
    p = run_cli(_args(tmp_path, fake), cwd=tmp_path, env={**fake.env, "FAKE_GCLOUD_NO_ACCOUNT": "1"}, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert ("scaleout: error: creating the queued resource failed: ERROR: (gcloud.compute.tpus.queued-resources.create) "
            "You do not currently have an active account selected. Please run: $ gcloud auth login") in p.stderr, p.stderr
    assert "to select an already authenticated account to use." in p.stderr


# --------------------------------------------------------------------------- status header, SLURM logs (30.11)


def _hand_made_cell(run_dir: Path, name: str, fw: str, devices: int, kind: str = "cpu", cores: int = 2):
    d = run_dir / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(config.to_dict(config.load([f"framework={fw}", f"devices={devices}"]))))
    s = {"tokens_per_s": 1000.0 * devices, "tokens_per_s_per_device": 1000.0, "time_to_first_step_s": 5.0,
         "step_time_p50_s": 0.1, "step_time_mean_s": 0.1, "step_time_p90_s": 0.1, "compile_s": 2.0, "mfu": 0.1,
         "peak_memory_bytes": 2**28, "final_loss": 3.0, "steps": 20, "error": None}
    recs = [{"kind": "start", "framework": fw, "devices": devices, "device_kind": kind, "host_cores": cores, "host": "h"},
            {"kind": "step", "step": 20, "loss": 3.0},
            {"kind": "summary", "framework": fw, "devices": devices, "processes": 1, "status": "ok", **s}]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_status_has_a_header_and_no_cryptic_local_columns(tmp_path, scaleout):
    run = tmp_path / "runs" / "r"
    _hand_made_cell(run, "jax-d1", "jax", 1)
    code, out, err = scaleout("status", str(run))
    assert code == 0, err
    head, row = out.splitlines()[:2]
    assert head.split() == ["cell", "job", "job", "state", "status", "step", "reached", "last", "loss"], head
    assert row.split()[:5] == ["jax-d1", "-", "-", "ok", "step"] and "LOCAL" not in out, row
    assert head.index("status") == row.index("ok")  # the columns line up under their names


def test_a_slurm_task_links_its_logs_into_the_cell(tmp_path, monkeypatch):
    from launch.targets.slurm.job import link_logs
    folder, cell = tmp_path / "run" / "slurm" / "77", tmp_path / "run" / "jax-d2"
    folder.mkdir(parents=True)
    cell.mkdir()
    for k, v in {"SUBMITIT_FOLDER": str(folder), "SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "77", "SLURM_PROCID": "1",
                 "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1",
                 "SLURM_JOB_NODELIST": "n1"}.items():
        monkeypatch.setenv(k, v)
    for var in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(var, raising=False)
    (folder / "77_1_log.out").write_text("the task's stdout\n")
    link_logs(cell)
    link_logs(cell)  # a requeued task links again
    out = cell / "logs" / "slurm-77-task1.out"
    assert out.is_symlink() and not os.path.isabs(os.readlink(out)) and out.read_text() == "the task's stdout\n"
    assert (cell / "logs" / "slurm-77-task1.err").is_symlink()
    assert sorted(p.name for p in (cell / "logs").iterdir()) == ["slurm-77-task1.err", "slurm-77-task1.out"]


# --------------------------------------------------------------------------- the report (30.12)


def test_plots_carry_the_simulated_devices_warning(tmp_path):
    from PIL import Image

    from launch.report import report

    def foot_has_warning_colour(png: Path) -> bool:
        im = Image.open(png).convert("RGB")
        w, h = im.size
        target = tuple(int(report.WARNING_COLOUR[i:i + 2], 16) for i in (1, 3, 5))
        foot = im.crop((0, int(h * 0.9), w, h))
        colours = [c for _, c in foot.getcolors(foot.width * foot.height)]
        return any(all(abs(a - b) < 40 for a, b in zip(c, target)) for c in colours)

    for name, kind, warned in (("sim", "cpu", True), ("real", "NVIDIA H100", False)):
        run = tmp_path / name
        for fw in ("jax", "torch"):
            for n in (1, 2):
                _hand_made_cell(run, f"{fw}-d{n}", fw, n, kind=kind)
        out = report.write(run)
        assert len(out["plots"]) == 4
        md = out["md"].read_text()
        assert all(f"\n## {section}\n" in md for section in report.READ_FIRST)  # what a sweep says to read first
        for png in out["plots"]:
            text = Image.open(png).text.get("Description", "")
            assert ("functional dry run" in text) is warned, (png, text)
            assert foot_has_warning_colour(png) is warned, png


# --------------------------------------------------------------------------- plan (30.13)


def test_plan_of_a_sweep_lists_the_sweeps_cells(scaleout):
    code, out, err = scaleout("plan", "sweep=cpu")
    assert code == 0, err
    last = out.strip().splitlines()[-1]
    assert "this plan is the one cell of framework=jax devices=1" in last, last
    assert "would run 6 cell(s): jax-d1 (batch 4), jax-d2 (batch 8), jax-d4 (batch 16), torch-d1 (batch 4)" in last, last
    code, out, _ = scaleout("plan", "--json", "sweep.devices=[3]")
    assert code == 0 and "not divisible by the smallest sweep device count 3" in json.loads(out)["sweep"]["error"]


def test_plan_compile_of_a_torch_cell_says_compile_and_flops(scaleout):
    from launch.core import flops
    code, out, err = scaleout("plan", "--compile", "framework=torch", "devices=2")
    assert code == 0, err
    assert "compile: none ahead of time (PyTorch runs eagerly" in out, out
    cfg = config.load(["framework=torch", "devices=2"])
    per_device = flops.flops_per_token(cfg.model) * cfg.train.global_batch * cfg.model.seq_len / 2
    assert f"flops/step per device: formula {per_device:,.0f}" in out, out


@pytest.mark.slow
def test_a_slurm_cell_has_its_logs_in_the_cell_and_runs_jax_on_the_cpu_alone(cluster, tmp_path):
    """On the real cluster: CELL/logs/ holds links to the task's submitit files, `scaleout logs` prints each file
    once, and the JAX trainer of a CPU node ran with JAX_PLATFORMS=cpu (nothing from libtpu in its log)."""
    args = ["run", f"run.dir={tmp_path}/runs", f"jax.cache_dir={tmp_path}/jc", *CLUSTER, "devices=2", "train.steps=2",
            "run.name=sl", "slurm.wait=true", "checkpoint.async=false"]
    p = run_cli(args, cwd=tmp_path, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    run, cell = tmp_path / "runs" / "sl", tmp_path / "runs" / "sl" / "jax-d2"
    job = json.loads((run / "jobs.json").read_text())["cells"]["jax-d2"]["job_id"]
    links = sorted(p.name for p in (cell / "logs").iterdir())
    assert links == [f"slurm-{job}-task{t}.{k}" for t in (0, 1) for k in ("err", "out")], links
    for name in links:
        target = (cell / "logs" / name).resolve()
        assert target.parent == (run / "slurm" / job).resolve() and target.is_file(), (name, target)
    out = (cell / "logs" / f"slurm-{job}-task0.out").read_text() + (cell / "logs" / f"slurm-{job}-task0.err").read_text()
    assert "[scaleout] ok: 2 steps" in out and "libtpu" not in out and "TPU" not in out, out[-3000:]
    start = next(json.loads(l) for l in (cell / "metrics.jsonl").read_text().splitlines() if '"start"' in l)
    assert start["settings"]["jax_platforms"] == "cpu", start["settings"]
    logs = run_cli(["logs", str(run), "jax-d2"], cwd=tmp_path)
    assert logs.returncode == 0 and logs.stdout.count("[scaleout] ok: 2 steps") == 1, logs.stdout[-3000:]

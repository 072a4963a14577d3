"""The JAX trainer, run for real: sharding does not change the math, checkpoints resume exactly."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import losses, run_cell, summary

pytestmark = pytest.mark.slow
STEPS = ["train.steps=12", "checkpoint.async=false"]


def curve(recs):
    d = losses(recs)
    return np.array([d[k] for k in sorted(d)])


def test_loss_decreases_over_30_steps(tmp_path):
    _, recs = run_cell(tmp_path, "train.steps=30")
    c = curve(recs)
    assert len(c) == 30
    assert c[-5:].mean() < c[:3].mean() - 1.0, c
    s = summary(recs)
    assert s["status"] == "ok" and s["framework"] == "jax" and s["steps"] == 30
    for key in ("compile_s", "time_to_first_step_s", "step_time_p50_s", "step_time_p90_s", "tokens_per_s",
                "tokens_per_s_per_device", "mfu", "flops_per_token", "peak_flops_per_device", "params", "bytes_per_device"):
        assert s[key] is not None and s[key] != 0, key
    step = [r for r in recs if r["kind"] == "step"][-1]
    assert set(step) >= {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu"}
    assert [r for r in recs if r["kind"] == "compile"][0]["seconds"] > 0


def test_sharding_does_not_change_the_math(tmp_path):
    layouts = [
        ["devices=1"],
        ["devices=2"],
        ["devices=4"],  # fsdp=4
        ["devices=4", "parallel.fsdp=1", "parallel.data=4"],
        ["devices=4", "parallel.fsdp=1", "parallel.data=2", "parallel.tensor=2"],
        ["devices=2", "train.grad_accum=2"],
    ]
    curves = []
    for i, extra in enumerate(layouts):
        _, recs = run_cell(tmp_path, *STEPS, f"run.name=l{i}", *extra)
        curves.append(curve(recs))
    for c in curves[1:]:
        np.testing.assert_allclose(c, curves[0], rtol=1e-4)


def test_stop_after_then_resume_equals_uninterrupted(tmp_path):
    _, full = run_cell(tmp_path, *STEPS, "run.name=full", "devices=2")
    _, first = run_cell(tmp_path, *STEPS, "run.name=chunk", "devices=2", "train.stop_after=8")
    assert summary(first)["status"] == "stopped" and summary(first)["steps"] == 8
    _, second = run_cell(tmp_path, *STEPS, "run.name=chunk", "devices=2")
    s = summary(second)
    assert s["resumed_from_step"] == 8 and s["steps"] == 12 and s["status"] == "ok"
    assert min(losses(second, since=8)) and min(k for k in losses(second, since=8)) == 9
    np.testing.assert_allclose(s["final_loss"], summary(full)["final_loss"], rtol=1e-6)


def test_sigkill_after_checkpoint_resumes_to_identical_weights(tmp_path):
    from jaxrun_helpers import final_params
    base = [*STEPS, "devices=2", "checkpoint.every=4", "checkpoint.keep=5"]
    run_cell(tmp_path, *base, "run.name=ref")
    args = [sys.executable, "-m", "launch", "run", f"run.dir={tmp_path}/runs", f"checkpoint.dir={tmp_path}/ckpt",
            f"jax.cache_dir={tmp_path}/jaxcache", *base, "run.name=killed"]
    proc = subprocess.Popen(args, cwd=tmp_path, env={**os.environ, "SCALEOUT_FAULT": "hang@7"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    ckpt = tmp_path / "ckpt" / "killed" / "jax-d2"
    deadline = time.time() + 120
    while not (ckpt / "4").is_dir() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (ckpt / "4").is_dir() and not (ckpt / "8").exists()
    _, recs = run_cell(tmp_path, *base, "run.name=killed")
    assert summary(recs)["resumed_from_step"] == 4
    ref, got = final_params(tmp_path / "ckpt" / "ref" / "jax-d2", 12), final_params(ckpt, 12)
    assert ref.keys() == got.keys()
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-6, atol=0, err_msg=k)


def test_checkpoint_from_4_devices_continues_on_2(tmp_path):
    _, full = run_cell(tmp_path, *STEPS, "run.name=full", "devices=4")
    run_cell(tmp_path, *STEPS, "run.name=four", "devices=4", "train.stop_after=6")
    _, two = run_cell(tmp_path, *STEPS, "run.name=two", "devices=2",
                      f"checkpoint.load_from={tmp_path}/ckpt/four/jax-d4")
    assert summary(two)["resumed_from_step"] == 6
    a, b = losses(full, since=6), losses(two, since=6)
    assert sorted(a) == sorted(b) == list(range(7, 13))
    np.testing.assert_allclose([b[k] for k in sorted(b)], [a[k] for k in sorted(a)], rtol=1e-4)


def test_two_processes_match_one_process(tmp_path):
    _, one = run_cell(tmp_path, *STEPS, "run.name=one", "devices=4")
    _, two = run_cell(tmp_path, *STEPS, "run.name=two", "devices=4", "local.processes=2")
    assert summary(two)["processes"] == 2
    np.testing.assert_allclose(curve(two), curve(one), rtol=1e-4)


def test_scan_and_unrolled_agree(tmp_path):
    _, scan = run_cell(tmp_path, *STEPS, "run.name=scan", "model.n_layers=4")
    _, unrolled = run_cell(tmp_path, *STEPS, "run.name=unrolled", "model.n_layers=4", "model.scan_layers=false")
    np.testing.assert_allclose(curve(unrolled), curve(scan), rtol=1e-4)


def test_remat_and_bf16_run(tmp_path):
    _, full = run_cell(tmp_path, *STEPS, "run.name=ref")
    _, remat = run_cell(tmp_path, *STEPS, "run.name=remat", "model.remat=dots")
    np.testing.assert_allclose(curve(remat), curve(full), rtol=1e-4)
    _, bf16 = run_cell(tmp_path, *STEPS, "run.name=bf16", "model.dtype=bf16")
    np.testing.assert_allclose(curve(bf16), curve(full), rtol=5e-2)


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path):
    p, recs = run_cell(tmp_path, *STEPS, "checkpoint.every=2", env={"SCALEOUT_FAULT": "nan@5"}, check=False)
    assert p.returncode != 0
    assert "loss is nan at step 5" in p.stderr + p.stdout
    s = summary(recs)
    assert s["status"] == "failed" and "step 5" in s["error"]
    ckpt = tmp_path / "ckpt" / "tiny" / "jax-d1"
    assert sorted(int(d.name) for d in ckpt.iterdir() if d.name.isdigit()) == [2, 4]


def test_failing_process_surfaces_error(tmp_path):
    p, _ = run_cell(tmp_path, *STEPS, "devices=2", "local.processes=2", env={"SCALEOUT_FAULT": "crash@3:p1"}, check=False)
    assert p.returncode != 0
    assert "process p1 exited with code 1" in p.stderr
    assert "injected crash at step 3" in p.stderr


def test_scan_keeps_compile_time_flat_in_depth(tmp_path):
    """Compile time with scan at 8 layers is less than 1.5x that at 2 layers.

    Measured as this process's CPU time (other processes on a shared machine do not inflate it),
    best of 3, the two depths interleaved."""
    import time

    import jax

    from jaxrun.train import JaxEngine
    from launch import config
    from launch.launcher.rundir import cell_config

    best = {2: float("inf"), 8: float("inf")}
    for i in range(3):
        for layers in (2, 8):
            jax.clear_caches()
            cfg = cell_config(config.load([f"model.n_layers={layers}", f"checkpoint.dir={tmp_path}/c{layers}-{i}",
                                           "checkpoint.async=false", "jax.compilation_cache=false"]), "x")
            engine = JaxEngine(cfg, tmp_path)
            t0 = time.process_time()
            engine.compile()
            best[layers] = min(best[layers], time.process_time() - t0)
    assert best[8] < 1.5 * best[2], best


def test_fsdp4_each_device_holds_a_quarter(tmp_path):
    import jax

    from jaxrun.train import JaxEngine
    from launch import config
    from launch.launcher.rundir import cell_config

    cfg = cell_config(config.load(["devices=4", f"checkpoint.dir={tmp_path}/c", "checkpoint.async=false"]), "x")
    engine = JaxEngine(cfg, tmp_path)
    engine.init_state()
    from jaxrun.mesh import path_name
    for path, leaf in jax.tree_util.tree_flatten_with_path(engine.params)[0]:
        name = path_name(path)
        shards = leaf.addressable_shards
        assert len(shards) == 4
        if "norm" in name:
            assert all(s.data.shape == leaf.shape for s in shards), name  # norms are replicated
        else:
            assert all(s.data.size * 4 == leaf.size for s in shards), name
            assert len({str(s.index) for s in shards}) == 4, name  # four different quarters


@pytest.mark.parametrize("axes", [["parallel.data=4", "parallel.fsdp=1"], ["parallel.data=2", "parallel.fsdp=2"]])
def test_data_parallel_devices_each_hold_their_own_rows(tmp_path, axes):
    """Issue 24.23: a batch sharded over fsdp only leaves the loss unchanged (every data replica computes the same
    rows) but makes the throughput figure wrong. The trainer's own batch arrays, for parallel.data=4 and 2 x 2: each
    device holds a quarter, rows [2i, 2i+2) of the global batch, and no two devices the same rows."""
    from jaxrun.train import JaxEngine
    from launch import config
    from launch.data.batches import Batches
    from launch.launcher.rundir import cell_config

    cfg = cell_config(config.load(["devices=4", *axes, "train.global_batch=8", f"checkpoint.dir={tmp_path}/c",
                                   "checkpoint.async=false"]), "x")
    engine = JaxEngine(cfg, tmp_path)
    T = cfg.model.seq_len
    assert engine.batch_sh.shard_shape((8, T)) == (2, T)
    assert engine.program.microbatch_sh.shard_shape((2, 4, T)) == (2, 1, T)
    want, _ = Batches(cfg.data, cfg.model.vocab_size, T).split(3, 0, 8)
    inputs, _ = engine._batch(3)
    shards = inputs.addressable_shards
    assert sorted(s.index[0].start for s in shards) == [0, 2, 4, 6]
    for s in shards:
        np.testing.assert_array_equal(np.asarray(s.data), want[s.index[0]])


# --------------------------------------------------------------------------- the trainer started directly
# (python -m jaxrun --config CELL/config.yaml, as every target starts it; no launcher involved)

def test_checkpoint_of_another_run_is_refused_unless_load_from(tmp_path):
    from jaxrun_helpers import run_trainer, summary as last, write_cell
    shared = tmp_path / "shared-ckpt"
    a = write_cell(tmp_path / "a", "run.id=run-a", f"checkpoint.dir={shared}", "train.steps=6", "train.stop_after=4",
                   "jax.xla_flags=--xla_force_host_platform_device_count=1")
    p, recs = run_trainer("jax", a)
    assert p.returncode == 0 and last(recs)["status"] == "stopped", p.stderr[-2000:]
    # what the framework was set to is on record: fp32 matmuls without TF32, jax.xla_flags appended
    settings = recs[0]["settings"]
    assert settings["jax_default_matmul_precision"] == "highest" and last(recs)["matmul_precision"] == "highest"
    assert settings["xla_flags"].endswith(" --xla_force_host_platform_device_count=1"), settings
    assert json.loads((shared / "4" / "meta" / "metadata").read_text())["run_id"] == "run-a"
    # run B finds run A's checkpoint where its own would be: refused, in one sentence naming both runs
    b = write_cell(tmp_path / "b", "run.id=run-b", f"checkpoint.dir={shared}", "train.steps=6")
    p, recs = run_trainer("jax", b)
    assert p.returncode == 1
    err = last(recs)["error"]
    assert err.startswith("CheckpointMismatch: ") and "run run-a, not to this run run-b" in err and str(shared) in err
    assert "\n" not in err and f"error (process 0): {err}" in p.stderr
    # ... and accepted when run B starts from it on purpose
    c = write_cell(tmp_path / "c", "run.id=run-b", f"checkpoint.load_from={shared}", "train.steps=6")
    p, recs = run_trainer("jax", c)
    assert p.returncode == 0, p.stderr[-2000:]
    s = last(recs)
    assert s["status"] == "ok" and s["resumed_from_step"] == 4 and s["steps"] == 6


def test_second_sigterm_ends_a_hung_trainer(tmp_path):
    from jaxrun_helpers import kill_all, steps_recorded, trainer_argv, trainer_env, wait_for, write_cell
    cfg = write_cell(tmp_path / "cell", "train.steps=20")
    proc = subprocess.Popen(trainer_argv("jax", cfg), env=trainer_env(1, SCALEOUT_FAULT="hang@3"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: steps_recorded(cfg.parent) == 2, what="two steps")
        time.sleep(0.5)  # inside the hang of step 3
        proc.send_signal(signal.SIGTERM)  # asks for a clean stop after the step: the step never ends
        time.sleep(2.0)
        assert proc.poll() is None
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM
        assert time.time() - t0 < 5
        assert "second SIGTERM: exiting now without saving" in proc.stderr.read()
    finally:
        kill_all([proc.pid])


def test_signal_during_start_up_stops_cleanly(tmp_path):
    """A signal before the loop starts (distributed init, model build) ends the trainer cleanly, not by the signal."""
    from jaxrun_helpers import catches, kill_all, records, summary as last, trainer_argv, trainer_env, wait_for, write_cell
    cfg = write_cell(tmp_path / "cell", "train.steps=20")
    proc = subprocess.Popen(trainer_argv("jax", cfg), env=trainer_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: catches(proc.pid, signal.SIGTERM), timeout=30, what="the trainer's SIGTERM handler")
        assert not records(cfg.parent)  # still starting up
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        s = last(records(cfg.parent))
        assert s["status"] == "stopped" and s["stopped_by"] == "SIGTERM" and s["steps"] == 0
        assert not [r for r in records(cfg.parent) if r["kind"] == "step"]
    finally:
        kill_all([proc.pid])


def test_trainer_dies_with_its_launcher(tmp_path):
    """The launcher is SIGKILLed (it cannot clean up): its trainer stops by itself, after a checkpoint."""
    from jaxrun_helpers import (
        alive,
        kill_all,
        records,
        start_under_launcher,
        steps_recorded,
        summary as last,
        trainer_argv,
        trainer_env,
        wait_for,
        write_cell,
    )
    cfg = write_cell(tmp_path / "cell", "train.steps=100000", "checkpoint.every=0")
    launcher, trainer = start_under_launcher(trainer_argv("jax", cfg), tmp_path / "trainer.log", trainer_env(1))
    try:
        wait_for(lambda: steps_recorded(cfg.parent) >= 2, what="two steps")
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not alive(trainer), timeout=60, what="the trainer to exit")
        s = last(records(cfg.parent))
        assert s["status"] == "stopped" and s["stopped_by"] in ("SIGTERM", "launcher gone"), s
        assert (cfg.parent / "checkpoints" / str(s["steps"])).is_dir()
    finally:
        kill_all([launcher.pid, trainer])


def test_hung_trainer_dies_with_its_launcher(tmp_path):
    """Stuck in a step when its launcher is SIGKILLed: asked to stop, it cannot, so it ends itself after
    the grace period (launch.core.engine.LAUNCHER_GONE_GRACE_S) instead of living on as an orphan."""
    from jaxrun_helpers import (
        alive,
        kill_all,
        start_under_launcher,
        steps_recorded,
        trainer_argv,
        trainer_env,
        wait_for,
        write_cell,
    )

    from launch.core.engine import LAUNCHER_GONE_GRACE_S
    cfg = write_cell(tmp_path / "cell", "train.steps=20")
    env = trainer_env(1, SCALEOUT_FAULT="hang@3")
    launcher, trainer = start_under_launcher(trainer_argv("jax", cfg), tmp_path / "trainer.log", env)
    try:
        wait_for(lambda: steps_recorded(cfg.parent) == 2, what="two steps")
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not alive(trainer), timeout=LAUNCHER_GONE_GRACE_S + 20, what="the hung trainer to exit")
        assert "training did not stop within" in (tmp_path / "trainer.log").read_text()
    finally:
        kill_all([launcher.pid, trainer])


def test_damaged_latest_checkpoint_falls_back_then_fails_in_one_sentence(tmp_path):
    """Protects against (issue 13.9): a truncated data file in the latest Orbax step blocking every rerun
    with a TensorStore dump. The rerun continues from the previous step, names the damaged one, keeps it
    as `<step>.corrupt` (not counted by keep-N, not in the next save's way); with every step damaged (a
    deleted file) it fails in one sentence naming the directory."""
    import os

    from jaxrun_helpers import run_trainer, summary as last, write_cell
    base = ["train.steps=12", "checkpoint.every=4", "checkpoint.keep=2"]
    ckpt = tmp_path / "cell" / "checkpoints"
    p, _ = run_trainer("jax", write_cell(tmp_path / "cell", *base, "train.stop_after=8"))
    assert p.returncode == 0, p.stderr[-2000:]
    data = [f for f in (ckpt / "8" / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    big = max(data, key=lambda f: f.stat().st_size)
    os.truncate(big, big.stat().st_size // 2)
    p, recs = run_trainer("jax", write_cell(tmp_path / "cell", *base))
    assert p.returncode == 0, p.stderr[-3000:]
    s = last(recs)
    assert s["status"] == "ok" and s["resumed_from_step"] == 4 and s["steps"] == 12, s
    assert f"checkpoint step 8 ({ckpt}/8) is damaged and is skipped" in p.stderr
    assert (ckpt / "8.corrupt" / "state").is_dir() and f"{ckpt}/8.corrupt" in p.stderr  # kept for inspection
    assert sorted(d.name for d in ckpt.iterdir()) == ["12", "8", "8.corrupt"]  # keep=2 over the real steps
    for step in ("8", "12"):
        next((ckpt / step / "state").glob("manifest.ocdbt")).unlink()
    p, recs = run_trainer("jax", write_cell(tmp_path / "cell", *base))
    assert p.returncode == 1
    err = last(recs)["error"]
    assert err.startswith(f"CheckpointUnreadable: no checkpoint in {ckpt} can be read (step 12: "), err
    assert "\n" not in err and len(err) < 1000 and f"error (process 0): {err}" in p.stderr


def test_keep_n_retention_and_every_step_records_the_scheduled_lr(tmp_path):
    """Protects against: checkpoint.keep ignored (Orbax max_to_keep not passed: every step piles up) or
    off by one; and a step record whose lr is not the one launch.core.loop.lr_at gave that update (issue 19,
    uncovered 6 and 8)."""
    from jaxrun_helpers import run_trainer, summary as last, write_cell

    from launch import config
    from launch.core import loop
    cfg_path = write_cell(tmp_path / "cell", "train.steps=8", "train.warmup_steps=3", "checkpoint.every=2",
                          "checkpoint.keep=2")
    p, recs = run_trainer("jax", cfg_path)
    assert p.returncode == 0 and last(recs)["status"] == "ok", p.stderr[-2000:]
    assert sorted((tmp_path / "cell" / "checkpoints").iterdir()) == [tmp_path / "cell" / "checkpoints" / s for s in ("6", "8")]
    t = config.load_resolved(cfg_path).train
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 9))
    for r in steps:
        assert r["lr"] == pytest.approx(loop.lr_at(r["step"] - 1, t), rel=1e-12), r

"""The PyTorch FSDP2 trainer, run for real under torchrun with gloo."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, losses, run_cell, summary

pytestmark = pytest.mark.slow
STEPS = ["framework=torch", "train.steps=12", "checkpoint.async=false"]


def curve(recs):
    d = losses(recs)
    return np.array([d[k] for k in sorted(d)])


def test_loss_decreases(tmp_path):
    _, recs = run_cell(tmp_path, "framework=torch", "train.steps=30", "devices=2")
    c = curve(recs)
    assert len(c) == 30 and c[-5:].mean() < c[:3].mean() - 1.0, c
    s = summary(recs)
    assert s["status"] == "ok" and s["framework"] == "torch" and s["processes"] == 2
    for key in ("compile_s", "time_to_first_step_s", "step_time_p50_s", "tokens_per_s", "mfu",
                "peak_flops_per_device", "bytes_per_device", "peak_memory_bytes"):
        assert s[key] is not None, key


def test_same_curve_on_1_2_4_ranks_and_hsdp(tmp_path):
    layouts = [["devices=1"], ["devices=2"], ["devices=4"], ["devices=4", "parallel.data=2", "parallel.fsdp=2"],
               ["devices=2", "train.grad_accum=2"]]
    curves = [curve(run_cell(tmp_path, *STEPS, f"run.name=l{i}", *extra)[1]) for i, extra in enumerate(layouts)]
    for c in curves[1:]:
        np.testing.assert_allclose(c, curves[0], rtol=1e-4)


def test_fsdp4_local_shards_are_a_quarter_and_each_data_rank_trains_its_own_rows(tmp_path):
    out = tmp_path / "shards.json"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                        str(ROOT / "tests" / "torch_shard_probe.py"), str(out)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    shards = json.loads(out.read_text())
    assert shards, "no parameters reported"
    for name, (full, local) in shards.items():
        assert local[0] * 4 == full[0] and local[1:] == full[1:], name
    # issue 24.23: with parallel.data=4 (and with HSDP 2 x 2) each rank trains on its own quarter of the batch,
    # rows [2r, 2r+2) of the global batch of 8 (a trainer that split it over fsdp only would give every rank all 8)
    from launch import config
    from launch.data.batches import Batches
    cfg = config.load(["framework=torch", "train.global_batch=8"])
    batch, _ = Batches(cfg.data, cfg.model.vocab_size, cfg.model.seq_len).split(3, 0, 8)
    for rank in range(4):
        got = json.loads((tmp_path / f"shards.json.rows{rank}.json").read_text())
        for layout in ("data4", "hsdp"):
            assert got[layout]["rows_per_rank"] == 2, (rank, layout)
            assert np.array_equal(np.array(got[layout]["inputs"]), batch[2 * rank: 2 * rank + 2]), (rank, layout)


def test_stop_after_then_resume(tmp_path):
    _, full = run_cell(tmp_path, *STEPS, "run.name=full", "devices=2")
    run_cell(tmp_path, *STEPS, "run.name=chunk", "devices=2", "train.stop_after=8")
    _, second = run_cell(tmp_path, *STEPS, "run.name=chunk", "devices=2")
    s = summary(second)
    assert s["resumed_from_step"] == 8 and s["steps"] == 12
    np.testing.assert_allclose(s["final_loss"], summary(full)["final_loss"], rtol=1e-6)


def test_sigkill_then_rerun_resumes_to_identical_weights(tmp_path):
    from torch_helpers import load_dcp_model
    base = [*STEPS, "devices=2", "checkpoint.every=4", "checkpoint.keep=5"]
    run_cell(tmp_path, *base, "run.name=ref")
    args = [sys.executable, "-m", "launch", "run", f"run.dir={tmp_path}/runs", f"checkpoint.dir={tmp_path}/ckpt", *base,
            "run.name=killed"]
    proc = subprocess.Popen(args, cwd=tmp_path, env={**os.environ, "SCALEOUT_FAULT": "hang@7"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    ckpt = tmp_path / "ckpt" / "killed" / "torch-d2"
    deadline = time.time() + 120
    while not (ckpt / "step_4" / "COMMIT").is_file() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (ckpt / "step_4" / "COMMIT").is_file() and not (ckpt / "step_8").exists()
    _, recs = run_cell(tmp_path, *base, "run.name=killed")
    assert summary(recs)["resumed_from_step"] == 4
    ref, got = load_dcp_model(tmp_path / "ckpt" / "ref" / "torch-d2" / "step_12"), load_dcp_model(ckpt / "step_12")
    assert ref.keys() == got.keys() and ref
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-6, atol=0, err_msg=k)


def test_interrupted_save_is_ignored_with_warning(tmp_path):
    base = [*STEPS, "devices=2", "checkpoint.every=4", "checkpoint.keep=5"]
    run_cell(tmp_path, *base, "train.stop_after=8")
    ckpt = tmp_path / "ckpt" / "tiny" / "torch-d2"
    # make step_8 look like a save that died before its commit
    (ckpt / "step_8" / "COMMIT").unlink()
    (ckpt / "step_8").rename(ckpt / ".tmp-step_8")
    p, recs = run_cell(tmp_path, *base)
    assert summary(recs)["resumed_from_step"] == 4
    assert "ignoring incomplete checkpoint" in p.stdout and ".tmp-step_8" in p.stdout


def test_checkpoint_from_4_ranks_continues_on_2(tmp_path):
    _, full = run_cell(tmp_path, *STEPS, "run.name=full", "devices=4")
    run_cell(tmp_path, *STEPS, "run.name=four", "devices=4", "train.stop_after=6")
    _, two = run_cell(tmp_path, *STEPS, "run.name=two", "devices=2", f"checkpoint.load_from={tmp_path}/ckpt/four/torch-d4")
    assert summary(two)["resumed_from_step"] == 6
    a, b = losses(full, since=6), losses(two, since=6)
    assert sorted(a) == sorted(b) == list(range(7, 13))
    np.testing.assert_allclose([b[k] for k in sorted(b)], [a[k] for k in sorted(a)], rtol=1e-4)


def test_async_checkpoint_and_non_finite_loss(tmp_path):
    p, recs = run_cell(tmp_path, "framework=torch", "train.steps=12", "devices=2", "checkpoint.every=2",
                       env={"SCALEOUT_FAULT": "nan@5"}, check=False)
    assert p.returncode != 0 and "loss is nan at step 5" in p.stdout + p.stderr
    assert summary(recs)["status"] == "failed"
    ckpt = tmp_path / "ckpt" / "tiny" / "torch-d2"
    assert sorted(d.name for d in ckpt.iterdir() if (d / "COMMIT").is_file()) == ["step_2", "step_4"]


def test_the_checkpoint_process_starts_before_the_first_step_and_only_for_saves_before_the_last(tmp_path):
    """Issue 26: DCP's checkpoint process, started inside the first async save, slowed the steps after it (its
    interpreter and gloo set-up ran meanwhile). It now runs before step 1 where the run saves before its end,
    and a run whose only save is its last writes that one in the trainer (no process per rank to wait for)."""
    ready = "Checkpoint background process is running"
    run_cell(tmp_path, "framework=torch", "devices=2", "train.steps=4", "checkpoint.every=2", "run.name=every2")
    log = (tmp_path / "runs" / "every2" / "torch-d2" / "logs" / "torchrun.log").read_text()
    assert log.count(ready) == 2, log[-3000:]  # one per rank
    assert log.rindex(ready) < log.index("step 1/4"), log[-3000:]
    ckpt = tmp_path / "ckpt" / "every2" / "torch-d2"
    assert sorted(d.name for d in ckpt.iterdir() if (d / "COMMIT").is_file()) == ["step_2", "step_4"]
    _, recs = run_cell(tmp_path, "framework=torch", "devices=2", "train.steps=2", "checkpoint.every=0", "run.name=last")
    log = (tmp_path / "runs" / "last" / "torch-d2" / "logs" / "torchrun.log").read_text()
    assert ready not in log and (tmp_path / "ckpt" / "last" / "torch-d2" / "step_2" / "COMMIT").is_file(), log[-3000:]
    assert summary(recs)["checkpoint_saves"] == 1


def test_failing_rank_is_surfaced(tmp_path):
    p, _ = run_cell(tmp_path, *STEPS, "devices=2", env={"SCALEOUT_FAULT": "crash@3:p1"}, check=False)
    assert p.returncode != 0
    assert "injected crash at step 3" in p.stdout + p.stderr
    assert "rank 1" in p.stdout + p.stderr


# --------------------------------------------------------------------------- the trainer started directly
# (python -m torchrun_fsdp / torchrun, as every target starts it; no launcher involved)

def test_checkpoint_of_another_run_is_refused_unless_load_from(tmp_path):
    from jaxrun_helpers import run_trainer, summary as last, write_cell
    shared = tmp_path / "shared-ckpt"
    common = ["framework=torch", f"checkpoint.dir={shared}"]
    p, recs = run_trainer("torch", write_cell(tmp_path / "a", *common, "run.id=run-a", "train.steps=6", "train.stop_after=4"))
    assert p.returncode == 0 and last(recs)["status"] == "stopped", p.stderr[-2000:]
    assert recs[0]["settings"]["float32_matmul_precision"] == "highest" and last(recs)["matmul_precision"] == "highest"
    assert json.loads((shared / "step_4" / "meta.json").read_text())["run_id"] == "run-a"
    p, recs = run_trainer("torch", write_cell(tmp_path / "b", *common, "run.id=run-b", "train.steps=6"))
    assert p.returncode == 1
    err = last(recs)["error"]
    assert err.startswith("CheckpointMismatch: ") and "run run-a, not to this run run-b" in err and str(shared) in err
    assert "\n" not in err and f"error (rank 0): {err}" in p.stderr
    c = write_cell(tmp_path / "c", "framework=torch", "run.id=run-b", f"checkpoint.load_from={shared}", "train.steps=6")
    p, recs = run_trainer("torch", c)
    assert p.returncode == 0, p.stderr[-2000:]
    s = last(recs)
    assert s["status"] == "ok" and s["resumed_from_step"] == 4 and s["steps"] == 6


def test_second_sigterm_ends_hung_ranks(tmp_path):
    from jaxrun_helpers import alive, kill_all, steps_recorded, torch_ranks, trainer_argv, trainer_env, wait_for, write_cell
    cfg = write_cell(tmp_path / "cell", "framework=torch", "devices=2", "train.steps=20")
    proc = subprocess.Popen(trainer_argv("torch", cfg, nproc=2), env=trainer_env(2, SCALEOUT_FAULT="hang@3"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    workers = []
    try:
        wait_for(lambda: steps_recorded(cfg.parent) == 2, what="two steps")
        workers = torch_ranks(proc.pid)
        assert len(workers) == 2
        time.sleep(0.5)
        for pid in workers:  # e.g. `scancel` signals every process of the job
            os.kill(pid, signal.SIGTERM)
        time.sleep(2.0)
        assert all(alive(pid) for pid in workers)  # a clean stop waits for the step, which hangs
        t0 = time.time()
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not any(alive(pid) for pid in workers), timeout=10, what="the ranks to exit")
        assert time.time() - t0 < 5
        assert proc.wait(timeout=60) != 0
    finally:
        kill_all([*workers, proc.pid])


def test_ranks_die_with_their_launcher_through_torchrun(tmp_path):
    """The launcher is SIGKILLed; torchrun between it and the ranks survives it, yet the ranks stop
    (watchdog on SCALEOUT_PARENT_PID), with a checkpoint, and then torchrun ends too."""
    from jaxrun_helpers import (
        alive,
        kill_all,
        records,
        start_under_launcher,
        steps_recorded,
        summary as last,
        torch_ranks,
        trainer_argv,
        trainer_env,
        wait_for,
        write_cell,
    )
    cfg = write_cell(tmp_path / "cell", "framework=torch", "devices=2", "train.steps=100000", "checkpoint.every=0")
    launcher, torchrun = start_under_launcher(trainer_argv("torch", cfg, nproc=2), tmp_path / "trainer.log", trainer_env(2))
    workers = []
    try:
        wait_for(lambda: steps_recorded(cfg.parent) >= 2, what="two steps")
        workers = torch_ranks(torchrun)
        assert len(workers) == 2
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not any(alive(pid) for pid in [torchrun, *workers]), timeout=90, what="torchrun and its ranks to exit")
        s = last(records(cfg.parent))
        assert s["status"] == "stopped" and s["stopped_by"] in ("launcher gone", "peer"), s
        assert (cfg.parent / "checkpoints" / f"step_{s['steps']}" / "COMMIT").is_file()
    finally:
        kill_all([launcher.pid, torchrun, *workers])


def test_damaged_latest_checkpoint_falls_back_then_fails_in_one_sentence(tmp_path):
    """Protects against (issue 13.9): a truncated shard file in the latest DCP step blocking every rerun
    (torchrun boilerplate, no path). The rerun continues from the previous step, names the damaged one,
    keeps it as `step_<N>.corrupt` (not counted by keep-N, not overwritten by the next save of that step);
    with every step damaged (a deleted file) it fails in one sentence naming the directory."""
    import os

    from jaxrun_helpers import run_trainer, summary as last, write_cell
    base = ["framework=torch", "train.steps=12", "checkpoint.every=4", "checkpoint.keep=2"]
    ckpt = tmp_path / "cell" / "checkpoints"
    p, _ = run_trainer("torch", write_cell(tmp_path / "cell", *base, "train.stop_after=8"))
    assert p.returncode == 0, p.stderr[-2000:]
    shard = next((ckpt / "step_8").glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 2)
    p, recs = run_trainer("torch", write_cell(tmp_path / "cell", *base))
    assert p.returncode == 0, p.stderr[-3000:]
    s = last(recs)
    assert s["status"] == "ok" and s["resumed_from_step"] == 4 and s["steps"] == 12, s
    assert f"checkpoint step 8 ({ckpt}/step_8) is damaged and is skipped" in p.stderr
    assert f"{ckpt}/step_8.corrupt" in p.stderr
    assert sorted(d.name for d in ckpt.iterdir()) == ["step_12", "step_8", "step_8.corrupt"]  # keep=2
    assert (ckpt / "step_8.corrupt" / shard.name).stat().st_size < (ckpt / "step_8" / shard.name).stat().st_size
    for step in ("step_8", "step_12"):
        (ckpt / step / ".metadata").unlink()
    p, recs = run_trainer("torch", write_cell(tmp_path / "cell", *base))
    assert p.returncode == 1
    err = last(recs)["error"]
    assert err.startswith(f"CheckpointUnreadable: no checkpoint in {ckpt} can be read (step 12: "), err
    assert "\n" not in err and len(err) < 1000 and f"error (rank 0): {err}" in p.stderr


def test_cpu_pytorch_on_a_host_with_gpus_is_refused_at_once(tmp_path):
    """Protects against: a CPU-only PyTorch build silently training on the CPU of a GPU host and being
    compared with JAX on the GPUs (launch.core.gpus.check_platform, called in torchrun_fsdp's build). A plain
    CPU run (no GPUs visible) still trains."""
    from jaxrun_helpers import run_trainer, summary as last, write_cell
    cfg = write_cell(tmp_path / "cell", "framework=torch", "train.steps=2")
    p, recs = run_trainer("torch", cfg, CUDA_VISIBLE_DEVICES="0,1")
    assert p.returncode == 1
    err = last(recs)["error"]
    assert "sees GPUs (CUDA_VISIBLE_DEVICES=0,1) but PyTorch runs on the CPU platform" in err, err
    assert not list((tmp_path / "cell").glob("checkpoints/step_*"))
    p, recs = run_trainer("torch", cfg, CUDA_VISIBLE_DEVICES="")
    assert p.returncode == 0 and last(recs)["status"] == "ok", p.stderr[-2000:]


def test_keep_n_retention_and_every_step_records_the_scheduled_lr(tmp_path):
    """Protects against: checkpoint.keep ignored or off by one in the DCP commit (every step piles up); and
    a step record whose lr is not the one launch.core.loop.lr_at gave that update (issue 19, uncovered 6 and 8)."""
    from jaxrun_helpers import run_trainer, summary as last, write_cell

    from launch import config
    from launch.core import loop
    cfg_path = write_cell(tmp_path / "cell", "framework=torch", "train.steps=8", "train.warmup_steps=3",
                          "checkpoint.every=2", "checkpoint.keep=2")
    p, recs = run_trainer("torch", cfg_path)
    assert p.returncode == 0 and last(recs)["status"] == "ok", p.stderr[-2000:]
    assert sorted(d.name for d in (tmp_path / "cell" / "checkpoints").iterdir()) == ["step_6", "step_8"]
    t = config.load_resolved(cfg_path).train
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 9))
    for r in steps:
        assert r["lr"] == pytest.approx(loop.lr_at(r["step"] - 1, t), rel=1e-12), r

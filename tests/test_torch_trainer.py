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


def test_fsdp4_local_shards_are_a_quarter(tmp_path):
    out = tmp_path / "shards.json"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                        str(ROOT / "tests" / "torch_shard_probe.py"), str(out)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    shards = json.loads(out.read_text())
    assert shards, "no parameters reported"
    for name, (full, local) in shards.items():
        assert local[0] * 4 == full[0] and local[1:] == full[1:], name


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


def test_failing_rank_is_surfaced(tmp_path):
    p, _ = run_cell(tmp_path, *STEPS, "devices=2", env={"SCALEOUT_FAULT": "crash@3:p1"}, check=False)
    assert p.returncode != 0
    assert "injected crash at step 3" in p.stdout + p.stderr
    assert "rank 1" in p.stdout + p.stderr

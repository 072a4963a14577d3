"""The Cloud TPU target against the strict gcloud emulation in tests/fake_gcloud (the only fake in the suite)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_cli, summary

FAKE = ROOT / "tests" / "fake_gcloud"
SNAPSHOTS = ROOT / "tests" / "snapshots"


@pytest.fixture
def gcloud(tmp_path):
    state = tmp_path / "gcloud"
    env = {"PATH": f"{FAKE}{os.pathsep}{os.environ['PATH']}", "FAKE_GCLOUD_ROOT": str(state)}

    def calls():
        log = state / "calls.log"
        return [json.loads(l) for l in log.read_text().splitlines()] if log.is_file() else []

    def deleted():
        log = state / "deleted.log"
        return log.read_text().split() if log.is_file() else []

    return env, calls, deleted


def _args(tmp_path, *extra):
    return ["run", "target=tpu", "devices=8", "tpu.generation=v4", "run.name=t", f"run.dir={tmp_path}/runs",
            f"checkpoint.dir={tmp_path}/ckpt", "tpu.poll_interval_s=0.05", f"tpu.python={sys.executable}",
            "train.steps=6", "checkpoint.async=false", *extra]


def _verbs(calls):
    return [" ".join(c[2:4]) for c in calls]


@pytest.mark.slow
def test_queued_run_on_a_two_worker_slice(tmp_path, gcloud):
    env, calls, deleted = gcloud
    marker = tmp_path / "setup-ran"
    p = run_cli(_args(tmp_path, f'tpu.setup=["touch {marker}"]'), cwd=tmp_path, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    verbs = _verbs(calls())
    assert verbs[0] == "queued-resources create"
    assert verbs[1:4] == ["queued-resources describe"] * 3  # WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE
    assert verbs[4:] == ["tpu-vm scp", "tpu-vm ssh", "tpu-vm ssh", "tpu-vm ssh", "tpu-vm ssh", "tpu-vm scp", "queued-resources delete"]
    create = calls()[0]
    assert "--accelerator-type=v4-16" in create and "--node-id=scaleout-t" in create
    assert marker.is_file()
    assert deleted() == ["scaleout-t"]
    assert "[w0] [scaleout] ok: 6 steps" in p.stdout and "[w1]" in p.stdout
    cell = tmp_path / "runs" / "t" / "jax-d8"
    for i in (0, 1):
        assert (cell / "logs" / f"worker-{i}.log").is_file()
    recs = [json.loads(l) for l in (cell / "metrics.jsonl").read_text().splitlines()]
    s = summary(recs)
    assert s["status"] == "ok" and s["processes"] == 2 and s["devices"] == 8 and s["steps"] == 6
    r = run_cli(["report", str(tmp_path / "runs" / "t")], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    row = json.loads((tmp_path / "runs" / "t" / "report.json").read_text())["cells"][0]
    assert row["status"] == "ok" and row["processes"] == 2 and row["tokens_per_s"] > 0


@pytest.mark.slow
def test_failing_worker_stops_the_other_and_the_slice_is_deleted(tmp_path, gcloud):
    env, calls, deleted = gcloud
    p = run_cli(_args(tmp_path, 'tpu.setup=["true"]'), cwd=tmp_path, env={**env, "SCALEOUT_FAULT": "crash@3:p1"}, timeout=600)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "worker 1 exited with code 1; the other workers were stopped" in p.stderr
    assert "injected crash at step 3" in p.stderr.split("Last lines of worker 1", 1)[1]
    assert deleted() == ["scaleout-t"]
    ps = subprocess.run(["pgrep", "-f", "[m] jaxrun --config runs/t/"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", "a worker's trainer was left running"


def test_failed_queued_resource_is_one_sentence_and_cleaned_up(tmp_path, gcloud):
    env, calls, deleted = gcloud
    p = run_cli(_args(tmp_path), cwd=tmp_path, env={**env, "FAKE_GCLOUD_QR_OUTCOME": "FAILED"}, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "scaleout: error: queued resource scaleout-t is FAILED: the slice could not be provided" in p.stderr
    assert deleted() == ["scaleout-t"]
    assert "tpu-vm ssh" not in _verbs(calls())


@pytest.mark.parametrize("extra,message", [
    (["devices=12", "train.global_batch=24"], r"devices=12 is not a v4 slice size; valid chip counts: 4, 8, 16"),
    (["tpu.zone=us-west4"], r"tpu.zone='us-west4' is not a valid zone"),
    (["tpu.name=My_TPU"], r"tpu.name='My_TPU' is not a valid TPU name"),
    (["tpu.name=x;rm"], r"tpu.name='x;rm' is not a valid TPU name"),
    (["tpu.project=p$(id)"], r"tpu.project='p\$\(id\)' is not a valid GCP project id"),
    (["tpu.accelerator_type=v5litepod-16"], r"tpu.accelerator_type=v5litepod-16 has 16 chips but devices=8"),
    (["framework=torch"], r"PyTorch on TPU needs torch_xla"),
])
def test_bad_input_creates_nothing(tmp_path, gcloud, extra, message):
    import re
    env, calls, _ = gcloud
    p = run_cli(_args(tmp_path, *extra), cwd=tmp_path, env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert re.search(message, p.stderr), p.stderr
    assert calls() == [] and not (tmp_path / "runs").exists()


def test_missing_gcloud(tmp_path):
    p = run_cli(_args(tmp_path), cwd=tmp_path, env={"PATH": os.path.dirname(sys.executable)})
    assert p.returncode == 2 and "tpu.gcloud='gcloud' is not on PATH" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_setup_and_names_cannot_inject(tmp_path, gcloud):
    env, calls, deleted = gcloud
    pwn = tmp_path / "pwned"
    setup = [f"echo $(touch {pwn}1); touch {pwn}2", f"echo 'a' \"b\" `touch {pwn}3`", f"echo one\ntouch {pwn}4"]
    from launch import config
    from launch.targets import tpu
    cfg = config.replace(config.load(["target=tpu", "devices=8", "tpu.generation=v4"]), {"tpu.setup": setup})
    cmd = tpu.Commands(cfg, "v", "r", "c").unpack_and_setup()[-1]
    assert f"echo '$(touch' '{pwn}1);' touch {pwn}2" in cmd and f"echo one touch {pwn}4" in cmd
    p = run_cli(_args(tmp_path, "tpu.setup=" + json.dumps(setup), "train.steps=1"), cwd=tmp_path, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert not any(Path(f"{pwn}{i}").exists() for i in range(1, 5))


@pytest.mark.parametrize("name,overrides", [
    ("plan_tpu_v5e_16", ["tpu.generation=v5e", "devices=16", "train.global_batch=32"]),
    ("plan_tpu_v4_32", ["tpu.generation=v4", "devices=16", "train.global_batch=32", "tpu.runtime_version=tpu-ubuntu2204-base",
                        "tpu.capacity=spot", "tpu.zone=us-central2-b"]),
])
def test_plan_matches_reviewed_snapshot(name, overrides, scaleout):
    code, out, err = scaleout("plan", "--json", "target=tpu", "run.dir=/runs", "run.name=exp", "tpu.project=my-project",
                              "checkpoint.dir=gs://my-bucket/ckpt", *overrides)
    assert code == 0, err
    got = "\n".join(json.loads(out)["commands"]) + "\n"
    snap = SNAPSHOTS / f"{name}.txt"
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        snap.write_text(got)
    assert got == snap.read_text()


@pytest.mark.slow
def test_existing_tpu_vm_is_used_and_kept(tmp_path, gcloud):
    env, calls, deleted = gcloud
    g = [str(FAKE / "gcloud"), "compute", "tpus", "queued-resources"]
    full_env = {**os.environ, **env}
    subprocess.run(g + ["create", "mine", "--node-id=my-vm", "--accelerator-type=v4-16", "--runtime-version=v",
                        "--zone=us-central2-b"], env=full_env, check=True, capture_output=True)
    for _ in range(3):
        subprocess.run(g + ["describe", "mine", "--zone=us-central2-b"], env=full_env, check=True, capture_output=True)
    before = len(calls())
    p = run_cli(_args(tmp_path, "tpu.mode=existing", "tpu.name=my-vm", "tpu.zone=us-central2-b", 'tpu.setup=["true"]'),
                cwd=tmp_path, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    verbs = _verbs(calls()[before:])
    assert verbs[0] == "tpu-vm describe" and "queued-resources create" not in verbs and "queued-resources delete" not in verbs
    assert deleted() == []
    p = run_cli(_args(tmp_path, "tpu.mode=existing", "tpu.name=my-vm", "tpu.zone=us-central2-b", "devices=4",
                      "run.name=t2"), cwd=tmp_path, env=env)
    assert p.returncode == 2 and "TPU VM my-vm has 2 worker(s) but devices=4 on v4 needs 1" in p.stderr

"""The Cloud TPU target against the strict gcloud emulation in tests/fake_gcloud (the only fake in the suite).

The emulation runs each worker's commands in its own sandbox with a TPU VM's environment (see its
docstring): workers import only the shipped archive, the image's python3 is 3.10, chips are files
in the sandbox, gs:// is a real GCS API (tests/gcs_emulator.py, a bucket per test) that the workers'
gcsfs / google-cloud-storage / TensorStore clients reach, and the local ssh going away never stops a
remote command. Tests here must not touch any process they did not start: leftovers are found by
the emulation's FAKE_TPU_NODE marker (under tmp_path) and killed by PID.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_cli, summary, wait_for

FAKE = ROOT / "tests" / "fake_gcloud"
GCLOUD = FAKE / "gcloud"
SNAPSHOTS = ROOT / "tests" / "snapshots"
NODE = "scaleout-t"
CELL = "jax-d8"


def _environ(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "environ").read_bytes()
    except OSError:
        return b""


def processes_with_env(text: str):
    """PIDs of processes whose environment mentions `text` (the emulated workers carry FAKE_TPU_NODE=<tmp>/...)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid() and text.encode() in _environ(int(p))]


def kill_pids(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(autouse=True)
def no_worker_left(tmp_path):
    """A test that leaves an emulated worker's process running fails; those processes are killed by PID."""
    yield
    marker = f"FAKE_TPU_NODE={tmp_path}"
    deadline = time.monotonic() + 15
    left = processes_with_env(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.3)
        left = processes_with_env(marker)
    kill_pids(left)
    if left:
        pytest.fail(f"emulated worker processes left behind: {left}", pytrace=False)


class Fake:
    def __init__(self, tmp_path: Path, gcs=None):
        self.state = tmp_path / "gcloud"
        self.gcs = gcs
        self.bucket = gcs.bucket if gcs else "bucket"
        self.env = {"PATH": f"{FAKE}{os.pathsep}{os.environ['PATH']}", "FAKE_GCLOUD_ROOT": str(self.state),
                    "FAKE_GCLOUD_PYTHON": sys.executable, **(gcs.env if gcs else {})}
        self.venv = self.state / "image" / "venv"  # what the default tpu.setup would build on a worker

    def calls(self):
        log = self.state / "calls.log"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []

    def deleted(self):
        log = self.state / "deleted.log"
        return log.read_text().split() if log.is_file() else []

    def worker(self, i: int, node: str = NODE) -> Path:
        return self.state / "tpus" / node / f"worker-{i}"

    def node_processes(self, node: str = NODE):
        return processes_with_env(f"FAKE_TPU_NODE={self.state / 'tpus' / node}")

    def gcloud(self, *args, check=True):
        return subprocess.run([str(GCLOUD), *args], env={**os.environ, **self.env}, capture_output=True, text=True, check=check)

    def make_vm(self, name: str, acc: str = "v4-8", zone: str = "us-central2-b", runtime: str = "tpu-ubuntu2204-base"):
        """A TPU VM the user already has (tpu.mode=existing)."""
        self.gcloud("compute", "tpus", "queued-resources", "create", f"q-{name}", f"--node-id={name}",
                    f"--accelerator-type={acc}", f"--runtime-version={runtime}", f"--zone={zone}")
        for _ in range(3):
            self.gcloud("compute", "tpus", "queued-resources", "describe", f"q-{name}", f"--zone={zone}")

    def delete_vm(self, qr: str, zone: str = "us-central2-b"):
        self.gcloud("compute", "tpus", "queued-resources", "delete", qr, f"--zone={zone}", "--force", "--quiet")


@pytest.fixture
def fake(tmp_path, gcs):
    return Fake(tmp_path, gcs)


def _args(tmp_path, fake, *extra):
    """A v4-16 slice (2 workers) of the v4 defaults; tpu.setup links the image's venv where the
    default setup would build it (no network here)."""
    return ["run", "target=tpu", "devices=8", "tpu.generation=v4", "run.name=t", f"run.dir={tmp_path}/runs",
            f"checkpoint.dir=gs://{fake.bucket}/ckpt", "tpu.poll_interval_s=0.05", "train.steps=6", "checkpoint.async=false",
            f'tpu.setup=["ln -sfn {fake.venv} ../venv", "ln -sfn {fake.venv} ../venv-torch"]', *extra]


def _verbs(calls):
    return [" ".join(c[2:4]) if c[0] != "alpha" else "alpha " + " ".join(c[3:5]) for c in calls]


def _record(tmp_path, cell=CELL):
    return json.loads((tmp_path / "runs" / "t" / cell / "tpu-job.json").read_text())


# --------------------------------------------------------------------------- end to end

@pytest.mark.slow
def test_queued_run_on_a_two_worker_slice(tmp_path, fake):
    """The whole lifecycle on a 2-worker slice, with checkpoints in the shared gs:// bucket and one
    worker's log connection dropped mid-run: the follower resumes from the last byte, so the local
    log is the worker's log, nothing lost or repeated. (tpu.keep=true so that the workers' own logs
    can be compared; deletion after a successful run is checked by test_setup_and_names_cannot_inject.)"""
    marker = tmp_path / "setup-ran"
    p = run_cli(_args(tmp_path, fake, f'tpu.setup=["ln -sfn {fake.venv} ../venv", "touch {marker}"]', "tpu.keep=true"),
                cwd=tmp_path, env={**fake.env, "FAKE_GCLOUD_SSH_DROP": "1.5:tail -c +"}, timeout=600)
    try:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        verbs = _verbs(fake.calls())
        assert verbs[0] == "queued-resources create"
        assert verbs[1:4] == ["queued-resources describe"] * 3  # WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE
        # scp code (one per worker); ssh: unpack + setup, free the chips, check python, start; 2 follows + 1 reconnect;
        # scp metrics
        assert verbs[4:] == ["tpu-vm scp"] * 2 + ["tpu-vm ssh"] * 4 + ["tpu-vm ssh"] * 3 + ["tpu-vm scp"]
        create = fake.calls()[0]
        assert "--accelerator-type=v4-16" in create and "--node-id=scaleout-t" in create
        assert "--runtime-version=tpu-ubuntu2204-base" in create and "--zone=us-central2-b" in create
        assert marker.is_file()
        assert "[w0] [scaleout] ok: 6 steps" in p.stdout and "[w1]" in p.stdout
        cell = tmp_path / "runs" / "t" / CELL
        recs = [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines()]
        s = summary(recs)
        assert s["status"] == "ok" and s["processes"] == 2 and s["devices"] == 8 and s["steps"] == 6
        assert fake.gcs.fs().exists(f"{fake.bucket}/ckpt/t/{CELL}/6/commit_success.txt"), "the workers wrote no gs:// checkpoint"
        rec = _record(tmp_path)
        assert rec["state"] == "ended" and rec["result"] == "COMPLETED"
        local = [(cell / "logs" / f"worker-{i}.log").read_text() for i in (0, 1)]
        assert sum("reconnecting from byte" in text for text in local) == 1, "the dropped connection was not resumed"
        for i, text in enumerate(local):
            remote = next(fake.worker(i).glob(f"scaleout/*/runs/t/{CELL}/job/{rec['job']}.log")).read_text()
            noise = ("connection to worker", "closed by remote host")  # the follower's and ssh's own words
            assert "".join(line for line in text.splitlines(keepends=True) if not any(n in line for n in noise)) == remote
        assert fake.node_processes() == []
        r = run_cli(["report", str(tmp_path / "runs" / "t")], cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        row = json.loads((tmp_path / "runs" / "t" / "report.json").read_text())["cells"][0]
        assert row["status"] == "ok" and row["processes"] == 2 and row["tokens_per_s"] > 0
    finally:
        fake.delete_vm(NODE)


@pytest.mark.slow
def test_failing_worker_stops_the_others_within_a_bound(tmp_path, fake):
    """Fail-fast: worker 1 crashes at step 3, the launcher stops worker 0's (detached) trainer itself:
    tpu.keep=true, so deleting the slice cannot be what kills it. The survivor must be gone when the
    launcher returns, and the launcher must return soon after the crash."""
    p = run_cli(_args(tmp_path, fake, "tpu.keep=true", "train.steps=200"), cwd=tmp_path,
                env={**fake.env, "FAKE_TPU_ENV_SCALEOUT_FAULT": "crash@3:p1"}, timeout=600)
    ended = time.time()
    try:
        assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
        assert "worker 1 exited with code 1; the other workers were stopped" in p.stderr
        assert "injected crash at step 3" in p.stderr.split("Last lines of worker 1", 1)[1]
        assert fake.node_processes() == [], "a worker's trainer was left running"
        job = _record(tmp_path)["job"]
        exits = {i: next(fake.worker(i).glob(f"scaleout/*/runs/t/{CELL}/job/{job}.exit"), None) for i in (0, 1)}
        assert exits[1] is not None and exits[1].read_text().strip() == "1"
        crashed = exits[1].stat().st_mtime
        assert ended - crashed < 45, f"the launcher took {ended - crashed:.0f} s after the crash to stop the others"
        assert exits[0] is None or exits[0].read_text().strip() != "0", "worker 0 was not stopped"
        assert fake.deleted() == []
    finally:
        fake.delete_vm(NODE)


def test_failed_queued_resource_is_one_sentence_and_cleaned_up(tmp_path, fake):
    """Also: the v4 defaults (software version, zone) are v4's, or the emulated service would refuse the create."""
    p = run_cli(_args(tmp_path, fake), cwd=tmp_path, env={**fake.env, "FAKE_GCLOUD_QR_OUTCOME": "FAILED"}, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "scaleout: error: queued resource scaleout-t is FAILED: the slice could not be provided" in p.stderr
    assert fake.deleted() == [NODE]
    assert "tpu-vm ssh" not in _verbs(fake.calls())


@pytest.mark.parametrize("extra,message", [
    (["devices=2"], r"devices=2 is not a v4 slice size; valid chip counts: 4, 8, 16"),
    (["tpu.zone=us-west4"], r"tpu.zone='us-west4' is not a valid zone"),
    (["tpu.name=My_TPU"], r"tpu.name='My_TPU' is not a valid TPU name"),
    (["tpu.name=x;rm"], r"tpu.name='x;rm' is not a valid TPU name"),
    (["tpu.project=p$(id)"], r"tpu.project='p\$\(id\)' is not a valid GCP project id"),
    (["tpu.accelerator_type=v5litepod-16"], r"tpu.accelerator_type=v5litepod-16 has 16 chips but devices=8"),
    (["data.source=file", "data.path=gs://b/tokens.bin"], r"data.path=gs://b/tokens.bin is a URL, but the trainers memory-map"),
    (["model.init=hf:gs://b/hf"], r"model.init=hf:gs://b/hf is a URL"),
    (["tpu.ssh_args=[internal-ip]"], r"tpu.ssh_args\[0\]='internal-ip' is not a gcloud flag"),
    (["tpu.ssh_args=[--worker=1]"], r"tpu.ssh_args\[0\]=--worker=1 is a flag scaleout sets itself"),
    (["tpu.create_args=[--valid-until-duration=1h]"], r"tpu.create_args\[0\]=--valid-until-duration=1h is a flag scaleout sets"),
    (["tpu.runtime_version=v2-alpha-tpuv6e"], r"tpu.runtime_version=v2-alpha-tpuv6e is the software version for v6e TPUs, not v4"),
    (["tpu.zone=us-east1-d"], r"tpu.zone=us-east1-d does not offer v4 TPUs \(Cloud TPU lists v4 in us-central2-b\)"),
    (["tpu.generation=v5p", "tpu.zone=us-west4-b"], r"tpu.zone=us-west4-b does not offer v5p TPUs"),
    (["checkpoint.dir=null"], r"checkpoint.dir=\S+/runs/t/jax-d8/checkpoints is not shared storage, but a v4-16 slice has 2 workers"),
    (["checkpoint.dir=/mnt/ckpt"], r"checkpoint.dir=/mnt/ckpt/t/jax-d8 is not shared storage"),
    (["checkpoint.dir=gs://CHANGE-ME-bucket/scaleout", "devices=4"], r"is the placeholder of configs/target/tpu.yaml"),
    (["checkpoint.load_from=/data/ckpt"], r"checkpoint.load_from=\S+ is not on gs://, so the TPU workers cannot read it"),
])
def test_bad_input_creates_nothing(tmp_path, fake, extra, message):
    p = run_cli(_args(tmp_path, fake, *extra), cwd=tmp_path, env=fake.env)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert re.search(message, p.stderr), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert fake.calls() == [] and not (tmp_path / "runs").exists()


def test_plan_shows_the_checkpoint_sentence_that_run_would_refuse_with(scaleout):
    """`plan` stays a dry run with the group file's placeholder; `run` refuses it (test_bad_input_creates_nothing)."""
    code, out, err = scaleout("plan", "--json", "target=tpu", "devices=16", "train.global_batch=32", "run.dir=/runs", "run.name=exp")
    assert code == 0, err
    first = json.loads(out)["commands"][0]
    assert first.startswith("# `scaleout run` refuses this config: checkpoint.dir=gs://CHANGE-ME-bucket/scaleout/exp/jax-d16 "
                            "is the placeholder of configs/target/tpu.yaml")


def test_missing_gcloud(tmp_path, fake):
    p = run_cli(_args(tmp_path, fake), cwd=tmp_path, env={"PATH": os.path.dirname(sys.executable)})
    assert p.returncode == 2 and "tpu.gcloud='gcloud' is not on PATH" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_setup_and_names_cannot_inject(tmp_path, fake):
    pwn = tmp_path / "pwned"
    setup = [f"ln -sfn {fake.venv} ../venv", f"echo $(touch {pwn}1); touch {pwn}2", f"echo 'a' \"b\" `touch {pwn}3`",
             f"echo one\ntouch {pwn}4"]
    from launch import config
    from launch.targets.tpu import target as tpu
    cfg = config.replace(config.load(["target=tpu", "devices=8", "tpu.generation=v4"]), {"tpu.setup": setup})
    cmd = tpu.Commands(cfg, "v", "c").unpack_and_setup()[-1]
    assert f"echo '$(touch' '{pwn}1);' touch {pwn}2" in cmd and f"echo one touch {pwn}4" in cmd
    p = run_cli(_args(tmp_path, fake, "tpu.setup=" + json.dumps(setup), "train.steps=1", "devices=4"), cwd=tmp_path,
                env=fake.env, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert not any(Path(f"{pwn}{i}").exists() for i in range(1, 5))
    assert fake.deleted() == [NODE] and _record(tmp_path, "jax-d4")["deleted"] is True


@pytest.mark.parametrize("name,overrides", [
    ("plan_tpu_v5e_16", ["tpu.generation=v5e", "devices=16", "train.global_batch=32"]),
    ("plan_tpu_v4_32", ["tpu.generation=v4", "devices=16", "train.global_batch=32", "tpu.runtime_version=tpu-ubuntu2204-base",
                        "tpu.capacity=spot", "tpu.zone=us-central2-b"]),
    ("plan_tpu_v6e_8_best_effort", ["tpu.generation=v6e", "devices=8", "train.global_batch=16", "tpu.capacity=best-effort"]),
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
def test_existing_tpu_vm_is_used_and_kept(tmp_path, fake):
    """Also: a TPU VM of the wrong shape is refused by preflight, before anything is written."""
    fake.make_vm("my-vm", acc="v4-16")
    before = len(fake.calls())
    p = run_cli(_args(tmp_path, fake, "tpu.mode=existing", "tpu.name=my-vm", "tpu.zone=us-central2-b"),
                cwd=tmp_path, env=fake.env, timeout=600)
    try:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        verbs = _verbs(fake.calls()[before:])
        assert verbs[0] == "tpu-vm describe" and "queued-resources create" not in verbs and "queued-resources delete" not in verbs
        assert fake.deleted() == []
        p = run_cli(_args(tmp_path, fake, "tpu.mode=existing", "tpu.name=my-vm", "tpu.zone=us-central2-b", "devices=4",
                          "run.name=t2"), cwd=tmp_path, env=fake.env)
        assert p.returncode == 2 and "TPU VM my-vm has 2 worker(s) but devices=4 on v4 needs 1" in p.stderr
        assert not (tmp_path / "runs" / "t2").exists(), "a refused cell wrote its run directory or archive"
    finally:
        fake.delete_vm("q-my-vm")


# --------------------------------------------------------------------------- issue 12, items 14-17

def test_best_effort_goes_through_the_alpha_track(tmp_path, fake):
    """`--best-effort` exists only in `gcloud alpha ... queued-resources create`; GA refuses it."""
    p = run_cli(_args(tmp_path, fake, "tpu.capacity=best-effort"), cwd=tmp_path,
                env={**fake.env, "FAKE_GCLOUD_QR_OUTCOME": "FAILED"}, timeout=120)
    assert "is FAILED" in p.stderr, p.stderr
    create = fake.calls()[0]
    assert create[:5] == ["alpha", "compute", "tpus", "queued-resources", "create"] and "--best-effort" in create
    assert fake.deleted() == [NODE]


def test_emulator_refuses_alpha_flags_on_ga_and_mismatched_software(fake):
    base = ["compute", "tpus", "queued-resources", "create", "q", "--node-id=n", "--accelerator-type=v4-8", "--zone=us-central2-b"]
    p = fake.gcloud(*base, "--runtime-version=tpu-ubuntu2204-base", "--best-effort", check=False)
    assert p.returncode == 2 and "unrecognized arguments: --best-effort" in p.stderr
    p = fake.gcloud(*base, "--runtime-version=v2-alpha-tpuv5-lite", check=False)
    assert p.returncode == 1 and "runtime version 'v2-alpha-tpuv5-lite' is not supported for accelerator type v4-8" in p.stderr
    p = fake.gcloud(*base[:-1], "--zone=us-west4-a", "--runtime-version=tpu-ubuntu2204-base", check=False)
    assert p.returncode == 1 and "v4-8 is not available in zone us-west4-a" in p.stderr
    fake.gcloud("alpha", *base, "--runtime-version=tpu-ubuntu2204-base", "--best-effort")
    fake.gcloud("compute", "tpus", "queued-resources", "delete", "q", "--zone=us-central2-b", "--quiet")


@pytest.mark.parametrize("gen,devices,acc,version,zone", [
    ("v4", 4, "v4-8", "tpu-ubuntu2204-base", "us-central2-b"),
    ("v5e", 4, "v5litepod-4", "v2-alpha-tpuv5-lite", "us-west4-a"),
    ("v5p", 4, "v5p-8", "v2-alpha-tpuv5", "us-east5-a"),
    ("v6e", 4, "v6e-4", "v2-alpha-tpuv6e", "us-east1-d"),
])
def test_software_version_and_zone_follow_the_generation(gen, devices, acc, version, zone):
    from launch import config
    from launch.launcher import rundir
    from launch.targets.tpu import target as tpu
    cfg = config.load(["target=tpu", f"tpu.generation={gen}", f"devices={devices}", "checkpoint.dir=gs://b/c"])
    cmds = tpu.plan_commands(rundir.cell_config(cfg, "c"), Path("/r/c"))
    assert f"--accelerator-type={acc} --runtime-version={version} --zone={zone}" in cmds[0]


def test_a_zone_scaleout_does_not_know_is_passed_on():
    from launch import config
    from launch.launcher import rundir
    from launch.targets.tpu import target as tpu
    cfg = config.load(["target=tpu", "tpu.generation=v5e", "devices=4", "tpu.zone=asia-east9-z", "checkpoint.dir=gs://b/c"])
    assert "--zone=asia-east9-z" in tpu.plan_commands(rundir.cell_config(cfg, "c"), Path("/r/c"))[0]


def test_freeing_chips_kills_their_holders_on_the_worker_only(tmp_path, fake):
    """The chip-freeing command kills whatever holds the worker's chips, waits for it, removes libtpu's
    lock file, all inside the worker's sandbox; a JAX trainer elsewhere on this machine (a decoy whose
    command line is `python -m jaxrun --config ...`) is left alone. (tpu.python=python3.10 then stops
    the cell at the Python check, right after the chips are freed.)"""
    fake.make_vm("my-vm")
    sysroot = fake.worker(0, "my-vm") / "sysroot"
    (sysroot / "tmp" / "libtpu_lockfile").touch()
    # a stale trainer that holds chip 0 (started detached, as a trainer of an earlier run would be)
    holder = int(subprocess.run(["bash", "-c", f"sleep 300 < {sysroot / 'dev' / 'accel0'} > /dev/null 2>&1 & echo $!"],
                                capture_output=True, text=True, check=True).stdout)
    decoy = subprocess.Popen(["bash", "-c", "exec -a 'python -m jaxrun --config decoy/config.yaml' sleep 300"])
    try:
        p = run_cli(_args(tmp_path, fake, "tpu.mode=existing", "tpu.name=my-vm", "devices=4", "tpu.python=python3.10"),
                    cwd=tmp_path, env=fake.env, timeout=120)
        assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
        assert f"freeing the TPU chips: killing PID {holder}" in p.stdout
        assert not Path(f"/proc/{holder}").exists(), "the chips' holder is still running"
        assert not (sysroot / "tmp" / "libtpu_lockfile").exists()
        assert decoy.poll() is None, "a process outside the worker was killed"
    finally:
        kill_pids([holder])
        decoy.kill()
        decoy.wait()
        fake.delete_vm("q-my-vm")


def test_old_python_on_the_workers_is_one_sentence_before_training(tmp_path, fake):
    """TPU VM images have Python 3.10; the trainer needs 3.11+: refused before any trainer starts."""
    p = run_cli(_args(tmp_path, fake, "tpu.python=python3.10"), cwd=tmp_path, env=fake.env, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert ("scaleout: error: tpu.python=python3.10 is Python 3.10 on the workers, but scaleout needs Python 3.11 or newer; "
            "keep the default tpu.setup and tpu.python") in p.stderr
    assert not any("setsid" in c[-1] for c in fake.calls()), "a trainer was started"
    assert fake.deleted() == [NODE]


def test_default_setup_makes_a_python311_venv_with_the_pinned_stack():
    from launch import config
    from launch.targets.tpu import target as tpu
    cfg = config.load(["target=tpu", "devices=4", "tpu.generation=v4"])
    c = tpu.Commands(cfg, "v", "c")
    setup = c.unpack_and_setup()[-1]
    assert "python3 -m uv venv --python 3.11 --allow-existing ../venv" in setup
    assert ("uv pip install --python ../venv/bin/python --quiet -r pyproject.toml --extra jax --extra gcs -c constraints.txt "
            "'jax[tpu]'") in setup  # gcs: gcsfs + google-cloud-storage, which Orbax needs for gs://
    assert "../venv/bin/python -m jaxrun --config runs/" in c.start("j")[0][-1]
    assert "sys.version_info[:2]" in c.check_python()[-1] and "(3, 11)" in c.check_python()[-1]


def test_workers_import_only_the_shipped_archive(tmp_path, fake, monkeypatch, capsys):
    """An archive that forgot a module fails on the workers (the project's editable install is not
    importable there), and the image's venv cannot import the project outside the unpacked code."""
    from launch import config
    from launch.launcher import sweep
    from launch.launcher.rundir import RunDir
    from launch.targets.tpu import commands as tpu_commands, target as tpu
    for k, v in fake.env.items():
        monkeypatch.setenv(k, v)
    real = tpu_commands.tracked_files
    monkeypatch.setattr(tpu_commands, "tracked_files", lambda root: [f for f in real(root) if f != "launch/core/metrics.py"])
    cfg = config.load(_args(tmp_path, fake, "devices=4")[1:])
    run = RunDir(cfg)
    cells = run.write(sweep.single(cfg, run))
    out = tpu.run_cell(cells[0])
    log = (tmp_path / "runs" / "t" / "jax-d4" / "logs" / "worker-0.log").read_text()
    assert out.state == "failed" and re.search(r"No module named 'launch.core.metrics'|cannot import name 'metrics' from 'launch.core'",
                                               log), log[-2000:]
    assert fake.deleted() == [NODE]
    p = subprocess.run([str(fake.venv / "bin" / "python"), "-c", "import launch"], cwd=tmp_path, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})  # a worker's environment has no PYTHONPATH
    assert p.returncode == 1 and "No module named 'launch'" in p.stderr


# --------------------------------------------------------------------------- item 19: delete and describe

def test_transient_describe_failures_are_retried(tmp_path, fake):
    p = run_cli(_args(tmp_path, fake), cwd=tmp_path,
                env={**fake.env, "FAKE_GCLOUD_QR_OUTCOME": "FAILED", "FAKE_GCLOUD_FAIL": "describe:2"}, timeout=120)
    assert "queued resource scaleout-t is FAILED" in p.stderr, p.stderr
    assert p.stderr.count("UNAVAILABLE") == 2 and "retrying" in p.stderr
    assert fake.deleted() == [NODE]


def test_failed_delete_is_retried(tmp_path, fake):
    p = run_cli(_args(tmp_path, fake), cwd=tmp_path,
                env={**fake.env, "FAKE_GCLOUD_QR_OUTCOME": "FAILED", "FAKE_GCLOUD_FAIL": "delete:2"}, timeout=120)
    assert p.returncode == 2, p.stderr
    assert fake.deleted() == [NODE]
    assert _verbs(fake.calls()).count("queued-resources delete") == 3


def test_delete_that_keeps_failing_prints_the_manual_command(tmp_path, fake):
    p = run_cli(_args(tmp_path, fake), cwd=tmp_path,
                env={**fake.env, "FAKE_GCLOUD_QR_OUTCOME": "FAILED", "FAKE_GCLOUD_FAIL": "delete:99"}, timeout=120)
    assert p.returncode == 2
    assert ("could not delete queued resource scaleout-t after 4 attempts" in p.stderr
            and "until you delete it: gcloud compute tpus queued-resources delete scaleout-t --zone=us-central2-b --force --quiet"
            in p.stderr), p.stderr
    assert fake.deleted() == [] and (fake.state / "queued" / f"{NODE}.json").is_file()


# --------------------------------------------------------------------------- issue 19 item 7: cleanup

@pytest.mark.parametrize("outcome,extra,message", [
    ("WAITING_FOR_RESOURCES", ["tpu.timeout_s=0.3"], "did not become ACTIVE within tpu.timeout_s=0.3 s"),
    ("SUSPENDED", [], "queued resource scaleout-t is SUSPENDED"),
])
def test_timeout_or_suspended_deletes_the_queued_resource(tmp_path, fake, outcome, extra, message):
    p = run_cli(_args(tmp_path, fake, *extra), cwd=tmp_path, env={**fake.env, "FAKE_GCLOUD_QR_OUTCOME": outcome}, timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert fake.deleted() == [NODE]


@pytest.mark.slow
def test_keep_true_keeps_the_slice(tmp_path, fake):
    p = run_cli(_args(tmp_path, fake, "tpu.keep=true", "devices=4", "train.steps=2"), cwd=tmp_path, env=fake.env, timeout=600)
    try:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        assert fake.deleted() == [] and "queued-resources delete" not in _verbs(fake.calls())
        assert fake.gcloud("compute", "tpus", "tpu-vm", "describe", NODE, "--zone=us-central2-b").returncode == 0
    finally:
        fake.delete_vm(NODE)


@pytest.mark.slow
def test_profile_of_every_worker_is_copied_back(tmp_path, fake):
    """profile.steps on a 2-worker slice with profile.all_processes: each worker traces its own
    process, and the launcher brings both traces back next to the metrics (scp --recurse, which the
    emulation, like gcloud, requires for a directory)."""
    p = run_cli(_args(tmp_path, fake, "devices=8", "train.steps=4", "profile.steps=[2,3]", "profile.all_processes=true",
                      "metrics.wandb.enabled=true"), cwd=tmp_path, env=fake.env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    scps = [c for c in fake.calls() if c[2:4] == ["tpu-vm", "scp"] and "--recurse" in c]
    profile_scps = [c for c in scps if any(a.endswith("/profile") for a in c)]
    assert sorted(next(a for a in c if a.startswith("--worker=")) for c in profile_scps) == ["--worker=0", "--worker=1"]
    cell = tmp_path / "runs" / "t" / CELL
    # the cell's offline W&B run, written by process 0 on worker 0, comes back too (the slice is deleted)
    [wandb_scp] = [c for c in scps if c not in profile_scps]
    assert "--worker=0" in wandb_scp and any(a.endswith("/wandb") for a in wandb_scp)
    assert next((cell / "wandb").glob("offline-run-*/run-*.wandb")).stat().st_size > 0
    for i in (0, 1):
        assert next((cell / "profile" / f"process-{i}").glob("plugins/profile/*/perfetto_trace.json.gz")).stat().st_size > 0
        b = json.loads((cell / "profile" / f"process-{i}" / "breakdown.json").read_text())
        assert b["error"] is None and [r["step"] for r in b["breakdown"]] == [2, 3], (i, b)
        assert all(r["matmul_attention"] > 0 and r["other_compute"] > 0 for r in b["breakdown"]), (i, b)
    recs = [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines()]
    [rec] = [r for r in recs if r["kind"] == "profile"]
    assert rec["error"] is None and rec["steps"] == [2, 3] and len(rec["breakdown"]) == 2
    assert summary(recs)["profiled_steps"] == [2, 3]


def test_plan_shows_the_profile_copy_back(scaleout):
    code, out, err = scaleout("plan", "target=tpu", "devices=8", "tpu.generation=v4", "profile.steps=[2,3]")
    assert code == 0, err
    lines = [line for line in out.splitlines() if "--recurse" in line]
    assert len(lines) == 1 and "/profile" in lines[0] and "--worker=0" in lines[0]
    code, out, err = scaleout("plan", "target=tpu", "devices=8", "tpu.generation=v4", "metrics.wandb.enabled=true")
    assert code == 0, err
    lines = [line for line in out.splitlines() if "--recurse" in line]
    assert len(lines) == 1 and "/wandb" in lines[0] and "--worker=0" in lines[0]


def _launcher(tmp_path, fake, *extra, env=None):
    return subprocess.Popen([sys.executable, "-m", "launch", *_args(tmp_path, fake, *extra)], cwd=tmp_path,
                            env={**os.environ, **fake.env, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.slow
def test_sigint_during_training_stops_the_workers_and_deletes_the_slice(tmp_path, fake):
    """Ctrl-C on the launcher: the detached trainers are stopped on every worker, their metrics are
    collected, the slice is deleted and no worker process is left."""
    launcher = _launcher(tmp_path, fake, "train.steps=100000", "train.log_every=1")
    log0 = tmp_path / "runs" / "t" / CELL / "logs" / "worker-0.log"
    try:
        wait_for(lambda: log0.is_file() and re.search(r"step \d+/100000", log0.read_text()), 300, "training to start")
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, out[-2000:] + err[-2000:]
    assert fake.deleted() == [NODE]
    assert fake.node_processes() == []
    recs = [json.loads(line) for line in (tmp_path / "runs" / "t" / CELL / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "step" for r in recs), "what the trainers wrote before the stop was not collected"
    assert _record(tmp_path)["result"] == "CANCELLED"


def _descendants(pid):
    children = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                ppid = int((Path("/proc") / p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@pytest.mark.slow
def test_launcher_that_goes_away_is_reattached_by_status(tmp_path, fake):
    """The launching machine disconnects (the launcher and everything local to it are SIGKILLed) once
    the trainers have started; they carry on, detached, on the workers. A later `scaleout status`
    finds them from the cell's record, reports them running, and once they have ended collects
    metrics.jsonl and the worker logs and deletes the slice; `scaleout logs` shows the whole run."""
    launcher = _launcher(tmp_path, fake)
    try:
        wait_for(lambda: any("setsid" in c[-1] for c in fake.calls()), 300, "the trainers to start")
        local = [launcher.pid] + [p for p in _descendants(launcher.pid) if b"FAKE_TPU_NODE=" not in _environ(p)]
        kill_pids(local)
        launcher.wait(timeout=30)
    finally:
        launcher.kill()
    run_dir = tmp_path / "runs" / "t"
    metrics = run_dir / CELL / "metrics.jsonl"
    assert not (metrics.is_file() and '"summary"' in metrics.read_text()), "the launcher finished before it was killed"
    seen = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        st = run_cli(["status", str(run_dir)], cwd=tmp_path, env=fake.env, timeout=120)
        assert st.returncode == 0, st.stderr
        seen.append(st.stdout)
        if re.search(rf"{CELL}\s.*\sok\s", st.stdout):
            break
        time.sleep(1)
    assert re.search(rf"{CELL}\s.*RUNNING\s+running", seen[0]), seen[0]  # found again while still training
    assert re.search(rf"{CELL}\s.*COMPLETED\s+ok\s+step 6/6", seen[-1]), seen[-1]
    assert fake.deleted() == [NODE]
    s = summary([json.loads(line) for line in (run_dir / CELL / "metrics.jsonl").read_text().splitlines()])
    assert s["status"] == "ok" and s["processes"] == 2 and s["steps"] == 6
    logs = run_cli(["logs", str(run_dir), CELL], cwd=tmp_path, env=fake.env, timeout=120)
    assert logs.returncode == 0 and "[scaleout] ok: 6 steps" in logs.stdout, logs.stdout[-2000:]
    assert _record(tmp_path)["result"] == "COMPLETED"


@pytest.mark.slow
def test_detached_cell_blocks_a_rerun_and_is_cancelled(tmp_path, fake):
    """After the launcher went away, its trainers still run: a second `scaleout run` of the cell is
    refused (one sentence, nothing created), and `scaleout cancel` stops them, collects what they
    wrote and deletes the slice."""
    launcher = _launcher(tmp_path, fake, "devices=4", "train.steps=100000", "train.log_every=1")
    cell = tmp_path / "runs" / "t" / "jax-d4"
    log0 = cell / "logs" / "worker-0.log"
    try:
        wait_for(lambda: log0.is_file() and "step 1/100000" in log0.read_text(), 300, "training to start")
        kill_pids([launcher.pid] + [p for p in _descendants(launcher.pid) if b"FAKE_TPU_NODE=" not in _environ(p)])
        launcher.wait(timeout=30)
    finally:
        launcher.kill()
    streamed = log0.read_text()
    assert fake.node_processes(), "the detached trainer did not outlive its launcher"
    creates = _verbs(fake.calls()).count("queued-resources create")
    again = run_cli(_args(tmp_path, fake, "devices=4", "train.steps=100000"), cwd=tmp_path, env=fake.env, timeout=120)
    assert again.returncode == 2 and "cell jax-d4 already has a live job" in again.stderr, again.stderr
    assert _verbs(fake.calls()).count("queued-resources create") == creates
    c = run_cli(["cancel", str(tmp_path / "runs" / "t"), "jax-d4"], cwd=tmp_path, env=fake.env, timeout=300)
    assert c.returncode == 0, c.stdout + c.stderr
    assert "jax-d4: stopped the trainers on 1 worker(s); collected metrics.jsonl and the worker logs; deleted queued resource scaleout-t" in c.stdout
    assert fake.deleted() == [NODE]
    wait_for(lambda: fake.node_processes() == [], 10, "the trainers to end")
    assert _record(tmp_path, "jax-d4")["result"] == "CANCELLED"
    collected = log0.read_text()
    assert collected.startswith(streamed) and len(collected) > len(streamed), "the worker's whole log was not collected"
    st = run_cli(["status", str(tmp_path / "runs" / "t")], cwd=tmp_path, env=fake.env, timeout=120)
    assert re.search(r"jax-d4\s.*CANCELLED\s+cancelled", st.stdout), st.stdout


def test_ssh_going_away_does_not_stop_the_remote_command(tmp_path, fake):
    """Real `gcloud ... ssh` does not stop the remote command when the local ssh is terminated."""
    fake.make_vm("my-vm")
    pid_file = fake.worker(0, "my-vm") / "remote.pid"
    ssh = subprocess.Popen([str(GCLOUD), "compute", "tpus", "tpu-vm", "ssh", "my-vm", "--worker=0", "--zone=us-central2-b",
                            "--command=echo $$ > remote.pid; exec sleep 300"], env={**os.environ, **fake.env},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: pid_file.is_file() and pid_file.read_text().strip(), 30, "the remote command")
        remote = int(pid_file.read_text())
        ssh.terminate()
        ssh.wait(timeout=10)
        time.sleep(0.5)
        os.kill(remote, 0)  # still running
        assert fake.node_processes("my-vm") == [remote]
    finally:
        ssh.kill()
        fake.delete_vm("q-my-vm")  # the VM goes, and its processes with it
    wait_for(lambda: fake.node_processes("my-vm") == [], 10, "the deleted VM's processes to end")


def test_a_home_interpreter_expands_on_the_workers(tmp_path):
    """tpu.python=~/... reaches the workers' shell with ~/ unquoted (it was quoted, so it never expanded): the
    Python check, run here by bash with the worker's HOME, finds it; ~user/... is refused (issue 24.12)."""
    from launch import config
    from launch.config import ConfigError
    from launch.targets.tpu import target as tpu
    cfg = config.load(["target=tpu", "devices=4", "tpu.generation=v4", "tpu.python=~/py/bin/python"])
    c = tpu.Commands(cfg, "v", "c")
    home = tmp_path / "home"
    (home / "scaleout" / "v").mkdir(parents=True)
    (home / "py" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, home / "py" / "bin" / "python")
    check = c.check_python()[-1].split("--command=", 1)[1]
    p = subprocess.run(["bash", "-c", check], cwd=home, env={"HOME": str(home), "PATH": os.environ["PATH"]},
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "~/py/bin/python -m jaxrun --config" in c.start("j")[0][-1]  # JAX: one --worker=all ssh
    with pytest.raises(ConfigError, match=r"tpu\.python='~bob/x' is not valid: only a leading ~/"):
        tpu.validate(config.load(["target=tpu", "devices=4", "tpu.generation=v4", "tpu.python=~bob/x"]))

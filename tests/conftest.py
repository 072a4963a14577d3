import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# submitit configures logging when it is first imported (logging.config.dictConfig), which closes every handler that
# exists then: absl's among them, whose stream is the sys.stderr of the moment jax first imported absl -- a test's
# captured stream, which pytest then finds closed ("I/O operation on closed file" at teardown, then "lost
# sys.stderr"). Imported here, before any test, it closes nothing of theirs.
import submitit  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
# In-process JAX tests see 4 simulated CPU devices (must be set before jax is imported).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")


# `make test` runs the suite on pytest-xdist workers. The tests of these modules, and the others that ask for the
# cluster (their names say slurm), submit to the one SLURM cluster of scripts/slurm-local.sh (or start a private
# one): they are one work unit, run by one worker in order, so they never queue behind each other's jobs; every
# other test is a unit of its own. (xdist's own `xdist_group` mark does not group under pytest 9: it rewrites
# `item._nodeid`, which pytest 9 no longer reads.) A test that uses a cluster fixture must match this rule:
# `pytest_collection_modifyitems` below fails the run otherwise.
SLURM_MODULES = {"test_slurm", "test_slurm_multinode", "test_cluster", "test_projection_slurm"}
SLURM_FIXTURES = {"cluster", "gpu_partition", "gpu_cluster"}


def slurm_unit(nodeid: str) -> bool:
    path, _, name = nodeid.partition("::")
    return Path(path).stem in SLURM_MODULES or "slurm" in name.split("[", 1)[0]


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class SlurmTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "slurm" if slurm_unit(nodeid) else nodeid

    return SlurmTogether(config, log)


def pytest_collection_modifyitems(config, items):
    stray = [i.nodeid for i in items if SLURM_FIXTURES & set(getattr(i, "fixturenames", ())) and not slurm_unit(i.nodeid)]
    if stray:
        raise pytest.UsageError(f"these tests use a SLURM cluster fixture but would not run on the SLURM worker (put "
                                f"'slurm' in their names or their module in SLURM_MODULES): {', '.join(stray)}")
    items.sort(key=lambda i: not slurm_unit(i.nodeid))  # the long SLURM unit first, not as a lone tail at the end


def in_ci() -> bool:
    """CI sets CI to a non-empty value (true, 1, yes...): tests that need a service must fail there, not skip."""
    return bool(os.environ.get("CI", "").strip())


def processes_mentioning(text: str):
    """(pid, command line) of every process on the machine whose command line contains `text`."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append((int(pid), cmd.strip()))
    return out


def wait_for(predicate, timeout: float = 120.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(autouse=True)
def no_process_left_behind(tmp_path):
    """A test that leaves a process mentioning its tmp_path running fails, and those processes are killed
    (by PID: nothing else on the machine is touched)."""
    yield
    deadline = time.monotonic() + 15  # a launcher's children may still be ending after their parent
    left = processes_mentioning(str(tmp_path))
    while left and time.monotonic() < deadline:
        time.sleep(0.3)
        left = processes_mentioning(str(tmp_path))
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        pytest.fail("processes left behind: " + "; ".join(f"{pid} {cmd[:160]}" for pid, cmd in left), pytrace=False)


@pytest.fixture(scope="session")
def gcs_server():
    """One Cloud Storage API emulator for the session (tests/gcs_emulator.py); tests take their own bucket."""
    from gcs_emulator import GcsEmulator
    server = GcsEmulator()
    yield server
    server.stop()


@pytest.fixture
def gcs(gcs_server, monkeypatch):
    """The emulator with a fresh bucket (`gcs.bucket`); this process's gs:// clients point at it, and
    `gcs.env` is what a subprocess needs to reach it."""
    bucket = gcs_server.new_bucket()
    for k, v in gcs_server.env.items():
        monkeypatch.setenv(k, v)

    class Handle:
        pass

    h = Handle()
    h.server, h.bucket, h.env, h.url = gcs_server, bucket, gcs_server.env, gcs_server.url
    h.fs = gcs_server.fs
    return h


@pytest.fixture
def scaleout(tmp_path, capsys):
    """Run the CLI in-process in tmp_path; returns (exit code, stdout, stderr)."""
    from launch.launcher.cli import main

    def call(*argv):
        old = os.getcwd()
        os.chdir(tmp_path)
        try:
            code = main(list(argv))
        finally:
            os.chdir(old)
        out = capsys.readouterr()
        return code, out.out, out.err

    return call


def status_rows(stdout: str):
    """The cell lines of `scaleout status` (its header and the indented detail lines left out)."""
    lines = [line for line in stdout.splitlines() if line and not line.startswith(" ")]
    return lines[1:] if lines and lines[0].split()[:2] == ["cell", "job"] else lines


def run_cli(args, cwd, env=None, timeout=600):
    """The CLI as a user runs it: a subprocess."""
    return subprocess.run([sys.executable, "-m", "launch", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def run_cell(tmp_path, *overrides, env=None, timeout=600, check=True):
    """`scaleout run` in a subprocess with checkpoints/runs under tmp_path.

    Returns (completed process, records of the cell's metrics.jsonl)."""
    from launch.core import metrics
    args = ["run", f"run.dir={tmp_path}/runs", f"checkpoint.dir={tmp_path}/ckpt",
            f"jax.cache_dir={tmp_path}/jaxcache", *overrides]
    p = run_cli(args, cwd=tmp_path, env=env, timeout=timeout)
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cell = next((l.split("cell ", 1)[1].split(":", 1)[0] for l in p.stdout.splitlines() if l.startswith("[scaleout] cell ")), None)
    run_name = next((o.split("=", 1)[1] for o in overrides if o.startswith("run.name=")), "tiny")
    recs = metrics.read(tmp_path / "runs" / run_name / cell / "metrics.jsonl") if cell else []
    return p, recs


def losses(recs, since=0):
    """{step: loss} of the step records (a resumed cell appends; later records win)."""
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "step" and r["step"] > since}


def summary(recs):
    return [r for r in recs if r["kind"] == "summary"][-1]

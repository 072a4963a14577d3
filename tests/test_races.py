"""Launchers that race (issue 24.3-24.5): the run identity is created once, checkpoint places have one owner,
one launcher at a time owns a cell, and sweep.extra cannot move a cell out of its run.

The in-process tests make each race certain rather than likely: the writers run in threads that meet at a
barrier (or are slowed down) exactly where the window was; the end-to-end test starts two real launchers at once.
"""

import json
import subprocess
import sys
import threading
import time

import pytest
from conftest import run_cli

from launch import config
from launch.common import files
from launch.config import ConfigError
from launch.launcher import rundir, sweep
from launch.launcher.rundir import RunDir


def _cells(tmp_path, *overrides):
    cfg = config.load([f"run.dir={tmp_path}/runs", "run.name=r", f"jax.cache_dir={tmp_path}/jc", *overrides])
    run = RunDir(cfg)
    return run, sweep.single(cfg, run)


def _race(*jobs):
    """Run the callables at once in threads; returns what each returned or raised."""
    out = [None] * len(jobs)

    def go(i, f):
        try:
            out[i] = f()
        except Exception as e:  # noqa: BLE001 - the race's loser raises; the test looks at what
            out[i] = e

    threads = [threading.Thread(target=go, args=(i, f)) for i, f in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_two_launchers_on_a_new_run_directory_agree_on_its_identity(tmp_path, monkeypatch):
    """Both launchers planned their cells before run.json existed; each one's cells must end with the id
    run.json holds, whoever wrote it (issue 24.4: run.json and a cell's config.yaml had different run ids, and
    the cell could never be rerun). Creating the id is slowed, the second launcher's more, so that both are
    inside the window at once and the second one writes after the first has read its own id back."""
    import uuid
    slow, calls, guard = uuid.uuid4, [], threading.Lock()

    def uuid4():
        with guard:
            calls.append(None)
            n = len(calls)
        time.sleep(0.1 if n == 1 else 0.6)
        return slow()

    monkeypatch.setattr(rundir.uuid, "uuid4", uuid4)
    a, cells_a = _cells(tmp_path, "framework=jax")
    b, cells_b = _cells(tmp_path, "framework=torch")
    assert a.id is None and all(c.cfg.run.id is None for c in cells_a + cells_b)
    written = _race(lambda: a.write(cells_a), lambda: b.write(cells_b))
    assert not any(isinstance(w, Exception) for w in written), written
    rid = json.loads((a.path / files.RUN_FILE).read_text())["id"]
    for name in ("jax-d1", "torch-d1"):
        assert config.load_resolved(a.path / name / files.CONFIG_NAME).run.id == rid, name
    # the rerun of either cell is accepted (it was refused as "of another run")
    for fw in ("jax", "torch"):
        run, cells = _cells(tmp_path, f"framework={fw}")
        run.check(cells)
        run.write(cells)


def test_two_run_directories_racing_for_one_checkpoint_root(tmp_path, monkeypatch):
    """Two new run directories with the same run.name and checkpoint.dir=ROOT both pass the owner check before
    either has claimed ROOT/<run.name>/<cell>; exactly one may own it, the other is refused in one sentence and
    leaves its run directory without a config or an identity (issue 24.4)."""
    barrier = threading.Barrier(2, timeout=10)
    check = rundir.check_checkpoint_owner

    def checked_then_wait(cell_cfg, run_path):
        check(cell_cfg, run_path)
        if threading.current_thread() is not threading.main_thread():
            barrier.wait()  # both have passed the check: now both claim

    monkeypatch.setattr(rundir, "check_checkpoint_owner", checked_then_wait)
    common = ["run.name=same", f"checkpoint.dir={tmp_path}/ckpt", f"jax.cache_dir={tmp_path}/jc"]
    runs = [RunDir(config.load([f"run.dir={tmp_path}/{d}", *common])) for d in ("a", "b")]
    cells = [sweep.single(r.cfg, r) for r in runs]
    out = _race(*(lambda r=r, c=c: r.write(c) for r, c in zip(runs, cells)))
    won = [i for i, o in enumerate(out) if not isinstance(o, Exception)]
    assert len(won) == 1, out
    lost = 1 - won[0]
    assert isinstance(out[lost], ConfigError), out[lost]
    assert "checkpoint.dir" in str(out[lost]) and "is already claimed by run" in str(out[lost]), out[lost]
    owner = json.loads((tmp_path / "ckpt" / "same" / "jax-d1" / files.OWNER_FILE).read_text())
    assert owner["run_dir"] == str(runs[won[0]].path) and owner["run_id"] == runs[won[0]].id
    assert not (runs[lost].path / "jax-d1" / files.CONFIG_NAME).exists()
    assert not (runs[lost].path / files.RUN_FILE).exists()  # the loser's identity was not left behind


def test_a_refused_write_leaves_no_claim(tmp_path, monkeypatch):
    """Another run claims a sweep's second checkpoint place between the sweep's check and its claims: the sweep is
    refused, and the first cell's place, claimed a moment before, is released again (a refused run leaves no
    claim and no identity behind)."""
    common = [f"checkpoint.dir={tmp_path}/ckpt", f"jax.cache_dir={tmp_path}/jc", "run.name=same"]
    other = RunDir(config.load([f"run.dir={tmp_path}/other", *common, "framework=torch"]))
    other.write(sweep.single(other.cfg, other))
    monkeypatch.setattr(rundir, "check_checkpoint_owner", lambda cell_cfg, run_path: None)  # checked before the claim
    cfg = config.load([f"run.dir={tmp_path}/mine", *common, "sweep.frameworks=[jax,torch]", "sweep.devices=[1]"])
    mine = RunDir(cfg)
    cells = sweep.expand(cfg, mine)
    with pytest.raises(ConfigError, match="checkpoint.dir"):
        mine.write(cells)
    assert not (tmp_path / "ckpt" / "same" / "jax-d1" / files.OWNER_FILE).exists()
    assert not (mine.path / files.RUN_FILE).exists()


@pytest.mark.slow
def test_two_launches_at_once_then_both_cells_rerun(tmp_path):
    """Two real `scaleout run` processes started together on a new run directory (different cells), then both
    commands again: both first runs succeed, run.json's id is in both cells' configs, and both reruns are
    accepted (the issue's reproducer: the second rerun was refused, its cell could never resume)."""
    common = [f"run.dir={tmp_path}/runs", "run.name=r", f"jax.cache_dir={tmp_path}/jc", "train.steps=2"]
    argv = [[sys.executable, "-m", "launch", "run", *common, f"devices={d}"] for d in (1, 2)]
    procs = [subprocess.Popen(a, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in argv]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    run = tmp_path / "runs" / "r"
    rid = json.loads((run / files.RUN_FILE).read_text())["id"]
    assert {config.load_resolved(run / c / files.CONFIG_NAME).run.id for c in ("jax-d1", "jax-d2")} == {rid}
    for d in (1, 2):
        p = run_cli(["run", *common, f"devices={d}"], tmp_path)
        assert p.returncode == 0 and f"cell jax-d{d}: finished earlier, skipped" in p.stdout, p.stderr


@pytest.mark.parametrize("key,value", [("run.dir", "[a, b]"), ("run.name", "[a, b]"), ("run.id", "[x, y]"),
                                       ("framework", "[jax, torch]"), ("devices", "[1, 2]"), ("target", "[local]"),
                                       ("checkpoint.dir", "[/tmp/a, /tmp/b]"), ("sweep.devices", "[[1], [2]]")])
def test_sweep_extra_refuses_keys_that_place_the_run_or_cell(tmp_path, scaleout, key, value):
    """sweep.extra of a key that says which run a cell belongs to or where it lives: one sentence naming the key,
    exit 2, nothing written (issue 24.5: the lock and logs went to one run, config.yaml to another)."""
    small = ["sweep.frameworks=[jax]", "sweep.devices=[1]", "train.steps=1"]  # little to run if the check were gone
    for verb in ("plan", "sweep"):
        code, out, err = scaleout(verb, f"run.dir={tmp_path}/runs", *small, f"sweep.extra={{{key}: {value}}}")
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (verb, err)
        assert f"sweep.extra key {key} is not valid" in err and "sweep.frameworks" in err, err
        assert not (tmp_path / "runs").exists()

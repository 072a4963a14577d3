"""Reading a run directory someone else wrote runs nothing of theirs (issue 24.1).

`status`, `logs`, `report` and `export` are how one looks at a shared or copied run. A crafted run directory
(a jobs.json pointing at a pickle that calls os.system, names that climb out of the directory, a DCP checkpoint
whose .metadata is such a pickle, a TPU record with a gcloud of its own) must not make them run any code or
read outside the run directory. Needs no cluster: the job ids are not in any queue.
"""

import json
import os
import pickle

from conftest import run_cli, status_rows

from launch import config
from launch.common import files
from launch.launcher import rundir


class Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _cell(run, name, *overrides):
    cfg = config.load([f"run.dir={run.parent}", f"run.name={run.name}", *overrides])
    d = run / name
    config.save(rundir.cell_config(cfg, name), d / files.CONFIG_NAME)
    return d


def test_status_logs_and_report_never_unpickle_what_a_run_directory_holds(tmp_path):
    """The issue's reproducer: jobs.json names a folder holding a crafted `999999_0_0_result.pkl` (and the
    same pickle sits where submitit would have written it inside the run): nothing runs it."""
    marker = tmp_path / "pwned"
    evil = pickle.dumps(Evil(marker))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "999999_0_0_result.pkl").write_bytes(evil)
    run = tmp_path / "runs" / "shared"
    _cell(run, "jax-d1", "target=slurm")
    inside = run / "slurm" / "999999_0"
    inside.mkdir(parents=True)
    (inside / "999999_0_0_result.pkl").write_bytes(evil)
    (run / files.JOBS_FILE).write_text(json.dumps({"cells": {
        "jax-d1": {"job_id": "999999_0", "folder": str(elsewhere), "history": ["999999_0"]}}}))
    for verb in (["status", str(run)], ["logs", str(run)], ["report", str(run)]):
        p = run_cli(verb, cwd=tmp_path)
        assert p.returncode == 0 and "Traceback" not in p.stderr, (verb, p.stdout, p.stderr)
        assert not marker.exists(), f"`scaleout {verb[0]}` ran the pickle"
    p = run_cli(["status", str(run)], cwd=tmp_path)
    assert status_rows(p.stdout)[0].split()[:3] == ["jax-d1", "job", "999999_0"], p.stdout


def test_names_and_paths_read_from_a_run_directory_stay_inside_it(tmp_path):
    """jobs.json entries whose cell or job id would climb out, sweep.json cells named `../...`, a cell that is a
    link to another run's cell, a profile record naming an outside directory: none is followed."""
    victim = tmp_path / "victim" / "run"
    _cell(victim, "jax-d1")
    (victim / "jax-d1" / files.METRICS_NAME).write_text('{"kind": "summary", "status": "ok", "steps": 99}\n')
    run = tmp_path / "runs" / "shared"
    cell = _cell(run, "jax-d1", "target=slurm")
    (tmp_path / "victim" / "rank0.pt.trace.json").write_text("{}")  # a trace outside the run, where the record points
    (cell / files.METRICS_NAME).write_text(json.dumps({"kind": "profile", "dir": str(tmp_path / "victim" / "rank0.pt.trace.json"), "steps": [1],
                                                        "breakdown": [], "mean": {}, "error": None}) + "\n")
    os.symlink(victim / "jax-d1", run / "torch-d1")
    (run / files.SWEEP_FILE).write_text(json.dumps({"scaling": "weak", "cells": [
        {"name": "jax-d1"}, {"name": "../../victim/run/jax-d1"}, {"name": "torch-d1"}, {"name": str(victim / "jax-d1")}]}))
    (run / files.JOBS_FILE).write_text(json.dumps({"cells": {
        "jax-d1": {"job_id": "1;touch x", "history": []},
        "../../victim/run/jax-d1": {"job_id": "5"},
        "torch-d1": {"job_id": "../../../victim"}}}))
    p = run_cli(["status", str(run)], cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert [line.split()[0] for line in status_rows(p.stdout)] == ["jax-d1"], p.stdout
    assert "job" not in status_rows(p.stdout)[0].split()[1:2]  # no job: its entry was refused
    assert "ignoring the entry" in p.stderr, p.stderr
    p = run_cli(["report", str(run)], cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    report = json.loads((run / "report.json").read_text())
    assert [c["cell"] for c in report["cells"]] == ["jax-d1"]
    assert report["profile"]["jax-d1"]["trace"] is None


def test_export_never_unpickles_a_checkpoints_metadata(tmp_path):
    """A DCP step whose .metadata is a crafted pickle: export refuses it in one sentence, without running it;
    a real checkpoint's metadata still loads (only DCP's own classes are resolved)."""
    marker = tmp_path / "pwned"
    cell = _cell(tmp_path / "runs" / "shared", "torch-d1", "framework=torch")
    step = cell / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "COMMIT").write_text("")
    (step / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    p = run_cli(["export", str(cell), str(tmp_path / "out")], cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert "names posix.system" in p.stderr or "names os.system" in p.stderr, p.stderr
    assert not marker.exists()

    import torch
    import torch.distributed.checkpoint as dcp

    from launch.interop import dcp_reader
    real = tmp_path / "real"
    dcp.save({"model": {"w": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}, "step": 3},
             checkpoint_id=str(real), no_dist=True)
    md = dcp_reader.reader(str(real)).read_metadata()
    assert tuple(md.state_dict_metadata["model.w"].size) == (2, 3)
    state = {"model": {"w": torch.empty(2, 3)}}
    dcp.load(state, storage_reader=dcp_reader.reader(str(real)), no_dist=True)
    assert torch.equal(state["model"]["w"], torch.ones(2, 3))


def test_status_does_not_run_a_gcloud_the_run_directory_brings(tmp_path):
    """A TPU cell whose config names a `gcloud` inside the run directory and whose record says its trainers
    are running: `status` does not execute that program (it would be asked about the workers)."""
    marker = tmp_path / "pwned"
    run = tmp_path / "runs" / "shared"
    tool = run / "bin" / "gcloud"
    tool.parent.mkdir(parents=True)
    tool.write_text(f"#!/bin/sh\ntouch {marker}\n")
    tool.chmod(0o755)
    cell = _cell(run, "jax-d8", "target=tpu", "devices=8", "tpu.generation=v4", f"tpu.gcloud={tool}",
                 "checkpoint.dir=gs://b/c")
    (cell / files.TPU_JOB_FILE).write_text(json.dumps({"version": "0123456789ab", "node": "n", "workers": 1,
                                                       "job": "20260101T000000-abcd", "state": "running", "created": True}))
    p = run_cli(["status", str(run)], cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert not marker.exists()
    assert "scaleout does not run programs a run directory names" in p.stdout, p.stdout
    # a damaged record (a job id that would climb out of the job directory) is not used at all
    (cell / files.TPU_JOB_FILE).write_text(json.dumps({"version": "0123456789ab", "workers": 1, "job": "../../x",
                                                       "state": "running"}))
    p = run_cli(["status", str(run)], cwd=tmp_path)
    assert p.returncode == 0 and "ignored, its job is not a job id" in p.stderr and not marker.exists(), p.stderr

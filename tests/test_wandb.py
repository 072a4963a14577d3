"""metrics.wandb: one offline W&B run per cell (process 0 only), read back with wandb's own reader of
its transaction log (`wandb leet inspect --json`), holds the scalars of metrics.jsonl, the resolved
config and the summary; the report's plots go to the group's `report` run. Offline: no network, no
account. Bad input is one sentence before anything starts."""

import json
import subprocess
import sys

import pytest
import yaml
from conftest import in_ci, run_cell, run_cli

from launch.common.files import read_records
from launch.core import wandb_run


def _wandb():
    if in_ci():
        import wandb
    else:
        wandb = pytest.importorskip("wandb")
    return wandb


def _inspect(run_dir, *flags):
    """wandb's reader of an offline run's .wandb log: one JSON object per record (or the --summary one)."""
    p = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", *flags, str(run_dir)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return json.loads(p.stdout) if flags else [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def test_bad_mode_and_missing_wandb_are_one_sentence(tmp_path, scaleout, monkeypatch):
    code, out, err = scaleout("run", "metrics.wandb.mode=cloud", "run.dir=runs")
    assert code == 2 and err == "scaleout: error: metrics.wandb.mode='cloud' is not valid; choose one of: offline, online.\n"
    monkeypatch.setattr(wandb_run, "installed", lambda: False)  # as on a machine without the package
    code, out, err = scaleout("sweep", "metrics.wandb.enabled=true", "run.dir=runs")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "metrics.wandb.enabled=true needs the wandb package, which is not installed here; pip install wandb" in err
    assert not (tmp_path / "runs").exists()


def test_run_ids_are_stable_and_use_wandb_characters():
    assert wandb_run.run_id("8bb78dc326f5", "jax-d2") == "8bb78dc326f5-jax-d2"
    assert wandb_run.run_id(None, "torch-d1-attention.doc") == "torch-d1-attention-doc"


@pytest.mark.slow
def test_an_offline_run_per_cell_holds_the_metrics_config_and_summary(tmp_path):
    _wandb()
    _, recs = run_cell(tmp_path, "framework=torch", "devices=2", "train.steps=4", "train.log_every=1",
                       "train.eval_every=2", "metrics.wandb.enabled=true", "metrics.wandb.project=proj",
                       "checkpoint.every=0", "run.name=wb", env={"WANDB_MODE": "online"})  # the config's mode wins
    cell = tmp_path / "runs" / "wb" / "torch-d2"
    [offline] = (cell / wandb_run.WANDB_DIR).glob("offline-run-*")  # one run: process 0's, offline
    records = _inspect(offline)
    [run] = [r["run"] for r in records if r["type"] == "run"]
    cfg = yaml.safe_load((cell / "config.yaml").read_text())
    assert (run["project"], run["run_group"], run["display_name"]) == ("proj", "wb", "torch-d2")
    assert run["run_id"] == f"{cfg['run']['id']}-torch-d2" and run["telemetry"]["feature"]["offline"] is True
    got_cfg = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert got_cfg == json.loads(json.dumps(cfg))  # the resolved cell config

    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    steps = [r for r in recs if r["kind"] == "step"]
    train = {h["step"]: h for h in history if "train/loss" in h}
    assert sorted(train) == [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:  # the TensorBoard scalars of each step record, equal
        for key in ("loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu"):
            assert train[r["step"]][f"train/{key}"] == r[key], (r["step"], key)
    evals = {h["step"]: h["eval/loss"] for h in history if "eval/loss" in h}
    assert evals == {r["step"]: r["loss"] for r in recs if r["kind"] == "eval"} and sorted(evals) == [0, 2, 4]

    summary = _inspect(offline, "--summary")
    want = [r for r in recs if r["kind"] == "summary"][-1]
    assert summary["state"] == "finished" and summary["exit_code"] == 0
    for key in ("status", "final_loss", "tokens_per_s", "steps", "mfu", "params"):
        assert summary["summary"][key] == want[key], key

    # the report's plots, as images on the group's `report` run
    p = run_cli(["report", str(tmp_path / "runs" / "wb")], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    [report] = (tmp_path / "runs" / "wb" / wandb_run.WANDB_DIR).glob("offline-run-*")
    [item] = [r["history"]["item"] for r in _inspect(report) if r["type"] == "history"]
    images = sorted(k.split("/")[1].split(".")[0] for k in item if k.endswith("._type") and item[k] == "image-file")
    plots = json.loads((tmp_path / "runs" / "wb" / "report.json").read_text())["plots"]
    assert images == sorted(name.rsplit(".", 1)[0] for name in plots) and len(images) >= 3
    for name in images:
        assert (report / "files" / item[f"report/{name}.path"]).stat().st_size > 0
    assert read_records(cell / "metrics.jsonl")[-1]["kind"] == "summary"

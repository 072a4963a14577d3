"""Contenders (issue 26): a sweep compares named contenders, each a framework plus its own settings."""

import json

import pytest
from conftest import run_cli

from launch import config
from launch.config import ConfigError, contenders, loader
from launch.launcher import plan, sweep

CUSTOM = "sweep.custom_contenders={jax-unrolled: {framework: jax, model.scan_layers: false}}"


def test_three_contenders_and_a_custom_one_make_their_own_cells(tmp_path):
    cfg = config.load([f"run.dir={tmp_path}", "sweep.devices=[1,2]", CUSTOM,
                       "sweep.contenders=[jax,torch,torch-compile,jax-unrolled]"])
    cells = {c.name: c for c in sweep.expand(cfg)}
    assert list(cells) == ["jax-d1", "jax-d2", "torch-d1", "torch-d2", "torch-compile-d1", "torch-compile-d2",
                           "jax-unrolled-d1", "jax-unrolled-d2"]
    # a contender's settings apply to its own cells only
    assert [cells[n].cfg.torch.compile for n in ("torch-d1", "torch-compile-d1", "jax-d1")] == [False, True, False]
    assert cells["jax-unrolled-d2"].cfg.model.scan_layers is False and cells["jax-d2"].cfg.model.scan_layers is True
    assert cells["torch-compile-d2"].framework == "torch" and cells["torch-compile-d2"].contender == "torch-compile"
    assert {c.cfg.contender for c in cells.values()} == {"jax", "torch", "torch-compile", "jax-unrolled"}
    assert cells["torch-compile-d2"].cfg.train.global_batch == 16  # weak scaling as for every contender
    m = sweep.manifest(cfg, list(cells.values()))
    assert [c["name"] for c in m["contenders"]] == ["jax", "torch", "torch-compile", "jax-unrolled"]
    assert m["contenders"][3] == {"name": "jax-unrolled", "framework": "jax", "overrides": {"model.scan_layers": False}}
    assert {c["name"]: c["contender"] for c in m["cells"]}["torch-compile-d1"] == "torch-compile"


def test_frameworks_stay_the_simple_case(tmp_path):
    """sweep.frameworks: one contender per framework, named for what it runs; cell names as before."""
    base = [f"run.dir={tmp_path}", "sweep.devices=[1]"]
    assert [c.name for c in sweep.expand(config.load(base))] == ["jax-d1", "torch-d1"]
    compiled = sweep.expand(config.load([*base, "torch.compile=true"]))
    assert [c.name for c in compiled] == ["jax-d1", "torch-compile-d1"] and compiled[1].cfg.torch.compile
    assert [c.contender for c in sweep.expand(config.load([*base, "sweep.frameworks=[torch]"]))] == ["torch"]


@pytest.mark.parametrize("key,value", [("run.name", "other"), ("checkpoint.dir", "/tmp/x"), ("devices", 4),
                                       ("target", "slurm"), ("run.dir", "/tmp"), ("sweep.devices", [8]),
                                       ("contender", "jax")])
def test_a_contender_may_not_move_the_run_or_its_cells(key, value, tmp_path):
    """The same rule as sweep.extra's (one list, launch.config.loader.PLACE_KEYS), checked when the config loads."""
    with pytest.raises(ConfigError, match=rf"sweep\.custom_contenders\.bad sets {key}, which says which run a cell "
                                          r"belongs to or where it lives .*; a contender sets only how its cells train"):
        config.load([f"run.dir={tmp_path}", "sweep.contenders=[jax,bad]",
                     f"sweep.custom_contenders={{bad: {{framework: torch, {key}: {json.dumps(value)}}}}}"])
    assert loader.defines_place(key)
    assert not any(loader.defines_place(k) for k in ("model.scan_layers", "torch.compile", "train.lr", "data.pad_to"))


def test_a_refused_contender_writes_nothing(tmp_path):
    p = run_cli(["sweep", f"run.dir={tmp_path}/runs", "sweep.contenders=[jax,bad]",
                 "sweep.custom_contenders={bad: {framework: jax, run.name: elsewhere}}"], cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert "sets run.name, which says which run a cell belongs to" in p.stderr
    assert not (tmp_path / "runs").exists()


def test_a_contender_setting_and_a_sweep_extra_axis_cannot_overlap(tmp_path):
    with pytest.raises(ConfigError, match=r"sets model\.scan_layers, which sweep\.extra also sweeps"):
        config.load([f"run.dir={tmp_path}", "sweep.contenders=[jax-unrolled]", CUSTOM,
                     "sweep.extra={model.scan_layers: [true, false]}"])


def test_a_bad_contender_setting_names_its_cell(tmp_path):
    cfg = config.load([f"run.dir={tmp_path}", "sweep.devices=[2]", "sweep.contenders=[tp]",
                       "sweep.custom_contenders={tp: {framework: torch, parallel.tensor: 2, parallel.fsdp: 1}}"])
    with pytest.raises(ConfigError, match=r"sweep cell tp-d2: parallel\.tensor=2 is not supported with framework=torch"):
        sweep.expand(cfg)


def test_run_and_plan_as_a_contender(tmp_path):
    """`scaleout run contender=torch-compile` runs one cell as that contender: its framework and settings apply."""
    cfg = config.load([f"run.dir={tmp_path}", "contender=torch-compile", "devices=2"])
    [cell] = sweep.single(cfg)
    assert cell.name == "torch-compile-d2" and cell.framework == "torch" and cell.cfg.torch.compile
    assert cell.cfg.contender == "torch-compile"
    p = plan.describe(cfg)
    assert p["cell"] == "torch-compile-d2" and p["framework"] == "torch" and p["contender"] == "torch-compile"
    unset = sweep.single(config.load([f"run.dir={tmp_path}", "framework=torch", "torch.compile=true"]))[0]
    assert unset.name == "torch-compile-d1" and unset.cfg.contender == "torch-compile"
    assert sweep.single(config.load([f"run.dir={tmp_path}"]))[0].name == "jax-d1"


def test_contender_names_of_written_cells():
    assert contenders.name_of({"framework": "torch", "torch": {"compile": True}}) == "torch-compile"
    assert contenders.name_of({"framework": "torch", "torch": {"compile": False}}) == "torch"
    assert contenders.name_of({"framework": "jax", "contender": "jax-unrolled"}) == "jax-unrolled"
    assert contenders.flatten({"framework": "jax", "model": {"scan_layers": False}, "slurm.additional": {"a": 1}}) == {
        "framework": "jax", "model.scan_layers": False, "slurm.additional": {"a": 1}}


def test_the_report_keeps_the_order_the_sweep_listed():
    from launch.report import compare
    rows = [{"contender": n} for n in ("jax", "torch-compile", "mine", "torch")]
    assert compare.contender_order(rows, ["torch-compile", "jax"]) == ["torch-compile", "jax", "torch", "mine"]
    assert compare.contender_order(rows) == ["jax", "torch", "torch-compile", "mine"]

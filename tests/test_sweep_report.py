"""The sweep and the scaling report: the main job."""

import csv
import json

import numpy as np
import pytest
import yaml
from conftest import run_cli

from launch import config
from launch.config import ConfigError
from launch.core import flops
from launch.launcher import rundir, sweep
from launch.report import compare, report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_weak_and_strong_batch_arithmetic(tmp_path):
    base = [f"run.dir={tmp_path}", "sweep.devices=[2,4,8]", "train.global_batch=16"]
    weak = {c.name: c.cfg.train.global_batch for c in sweep.expand(config.load([*base, "sweep.scaling=weak"]))}
    assert weak == {"jax-d2": 16, "jax-d4": 32, "jax-d8": 64, "torch-d2": 16, "torch-d4": 32, "torch-d8": 64}
    strong = {c.name: c.cfg.train.global_batch for c in sweep.expand(config.load([*base, "sweep.scaling=strong"]))}
    assert set(strong.values()) == {16}
    with pytest.raises(ConfigError, match=r"train\.global_batch=6 is not divisible by the smallest sweep device count 4"):
        sweep.expand(config.load([f"run.dir={tmp_path}", "sweep.devices=[4,8]", "train.global_batch=6"]))
    with pytest.raises(ConfigError, match=r"sweep cell jax-d8: train\.global_batch=4 is not divisible by the data-parallel size 8"):
        sweep.expand(config.load([f"run.dir={tmp_path}", "sweep.devices=[1,8]", "train.global_batch=4", "sweep.scaling=strong"]))


def test_extra_sweep_keys_make_more_cells(tmp_path):
    cells = sweep.expand(config.load([f"run.dir={tmp_path}", "sweep.devices=[1]", "sweep.frameworks=[jax]",
                                      "sweep.extra={model.remat: [none, full]}"]))
    assert [c.name for c in cells] == ["jax-d1-remat_none", "jax-d1-remat_full"]
    assert [c.cfg.model.remat for c in cells] == ["none", "full"]


def _cell(run_dir, name, fw, devices, summary, losses=(), batch=8, status="ok", overrides=()):
    d = run_dir / name
    d.mkdir(parents=True)
    cfg = config.to_dict(config.load([f"framework={fw}", f"devices={devices}", f"train.global_batch={batch}", *overrides]))
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    recs = [{"kind": "start", "framework": fw, "devices": devices, "device_kind": "NVIDIA H100", "host_cores": 64, "host": "n1"}]
    recs += [{"kind": "step", "step": i + 1, "loss": l} for i, l in enumerate(losses)]
    if summary is not None:
        recs.append({"kind": "summary", "framework": fw, "devices": devices, "processes": devices, "status": status, **summary})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def _s(tps, devices, ttfs, step):
    return {"tokens_per_s": tps, "tokens_per_s_per_device": tps / devices, "time_to_first_step_s": ttfs,
            "step_time_p50_s": step, "step_time_mean_s": step, "step_time_p90_s": step, "compile_s": ttfs / 2,
            "mfu": 0.4, "peak_memory_bytes": 2**30, "final_loss": 2.0, "steps": 100, "error": None}


def test_report_on_hand_made_metrics(tmp_path):
    run = tmp_path / "run"
    # 1 device: jax starts 30 s later but steps take 0.5 s vs 0.8 s -> catches up after 1 + 30/0.3 = 101 steps
    _cell(run, "jax-d1", "jax", 1, _s(1000, 1, 40.0, 0.5), losses=[5.0, 4.0, 3.0])
    _cell(run, "torch-d1", "torch", 1, _s(625, 1, 10.0, 0.8), losses=[5.0, 4.0, 3.03])
    # 2 devices: jax starts later and is slower per step -> never catches up (issue 24.26: a cell that ran, to show it)
    _cell(run, "jax-d2", "jax", 2, _s(1500, 2, 40.0, 0.9))
    _cell(run, "torch-d2", "torch", 2, _s(1250, 2, 10.0, 0.8))
    # 8 devices: a failed cell whose error is in its log, 4 devices: one whose summary has it
    _cell(run, "torch-d8", "torch", 8, None, status="failed")
    (run / "torch-d8" / "logs").mkdir()
    (run / "torch-d8" / "logs" / "torchrun.log").write_text("Traceback...\nRuntimeError: NCCL timeout on rank 3\n")
    _cell(run, "torch-d4", "torch", 4, {**_s(2000, 4, 12.0, 0.6), "error": "RuntimeError: boom\n"}, status="failed")
    names = ["jax-d1", "jax-d2", "torch-d1", "torch-d2", "torch-d4", "torch-d8"]
    (run / "sweep.json").write_text(json.dumps({"scaling": "weak", "cells": [{"name": n} for n in names]}))
    out = report.write(run)
    doc = json.loads(out["json"].read_text())
    rows = {r["cell"]: r for r in doc["cells"]}
    assert sorted(rows) == names
    assert rows["torch-d8"]["status"] == "failed" and rows["torch-d8"]["error"] == "RuntimeError: NCCL timeout on rank 3"
    assert rows["torch-d4"]["status"] == "failed" and rows["torch-d4"]["error"] == "RuntimeError: boom"
    d = doc["derived"]
    assert d["efficiency"]["jax"] == {"1": 1.0, "2": 0.75}
    assert len(d["pairs"]) == 2  # 1 and 2 devices have finished cells of both
    p, never = d["pairs"]
    assert (p["a"], p["b"], p["devices"], p["throughput_ratio"]) == ("jax", "torch", 1, 1.6)
    assert p["break_even"] == {"slower_start": "jax", "steps": 101}
    assert p["wall_time_s"]["jax"] == pytest.approx(40 + 9999 * 0.5)
    assert p["wall_time_s"]["torch"] == pytest.approx(10 + 9999 * 0.8)
    assert p["loss_gap"]["max_rel_diff"] == pytest.approx(0.03 / 3.03) and p["notes"] == []
    assert (never["devices"], never["throughput_ratio"]) == (2, 1.2)
    assert never["break_even"] == {"slower_start": "jax", "steps": "never"}
    assert never["wall_time_s"]["jax"] == pytest.approx(40 + 9999 * 0.9)
    assert d["headline"]["1"]["with"]["winner"] == "jax" and d["headline"]["1"]["without"] is None
    assert d["headline"]["2"]["with"]["winner"] == "torch"
    assert doc["hardware"]["device_kinds"] == ["NVIDIA H100"] and not doc["hardware"]["simulated_devices_share_host"]
    md = out["md"].read_text()
    assert "**failed**: RuntimeError: NCCL timeout on rank 3" in md and "catches up after 101 steps" in md
    assert "- 2 device(s), **jax vs torch**: throughput 1.20x" in md and "jax starts 30.0 s later and never catches up" in md
    with open(out["csv"]) as f:
        assert len(list(csv.DictReader(f))) == 6


def test_break_even_arithmetic():
    assert report.break_even(40, 0.5, 10, 0.8) == {"slower_start": "a", "steps": 101}
    # issue 24.20: 1 + 10 / 0.3 = 34.33 steps: at 34 the slower start is still behind, at 35 it is ahead (not round())
    assert report.break_even(20, 0.5, 10, 0.8) == {"slower_start": "a", "steps": 35}
    assert report.wall_time(20, 0.5, 34) > report.wall_time(10, 0.8, 34)
    assert report.wall_time(20, 0.5, 35) < report.wall_time(10, 0.8, 35)
    assert report.break_even(10, 0.8, 20, 0.5)["steps"] == 35
    assert report.break_even(10, 0.8, 40, 0.5) == {"slower_start": "b", "steps": 101}
    assert report.break_even(40, 0.9, 10, 0.8)["steps"] == "never"
    assert report.break_even(40, 0.8, 10, 0.8)["steps"] == "never"


def test_strong_efficiency():
    rows = [{"contender": "jax", "devices": n, "status": "ok", "tokens_per_s": t, "tokens_per_s_per_device": t / n}
            for n, t in [(2, 100), (4, 180), (8, 200)]]
    eff = compare.efficiency(rows, "strong")["jax"]
    assert eff == {2: 1.0, 4: pytest.approx(0.9), 8: pytest.approx(0.5)}


def test_report_refuses_a_directory_without_cells(tmp_path):
    p = run_cli(["report", str(tmp_path)], cwd=tmp_path)
    assert p.returncode == 2 and "holds no cells" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_local_sweep_end_to_end(tmp_path):
    args = ["sweep", f"run.dir={tmp_path}/runs", f"jax.cache_dir={tmp_path}/jc", "checkpoint.every=2",
            "sweep.devices=[1,2]", "train.steps=6", "train.global_batch=4", "run.name=e2e", "checkpoint.async=false"]
    p = run_cli(args, cwd=tmp_path, env={"SCALEOUT_FAULT": "crash@4:cell=torch-d2"})
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    run = tmp_path / "runs" / "e2e"
    for name in ("report.md", "report.json", "report.csv", "throughput.png", "efficiency.png", "loss.png", "startup.png"):
        assert (run / name).is_file(), name
    for png in run.glob("*.png"):
        assert png.read_bytes()[:8] == PNG_MAGIC
        import matplotlib.image
        assert matplotlib.image.imread(png).shape[0] > 100
    doc = json.loads((run / "report.json").read_text())
    rows = {r["cell"]: r for r in doc["cells"]}
    assert set(rows) == {"jax-d1", "jax-d2", "torch-d1", "torch-d2"}
    for r in rows.values():
        assert set(report.ROW_FIELDS) <= set(r)
    assert rows["torch-d2"]["status"] == "failed" and "injected crash at step 4" in rows["torch-d2"]["error"]
    for name in ("jax-d1", "jax-d2", "torch-d1"):
        assert rows[name]["status"] == "ok" and rows[name]["tokens_per_s"] > 0 and rows[name]["steps"] == 6
    assert rows["jax-d2"]["global_batch"] == 8  # weak scaling
    for name in ("jax-d1", "jax-d2", "torch-d1"):  # the summary's numbers follow from the formula and the step times
        recs = [json.loads(l) for l in (run / name / "metrics.jsonl").read_text().splitlines()]
        s = [r for r in recs if r["kind"] == "summary"][-1]
        cfg = config.load_resolved(run / name / "config.yaml")
        tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
        assert s["flops_per_token"] == flops.flops_per_token(cfg.model)
        assert s["tokens_per_s"] == pytest.approx(tokens_per_step / s["step_time_mean_s"], rel=1e-9)
        assert s["tokens_per_s_per_device"] == pytest.approx(s["tokens_per_s"] / cfg.devices, rel=1e-9)
        assert s["mfu"] == pytest.approx(s["tokens_per_s_per_device"] * s["flops_per_token"] / s["peak_flops_per_device"], rel=1e-9)
        assert 1e8 < s["peak_flops_per_device"] * cfg.devices < 1e13  # a CPU matmul peak measured in this run
        steps = [r for r in recs if r["kind"] == "step"]
        assert s["step_time_p50_s"] == pytest.approx(np.median([r["step_time_s"] for r in steps[cfg.train.warmup_exclude:]]), rel=1e-9)
        assert 0 < s["loop_tokens_per_s"] <= s["tokens_per_s"] * 1.5
    assert set(doc["derived"]["efficiency"]) == {"jax", "torch"}
    pair = next(p for p in doc["derived"]["pairs"] if p["devices"] == 1)
    assert (pair["a"], pair["b"]) == ("jax", "torch") and pair["loss_gap"]["max_rel_diff"] < 1e-3
    assert rows["torch-d1"]["compiles"] == 0 and rows["jax-d1"]["compiles"] == 1  # eager torch compiles nothing
    assert doc["hardware"]["simulated_devices_share_host"] is True
    assert "functional dry run" in (run / "report.md").read_text()
    # on CPU, auto attention is XLA's dense path in JAX and SDPA's CPU flash kernel in PyTorch: said, and marked
    att = pair["attention"]
    assert att["kernels"] == {"jax": "xla (dense)", "torch": "flash (fused)"} and att["different_classes"] is True
    md = (run / "report.md").read_text()
    assert "different classes (fused vs dense)" in md and "MFU is measured against: the host's fp32 matmul" in md

    # rerun without the fault: finished cells are skipped, the crashed one resumes and finishes
    before = (run / "jax-d1" / "metrics.jsonl").read_text()
    p = run_cli(args, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.count("finished earlier, skipped") == 3
    assert (run / "jax-d1" / "metrics.jsonl").read_text() == before
    rows = {r["cell"]: r for r in json.loads((run / "report.json").read_text())["cells"]}
    assert rows["torch-d2"]["status"] == "ok"
    resumed = [json.loads(l) for l in (run / "torch-d2" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in resumed if r["kind"] == "summary"][-1]
    assert last["resumed_from_step"] == 2 and last["steps"] == 6  # the step-2 checkpoint, saved before the crash at 3->4
    assert [r["step"] for r in resumed if r["kind"] == "step"][-4:] == [3, 4, 5, 6]

    # a third run does no training at all
    p = run_cli(args, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.count("finished earlier, skipped") == 4
    assert "step " not in p.stdout


def test_sweep_refuses_reusing_a_run_dir_with_other_math(tmp_path):
    base = ["sweep", f"run.dir={tmp_path}/runs", "sweep.devices=[1]", "run.name=x"]
    cfg = config.load(base[1:])
    run = rundir.RunDir(cfg)
    cells = sweep.expand(cfg, run)
    run.write(cells, sweep.manifest(cfg, cells))
    p = run_cli([*base, "model.n_layers=3"], cwd=tmp_path)
    assert p.returncode == 2 and "already holds cell jax-d1 with a different config" in p.stderr


@pytest.mark.slow
def test_tensorboard_events_mirror_the_metrics(tmp_path):
    from conftest import losses, run_cell
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _, recs = run_cell(tmp_path, "train.steps=5", "metrics.tensorboard=true")
    tb = tmp_path / "runs" / "tiny" / "jax-d1" / "tensorboard"
    acc = EventAccumulator(str(tb))
    acc.Reload()
    events = {e.step: e.value for e in acc.Scalars("train/loss")}
    want = losses(recs)
    assert set(events) == set(want)
    for k in want:
        assert events[k] == pytest.approx(want[k], rel=1e-6)


def test_status_and_report_say_only_what_the_files_support(tmp_path):
    """Lost or damaged metrics (issue 13.11, 13.7): an empty metrics file whose log says it finished, a torn summary,
    a `null` line and a step record without a step: no traceback, and the words say what is known."""
    run = tmp_path / "run"
    _cell(run, "jax-d1", "jax", 1, _s(1000, 1, 40.0, 0.5), losses=[5.0, 4.0])
    _cell(run, "torch-d1", "torch", 1, None)
    (run / "torch-d1" / "metrics.jsonl").write_text("")
    (run / "torch-d1" / "logs").mkdir()
    (run / "torch-d1" / "logs" / "torchrun.log").write_text("[scaleout] step 4/4 loss 4.1\n[scaleout] ok: 4 steps, final loss 4.1\n")
    _cell(run, "jax-d2", "jax", 2, None, losses=[5.0, 4.5, 4.2])
    with open(run / "jax-d2" / "metrics.jsonl", "a") as f:
        f.write('null\n{"kind": "step", "loss": 1.0}\n{"kind": "summary", "status": "o')  # torn summary
    p = run_cli(["status", str(run)], cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    lines = {l.split()[0]: l for l in p.stdout.splitlines() if not l.startswith(" ")}
    assert " ok " in lines["jax-d1"] and "step 2/20" in lines["jax-d1"] and "loss 4.0000" in lines["jax-d1"]
    assert " unknown " in lines["jax-d2"] and "step 3/20" in lines["jax-d2"]
    assert "metrics lost or incomplete: the last step record is step 3" in p.stdout
    out = report.write(run)
    rows = {r["cell"]: r for r in json.loads(out["json"].read_text())["cells"]}
    assert rows["torch-d1"]["status"] == "incomplete"
    assert rows["torch-d1"]["error"] == "metrics lost or incomplete; the log says it finished at step 4"
    assert rows["jax-d2"]["status"] == "incomplete" and "step 3" in rows["jax-d2"]["error"]
    assert rows["jax-d1"]["status"] == "ok" and rows["jax-d1"]["error"] is None


def test_comparisons_with_sweep_extra_use_one_combination(tmp_path):
    """With sweep.extra a framework has several cells per device count: the JAX/PyTorch ratio must compare cells
    of the same combination, not whichever cell came last."""
    run = tmp_path / "run"
    _cell(run, "jax-d1-remat_none", "jax", 1, _s(1000, 1, 40.0, 0.5))
    _cell(run, "jax-d1-remat_full", "jax", 1, _s(100, 1, 40.0, 0.5))
    _cell(run, "torch-d1-remat_none", "torch", 1, _s(500, 1, 10.0, 0.8))
    _cell(run, "torch-d1-remat_full", "torch", 1, _s(400, 1, 10.0, 0.8))
    (run / "sweep.json").write_text(json.dumps({"scaling": "weak", "cells": [
        {"name": n} for n in ["jax-d1-remat_none", "jax-d1-remat_full", "torch-d1-remat_none", "torch-d1-remat_full"]]}))
    doc = json.loads(report.write(run)["json"].read_text())
    assert doc["derived"]["variant"] == "remat_none"
    ratios = {p["variant"]: p["throughput_ratio"] for p in doc["derived"]["pairs"]}
    assert ratios == {"remat_none": 2.0, "remat_full": 0.25}  # each combination against its own
    assert doc["derived"]["headline"]["1"]["with"]["winner"] == "jax"  # over the first combination only


def test_report_compares_every_pair_of_three_contenders(tmp_path):
    """jax, torch and torch-compile at two device counts: three pairs at each, the headline with and without
    torch.compile, per-contender efficiency, the contender in report.json, the CSV and report.md; eager torch's
    compile is "none" and torch.compile's comes with its graph breaks."""
    run = tmp_path / "run"
    tc = ["contender=torch-compile", "torch.compile=true"]
    for d, (j, t, c) in {1: (1000, 500, 900), 2: (1800, 900, 1900)}.items():
        _cell(run, f"jax-d{d}", "jax", d, {**_s(j, d, 20.0, 256 / j), "compiles": 1}, losses=[5.0, 4.0])
        _cell(run, f"torch-d{d}", "torch", d, {**_s(t, d, 5.0, 256 / t), "compiles": 0, "compile_s": 0.0},
              losses=[5.0, 4.0])
        _cell(run, f"torch-compile-d{d}", "torch", d, {**_s(c, d, 30.0, 256 / c), "compiles": 2, "graph_breaks": 1},
              losses=[5.0, 4.0004], overrides=tc)
    (run / "sweep.json").write_text(json.dumps({"scaling": "weak", "contenders": [
        {"name": "jax"}, {"name": "torch"}, {"name": "torch-compile"}], "cells": [
        {"name": f"{c}-d{n}"} for c in ("jax", "torch", "torch-compile") for n in (1, 2)]}))
    out = report.write(run)
    doc = json.loads(out["json"].read_text())
    d = doc["derived"]
    assert [c["name"] for c in doc["contenders"]] == ["jax", "torch", "torch-compile"]
    assert doc["contenders"][2]["torch_compile"] is True and doc["contenders"][1]["torch_compile"] is False
    got = {(p["devices"], p["a"], p["b"]): p for p in d["pairs"]}
    assert set(got) == {(n, a, b) for n in (1, 2) for a, b in
                        [("jax", "torch"), ("jax", "torch-compile"), ("torch", "torch-compile")]}
    assert got[(2, "jax", "torch-compile")]["throughput_ratio"] == pytest.approx(1800 / 1900)
    assert got[(1, "torch", "torch-compile")]["loss_gap"]["max_rel_diff"] == pytest.approx(0.0004 / 4.0004)
    assert set(d["efficiency"]) == {"jax", "torch", "torch-compile"}
    assert d["efficiency"]["torch-compile"]["2"] == pytest.approx(950 / 900)
    # 2 devices, 10,000 steps: torch-compile's faster steps pay back its later start; without it jax wins
    h = d["headline"]["2"]
    walls = {n: s + 9999 * 256 / tps for n, s, tps in [("jax", 20.0, 1800), ("torch", 5.0, 900), ("torch-compile", 30.0, 1900)]}
    best = min(walls, key=walls.get)
    assert h["with"]["winner"] == best == "torch-compile"
    assert h["without"]["winner"] == "jax" and h["without"]["runner_up"] == "torch"
    assert h["without"]["speedup"] == pytest.approx(walls["torch"] / walls["jax"])
    rows = {r["cell"]: r for r in doc["cells"]}
    assert rows["torch-compile-d1"]["contender"] == "torch-compile" and rows["torch-d1"]["contender"] == "torch"
    with open(out["csv"]) as f:
        csv_rows = {r["cell"]: r for r in csv.DictReader(f)}
    assert csv_rows["torch-compile-d2"]["contender"] == "torch-compile" and csv_rows["jax-d2"]["contender"] == "jax"
    md = out["md"].read_text()
    assert "**torch vs torch-compile**" in md and "Without torch.compile: **jax**" in md
    assert "| torch-d1 | torch | 1 |" in md and "| none |" in md  # eager: no compile
    comp = {c["cell"]: c for c in doc["compile"]}
    assert comp["torch-compile-d1"]["graph_breaks"] == 1 and comp["torch-d1"]["compiles"] == 0

"""The report's "Where the time goes" section: breakdown table, breakdown.png, report.json (issue 18)."""

import json

import pytest
import yaml
from conftest import run_cli

from launch import config
from launch.core.profile import CATEGORIES
from launch.report import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SECTION = "## Where the time goes"


def _cell(run, name, fw, devices, profile=None, steps=(2, 3)):
    """A finished cell with hand-made metrics; `profile`: the fields of its profile record, or None."""
    d = run / name
    d.mkdir(parents=True)
    overrides = [f"framework={fw}", f"devices={devices}", "train.steps=4"]
    if profile is not None:
        overrides.append(f"profile.steps=[{steps[0]},{steps[-1]}]")
    (d / "config.yaml").write_text(yaml.safe_dump(config.to_dict(config.load(overrides))))
    recs = [{"kind": "start", "framework": fw, "devices": devices, "device_kind": "cpu", "host_cores": 2, "host": "h"}]
    recs += [{"kind": "step", "step": i, "loss": 5.0 - i / 10, "step_time_s": 0.1} for i in (1, 2, 3, 4)]
    if profile is not None:
        recs.append({"kind": "profile", "process": 0, "steps": list(steps), "dir": "profile/process-0", "files": [],
                     "overhead_s": 0.5, **profile})
    recs.append({"kind": "summary", "status": "ok", "steps": 4, "tokens_per_s": 100.0, "tokens_per_s_per_device": 100.0 / devices,
                 "step_time_p50_s": 0.1, "step_time_mean_s": 0.1, "time_to_first_step_s": 1.0, "compile_s": 0.5,
                 "final_loss": 4.6, **({"profiled_steps": list(steps)} if profile is not None else {})})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return d


def _split(measured, **ms):
    """A breakdown step whose categories (milliseconds) sum to the traced time."""
    parts = {c: ms.get(c, 0.0) / 1e3 for c in CATEGORIES}
    return {"trace_s": sum(parts.values()), "measured_s": measured, **parts}


def test_section_table_and_errors_from_hand_made_records(tmp_path):
    run = tmp_path / "run"
    jax_step = _split(0.1, matmul_attention=60, other_compute=30, idle=10)
    _cell(run, "jax-d1", "jax", 1, {"error": None, "breakdown": [{"step": 2, **jax_step}, {"step": 3, **jax_step}], "mean": jax_step})
    torch_step = _split(0.2, matmul_attention=100, other_compute=50, collectives=40, host_data=2, idle=8)
    d = _cell(run, "torch-d1", "torch", 1, {"error": None, "breakdown": [{"step": 2, **torch_step}], "mean": torch_step})
    (d / "profile" / "process-0").mkdir(parents=True)  # the breakdown's directory; the trace beside it in traces/
    (d / "profile" / "traces").mkdir()
    (d / "profile" / "traces" / "rank0.pt.trace.json.gz").write_bytes(b"x")
    _cell(run, "jax-d2", "jax", 2, {"error": "RuntimeError: profiler | exploded", "breakdown": [], "mean": {}})
    _cell(run, "torch-d2", "torch", 2, None)  # not profiled: not in the section
    out = report.write(run)
    md = out["md"].read_text()
    section = md.split(SECTION, 1)[1].split("## Plots", 1)[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in section.splitlines() if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"cell", "jax-d1", "torch-d1", "jax-d2"}
    assert rows["jax-d1"] == "| jax-d1 | jax | 1 | 2–3 | 100 | 60.0 (60%) | 30.0 (30%) | 0 (0%) | 0 (0%) | 10.0 (10%) |"
    assert rows["torch-d1"].startswith("| torch-d1 | torch | 1 | 2–3 | 200 | 100 (50%) | 50.0 (25%) | 40.0 (20%) | 2.00 (1%) | 8.00 (4%) |")
    assert "**profile failed**: RuntimeError: profiler \\| exploded" in rows["jax-d2"]
    assert "excluded from the steady-state figures" in section
    assert f"- torch-d1: `torch-d1/profile/traces/rank0.pt.trace.json.gz`; open: `scaleout trace {run}/torch-d1`" in section
    assert "- jax-d1: no trace file" in section and "![breakdown.png](breakdown.png)" in section
    assert "![breakdown.png]" not in md.split("## Plots", 1)[1]  # shown once, in its section
    assert (run / "breakdown.png").read_bytes()[:8] == PNG_MAGIC
    doc = json.loads(out["json"].read_text())
    assert list(doc["profile"]) == ["jax-d1", "torch-d1", "jax-d2"]  # the frameworks side by side per device count
    assert doc["profile"]["torch-d1"]["mean"] == pytest.approx(torch_step)
    assert doc["profile"]["torch-d1"]["breakdown"][0]["step"] == 2
    assert doc["profile"]["jax-d2"]["error"].startswith("RuntimeError")
    assert "breakdown.png" in doc["plots"]


def test_run_without_profile_has_no_section(tmp_path):
    run = tmp_path / "run"
    _cell(run, "jax-d1", "jax", 1)
    _cell(run, "torch-d1", "torch", 1)
    out = report.write(run)
    assert SECTION not in out["md"].read_text()
    assert not (run / "breakdown.png").exists()
    doc = json.loads(out["json"].read_text())
    assert doc["profile"] == {} and "breakdown.png" not in doc["plots"]


@pytest.mark.slow
def test_profiled_sweep_report(tmp_path):
    """A real profiled sweep (tiny, JAX and PyTorch, 1 device, steps 2-3 of 4): the report shows both cells'
    breakdowns, draws breakdown.png and keeps the per-step breakdown in report.json."""
    args = ["sweep", f"run.dir={tmp_path}/runs", f"jax.cache_dir={tmp_path}/jc", "run.name=prof", "sweep.devices=[1]",
            "train.steps=4", "profile.steps=[2,3]", "checkpoint.every=0"]
    p = run_cli(args, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = tmp_path / "runs" / "prof"
    md = (run / "report.md").read_text()
    assert SECTION in md
    section = md.split(SECTION, 1)[1].split("## Plots", 1)[0]
    for cell in ("jax-d1", "torch-d1"):
        row = next(line for line in section.splitlines() if line.startswith(f"| {cell} |"))
        assert " | 2–3 | " in row and "profile failed" not in row, row
        assert f"open: `scaleout trace {run}/{cell}`" in section
    assert f"`xprof --logdir={run}/jax-d1/profile/process-0`" in section
    png = (run / "breakdown.png").read_bytes()
    assert png[:8] == PNG_MAGIC
    import matplotlib.image
    assert matplotlib.image.imread(run / "breakdown.png").shape[0] > 100
    doc = json.loads((run / "report.json").read_text())
    assert set(doc["profile"]) == {"jax-d1", "torch-d1"}
    for cell, e in doc["profile"].items():
        assert e["error"] is None, (cell, e["error"])
        assert e["steps"] == [2, 3] and [s["step"] for s in e["breakdown"]] == [2, 3]
        for s in e["breakdown"]:
            assert sum(s[c] for c in CATEGORIES) == pytest.approx(s["trace_s"], rel=1e-6)
            assert s["trace_s"] == pytest.approx(s["measured_s"], rel=0.1)
        assert (run / e["trace"]).is_file()
        assert e["excluded_steps"] == [2, 3]
    cells = {r["cell"]: r for r in doc["cells"]}
    assert cells["jax-d1"]["status"] == "ok" and cells["torch-d1"]["status"] == "ok"

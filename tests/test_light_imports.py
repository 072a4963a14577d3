"""`scaleout plan` and `scaleout report` work on a login node without jax or torch: they never import them."""

import json
import subprocess
import sys

CHECK = r"""
import json, sys
from launch.launcher.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax", "torch"))
print(json.dumps({"code": code, "heavy": heavy}))
"""


def _run(args, cwd):
    p = subprocess.run([sys.executable, "-c", CHECK, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_plan_imports_neither_framework(tmp_path):
    for target in ("local", "slurm", "tpu"):
        out = _run(["plan", "--json", f"target={target}", "devices=4", "model=300m"], tmp_path)
        assert out["code"] == 0 and out["heavy"] == [], (target, out)


def test_report_imports_neither_framework(tmp_path):
    from test_sweep_report import _cell, _s
    run = tmp_path / "run"
    _cell(run, "jax-d1", "jax", 1, _s(1000, 1, 40.0, 0.5), losses=[5.0, 4.0])
    _cell(run, "torch-d1", "torch", 1, _s(625, 1, 10.0, 0.8), losses=[5.0, 4.1])
    out = _run(["report", str(run)], tmp_path)
    assert out["code"] == 0 and out["heavy"] == [], out
    assert (run / "report.md").is_file()
    out = _run(["status", str(run)], tmp_path)
    assert out["code"] == 0 and out["heavy"] == [], out

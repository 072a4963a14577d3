"""Compile records (issue 26): every compilation from the framework's own instrumentation -- jax.monitoring
for JAX, Dynamo's compilation metrics and counters for torch.compile -- and none for eager PyTorch."""

import json
import subprocess
import sys

import pytest
from conftest import run_cli

from launch.report import report


DYNAMO_PROBE = r"""
import json
import torch
import torch._dynamo

from torchrun_fsdp.compiles import CompileLog


class Breaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x).relu()
        torch._dynamo.graph_break()  # what a data-dependent branch or an unsupported call does
        return self.lin(y)


log = CompileLog()
out = {"before": log.drain()}
m = torch.compile(Breaks(), backend="eager")
m(torch.randn(2, 4, 8)).sum().backward()
out["first"] = log.drain()
out["again"] = log.drain()
out["totals"] = log.totals()
m(torch.randn(2, 4, 8)).sum().backward()
out["same_shape"] = log.drain()
m(torch.randn(2, 7, 8)).sum().backward()
out["new_shape"] = log.drain()
print(json.dumps(out, default=str))
"""


def test_torch_compile_records_come_from_dynamo_and_show_a_forced_graph_break():
    """Real Dynamo (backend=eager keeps it seconds: no Inductor), in a process of its own (Dynamo's logging
    must not outlive this test's captured streams): a graph break splits the frame, Dynamo's counters say so,
    a new shape is a recompile with Dynamo's reason, and nothing is reported twice."""
    p = subprocess.run([sys.executable, "-c", DYNAMO_PROBE], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["before"] == []  # nothing compiled, nothing reported (Dynamo not even imported yet)
    first = out["first"]
    assert first and all(e["what"] == "forward" and e["compile_id"] for e in first)
    assert [e["after_graph_break"] for e in first] == [False, True] and not any(e["recompile"] for e in first)
    assert "after a graph break" in first[1]["reason"]
    assert all(e["seconds"] is not None and e["seconds"] >= 0 and e["cache"] == "off" for e in first)
    assert out["again"] == []  # reported once
    assert out["totals"]["graph_breaks"] >= 1 and out["totals"]["graphs"] >= 2  # the break made two graphs
    assert out["same_shape"] == []  # same shapes: no compile
    again = out["new_shape"]
    assert again and again[0]["recompile"] and "size mismatch" in again[0]["reason"]


def test_jax_compile_events_come_from_jax_monitoring():
    import jax
    import jax.numpy as jnp

    from jaxrun.compiles import CompileMonitor
    mon = CompileMonitor()
    try:
        mon.drain()

        def scaled(x):
            return x * 3 + 1

        f = jax.jit(scaled)
        f(jnp.ones(5))
        f(jnp.ones(5))
        f(jnp.ones(6))
        got = [e for e in mon.drain() if e["function"] == "scaled"]
        assert len(got) == 2  # one per shape, none for the cached call
        assert all(e["cache"] in ("hit", "miss", "off") and e["seconds"] >= e["backend_s"] > 0 for e in got)
        ev = mon.take_train_step(1.5, "train step", recompile=False)
        assert ev["seconds"] == 1.5 and ev["cache"] == "off"  # nothing compiled meanwhile
    finally:
        mon.close()


@pytest.mark.slow
def test_a_sweep_of_three_contenders_reports_every_pair(tmp_path):
    """jax, torch and torch-compile on 1 device: the report compares all three pairs; torch.compile's compile
    records are Dynamo's (forward and its lazy backward, with compile ids), JAX's come from jax.monitoring
    with the persistent cache's outcome, and eager PyTorch shows no compile."""
    args = ["sweep", f"run.dir={tmp_path}/runs", f"jax.cache_dir={tmp_path}/jc", "run.name=three", "sweep.devices=[1]",
            "sweep.contenders=[jax,torch,torch-compile]", "train.steps=4", "train.warmup_exclude=1",
            "checkpoint.every=2", "checkpoint.async=false"]
    # a cold Inductor/AOTAutograd cache, as on a fresh machine (a warm one serves the backward without compiling it)
    p = run_cli(args, cwd=tmp_path, timeout=1800, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = tmp_path / "runs" / "three"
    doc = json.loads((run / "report.json").read_text())
    assert [c["name"] for c in doc["contenders"]] == ["jax", "torch", "torch-compile"]
    pairs = {(q["a"], q["b"]) for q in doc["derived"]["pairs"] if q["devices"] == 1}
    assert pairs == {("jax", "torch"), ("jax", "torch-compile"), ("torch", "torch-compile")}
    for q in doc["derived"]["pairs"]:
        assert q["loss_gap"]["max_rel_diff"] < 1e-4, q  # same rows, same weights
    h = doc["derived"]["headline"]["1"]
    assert h["with"]["winner"] in ("jax", "torch", "torch-compile") and h["without"]["winner"] in ("jax", "torch")

    def records(cell):
        return [json.loads(line) for line in (run / cell / "metrics.jsonl").read_text().splitlines()]

    tc = [r for r in records("torch-compile-d1") if r["kind"] == "compile"]
    assert {r["what"] for r in tc} == {"forward", "backward"} and all(r["compile_id"] for r in tc)
    assert {r["cache"] for r in tc if r["what"] == "forward"} == {"miss"}  # the cold cache was asked
    assert all(r["scope"] == "train" and r["step"] == 1 for r in tc if r["what"] == "forward" and not r["recompile"])
    s_tc = [r for r in records("torch-compile-d1") if r["kind"] == "summary"][-1]
    assert s_tc["compiles"] >= 1 and s_tc["graphs"] >= 1 and s_tc["graph_breaks"] == 0  # fullgraph=True
    assert s_tc["compile_s"] == pytest.approx(sum(r["seconds"] for r in tc if r["scope"] == "train"))
    eager = records("torch-d1")
    assert not [r for r in eager if r["kind"] == "compile"]
    s_t = [r for r in eager if r["kind"] == "summary"][-1]
    assert s_t["compiles"] == 0 and s_t["compile_s"] == 0.0 and s_t["graphs"] is None and s_t["warmup_excess_s"] >= 0
    jax_train = [r for r in records("jax-d1") if r["kind"] == "compile" and r["scope"] == "train"]
    assert len(jax_train) == 1 and jax_train[0]["step"] == 0 and jax_train[0]["cache"] in ("hit", "miss")
    rows = {r["cell"]: r for r in doc["cells"]}
    assert rows["torch-d1"]["compiles"] == 0 and rows["torch-compile-d1"]["contender"] == "torch-compile"
    md = (run / "report.md").read_text()
    assert "| torch-d1 | torch | 1 |" in md and "none" in md and "**torch vs torch-compile**" in md
    ckpt = {c["cell"]: c for c in doc["checkpoints"]}
    assert set(ckpt) == {"jax-d1", "torch-d1", "torch-compile-d1"} and all(c["saves"] == 2 for c in ckpt.values())
    assert set(report.ROW_FIELDS) <= set(rows["jax-d1"])

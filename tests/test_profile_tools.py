"""The profilers' own readers open scaleout's traces: Holistic Trace Analysis and torch-tb-profiler read
a 2-rank PyTorch cell's trace directory with both ranks and its steps (`ProfilerStep#N`; the latter's
Distributed view), and xprof's converter (what `xprof --logdir` serves) turns a JAX cell's XSpace into
its trace viewer and overview page.

Both tools are installed by `make install` without their notebook/cloud dependencies (see the
Makefile); CI must have them, a bare checkout may skip.
"""

import gzip
import importlib
import json
import shutil

import pytest
from conftest import in_ci, run_cell

from launch.core import profile


def _tool(module: str):
    return importlib.import_module(module) if in_ci() else pytest.importorskip(module)


def _spans(trace, prefix):
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(prefix)]


@pytest.mark.slow
def test_hta_and_tb_profiler_read_both_ranks_of_a_torch_cell_and_their_steps(tmp_path):
    _tool("hta")
    from hta.trace_analysis import TraceAnalysis

    _, recs = run_cell(tmp_path, "framework=torch", "devices=2", "train.steps=6", "profile.steps=[3,4]",
                       "profile.all_processes=true", "checkpoint.every=0")
    cell = tmp_path / "runs" / "tiny" / "torch-d2"
    traces = cell / profile.PROFILE_DIR / profile.TRACES_DIR
    # one directory with every rank's trace and nothing else; the breakdowns beside it
    assert sorted(p.name for p in traces.iterdir()) == ["rank0.pt.trace.json.gz", "rank1.pt.trace.json.gz"]
    for i in (0, 1):
        assert sorted(p.name for p in (cell / "profile" / f"process-{i}").iterdir()) == [profile.BREAKDOWN_NAME]
        steps = {e["name"]: e for e in _spans(traces / f"rank{i}.pt.trace.json.gz", "ProfilerStep#")}
        ours = {e["name"]: e for e in _spans(traces / f"rank{i}.pt.trace.json.gz", profile.STEP_SPAN)}
        assert sorted(steps) == ["ProfilerStep#3", "ProfilerStep#4"] and sorted(ours) == ["scaleout/step#3", "scaleout/step#4"]
        for n in (3, 4):  # the profiler's step holds scaleout's, which is only the timed call
            s, o = steps[f"ProfilerStep#{n}"], ours[f"scaleout/step#{n}"]
            assert s["ts"] <= o["ts"] and o["ts"] + o["dur"] <= s["ts"] + s["dur"]

    analysis = TraceAnalysis(trace_dir=str(traces), include_last_profiler_step=True)
    assert sorted(analysis.t.traces) == [0, 1]
    for rank in (0, 1):
        assert sorted(int(i) for i in analysis.t.get_trace(rank)["iteration"].unique() if i >= 0) == [3, 4], rank
    default = TraceAnalysis(trace_dir=str(traces))  # HTA leaves a trace's last ProfilerStep out unless asked
    assert sorted(int(i) for i in default.t.get_trace(0)["iteration"].unique() if i >= 0) == [3]

    # torch-tb-profiler's loader (what `tensorboard --logdir=CELL/profile` runs): one run, a worker per rank,
    # its steps, and the Distributed view comparing the ranks step by step
    _tool("torch_tb_profiler")
    from torch_tb_profiler import io as tb_io
    from torch_tb_profiler.profiler.loader import RunLoader

    run = RunLoader("traces", str(traces), tb_io.Cache(str(tmp_path / "tb-cache"))).load()
    assert sorted(run.profiles) == [("All", "default"), ("rank0", "default"), ("rank1", "default")]
    for rank in ("rank0", "rank1"):
        assert [row[0] for row in run.profiles[(rank, "default")].overview["steps"]["rows"]] == ["3", "4"]
    distributed = run.profiles[("All", "default")]
    assert [v.name for v in distributed.views] == ["distributed"]
    assert {k: sorted(v) for k, v in distributed.steps_to_overlap["data"].items()} == {
        "all": ["rank0", "rank1"], "3": ["rank0", "rank1"], "4": ["rank0", "rank1"]}

    # scaleout's own breakdown and timing are what they were: the traced steps' parts sum to the timed step
    [rec] = [r for r in recs if r["kind"] == "profile"]
    assert rec["error"] is None and rec["files"] == ["profile/traces/rank0.pt.trace.json.gz"]
    for row in rec["breakdown"]:
        assert sum(row[c] for c in profile.CATEGORIES) == pytest.approx(row["trace_s"])
        assert row["trace_s"] == pytest.approx(row["measured_s"], rel=0.1)
    summary = [r for r in recs if r["kind"] == "summary"][-1]
    assert summary["profiled_steps"] == [3, 4] and summary["timed_steps"] == 2  # steps 5 and 6: 1-3 warm up


@pytest.mark.slow
def test_xprof_converts_the_jax_trace(tmp_path):
    raw = _tool("xprof.convert.raw_to_tool_data")
    _, recs = run_cell(tmp_path, "framework=jax", "train.steps=5", "profile.steps=[2,3]", "checkpoint.every=0")
    pdir = tmp_path / "runs" / "tiny" / "jax-d1" / "profile" / "process-0"
    [xplane] = pdir.glob("plugins/profile/*/*.xplane.pb")  # the layout `xprof --logdir=<pdir>` lists
    copy = tmp_path / "copy"
    shutil.copytree(xplane.parent, copy)  # xprof writes its caches beside the file it converts
    data, kind = raw.xspace_to_tool_data([str(copy / xplane.name)], "trace_viewer", {})
    assert kind == "application/json"
    events = json.loads(data)["traceEvents"]
    steps = sorted(int(e["args"]["step_num"]) for e in events
                   if str(e.get("name", "")).startswith(profile.STEP_SPAN) and "step_num" in (e.get("args") or {}))
    assert steps == [2, 3]
    data, kind = raw.xspace_to_tool_data([str(copy / xplane.name)], "overview_page", {})
    assert kind == "application/json" and json.loads(data)

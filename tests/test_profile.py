"""profile.steps: traces per cell in both frameworks, and the step-time breakdown read from them.

The end-to-end test is the issue's acceptance: a local sweep of `small`, JAX and PyTorch on 1 and
2 devices with profile.steps=[5,7]. The unit tests pin the breakdown's arithmetic and the
classification of real op names, so that a category cannot silently become empty.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from launch import config
from launch.common.files import read_records
from launch.config import ConfigError
from launch.core import profile
from tests.conftest import run_cli

WINDOW = [5, 7]


# --------------------------------------------------------------------------- the arithmetic

def test_partition_gives_each_instant_to_the_highest_priority_category():
    r = {c: i for i, c in enumerate(profile.PRIORITY)}
    spans = [(0, 10, r["other_compute"]), (2, 4, r["matmul_attention"]), (3, 6, r["collectives"]),
             (12, 14, r["host_data"]), (13, 15, r["other_compute"])]
    got = profile.partition(spans, 0, 20)
    assert got == {"collectives": 3, "matmul_attention": 1, "other_compute": 6 + 2, "host_data": 1, "idle": 2 + 5}
    assert sum(got.values()) == 20


def test_breakdown_clips_spans_to_each_step_and_sums_to_it():
    step = lambda n, ts, dur: {"ph": "X", "name": profile.STEP_SPAN, "args": {"step_num": str(n)}, "ts": ts, "dur": dur}  # noqa: E731
    op = lambda ts, dur, name="op": {"ph": "X", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [step(5, 0, 1000), step(6, 1000, 500), op(900, 300, "mm"), op(100, 100), op(1400, 50, "ar")]
    cats = {"mm": "matmul_attention", "op": "other_compute", "ar": "collectives"}
    rows = profile.breakdown(events, lambda e: cats.get(e["name"]) if e["name"] != profile.STEP_SPAN else None)
    assert [r["step"] for r in rows] == [5, 6]
    assert rows[0]["matmul_attention"] == pytest.approx(100e-6) and rows[1]["matmul_attention"] == pytest.approx(200e-6)
    assert rows[1]["collectives"] == pytest.approx(50e-6)
    for r in rows:
        assert sum(r[c] for c in profile.CATEGORIES) == pytest.approx(r["trace_s"])


def test_step_number_from_either_framework_span():
    assert profile.step_number({"name": "scaleout/step", "args": {"step_num": "7"}}) == 7  # jax.profiler.StepTraceAnnotation
    assert profile.step_number({"name": "scaleout/step#12"}) == 12  # torch.profiler.record_function
    assert profile.step_number({"name": "scaleout/data"}) is None


HLO = """HloModule jit__train_step, is_scheduled=true

%fused_computation.1 (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  %dot.2 = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tanh.3 = f32[8,8]{1,0} tanh(%dot.2)
}

%add_comp (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.9 = f32[] add(%a, %b)
}

ENTRY %main.10 (x: f32[8,8]) -> (f32[8,8], f32[]) {
  %x = f32[8,8]{1,0} parameter(0)
  %ynn_fusion.4 = f32[8,8]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_computation.1
  %all-gather.5 = f32[16,8]{1,0:T(8,128)} all-gather(%ynn_fusion.4), channel_id=1, dimensions={0}
  %all-reduce-start.6 = f32[8,8]{1,0} all-reduce-start(%x), to_apply=%add_comp
  %reduce.7 = f32[] reduce(%x, %c), dimensions={0,1}, to_apply=%add_comp
  %custom-call.8 = f32[8,8]{1,0} custom-call(%x), custom_call_target="__cublas$gemm"
  ROOT %tuple.11 = (f32[8,8]{1,0}, f32[]) tuple(%ynn_fusion.4, %reduce.7)
}
"""


def test_hlo_categories_follow_fusions_and_opcodes():
    from jaxrun.profile import hlo_categories, module_name
    cats = hlo_categories(HLO)
    assert module_name(HLO) == "jit__train_step"
    assert cats["ynn_fusion.4"] == "matmul_attention"  # a fusion holding a dot
    assert cats["all-gather.5"] == "collectives" and cats["all-reduce-start.6"] == "collectives"
    assert cats["reduce.7"] == "other_compute"  # its to_apply is not what it runs as
    assert cats["custom-call.8"] == "matmul_attention"
    assert cats["tuple.11"] == "other_compute"


def test_torch_names_land_in_their_categories():
    from torchrun_fsdp.profile import classify
    cpu = lambda name, cat="cpu_op": {"name": name, "cat": cat}  # noqa: E731
    assert classify(cpu("aten::addmm"), False) == "matmul_attention"
    assert classify(cpu("aten::_scaled_dot_product_flash_attention_for_cpu"), False) == "matmul_attention"
    assert classify(cpu("c10d::allreduce_"), False) == "collectives"
    assert classify(cpu("record_param_comms"), False) == "collectives"
    assert classify(cpu("FSDP::all_gather", "user_annotation"), False) == "collectives"
    assert classify(cpu("aten::silu"), False) == "other_compute"
    assert classify(cpu("Optimizer.step#AdamW.step", "user_annotation"), False) is None
    assert classify(cpu("scaleout/data", "user_annotation"), False) == "host_data"
    # on a GPU host, the GPU's timeline decides; host-side operators only launch kernels
    assert classify(cpu("aten::mm"), True) is None
    assert classify(cpu("sm90_xmma_gemm_f32f32_tf32f32", "kernel"), True) == "matmul_attention"
    assert classify(cpu("ncclDevKernel_AllGather_RING_LL", "kernel"), True) == "collectives"


@pytest.mark.parametrize("steps, shown", [
    ("[5]", "[5]"), ("[7,5]", "[7, 5]"), ("[5,30]", "[5, 30]"), ("[[1,2],[3,4]]", "[[1, 2], [3, 4]]"),
])
def test_bad_window_is_one_sentence(steps, shown):
    with pytest.raises(ConfigError) as e:
        config.load([f"profile.steps={steps}"])
    assert str(e.value).startswith(f"profile.steps={shown} is not valid: give [START, END] with 1 <= START <= END <= train.steps=20")


def test_window_that_leaves_no_steady_step_is_refused():
    with pytest.raises(ConfigError) as e:
        config.load(["profile.steps=[2,4]", "train.steps=4"])  # step 1 is warm-up, 2-4 traced
    assert "leaves no steady-state step of train.steps=4" in str(e.value)
    assert config.load(["profile.steps=[2,3]", "train.steps=4"]).profile.steps == [2, 3]  # step 4 is steady


def test_zero_is_not_a_step():
    with pytest.raises(ConfigError, match="positive integer"):
        config.load(["profile.steps=[0,2]"])


# --------------------------------------------------------------------------- end to end

def _trace_steps(cell: Path, framework: str) -> list:
    """The step numbers of the `scaleout/step` spans in the cell's trace file, read from the file."""
    pdir = cell / "profile" / "process-0"
    if framework == "jax":
        trace = next(pdir.glob("plugins/profile/*/perfetto_trace.json.gz"))
        assert next(pdir.glob("plugins/profile/*/*.xplane.pb")).stat().st_size > 0
    else:
        trace = cell / "profile" / "traces" / "rank0.pt.trace.json.gz"
        assert sorted(p.name for p in trace.parent.iterdir()) == ["rank0.pt.trace.json.gz"]  # process 0 only
    with gzip.open(trace, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return sorted(profile.step_number(e) for e in events if e.get("ph") == "X" and profile.step_number(e) is not None)


@pytest.mark.slow
def test_sweep_traces_every_cell_and_breaks_its_steps_down(tmp_path):
    p = run_cli(["sweep", "model=small", f"profile.steps=[{WINDOW[0]},{WINDOW[1]}]", "train.steps=8",
                 "sweep.devices=[1,2]", "checkpoint.every=0", "run.name=prof", f"run.dir={tmp_path}"], cwd=tmp_path, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = tmp_path / "prof"
    for fw in ("jax", "torch"):
        for d in (1, 2):
            cell = run / f"{fw}-d{d}"
            assert _trace_steps(cell, fw) == [5, 6, 7], cell
            recs = read_records(cell / "metrics.jsonl")
            [rec] = [r for r in recs if r["kind"] == "profile"]
            assert rec["error"] is None and rec["steps"] == [5, 6, 7]
            assert all((cell / f).is_file() for f in rec["files"])
            summary = [r for r in recs if r["kind"] == "summary"][-1]
            assert summary["profiled_steps"] == [5, 6, 7]
            assert summary["timed_steps"] == 8 - 3 - 3  # warm-up and traced steps left out
            steps = {r["step"]: r for r in recs if r["kind"] == "step"}
            for row in rec["breakdown"]:
                total = sum(row[c] for c in profile.CATEGORIES)
                assert total == pytest.approx(steps[row["step"]]["step_time_s"], rel=0.10), (cell, row)
                assert steps[row["step"]]["profiled"] is True
                assert row["matmul_attention"] > 0 and row["other_compute"] > 0, (cell, row)
                assert row["host_data"] > 0, (cell, row)  # the batch is built inside the step
                if d == 2:
                    assert row["collectives"] > 0, (cell, row)
                else:
                    assert row["collectives"] == 0, (cell, row)
            assert 6 not in {r["step"] for r in recs if r["kind"] == "step" and not r.get("profiled")}
    assert not (run / "jax-d1" / "profile" / "process-1").exists()  # process 0 only by default


def _cell(tmp_path, name, *extra, env=None):
    p = run_cli(["run", "framework=jax", "train.steps=8", f"run.dir={tmp_path}", f"run.name={name}", *extra],
                cwd=tmp_path, env=env, timeout=600)
    return p, read_records(tmp_path / name / "jax-d1" / "metrics.jsonl")


@pytest.mark.slow
def test_window_positions_keep_the_timing_right(tmp_path):
    """A window inside the warm-up takes its place there (the steady steps stay 4..8); a run
    stopped inside the window keeps what it traced, and its resumption traces nothing more."""
    p, recs = _cell(tmp_path, "early", "profile.steps=[1,2]")
    assert p.returncode == 0, p.stderr[-2000:]
    s = [r for r in recs if r["kind"] == "summary"][-1]
    assert s["profiled_steps"] == [1, 2] and s["timed_steps"] == 5  # steps 4-8: only step 3 is warm-up left
    p, recs = _cell(tmp_path, "cut", "profile.steps=[3,5]", "train.stop_after=4", "checkpoint.every=0")
    assert p.returncode == 0, p.stderr[-2000:]
    [rec] = [r for r in recs if r["kind"] == "profile"]
    assert rec["error"] is None and [r["step"] for r in rec["breakdown"]] == [3, 4]
    p, recs = _cell(tmp_path, "cut", "profile.steps=[3,5]", "checkpoint.every=0")
    assert p.returncode == 0, p.stderr[-2000:]
    assert [r["steps"] for r in recs if r["kind"] == "profile"] == [[3, 4]]  # the first attempt's, kept
    s = [r for r in recs if r["kind"] == "summary"][-1]
    assert s["resumed_from_step"] == 4 and s["steps"] == 8 and s["loop_tokens_per_s"] > 0


@pytest.mark.slow
def test_a_crash_inside_the_window_keeps_the_trace_of_the_steps_before_it(tmp_path):
    p, recs = _cell(tmp_path, "crash", "profile.steps=[3,6]", env={"SCALEOUT_FAULT": "crash@5"})
    assert p.returncode != 0
    [rec] = [r for r in recs if r["kind"] == "profile"]
    assert rec["error"] is None and [r["step"] for r in rec["breakdown"]] == [3, 4]
    assert next((tmp_path / "crash" / "jax-d1" / "profile" / "process-0").glob("plugins/profile/*/perfetto_trace.json.gz"))


# --------------------------------------------------------------------------- the profiler's own step marks

def test_the_profilers_step_marks_stay_outside_the_step_timing(tmp_path, monkeypatch):
    """The capture's `next_step` (PyTorch: prof.step(), the ProfilerStep#N boundary) runs before each traced
    step after the first, outside the step timer, and its time is profiler overhead: step times and the
    loop's rate are what they are without it. Fixed times: steps of 3, 1, 1, ... s, each profiler call 0.5 s."""
    import contextlib

    from launch.core import engine, loop, metrics
    from tests.test_engine import Clock, FakeEngine, _cfg

    clock = Clock()
    monkeypatch.setattr(loop.time, "perf_counter", clock)
    calls = []

    class Capture:
        def __init__(self, directory):
            self.directory = directory

        def start(self, first):
            calls.append(("start", first))
            clock.now += 0.5

        def next_step(self, n):
            calls.append(("next", n))
            clock.now += 0.5

        def step(self, n):
            return contextlib.nullcontext()

        def data(self):
            return contextlib.nullcontext()

        def stop(self):
            calls.append(("stop",))
            clock.now += 0.5
            return []

        def breakdown(self):
            return [{"step": n, "trace_s": 1.0, **{c: 0.2 for c in profile.CATEGORIES}} for n in (3, 4, 5)]

    fake = FakeEngine(clock, [3.0] + [1.0] * 7)
    fake.profiler = Capture
    cfg = _cfg("train.steps=8", "profile.steps=[3,5]", "train.warmup_exclude=1", "train.log_every=1",
               "train.global_batch=8", "model.seq_len=32")
    s = loop.run(fake, cfg, tmp_path, process_start=clock.now - 2.0, stopper=engine.Stopper())
    recs = metrics.read(tmp_path / "metrics.jsonl")
    assert calls == [("start", 3), ("next", 4), ("next", 5), ("stop",)]
    assert [r["step_time_s"] for r in recs if r["kind"] == "step"] == pytest.approx([3.0] + [1.0] * 7, rel=1e-12)
    [rec] = [r for r in recs if r["kind"] == "profile"]
    assert rec["overhead_s"] == pytest.approx(2.0) and [r["measured_s"] for r in rec["breakdown"]] == pytest.approx([1.0] * 3)
    assert s["profiled_steps"] == [3, 4, 5] and s["timed_steps"] == 4  # steps 2, 6, 7, 8
    assert s["loop_tokens_per_s"] == pytest.approx(8 * 32 / 1.0, rel=1e-12) == s["tokens_per_s"]

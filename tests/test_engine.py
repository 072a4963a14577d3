"""The shared trainer layer (launch.core.engine) and the loop's pieces, without starting a trainer."""

import json
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from launch import config
from launch.core import engine, loop, metrics
from launch.core.params import param_table


def _cfg(*overrides):
    return config.load(["checkpoint.dir=/ck/own", *overrides])


def _meta(cfg, run_id):
    return {"config_hash": config.math_hash(cfg), "run_id": run_id}


# --------------------------------------------------------------------------- checkpoints

def test_checkpoint_metadata_is_one_dict_for_both_frameworks():
    cfg = _cfg("run.id=r1", "devices=2")
    meta = engine.checkpoint_metadata(cfg, "torch", 2, {"torch": "x"}, step=7)
    assert meta == {"framework": "torch", "config_hash": config.math_hash(cfg), "run_id": "r1",
                    "mesh": {"data": 1, "fsdp": 2, "tensor": 1}, "devices": 2, "processes": 2,
                    "versions": {"torch": "x"}, "step": 7, "data": None}
    json.dumps(meta)


def test_another_runs_checkpoint_is_refused_in_one_sentence():
    cfg = _cfg("run.id=run-b")
    found = engine.Found("/ck/own", 4, load_from=False)
    with pytest.raises(engine.CheckpointMismatch) as e:
        engine.check_checkpoint(_meta(cfg, "run-a"), cfg, found)
    msg = str(e.value)
    assert "run-a" in msg and "run-b" in msg and "/ck/own" in msg and "step 4" in msg
    assert "\n" not in msg and msg.count(". ") == 0, msg
    assert "checkpoint.load_from=/ck/own" in msg  # says how to do it on purpose
    # a checkpoint that records no run is not this run's either
    with pytest.raises(engine.CheckpointMismatch, match="no recorded run"):
        engine.check_checkpoint({"config_hash": config.math_hash(cfg)}, cfg, found)


def test_load_from_accepts_another_run_but_not_other_math():
    cfg = _cfg("run.id=run-b")
    borrowed = engine.Found("/ck/other", 4, load_from=True)
    engine.check_checkpoint(_meta(cfg, "run-a"), cfg, borrowed)  # on purpose: fine
    other_math = _cfg("run.id=run-b", "model.d_model=32")
    with pytest.raises(engine.CheckpointMismatch, match="different model/train/data config"):
        engine.check_checkpoint(_meta(other_math, "run-a"), cfg, borrowed)


def test_a_trainer_started_by_hand_has_no_run_to_check():
    cfg = _cfg()
    assert engine.run_id(cfg) is None
    engine.check_checkpoint(_meta(cfg, "whoever"), cfg, engine.Found("/ck/own", 1, load_from=False))


def test_fallback_own_then_load_from_then_fresh():
    latest = {"/ck/own": None, "/ck/other": 6}
    cfg = _cfg("checkpoint.load_from=/ck/other")
    assert engine.find_checkpoint(cfg, latest.get) == engine.Found("/ck/other", 6, load_from=True)
    latest["/ck/own"] = 2
    assert engine.find_checkpoint(cfg, latest.get) == engine.Found("/ck/own", 2, load_from=False)
    assert engine.find_checkpoint(_cfg(), {"/ck/own": None}.get) is None
    with pytest.raises(FileNotFoundError, match="checkpoint.load_from='/ck/other' holds no complete checkpoint"):
        engine.find_checkpoint(cfg, {"/ck/own": None, "/ck/other": None}.get)


def test_restore_latest_checks_before_it_loads():
    cfg = _cfg("run.id=b")
    loaded = []
    read = lambda found: _meta(cfg, "a")  # noqa: E731
    with pytest.raises(engine.CheckpointMismatch):
        engine.restore_latest(cfg, {"/ck/own": [3]}.get, read, loaded.append)
    assert loaded == []
    got = engine.restore_latest(cfg, {"/ck/own": [3]}.get, lambda f: _meta(cfg, "b"), lambda f: "state")
    assert (got.step, got.state, got.skipped) == (3, "state", ())
    got = engine.restore_latest(cfg, {"/ck/own": []}.get, read, loaded.append)
    assert (got.step, got.state) == (0, None)


def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(caplog):
    """Protects against: a truncated/deleted file in the latest checkpoint blocking every rerun (issue 13.9)."""
    cfg = _cfg("run.id=b")

    def load(found):
        if found.step == 8:
            raise ValueError("TensorStore error: truncated\n" + "dump " * 500)
        return f"state{found.step}"

    def read(found):
        if found.step == 6:
            raise FileNotFoundError("meta.json")
        return _meta(cfg, "b")

    with caplog.at_level("WARNING"):
        got = engine.restore_latest(cfg, {"/ck/own": [2, 4, 6, 8]}.get, read, load,
                                    describe=lambda f: f"step {f.step} (/ck/own/{f.step})")
    assert (got.step, got.state) == (4, "state4")
    assert [s for s, _ in got.skipped] == [8, 6] and got.skipped[0][1] == "ValueError: TensorStore error: truncated"
    assert "/ck/own/8" in caplog.text and "/ck/own/6" in caplog.text
    # none readable: one sentence naming the directory, no dump
    with pytest.raises(engine.CheckpointUnreadable) as e:
        engine.restore_latest(cfg, {"/ck/own": [8]}.get, read, load)
    msg = str(e.value)
    assert "/ck/own" in msg and "step 8" in msg and "\n" not in msg and "dump" not in msg, msg
    # other math is refused, not skipped
    with pytest.raises(engine.CheckpointMismatch):
        engine.restore_latest(cfg, {"/ck/own": [2]}.get, lambda f: _meta(cfg, "a"), load)


@pytest.mark.parametrize("bad", [None, [], [1, 2], "text", 3])
def test_metadata_that_is_json_but_not_an_object_falls_back(bad, caplog):
    """Issue 24.14: `null` gave UnboundLocalError ('why'), `[]` AttributeError ('list' has no 'get')."""
    cfg = _cfg("run.id=b")
    read = lambda found: bad if found.step == 8 else _meta(cfg, "b")  # noqa: E731
    with caplog.at_level("WARNING"):
        got = engine.restore_latest(cfg, {"/ck/own": [4, 8]}.get, read, lambda f: f"state{f.step}")
    assert (got.step, got.state) == (4, "state4")
    assert got.skipped == ((8, f"its metadata is {json.dumps(bad)}, not a JSON object"),)
    assert "step 8 in /ck/own is damaged and is skipped (its metadata is" in caplog.text
    with pytest.raises(engine.CheckpointUnreadable, match=r"step 8: its metadata is .*, not a JSON object"):
        engine.restore_latest(cfg, {"/ck/own": [8]}.get, read, lambda f: "state")


def test_a_checkpoint_trained_on_another_token_file_is_refused(tmp_path):
    """Issue 24.9: resuming on a token file rewritten since the checkpoint (prepare-data over it) is refused in
    one sentence; a checkpoint that records no identity (synthetic data, older checkpoints) is not."""
    from launch.data import tokenizer
    text = tmp_path / "a.txt"
    text.write_text("abcdefgh" * 40)
    data = tmp_path / "t.bin"
    tokenizer.prepare([str(text)], str(data), val_fraction=0)
    cfg = _cfg("run.id=b", "data.source=file", f"data.path={data}")
    meta = engine.checkpoint_metadata(cfg, "jax", 1, {}, step=4)
    assert meta["data"] == {"bytes": 640, "sha256": tokenizer.file_hash(data)}
    found = engine.Found("/ck/own", 4, load_from=False)
    engine.check_checkpoint(meta, cfg, found)
    text.write_text("hgfedcba" * 40)  # the same size, other tokens
    tokenizer.prepare([str(text)], str(data), val_fraction=0, force=True)
    for borrowed in (found, engine.Found("/ck/other", 4, load_from=True)):
        with pytest.raises(engine.CheckpointMismatch) as e:
            engine.check_checkpoint(meta, cfg, borrowed)
        msg = str(e.value)
        assert msg.startswith(f"the checkpoint at step 4 in {borrowed.root} was trained on data.path={data} when it was "
                              f"640 bytes, sha256 {meta['data']['sha256'][:12]}, but that file is now 640 bytes, sha256 "), msg
        assert "\n" not in msg and "(it was rewritten since)" in msg
    engine.check_checkpoint({**meta, "data": None}, cfg, found)
    engine.check_checkpoint({k: v for k, v in meta.items() if k != "data"}, cfg, found)
    assert tokenizer.same_token_file({"bytes": 640, "sha256": None}, {"bytes": 640, "sha256": "x"})
    assert not tokenizer.same_token_file({"bytes": 640, "sha256": None}, {"bytes": 642, "sha256": None})


def test_set_aside_keeps_the_damaged_step_under_a_name_no_step_listing_matches(tmp_path):
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "x").write_text("1")
    assert engine.set_aside(tmp_path / "8") == tmp_path / "8.corrupt"
    (tmp_path / "8").mkdir()
    assert engine.set_aside(tmp_path / "8") == tmp_path / "8.corrupt-2"
    assert (tmp_path / "8.corrupt" / "x").read_text() == "1" and not (tmp_path / "8").exists()


# --------------------------------------------------------------------------- measurement plumbing

def test_bytes_per_device_and_peak_memory_fallback():
    assert engine.bytes_per_device(weights=10, optimizer=20) == {"weights": 10, "grads": 10, "optimizer": 20, "total": 40}
    assert engine.peak_memory_bytes(123) == 123
    assert engine.peak_memory_bytes(None) == metrics.peak_rss_bytes() > 0


def test_cpu_peak_is_measured_by_process_0_and_shared():
    calls = []

    def matmul(n):
        calls.append(n)
        return lambda: sum(range(1000))

    shared = {}

    def broadcast(value):
        shared["sent"] = value
        return 8e9

    # process 1 does not measure; it takes process 0's number, per device
    assert engine.cpu_peak_per_device(4, 1, 2, matmul, barrier=lambda: calls.append("barrier"),
                                      broadcast=broadcast) == 2e9
    assert calls == ["barrier"] and shared["sent"] == 0.0
    calls.clear()
    peak = engine.cpu_peak_per_device(4, 0, 2, matmul, barrier=lambda: calls.append("barrier"), broadcast=lambda v: v)
    assert calls[0] == "barrier" and calls[1] == 1024 and peak > 0
    calls.clear()
    engine.cpu_peak_per_device(1, 0, 1, matmul, barrier=lambda: calls.append("barrier"), broadcast=None)
    assert "barrier" not in calls  # one process: nobody to wait for


def test_threads_per_process():
    import os
    mine = len(os.sched_getaffinity(0))
    assert engine.threads_per_process(_cfg("local.threads=3"), 8) == 3
    assert engine.threads_per_process(_cfg(), 1, env={}) == mine  # this process's affinity, not the host's count
    assert engine.threads_per_process(_cfg(), 10 ** 6, env={}) == 1
    # a SLURM task has its SLURM_CPUS_PER_TASK cores to itself: on a 2-node job, torch-d1 and every rank alike
    slurm = {"SLURM_CPUS_PER_TASK": "6", "LOCAL_WORLD_SIZE": "4"}
    assert engine.threads_per_process(_cfg(), engine.sharing_processes(8, slurm), env=slurm) == 6
    # torchrun's ranks on one host share its cores: per host (LOCAL_WORLD_SIZE), not the world size
    host = {"LOCAL_WORLD_SIZE": "2"}
    assert engine.sharing_processes(8, host) == 2 and engine.sharing_processes(8, {}) == 8
    assert engine.threads_per_process(_cfg(), engine.sharing_processes(8, host), env=host) == max(1, mine // 2)


def test_stacked_names():
    names = {spec.name: spec.stacked_name for spec in param_table(config.load().model)}
    assert names["layers.{i}.attention.wq"] == "layers.attention.wq"
    assert names["output"] == "output"


# --------------------------------------------------------------------------- metrics

def test_non_finite_values_are_written_as_null_and_named(tmp_path):
    w = metrics.MetricsWriter(tmp_path / "m.jsonl")
    w.write("step", step=3, loss=float("nan"), grad_norm=np.float32("inf"), lr=np.float64(0.5),
            nested={"a": float("-inf"), "b": [1.0, float("nan")]})
    w.write("step", step=4, loss=1.0)
    w.close()
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    first = json.loads(lines[0], parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))
    assert first["loss"] is None and first["grad_norm"] is None and first["lr"] == 0.5
    assert first["nested"] == {"a": None, "b": [1.0, None]}
    assert first["non_finite"] == ["loss", "grad_norm", "nested.a", "nested.b[1]"]
    assert "non_finite" not in json.loads(lines[1])


def test_read_skips_torn_and_non_object_lines(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"kind": "step", "step": 1}\nnull\n[1]\n{"kind": "summ')
    assert metrics.read(p) == [{"kind": "step", "step": 1}]
    assert metrics.read(tmp_path / "missing.jsonl") == []


# --------------------------------------------------------------------------- the loop's pieces

def test_checkpoint_cadence():
    c = loop.CheckpointCadence(every=4)
    assert [s for s in range(1, 11) if c.due(s, last=s == 10)] == [4, 8, 10]
    assert [s for s in range(1, 6) if loop.CheckpointCadence(0).due(s, last=s == 5)] == [5]


def test_step_timer_and_summary_timing():
    timer = loop.StepTimer(process_start=0.0)
    for _ in range(5):
        timer.start()
        timer.keep(timer.stop(), tokens=100)
    timer.end_loop()
    assert timer.time_to_first_step_s > 0 and len(timer.durations) == 5
    assert timer.loop_tokens_per_s(warmup_exclude=3) > 0
    cfg = _cfg("train.warmup_exclude=1")
    timing = loop.Timing(step_times=[2.0, 1.0, 1.0, 1.0], losses=[5.0, 4.0, 3.0, 2.0], compile_s=0.0,
                         time_to_first_step_s=3.0, peak_flops_per_device=1e12)
    f = loop.timing_fields(timing, cfg)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    assert f["final_loss"] == 2.0 and f["timed_steps"] == 3 and f["step_time_p50_s"] == 1.0
    # a slow first step without a compile record is no compile: it is the warm-up excess
    assert f["compile_s"] == 0.0 and f["warmup_excess_s"] == pytest.approx(1.0)
    assert f["tokens_per_s"] == pytest.approx(tokens) and f["mfu"] is not None
    assert loop.timing_fields(loop.Timing(compile_s=2.5), cfg)["compile_s"] == 2.5


class Clock:
    """A perf_counter that moves only when told: fixed step times for the loop's timing."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FakeEngine:
    """The loop's Engine without a framework: each step takes `step_s[i]` on the clock; the first step compiles
    lazily (a compile event after it, as torch.compile's) when asked."""
    framework, process_index, process_count, device_kind = "torch", 0, 1, "cpu"

    def __init__(self, clock, step_s, lazy_s=0.0):
        self.clock, self.step_s, self.lazy_s = clock, list(step_s), lazy_s
        self.settings, self.saved, self.finals, self.events = {}, [], [], []

    def compile(self):
        return 0.0

    def compile_events(self):
        out, self.events = self.events, []
        return out

    def compile_totals(self):
        return {}

    def restore(self):
        return 0

    def train_step(self, step, lr):
        self.clock.now += self.step_s[step]
        if self.lazy_s and step == 0:
            self.events.append({"seconds": self.lazy_s, "reason": "first compile of forward"})
        return 5.0 - 0.1 * step, 1.0

    def eval_loss(self, index):
        return 4.0

    def save(self, step, final=False):
        self.clock.now += 0.25  # an intermediate save is part of the loop's wall clock
        self.saved.append(step)
        self.finals.append(final)

    def finish(self):
        self.clock.now += 10.0  # the final wait is not

    def any_process(self, flag):
        return flag

    def peak_flops_per_device(self):
        return 1e12

    def bytes_per_device(self):
        return engine.bytes_per_device(weights=100, optimizer=200)

    def peak_memory_bytes(self):
        return 1000

    def versions(self):
        return {}

    def profiler(self, directory):
        raise AssertionError("no profiling asked for")


def _run_loop(tmp_path, monkeypatch, step_s, *overrides, lazy_s=0.0):
    clock = Clock()
    monkeypatch.setattr(loop.time, "perf_counter", clock)
    cfg = _cfg(f"train.steps={len(step_s)}", *overrides)
    fake = FakeEngine(clock, step_s, lazy_s)
    summary = loop.run(fake, cfg, tmp_path, process_start=clock.now - 2.0, stopper=engine.Stopper())
    return summary, metrics.read(tmp_path / "metrics.jsonl"), cfg, fake


def test_loop_throughput_figures_are_exact_from_fixed_step_times(tmp_path, monkeypatch):
    """Issue 24.22: loop_tokens_per_s counting the warm-up steps survived (the checks were `> 0` and
    `<= 1.5 x tokens_per_s`). Steps of 3, 1, 1, 1, 1 s with warmup_exclude=1, 0.25 s saves after steps 2 and 4
    (and the last, after the loop) and 10 s of final wait: the steady steps' wall clock is 4 s plus two saves;
    tokens_per_s is one step's tokens per second."""
    s, recs, cfg, fake = _run_loop(tmp_path, monkeypatch, [3.0, 1.0, 1.0, 1.0, 1.0], "train.warmup_exclude=1",
                                   "checkpoint.every=2", "train.global_batch=8", "model.seq_len=32")
    assert (fake.saved, fake.finals) == ([2, 4, 5], [False, False, True])  # the engine knows which save is the last
    tokens = 8 * 32
    assert s["status"] == "ok" and s["timed_steps"] == 4
    assert s["tokens_per_s"] == pytest.approx(tokens / 1.0, rel=1e-12)
    assert s["loop_tokens_per_s"] == pytest.approx(tokens * 4 / (4.0 + 2 * 0.25), rel=1e-12)
    assert s["time_to_first_step_s"] == pytest.approx(2.0 + 3.0, rel=1e-12)
    assert s["step_time_p50_s"] == 1.0 and s["compile_s"] == 0.0 and s["compiles"] == 0  # eager: no compile
    assert s["warmup_excess_s"] == pytest.approx(2.0)  # the warm-up step's extra is a figure of its own
    assert [r["step_time_s"] for r in recs if r["kind"] == "step"] == pytest.approx([3.0, 1.0, 1.0, 1.0, 1.0])


def test_a_lazy_framework_reports_its_compile_time_from_the_engine(tmp_path, monkeypatch):
    """Issue 24.26 (was: the Engine protocol has an annotation): an engine that compiles inside its first step
    (torch.compile) reports that time as compile_s and in a `compile` record, not the warm-up's extra time."""
    s, recs, _, _ = _run_loop(tmp_path, monkeypatch, [3.0, 1.0, 1.0, 1.0], "train.warmup_exclude=1", lazy_s=1.75)
    assert s["compile_s"] == 1.75 and s["compiles"] == 1
    assert [(r["seconds"], r["step"], r["scope"]) for r in recs if r["kind"] == "compile"] == [(1.75, 1, "train")]
    assert [r.get("compiled") for r in recs if r["kind"] == "step"] == [True, None, None, None]
    s, recs, _, _ = _run_loop(tmp_path / "eager", monkeypatch, [3.0, 1.0, 1.0, 1.0], "train.warmup_exclude=1")
    assert s["compile_s"] == 0.0 and s["warmup_excess_s"] == pytest.approx(2.0)
    assert not [r for r in recs if r["kind"] == "compile"]


def test_steady_steps_leave_out_steps_that_compiled_and_count_real_tokens():
    """A step during which the train step compiled (a new shape) is not steady; tokens/s is real tokens
    over seconds, so steps of different lengths weigh by their tokens."""
    cfg = _cfg("train.warmup_exclude=1")
    timing = loop.Timing(step_times=[5.0, 1.0, 4.0, 2.0], step_tokens=[10, 100, 50, 300],
                         step_flops=[1.0, 10.0, 5.0, 30.0], compiled=[True, False, True, False],
                         peak_flops_per_device=1.0, first_save_index=3)
    f = loop.timing_fields(timing, cfg)
    assert f["timed_steps"] == 2 and f["tokens_per_s"] == pytest.approx(400 / 3.0)
    assert f["mfu"] == pytest.approx(40 / 3.0 / cfg.devices)
    assert f["post_save_step_ratio"] == pytest.approx(2.0)  # 2.0 s after the save, 1.0 s before
    assert loop.steady_indices(4, 1, [True, False, True, False]) == [1, 3]


def test_engine_protocol_reports_compile_events():
    assert {"compile_events", "compile_totals"} <= set(dir(loop.Engine))
    assert "lazy_compile_s" not in loop.Engine.__annotations__


def test_compile_log_totals():
    class W:
        def __init__(self):
            self.recs = []

        def write(self, kind, **f):
            self.recs.append((kind, f))

    class E:
        def __init__(self, events):
            self.events = events

        def compile_events(self):
            out, self.events = self.events, []
            return out

    from launch.core.compiles import CompileLog
    w = W()
    c = CompileLog(w)
    c.take(E([{"seconds": 2.0, "cache": "miss"}]), "train", 0)
    c.take(E([{"seconds": 1.0, "what": "forward", "recompile": True}, {"seconds": 0.5, "what": "backward",
                                                                        "recompile": True}]), "train", 4)
    c.take(E([{"seconds": 0.25}]), "eval", 4)
    t = c.totals({"graphs": 3})
    assert t["compile_s"] == 3.5 and t["compiles"] == 2 and t["recompiles"] == 1
    assert t["cache_hits"] == 0 and t["cache_misses"] == 1 and t["other_compiles"] == 1 and t["graphs"] == 3
    assert c.train_steps() == {4} and [k for k, _ in w.recs] == ["compile"] * 4
    assert w.recs[1][1]["step"] == 4 and w.recs[1][1]["scope"] == "train"


# --------------------------------------------------------------------------- process life

STOPPER = textwrap.dedent("""
    import os, signal, sys, time
    from launch.core.engine import Stopper
    s = Stopper().install()
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGTERM)
    print(s.requested, flush=True)  # the first signal asked to stop; USR2 does not count as a second
    os.kill(os.getpid(), signal.{second})
    time.sleep(30)
    print("still alive", flush=True)
""")


@pytest.mark.parametrize("second", ["SIGTERM", "SIGINT"])
def test_second_termination_signal_exits_at_once(second):
    p = subprocess.run([sys.executable, "-c", STOPPER.format(second=second)], capture_output=True, text=True, timeout=20)
    assert p.stdout.split() == ["SIGUSR2"]
    assert p.returncode == 128 + getattr(signal, second)
    assert f"second {second}" in p.stderr


def test_importing_the_loop_sets_nothing_and_needs_no_framework():
    code = ("import sys, launch.core.loop, launch.core.engine; "
            "print(hasattr(launch.core.loop, 'PROCESS_START'), sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.split("\n")[0]
    assert out == "False []"


def test_pid_alive():
    import os
    assert engine.pid_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not engine.pid_alive(p.pid)
    z = subprocess.Popen([sys.executable, "-c", "pass"])
    import time
    time.sleep(1.0)  # exited but not reaped: a zombie is not alive
    assert not engine.pid_alive(z.pid)
    z.wait()


def test_learning_rate_schedule_at_its_corners():
    """Protects against: a changed warm-up (starting at 0, off by one) or cosine (not reaching
    lr * min_lr_ratio at `steps`, wrong midpoint) in launch.core.loop.lr_at, which both frameworks use."""
    t = config.load(["train.lr=1.0", "train.warmup_steps=4", "train.steps=14", "train.min_lr_ratio=0.1"]).train
    assert loop.lr_at(0, t) == pytest.approx(0.25)  # the first update already moves: lr / warmup
    assert loop.lr_at(3, t) == pytest.approx(1.0)  # end of warm-up: the peak
    assert loop.lr_at(4, t) == pytest.approx(1.0)  # cosine starts at the peak
    assert loop.lr_at(9, t) == pytest.approx(0.55)  # half way: the mean of peak and floor
    assert loop.lr_at(13, t) == pytest.approx(0.1 + 0.45 * (1 + np.cos(0.9 * np.pi)))  # the last update
    assert loop.lr_at(14, t) == pytest.approx(0.1) and loop.lr_at(20, t) == pytest.approx(0.1)
    t0 = config.load(["train.lr=1.0", "train.warmup_steps=0", "train.steps=10"]).train
    assert loop.lr_at(0, t0) == pytest.approx(1.0)

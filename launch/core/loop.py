"""The training loop both trainers run, so both measure and log the same way.

A trainer provides the framework parts (`Engine`); this module owns the schedule (`lr_at`) and
`run`, which is built from three pieces a reader can take one at a time:

- `StepTimer`: each step's wall time (with a device sync: `Engine.train_step` returns floats),
  when it began, its real tokens, and the time from process start to the end of the first step;
- `CheckpointCadence`: which steps save (every `checkpoint.every`, and the last);
- `launch.core.compiles.CompileLog`: the `compile` records of every compilation the engine reports,
  stamped with their step and phase, and their totals;
- `SummaryBuilder` with `Timing`: the `summary` record, from the step times and tokens, losses,
  compile totals, checkpoint costs and peak FLOP/s, plus the engine's memory figures;
- `Profiling`: the `profile.steps` window: the framework's profiler around those steps, which are
  left out of the steady-state timing, and the `profile` record with the step-time breakdown.

Besides those, `run` handles `train.stop_after` and `train.stop_every` (`stop_step`), a stop request
(`launch.core.engine.Stopper`, taken by all processes together), the non-finite-loss stop and fault
injection for tests. How a trainer process gets here (signals, logging, config, build) is
`launch.core.engine.run_trainer`. Step numbers count completed optimizer steps: the record `step: 1`
is the first update.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import platform
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol

from launch import config as config_mod
from launch.common import envvars, files
from launch.config.schema import Config, TrainConfig
from launch.core import compiles as compiles_mod, flops, metrics, profile
from launch.core.params import count_params
from launch.data.tokenizer import token_file_identity
from launch.data.batches import is_dynamic, padded_len, step_seq_len

log = logging.getLogger(__name__)


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate for the update that turns `step` completed steps into step + 1.

    Linear warm-up over `warmup_steps` (the first update already uses lr/warmup_steps, never 0),
    then cosine decay to lr * min_lr_ratio at `steps`.
    """
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def stop_step(t: TrainConfig, start: int) -> int:
    """The step a run that starts after step `start` ends at: `train.steps`, or earlier at `train.stop_after`
    (absolute) or at the next multiple of `train.stop_every` after `start` (one chunk per run)."""
    stop = t.steps
    if t.stop_after is not None:
        stop = min(stop, t.stop_after)
    if t.stop_every is not None:
        stop = min(stop, (start // t.stop_every + 1) * t.stop_every)
    return stop


def at_stop_message(t: TrainConfig, step: int) -> str:
    """What to say when a cell's checkpoint is already at the step this config stops at."""
    if step >= t.steps:
        return f"already at step {step} of train.steps={t.steps}: finished, nothing to train (a new run.name starts afresh)"
    return (f"already at step {step} of {t.steps}, where train.stop_after={t.stop_after} stops it: nothing to train; "
            f"raise train.stop_after, or use train.stop_every=N to train N more steps per run")


class NonFiniteLoss(RuntimeError):
    pass


class Engine(Protocol):
    framework: str
    process_index: int
    process_count: int
    device_kind: str
    settings: Dict[str, Any]  # what the framework was set to that changes speed or numerics (recorded)

    def compile(self) -> float: ...  # compile ahead of the first step where the framework does; seconds (0 if lazy)
    def compile_events(self) -> List[Dict[str, Any]]: ...  # compilations since the last call (launch.core.compiles)
    def compile_totals(self) -> Dict[str, Any]: ...  # the framework's own compile totals for the summary
    def restore(self) -> int: ...  # completed steps of the latest complete checkpoint, 0 if none
    def train_step(self, step: int, lr: float) -> tuple: ...  # (loss, grad_norm) as Python floats
    def eval_loss(self, index: int) -> float: ...  # mean loss of held-out batch `index` (no gradient), all processes
    def save(self, step: int, final: bool = False) -> None: ...  # start saving the state after `step` steps (final:
    #   the run's last save, which the loop waits for next)
    def finish(self) -> None: ...  # wait for in-flight saves
    def any_process(self, flag: bool) -> bool: ...  # True if any process passes True (a collective)
    def peak_flops_per_device(self) -> float: ...
    def bytes_per_device(self) -> Dict[str, int]: ...
    def peak_memory_bytes(self) -> int: ...
    def versions(self) -> Dict[str, str]: ...
    def profiler(self, directory: Path) -> profile.Capture: ...  # the framework's profiler over profile.steps


class StopRequest(Protocol):
    """Why to stop after the current step (a signal's name, "launcher gone"), or None to go on.
    `launch.core.engine.Stopper` is the one trainers install."""
    requested: Optional[str]


@dataclass
class Fault:
    """Fault injection for tests of failure handling: SCALEOUT_FAULT="KIND@STEP[:pN][:cell=NAME]".

    KIND is crash (raise), nan (report a non-finite loss), hang (sleep) or hold (wait for a stop
    request); `:pN` limits it to process N, `:cell=NAME` to one cell of a sweep.
    """
    kind: str
    step: int
    process: Optional[int] = None
    cell: Optional[str] = None

    @staticmethod
    def from_env() -> Optional["Fault"]:
        spec = os.environ.get(envvars.FAULT)
        if not spec:
            return None
        kind, _, rest = spec.partition("@")
        step, *filters = rest.split(":")
        fault = Fault(kind, int(step))
        for f in filters:
            if f.startswith("cell="):
                fault.cell = f[5:]
            elif f.startswith("p"):
                fault.process = int(f[1:])
        return fault

    def applies(self, process: int, cell: str) -> bool:
        return self.process in (None, process) and self.cell in (None, cell)

    def before_step(self, step: int, stop_requested: Callable[[], bool] = lambda: False) -> None:
        """Called before the step that will complete `step`; `stop_requested` says whether a stop signal arrived."""
        if self.step != step:
            return
        if self.kind == "hold":  # wait for a stop signal: a test can signal a running trainer without racing it
            while not stop_requested():
                time.sleep(0.05)
        if self.kind == "crash":
            raise RuntimeError(f"injected crash at step {self.step} ({envvars.FAULT})")
        if self.kind == "hang":
            time.sleep(3600)

    def loss(self, step: int, loss: float) -> float:
        return float("nan") if self.kind == "nan" and self.step == step else loss


# --------------------------------------------------------------------------- the three pieces

class StepTimer:
    """Wall time of each step, when each began, its real tokens, and the time to the first step.

    `time_to_first_step_s` counts from `process_start`, the moment the trainer's entry point began
    (so it includes imports, distributed init, model build, compile and restore).
    """

    def __init__(self, process_start: float):
        self.process_start = process_start
        self.durations: List[float] = []  # steps whose result counted (finite loss, not profiled)
        self.kept_starts: List[float] = []  # perf_counter at the start of each of those
        self.kept_tokens: List[int] = []  # their real tokens (global_batch * the step's length; no padding)
        self.kept_flops: List[float] = []  # their model FLOPs (launch.core.flops)
        self.kept_compiled: List[bool] = []  # whether the train step compiled during them (not steady)
        self.starts: List[float] = []  # perf_counter at the start of every step taken
        self.time_to_first_step_s: Optional[float] = None
        self.loop_end: Optional[float] = None  # the last step's end, before the final save
        self.pauses: List[tuple] = []  # (perf_counter at start, seconds) of evaluations: not part of the loop's rate
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self.starts.append(self._t0)

    def stop(self) -> float:
        """The step that began at `start()` is done (its outputs synced): its duration."""
        now = time.perf_counter()
        if self.time_to_first_step_s is None:  # evaluations before it (step 0) are not start-up cost
            self.time_to_first_step_s = now - self.process_start - sum(s for _, s in self.pauses)
        return now - self._t0

    def keep(self, seconds: float, tokens: int = 0, model_flops: float = 0.0, compiled: bool = False) -> None:
        self.durations.append(seconds)
        self.kept_starts.append(self._t0)
        self.kept_tokens.append(tokens)
        self.kept_flops.append(model_flops)
        self.kept_compiled.append(compiled)

    def end_loop(self) -> None:
        self.loop_end = time.perf_counter()  # the final save and its wait are not part of the loop's rate

    def loop_tokens_per_s(self, warmup_exclude: int) -> Optional[float]:
        """Real tokens/s over the wall clock from the first steady step to the end of the loop:
        intermediate checkpoint saves and compilations during steps included."""
        n = len(metrics.steady(self.durations, warmup_exclude))
        if not n or self.loop_end is None:
            return None
        first = self.kept_starts[-n]
        paused = sum(s for t0, s in self.pauses if t0 >= first)
        return sum(self.kept_tokens[-n:]) / (self.loop_end - first - paused)


@dataclass
class CheckpointCadence:
    """Save every `every` steps (0: only at the end), and always after the last step taken."""
    every: int

    def due(self, step: int, last: bool) -> bool:
        return last or bool(self.every and step % self.every == 0)


@dataclass
class Timing:
    """What the summary's timing figures are computed from. `step_tokens`, `step_flops` and
    `compiled` run alongside `step_times` (empty: every step has global_batch * model.seq_len real
    tokens, the formula's FLOPs, and no compile)."""
    step_times: List[float] = field(default_factory=list)
    losses: List[float] = field(default_factory=list)
    compile_s: Optional[float] = None
    time_to_first_step_s: Optional[float] = None
    peak_flops_per_device: Optional[float] = None
    warmup_exclude: Optional[int] = None  # warm-up steps among step_times (fewer when some were traced); None: the config's
    step_tokens: List[int] = field(default_factory=list)
    step_flops: List[float] = field(default_factory=list)
    compiled: List[bool] = field(default_factory=list)
    first_save_index: Optional[int] = None  # index into step_times of the first step after the first intermediate save


class SummaryBuilder:
    """The `summary` record: identity fields from the start, outcome and figures at the end."""

    def __init__(self, engine: Engine, cfg: Config):
        t = cfg.train
        self.cfg, self.engine = cfg, engine
        self.fields: Dict[str, Any] = {
            "framework": engine.framework, "devices": cfg.devices, "processes": engine.process_count,
            "status": "failed", "error": None, "flops_per_token": flops.flops_per_token(cfg.model),
            "params": count_params(cfg.model)["total"], "global_batch": t.global_batch,
            "seq_len": cfg.model.seq_len, "matmul_precision": cfg.model.matmul_precision,
            "resumed_from_step": None, "steps": 0, "final_eval_loss": None}

    def __setitem__(self, key: str, value: Any) -> None:
        self.fields[key] = value

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def failed(self, error: BaseException) -> None:
        self.fields["error"] = f"{type(error).__name__}: {error}"
        self.fields["traceback"] = traceback.format_exc(limit=8)

    def build(self, timing: Timing) -> Dict[str, Any]:
        self.fields.update(timing_fields(timing, self.cfg))
        self.fields.update(self._memory())
        return self.fields

    def _memory(self) -> Dict[str, Any]:
        try:
            return {"bytes_per_device": self.engine.bytes_per_device(),
                    "peak_memory_bytes": self.engine.peak_memory_bytes()}
        except Exception:  # the state may not exist if init failed
            return {"bytes_per_device": self.fields.get("bytes_per_device"),
                    "peak_memory_bytes": self.fields.get("peak_memory_bytes", metrics.peak_rss_bytes())}


def steady_indices(n: int, warmup_exclude: int, compiled: List[bool]) -> List[int]:
    """Indices of the steady steps among `n` timed ones: after the warm-up (`metrics.steady`) and
    not one during which the train step compiled (a new shape, a recompile)."""
    first = n - len(metrics.steady([0.0] * n, warmup_exclude))
    return [i for i in range(first, n) if not (compiled and compiled[i])]


def timing_fields(timing: Timing, cfg: Config) -> Dict[str, Any]:
    """Steady-state step time percentiles, throughput and MFU (warm-up steps and steps that compiled
    left out; tokens are real tokens, see launch.core.flops), the final loss, the compile time of
    the train step (`compile_s`, from the compile records) and the warm-up steps' excess over the
    steady median (`warmup_excess_s`: start-up cost that is not a compile, e.g. eager PyTorch's
    first allocations)."""
    t = cfg.train
    n = len(timing.step_times)
    warmup = t.warmup_exclude if timing.warmup_exclude is None else timing.warmup_exclude
    idx = steady_indices(n, warmup, timing.compiled)
    st = [timing.step_times[i] for i in idx]
    p50 = metrics.percentile(st, 50)
    seconds = sum(st)
    mean = seconds / len(st) if st else None
    tokens = [timing.step_tokens[i] for i in idx] if timing.step_tokens else [t.global_batch * cfg.model.seq_len] * len(st)
    model_flops = ([timing.step_flops[i] for i in idx] if timing.step_flops
                   else [x * flops.flops_per_token(cfg.model) for x in tokens])
    tps = sum(tokens) / seconds if st and seconds else None
    peak = timing.peak_flops_per_device
    warm = timing.step_times[: n - len(metrics.steady(timing.step_times, warmup))] or timing.step_times[:1]
    return {
        "final_loss": timing.losses[-1] if timing.losses else None,
        "compile_s": timing.compile_s,
        "warmup_excess_s": sum(max(0.0, x - p50) for x in warm) if p50 is not None else None,
        "time_to_first_step_s": timing.time_to_first_step_s,
        "step_time_p50_s": p50,
        "step_time_p90_s": metrics.percentile(st, 90),
        "step_time_mean_s": mean,
        "tokens_per_s": tps,
        "tokens_per_s_per_device": tps / cfg.devices if tps else None,
        "mfu": sum(model_flops) / seconds / cfg.devices / peak if tps and peak else None,
        "peak_flops_per_device": peak,
        "timed_steps": len(st),
        "post_save_step_ratio": _post_save_ratio(timing, idx),
        **(_shape_fields(timing, idx, cfg) if is_dynamic(cfg.data) else {}),
    }


def _post_save_ratio(timing: Timing, idx: List[int]) -> Optional[float]:
    """Median steady step time after the first intermediate checkpoint save / before it: what a
    save's background work costs the steps that follow it (1.0: nothing)."""
    k = timing.first_save_index
    if k is None:
        return None
    before = [timing.step_times[i] for i in idx if i < k]
    after = [timing.step_times[i] for i in idx if i >= k]
    if not before or not after:
        return None
    return metrics.percentile(after, 50) / metrics.percentile(before, 50)


def _shape_fields(timing: Timing, idx: List[int], cfg: Config) -> Dict[str, Any]:
    """data.seq_lens / data.pad_to: the mean real length of the steady steps and the share of the
    positions they computed that was padding."""
    B = cfg.train.global_batch
    tokens = [timing.step_tokens[i] for i in idx] if timing.step_tokens else []
    if not tokens:
        return {"seq_len_mean": None, "padding_share": None}
    real = sum(tokens)
    padded = sum(B * padded_len(cfg.data, x // B) for x in tokens)
    return {"seq_len_mean": real / B / len(tokens), "padding_share": 1 - real / padded if padded else None}


class Profiling:
    """The `profile.steps` window: start the engine's profiler before its first step, a span around
    each traced step, stop and break the trace down after its last (or when the loop ends early).
    Traced steps count nowhere in the steady-state timing (every process leaves them out, traced
    or not); their time and the profiler's own are pauses of the loop's rate."""

    def __init__(self, engine: Engine, cfg: Config, cell_dir: Path, timer: StepTimer, w: "metrics.MetricsWriter"):
        self.engine, self.cell_dir, self.timer, self.w = engine, cell_dir, timer, w
        self.window = profile.Window.of(cfg)
        self.capture: Optional[profile.Capture] = None
        self.measured: Dict[int, float] = {}
        self.overhead_s = 0.0

    def covers(self, step: int) -> bool:
        return bool(self.window and self.window.covers(step))

    def before(self, step: int) -> None:
        """Step `step` is about to run: start the capture if it is the window's first step. A run
        resumed inside the window does not trace the rest (its first step after a restore is not
        a steady one, and the earlier attempt's trace is kept)."""
        win = self.window
        if self.capture is not None and win.start < step <= win.end:  # the profiler's own step boundary
            t0 = time.perf_counter()
            try:
                self.capture.next_step(step)
            except Exception as e:  # noqa: BLE001 - profiling is an observer
                log.warning(f"the profiler could not mark step {step}: {type(e).__name__}: {e}")
            self._pause(t0)
            return
        if not (win and step == win.start and self.capture is None and win.traced_by(self.engine.process_index)):
            return
        t0 = time.perf_counter()
        directory = profile.process_dir(self.cell_dir, self.engine.process_index)
        try:
            self.capture = self.engine.profiler(directory)
            self.capture.start(step)
        except Exception as e:  # noqa: BLE001 - profiling is an observer: the run goes on untraced
            self.capture = None
            self._record(directory, {"error": f"{type(e).__name__}: {e}", "files": [], "breakdown": []}, t0)
            return
        self._pause(t0)

    def span(self, step: int):
        return self.capture.step(step) if self.capture is not None and self.covers(step) else contextlib.nullcontext()

    def after(self, step: int, seconds: float, last: bool) -> None:
        """Step `step` took `seconds`; stop after the window's last step, or the loop's."""
        if self.covers(step):
            self.measured[step] = seconds
            self.timer.pauses.append((self.timer.starts[-1], seconds))
        if self.capture is not None and (step == self.window.end or last):
            self.finish()

    def traced_warmup(self, start: int, warmup_exclude: int) -> int:
        """How many of this run's first `warmup_exclude` steps were traced (they are not among the
        step times the warm-up count applies to)."""
        return sum(1 for s in self.measured if s <= start + warmup_exclude)

    def finish(self) -> None:
        """Stop the capture, write its trace and the `profile` record. A profiler that fails costs
        the record an `error`, never the training run."""
        capture, self.capture = self.capture, None
        if capture is None:
            return
        t0 = time.perf_counter()
        directory = capture.directory
        rec: Dict[str, Any] = {"files": [], "breakdown": [], "error": None}
        try:
            rec["files"] = [self._rel(f) for f in capture.stop()]
            rows = capture.breakdown()
            for row in rows:
                row["measured_s"] = self.measured.get(row["step"])
            rec["breakdown"] = rows
            rec["mean"] = profile.mean_breakdown([r for r in rows if r["measured_s"] is not None])
            if not rows:
                rec["error"] = "the trace holds none of the traced steps' spans"
        except Exception as e:  # noqa: BLE001 - profiling is an observer
            rec["error"] = f"{type(e).__name__}: {e}"
        del capture
        gc.collect()  # the parsed trace's objects are freed here, not inside the next timed step
        rec = self._record(directory, rec, t0)
        if self.engine.process_index == 0 and not rec["error"]:
            log.info(f"profiled steps {rec['steps']}: trace in {directory} (profiler: {rec['overhead_s']:.1f} s in all)")

    def _record(self, directory: Path, rec: Dict[str, Any], t0: float) -> Dict[str, Any]:
        """`breakdown.json` next to the trace and the `profile` record in metrics.jsonl."""
        rec = {"process": self.engine.process_index, "steps": sorted(self.measured), "dir": self._rel(directory), **rec}
        self._pause(t0)
        rec["overhead_s"] = self.overhead_s  # starting, stopping, writing and reading the trace
        if rec["error"]:
            log.warning(f"profile of steps {rec['steps'] or self.window.steps} failed (training goes on): {rec['error']}")
        try:
            profile.write_breakdown(directory, rec)
        except OSError as e:
            log.warning(f"could not write {directory / profile.BREAKDOWN_NAME}: {e}")
        self.w.write("profile", **rec)
        return rec

    def _rel(self, path: Path) -> str:
        return str(Path(path).relative_to(self.cell_dir))

    def _pause(self, t0: float) -> float:
        seconds = time.perf_counter() - t0
        self.timer.pauses.append((t0, seconds))
        self.overhead_s += seconds
        return seconds


# --------------------------------------------------------------------------- the loop

def evaluate(engine: Engine, cfg: Config, step: int, w: "metrics.MetricsWriter", summary: SummaryBuilder,
             timer: StepTimer) -> float:
    """Mean loss over the `train.eval_batches` fixed held-out batches (the same for every framework
    and device count); an `eval` record, `final_eval_loss`; its time is left out of the loop's rate."""
    t0 = time.perf_counter()
    loss = sum(engine.eval_loss(i) for i in range(cfg.train.eval_batches)) / cfg.train.eval_batches
    seconds = time.perf_counter() - t0
    timer.pauses.append((t0, seconds))
    w.write("eval", step=step, loss=loss, batches=cfg.train.eval_batches,
            tokens=cfg.train.eval_batches * cfg.train.eval_batch_size * cfg.model.seq_len, seconds=seconds)
    summary["final_eval_loss"] = loss
    if engine.process_index == 0:
        log.info(f"eval at step {step}: held-out loss {loss:.4f} ({seconds:.2f} s)")
    return loss


def stop_requested(engine: Engine, stopper: StopRequest) -> bool:
    """Whether to stop now; with several processes, all of them decide together (a signal reaches
    them at different steps, and one that stopped alone would leave the others in a collective)."""
    stop = stopper.requested is not None
    if engine.process_count > 1:
        stop = engine.any_process(stop)
    return stop


def start_record(engine: Engine, cfg: Config) -> Dict[str, Any]:
    t = cfg.train
    return dict(framework=engine.framework, devices=cfg.devices, processes=engine.process_count,
                device_kind=engine.device_kind, host_cores=os.cpu_count(), host=platform.node(),
                config_hash=config_mod.math_hash(cfg), model=cfg.model.name, global_batch=t.global_batch,
                seq_len=cfg.model.seq_len, mesh=config_mod.mesh_shape(cfg), versions=engine.versions(),
                settings=engine.settings, data=token_file_identity(cfg.data))


def _wandb(cfg: Config, cell_dir: Path):
    """The cell's W&B run, made by process 0's metrics writer (launch.core.wandb_run)."""
    def make():
        from launch.core import wandb_run
        return wandb_run.WandbWriter(cfg.metrics.wandb, cell_dir, config_mod.to_dict(cfg), cfg.run.id)
    return make


def run(engine: Engine, cfg: Config, cell_dir: Path, *, process_start: float, stopper: StopRequest) -> Dict[str, Any]:
    """Train from the latest checkpoint to `stop_after` or `steps`, or until `stopper` asks; returns the summary.

    `process_start` is the `time.perf_counter()` the entry point took as its first statement;
    `stopper` is the one it installed before anything else.
    """
    main = engine.process_index == 0
    t = cfg.train
    tb = cell_dir / files.TENSORBOARD_DIR if cfg.metrics.tensorboard else None
    w = metrics.MetricsWriter(cell_dir / files.METRICS_NAME, enabled=main, tensorboard_dir=tb,
                              wandb=_wandb(cfg, cell_dir) if cfg.metrics.wandb.enabled else None)
    w.write("start", **start_record(engine, cfg))
    summary = SummaryBuilder(engine, cfg)
    timer = StepTimer(process_start)
    timing = Timing(step_times=timer.durations, step_tokens=timer.kept_tokens, step_flops=timer.kept_flops,
                    compiled=timer.kept_compiled)
    cadence = CheckpointCadence(cfg.checkpoint.every)
    profiling = Profiling(engine, cfg, cell_dir, timer, w)
    compiles = compiles_mod.CompileLog(w)
    saves: List[float] = []  # seconds each save blocked the loop
    fault = Fault.from_env()
    if fault and not fault.applies(engine.process_index, cell_dir.name):
        fault = None
    dynamic = is_dynamic(cfg.data)
    print_every = max(t.log_every, t.steps // 10)
    try:
        timing.peak_flops_per_device = peak = engine.peak_flops_per_device()
        compiles.take(engine, "setup", 0)  # building the state, calibrating the matmul peak
        engine.compile()
        compiles.take(engine, "train", 0)  # the train step ahead of time (JAX)
        start = engine.restore()
        compiles.take(engine, "setup", start)
        summary["resumed_from_step"] = start if start else None
        summary["steps"] = start
        stop = stop_step(t, start)
        if main and start >= stop:
            log.info(f"{engine.framework}: {at_stop_message(t, start)}")
        elif main:
            log.info(f"{engine.framework}: {cfg.devices} device(s) ({engine.device_kind}), "
                     f"{engine.process_count} process(es), steps {start + 1}..{stop}" +
                     (f" of {t.steps}" if stop < t.steps else "") + (f", resumed from step {start}" if start else ""))
        if stop_requested(engine, stopper):  # a signal during start-up: nothing new to save
            summary["stopped_by"] = stopper.requested or "peer"
            stop = start
        if t.eval_every and start == 0 and stop > start:  # the held-out loss at initialisation
            evaluate(engine, cfg, 0, w, summary, timer)
            compiles.take(engine, "eval", 0)
        for step in range(start, stop):
            done = step + 1  # completed steps once this one is through
            if fault:
                fault.before_step(done, lambda: stopper.requested is not None)
            lr = lr_at(step, t)
            profiling.before(done)
            timer.start()
            with profiling.span(done):
                loss, gnorm = engine.train_step(step, lr)
            dt = timer.stop()
            compiled = any(r["scope"] == "train" for r in compiles.take(engine, "train", done))
            if fault:
                loss = fault.loss(done, loss)
            timing.time_to_first_step_s = timer.time_to_first_step_s
            if not math.isfinite(loss):
                raise NonFiniteLoss(f"loss is {loss} at step {done}; stopped without saving, the last good checkpoint is kept")
            length = step_seq_len(cfg.data, cfg.model.seq_len, step)  # the batch of `step` (real tokens only)
            tokens = t.global_batch * length
            step_flops = tokens * flops.flops_per_token(cfg.model, length)
            profiled = profiling.covers(done)
            if not profiled:  # a traced step is slower: not part of the steady state
                timer.keep(dt, tokens, step_flops, compiled)
            timing.losses.append(loss)
            summary["steps"] = done
            if main and (done % t.log_every == 0 or done == stop or profiled):
                tps = tokens / dt
                w.write("step", step=done, loss=loss, grad_norm=gnorm, lr=lr, step_time_s=dt,
                        tokens_per_s=tps, tokens_per_s_per_device=tps / cfg.devices,
                        mfu=step_flops / dt / cfg.devices / peak if peak else None,
                        **({"seq_len": length, "padded_len": padded_len(cfg.data, length)} if dynamic else {}),
                        **({"compiled": True} if compiled else {}),
                        **({"profiled": True} if profiled else {}))
            if main and (done % print_every == 0 or done in (start + 1, stop)):
                log.info(f"step {done}/{t.steps} loss {loss:.4f} grad_norm {gnorm:.3f} lr {lr:.2e} {dt * 1000:.1f} ms")
            stop_now = stop_requested(engine, stopper)
            last = done == stop or stop_now
            profiling.after(done, dt, last)
            if last:
                timer.end_loop()
            if t.eval_every and (done % t.eval_every == 0 or last):
                evaluate(engine, cfg, done, w, summary, timer)
                compiles.take(engine, "eval", done)
            if cadence.due(done, last):
                c0 = time.perf_counter()
                engine.save(done, final=last)
                saves.append(time.perf_counter() - c0)
                w.write("checkpoint", step=done, seconds=saves[-1])
                if not last and timing.first_save_index is None:
                    timing.first_save_index = len(timer.durations)  # the kept steps from here on follow a save
            if stop_now:
                summary["stopped_by"] = stopper.requested or "peer"
                break
        profiling.finish()  # normally done after the window's last step; here if that never came
        if profiling.measured:
            summary["profiled_steps"] = sorted(profiling.measured)
        c0 = time.perf_counter()
        engine.finish()
        wait_s = time.perf_counter() - c0
        if timer.durations:
            w.write("checkpoint_wait", seconds=wait_s)
        summary.fields.update({"checkpoint_saves": len(saves), "checkpoint_blocked_s": sum(saves),
                               "checkpoint_wait_s": wait_s})
        compiles.take(engine, "setup", summary["steps"])  # anything compiled at the end (saving)
        totals = compiles.totals(engine.compile_totals(), first_step=start + 1)
        summary.fields.update(totals)
        timing.compile_s = totals["compile_s"]
        timing.warmup_exclude = max(0, t.warmup_exclude - profiling.traced_warmup(start, t.warmup_exclude))
        loop_tps = timer.loop_tokens_per_s(timing.warmup_exclude)
        if loop_tps is not None:
            summary["loop_tokens_per_s"] = loop_tps
        summary["status"] = "ok" if summary["steps"] >= t.steps else "stopped"
        record = summary.build(timing)
    except BaseException as e:
        try:
            profiling.finish()  # the steps traced before the failure are worth keeping
        except BaseException:  # noqa: BLE001
            pass
        if isinstance(e, NonFiniteLoss):  # every process saw the same loss: finish in-flight saves, they are good
            try:
                engine.finish()
            except Exception:
                pass
        summary.failed(e)
        try:
            summary.fields.update(compiles.totals())  # what compiled before the failure
            timing.compile_s = summary["compile_s"]
        except Exception:  # noqa: BLE001 - the summary of a failure must still be written
            pass
        w.write("summary", **summary.build(timing))
        w.close()
        raise
    w.write("summary", **record)
    w.close()
    if main:
        compiled = (f"compile {record['compile_s'] or 0:.2f} s ({record['compiles']} compile(s), "
                    f"{record['recompiles']} recompile(s))" if record.get("compiles") else "compile none")
        log.info(f"{record['status']}: {record['steps']} steps, final loss {record['final_loss']}, "
                 f"{record['tokens_per_s'] or 0:.0f} tokens/s, {compiled}, "
                 f"first step after {record['time_to_first_step_s'] or 0:.2f} s")
    return record

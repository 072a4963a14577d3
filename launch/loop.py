"""The training loop both trainers run, so both measure and log the same way.

A trainer provides the framework parts (`Engine`); this module owns the schedule, step timing,
the metrics records, checkpoint cadence, `train.stop_after`, the non-finite-loss stop and the
summary. Step numbers count completed optimizer steps: the record `step: 1` is the first update.
"""

from __future__ import annotations

import math
import os
import platform
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol

from launch import config as config_mod
from launch import flops, metrics
from launch.params import count_params
from launch.rundir import METRICS_NAME
from launch.schema import Config, TrainConfig

PROCESS_START = time.perf_counter()  # the trainer module imports this first thing


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


class NonFiniteLoss(RuntimeError):
    pass


class Engine(Protocol):
    framework: str
    process_index: int
    process_count: int
    device_kind: str

    def compile(self) -> float: ...  # seconds spent compiling before the first step (0 if lazy)
    def restore(self) -> int: ...  # completed steps of the latest complete checkpoint, 0 if none
    def train_step(self, step: int, lr: float) -> tuple: ...  # (loss, grad_norm) as Python floats
    def save(self, step: int) -> None: ...  # start saving the state after `step` steps
    def finish(self) -> None: ...  # wait for in-flight saves
    def any_process(self, flag: bool) -> bool: ...  # True if any process passes True (a collective)
    def peak_flops_per_device(self) -> float: ...
    def bytes_per_device(self) -> Dict[str, int]: ...
    def peak_memory_bytes(self) -> int: ...
    def versions(self) -> Dict[str, str]: ...


@dataclass
class Fault:
    """Fault injection for tests of failure handling: SCALEOUT_FAULT="KIND@STEP[:pN][:cell=NAME]".

    KIND is crash (raise), nan (report a non-finite loss) or hang (sleep); `:pN` limits it to
    process N, `:cell=NAME` to one cell of a sweep.
    """
    kind: str
    step: int
    process: Optional[int] = None
    cell: Optional[str] = None

    @staticmethod
    def from_env() -> Optional["Fault"]:
        spec = os.environ.get("SCALEOUT_FAULT")
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


@dataclass
class Stopper:
    """Ends training cleanly (checkpoint, exit 0) after the current step on SIGUSR2/SIGTERM."""
    requested: Optional[str] = None
    signals: List[int] = field(default_factory=lambda: [signal.SIGUSR2, signal.SIGTERM])

    def install(self) -> None:
        for s in self.signals:
            try:
                signal.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name


def run(engine: Engine, cfg: Config, cell_dir: Path) -> Dict[str, Any]:
    """Train from the latest checkpoint to `stop_after` or `steps`; returns the summary."""
    main = engine.process_index == 0
    tb = cell_dir / "tensorboard" if cfg.metrics.tensorboard else None
    w = metrics.MetricsWriter(cell_dir / METRICS_NAME, enabled=main, tensorboard_dir=tb)
    t = cfg.train
    tokens_per_step = t.global_batch * cfg.model.seq_len
    fpt = flops.flops_per_token(cfg.model)
    summary: Dict[str, Any] = {"framework": engine.framework, "devices": cfg.devices,
                               "processes": engine.process_count, "status": "failed", "error": None,
                               "flops_per_token": fpt, "params": count_params(cfg.model)["total"],
                               "global_batch": t.global_batch, "seq_len": cfg.model.seq_len,
                               "resumed_from_step": None, "steps": 0}
    w.write("start", framework=engine.framework, devices=cfg.devices, processes=engine.process_count,
            device_kind=engine.device_kind, host_cores=os.cpu_count(), host=platform.node(),
            config_hash=config_mod.math_hash(cfg), model=cfg.model.name, global_batch=t.global_batch,
            seq_len=cfg.model.seq_len, mesh=config_mod.mesh_shape(cfg), versions=engine.versions())
    stopper = Stopper()
    stopper.install()
    fault = Fault.from_env()
    if fault and not fault.applies(engine.process_index, cell_dir.name):
        fault = None
    print_every = max(t.log_every, t.steps // 10)
    step_times: List[float] = []
    step_starts: List[float] = []
    losses: List[float] = []
    compile_s = ttfs = peak = None
    try:
        peak = engine.peak_flops_per_device()
        compile_s = engine.compile()
        if compile_s:
            w.write("compile", seconds=compile_s)
        start = engine.restore()
        summary["resumed_from_step"] = start if start else None
        summary["steps"] = start
        stop = t.stop_after or t.steps
        if main:
            print(f"[scaleout] {engine.framework}: {cfg.devices} device(s) ({engine.device_kind}), "
                  f"{engine.process_count} process(es), steps {start + 1}..{stop}" +
                  (f", resumed from step {start}" if start else ""), flush=True)
        for step in range(start, stop):
            if fault and fault.step == step + 1:
                _inject(fault)
            lr = lr_at(step, t)
            t0 = time.perf_counter()
            step_starts.append(t0)
            loss, gnorm = engine.train_step(step, lr)
            dt = time.perf_counter() - t0
            if fault and fault.kind == "nan" and fault.step == step + 1:
                loss = float("nan")
            if ttfs is None:
                ttfs = time.perf_counter() - PROCESS_START
            if not math.isfinite(loss):
                raise NonFiniteLoss(f"loss is {loss} at step {step + 1}; stopped without saving, the last good checkpoint is kept")
            step_times.append(dt)
            losses.append(loss)
            summary["steps"] = step + 1
            if main and ((step + 1) % t.log_every == 0 or step + 1 == stop):
                tps = tokens_per_step / dt
                w.write("step", step=step + 1, loss=loss, grad_norm=gnorm, lr=lr, step_time_s=dt,
                        tokens_per_s=tps, tokens_per_s_per_device=tps / cfg.devices,
                        mfu=flops.mfu(tps / cfg.devices, cfg.model, peak) if peak else None)
            if main and ((step + 1) % print_every == 0 or step + 1 in (start + 1, stop)):
                print(f"[scaleout] step {step + 1}/{t.steps} loss {loss:.4f} grad_norm {gnorm:.3f} "
                      f"lr {lr:.2e} {dt * 1000:.1f} ms", flush=True)
            stop_now = stopper.requested is not None
            if engine.process_count > 1:  # a signal reaches processes at different steps: stop together
                stop_now = engine.any_process(stop_now)
            last = step + 1 == stop or stop_now
            if last:
                loop_end = time.perf_counter()  # the final save and its wait are not part of the loop's rate
            if last or (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0):
                c0 = time.perf_counter()
                engine.save(step + 1)
                w.write("checkpoint", step=step + 1, seconds=time.perf_counter() - c0)
            if stop_now:
                summary["stopped_by"] = stopper.requested or "peer"
                break
        if not compile_s and getattr(engine, "lazy_compile_s", 0):
            compile_s = engine.lazy_compile_s  # torch.compile: traced and compiled inside the first step
            w.write("compile", seconds=compile_s)
        c0 = time.perf_counter()
        engine.finish()
        if step_times:
            w.write("checkpoint_wait", seconds=time.perf_counter() - c0)
        n_steady = len(metrics.steady(step_times, t.warmup_exclude))
        if n_steady:  # wall clock of the steady steps, with the time intermediate checkpoint saves cost
            summary["loop_tokens_per_s"] = tokens_per_step * n_steady / (loop_end - step_starts[-n_steady])
        summary["status"] = "ok" if summary["steps"] >= t.steps else "stopped"
        _fill_timing(summary, step_times, losses, compile_s, ttfs, t, tokens_per_step, cfg, peak, engine)
    except BaseException as e:
        if isinstance(e, NonFiniteLoss):  # every process saw the same loss: finish in-flight saves, they are good
            try:
                engine.finish()
            except Exception:
                pass
        summary["error"] = f"{type(e).__name__}: {e}"
        summary["traceback"] = traceback.format_exc(limit=8)
        _fill_timing(summary, step_times, losses, compile_s, ttfs, t, tokens_per_step, cfg, peak, engine)
        w.write("summary", **summary)
        w.close()
        raise
    w.write("summary", **summary)
    w.close()
    if main:
        print(f"[scaleout] {summary['status']}: {summary['steps']} steps, final loss {summary['final_loss']}, "
              f"{summary['tokens_per_s'] or 0:.0f} tokens/s, compile {summary['compile_s'] or 0:.2f} s, "
              f"first step after {summary['time_to_first_step_s'] or 0:.2f} s", flush=True)
    return summary


def _fill_timing(summary, step_times, losses, compile_s, ttfs, t, tokens_per_step, cfg, peak, engine) -> None:
    st = metrics.steady(step_times, t.warmup_exclude)
    p50 = metrics.percentile(st, 50)
    mean = sum(st) / len(st) if st else None
    if not compile_s and step_times and p50 is not None:  # lazy frameworks: the first steps' extra time
        warm = step_times[: len(step_times) - len(st)] or step_times[:1]
        compile_s = sum(max(0.0, x - p50) for x in warm)
    tps = tokens_per_step / mean if mean else None
    summary.update({
        "final_loss": losses[-1] if losses else None,
        "compile_s": compile_s,
        "time_to_first_step_s": ttfs,
        "step_time_p50_s": p50,
        "step_time_p90_s": metrics.percentile(st, 90),
        "step_time_mean_s": mean,
        "tokens_per_s": tps,
        "tokens_per_s_per_device": tps / cfg.devices if tps else None,
        "mfu": flops.mfu(tps / cfg.devices, cfg.model, peak) if tps and peak else None,
        "peak_flops_per_device": peak,
        "timed_steps": len(st),
    })
    try:
        summary["bytes_per_device"] = engine.bytes_per_device()
        summary["peak_memory_bytes"] = engine.peak_memory_bytes()
    except Exception:  # the state may not exist if init failed
        summary.setdefault("bytes_per_device", None)
        summary.setdefault("peak_memory_bytes", metrics.peak_rss_bytes())


def _inject(fault: Fault) -> None:
    if fault.kind == "crash":
        raise RuntimeError(f"injected crash at step {fault.step} (SCALEOUT_FAULT)")
    if fault.kind == "hang":
        time.sleep(3600)


def record_early_failure(framework: str, cfg: Config, cell_dir: Path, error: BaseException, is_main: bool) -> None:
    """A failure before the loop starts (init, distributed setup) still leaves a failed summary."""
    if is_main:
        w = metrics.MetricsWriter(cell_dir / METRICS_NAME)
        w.write("summary", framework=framework, devices=cfg.devices, status="failed",
                error=f"{type(error).__name__}: {error}", steps=0, traceback=traceback.format_exc(limit=8))
        w.close()


def exit_on_error(main_fn, where: str) -> None:
    """Run a trainer's main; on an error print it and exit 1 at once.

    Exiting at once matters: atexit hooks (jax.distributed.shutdown, process-group teardown) would
    wait for peers blocked in a collective with us, and the launcher must see the failure.
    """
    import sys
    try:
        code = main_fn()
    except SystemExit:
        raise
    except BaseException as e:
        traceback.print_exc()
        print(f"[scaleout] error ({where}): {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.exit(code)


def read_cell(prog: str, argv=None):
    """A trainer's command line, `--config CELL/config.yaml`, as (config, cell directory)."""
    import argparse
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--config", required=True, help="a cell's resolved config.yaml")
    args = ap.parse_args(argv)
    return config_mod.load_resolved(args.config), Path(args.config).resolve().parent

"""The report's "Where the time goes" section: each profiled cell's step-time breakdown.

Read from the `profile` record process 0 of a cell writes to its metrics.jsonl (`launch.core.loop`,
`launch.core.profile`): the traced steps, the seconds of each of `launch.core.profile.CATEGORIES` per step
and their mean, or the error that stopped the profiler. Shown as a table, a stacked bar per cell
(`breakdown.png`, both frameworks side by side at each device count) and, per cell, the trace's path
and the command that opens it (`scaleout trace RUN/CELL`; for JAX also XProf).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from launch.common import files
from launch.core.profile import CATEGORIES
from launch.report import trace

PLOT_NAME = "breakdown.png"
LABELS = {"matmul_attention": "matmul/attention", "other_compute": "other compute", "collectives": "collectives",
          "host_data": "host/data", "idle": "idle"}
COLORS = {"matmul_attention": "#4c72b0", "other_compute": "#55a868", "collectives": "#c44e52",
          "host_data": "#dd8452", "idle": "#b0b0b0"}


def _steps(steps: List[int]) -> str:
    steps = sorted(steps or [])
    if not steps:
        return "-"
    if steps == list(range(steps[0], steps[-1] + 1)) and len(steps) > 1:
        return f"{steps[0]}–{steps[-1]}"
    return ", ".join(map(str, steps))


def _ms(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    ms = 1e3 * seconds
    if ms == 0:
        return "0"
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def entries(run_dir: Path, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per cell with a `profile` record (or with profile.steps set but no record yet): what report.json
    keeps under `profile`. Empty when no cell of the run has a profile record."""
    if not any(r.get("_profile") for r in rows):
        return []
    out = []
    for r in sorted(rows, key=lambda r: (r.get("variant", ""), r["devices"], r.get("contender", r["framework"]))):
        rec = r.get("_profile")
        wanted = list(((r.get("_cfg") or {}).get("profile") or {}).get("steps") or [])
        if not rec and not wanted:
            continue
        e: Dict[str, Any] = {"cell": r["cell"], "framework": r["framework"], "devices": r["devices"],
                             "excluded_steps": r.get("_profiled_steps")}
        if not rec:
            e.update(steps=wanted, error=f"no profile record: the cell ended before step {wanted[-1]}, or is still running",
                     mean={}, breakdown=[], trace=None, open=None, xprof=None)
            out.append(e)
            continue
        e.update({k: rec.get(k) for k in ("process", "steps", "dir", "files", "breakdown", "mean", "error", "overhead_s")})
        e["mean"], e["breakdown"] = e["mean"] or {}, e["breakdown"] or []
        cell_dir = Path(run_dir) / r["cell"]
        named = rec.get("dir") if isinstance(rec.get("dir"), str) and rec.get("dir") else "profile"
        where = files.inside(cell_dir, named)  # the record may come from anyone: only a place inside the cell
        try:
            found: Optional[Path] = trace.find(where) if where else None
        except trace.TraceError:
            found = None
        e["trace"] = str(found.relative_to(run_dir)) if found else None
        e["open"] = f"scaleout trace {shlex.quote(str(cell_dir))}" if found else None
        e["xprof"] = (f"xprof --logdir={shlex.quote(str(trace.xprof_logdir(found)))}"
                      if found and found.name == trace.JAX_TRACE else None)
        e["other_processes"] = [d.name for d in trace.process_dirs(cell_dir / "profile")
                                if d.name != Path(named).name]
        out.append(e)
    return out


def markdown(profiled: List[Dict[str, Any]], plot: Optional[str]) -> List[str]:
    if not profiled:
        return []
    L = ["", "## Where the time goes", "",
         "The steps in `profiled steps` were traced with each framework's profiler (`profile.steps`) and are "
         "excluded from the steady-state figures above (tracing slows them; the summary lists them as "
         "`profiled_steps`). Each traced step is split into five parts that add up to it: at every instant, "
         "collectives if one is running, else matmul/attention, else other compute, else host/data work "
         "(building the batch), else idle (dispatch, Python, waiting). Each part: milliseconds per step, mean "
         "over the traced steps (its share of the traced step). How each framework's trace is read and where the "
         "two are not comparable: docs/profiling.md.", "",
         "| cell | fw | dev | profiled steps | measured ms/step | " + " | ".join(LABELS[c] for c in CATEGORIES) + " |",
         "|---|---|---|---|---|" + "---|" * len(CATEGORIES)]
    for e in profiled:
        head = f"| {e['cell']} | {e['framework']} | {e['devices']} | {_steps(e['steps'])} | "
        mean = e["mean"]
        if e["error"] or not mean:
            why = (e["error"] or "the profile record has no breakdown").strip().splitlines()[-1].replace("|", "\\|")
            L.append(head + f"- | **profile failed**: {why} |" + " |" * (len(CATEGORIES) - 1))
            continue
        total = sum(mean.get(c) or 0.0 for c in CATEGORIES) or 1.0
        parts = [f"{_ms(mean.get(c))} ({100 * (mean.get(c) or 0.0) / total:.0f}%)" for c in CATEGORIES]
        L.append(head + f"{_ms(mean.get('measured_s'))} | " + " | ".join(parts) + " |")
    if plot:
        L += ["", f"![{plot}]({plot})"]
    L += ["", "Traces (paths relative to the run directory) and the command that opens each in the Perfetto UI:", ""]
    for e in profiled:
        if not e.get("trace"):
            L.append(f"- {e['cell']}: no trace file" + (f" ({e['error']})" if e.get("error") else ""))
            continue
        line = f"- {e['cell']}: `{e['trace']}`; open: `{e['open']}`"
        if e.get("xprof"):
            line += f"; XProf view: `{e['xprof']}`"
        if e.get("other_processes"):
            line += f"; other processes traced: {', '.join(e['other_processes'])} (`scaleout trace CELL/profile/process-<i>`)"
        L.append(line)
    return L


def plot(run_dir: Path, profiled: List[Dict[str, Any]], save: Callable[[Any, Path], Path]) -> Path:
    """`breakdown.png`: one stacked bar per cell (ms per step by category), cells of the same device count
    side by side, a tick at the measured step time; a cell whose profile failed is labelled, without a bar."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(profiled) + 2), 4.5))
    xs, x, last = [], 0.0, None
    for e in profiled:  # a gap between device counts
        key = (e["devices"], e["cell"].split("-", 2)[2:])
        x += 1.0 if last is None or key == last else 1.6
        xs.append(x)
        last = key
    for c in CATEGORIES:
        bottoms = [sum(1e3 * (e["mean"].get(k) or 0.0) for k in CATEGORIES[:CATEGORIES.index(c)]) for e in profiled]
        heights = [1e3 * (e["mean"].get(c) or 0.0) for e in profiled]
        ax.bar(xs, heights, bottom=bottoms, width=0.7, color=COLORS[c], label=LABELS[c])
    measured = [(xi, 1e3 * e["mean"]["measured_s"]) for xi, e in zip(xs, profiled) if e["mean"].get("measured_s")]
    if measured:
        ax.scatter(*zip(*measured), marker="_", s=600, color="black", zorder=3, label="measured step")
    for xi, e in zip(xs, profiled):
        if e["error"] or not e["mean"]:
            ax.text(xi, 0, "profile failed" if e.get("dir") else "no profile", rotation=90, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [e["cell"] for e in profiled], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="ms per step (mean of traced steps)", title="Where the time goes")
    handles, labels = ax.get_legend_handles_labels()  # the stack's order, top first
    ax.legend(handles[::-1], labels[::-1], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save(fig, Path(run_dir) / PLOT_NAME)

"""`scaleout report RUN_DIR`: the scaling report, from the run directory alone.

Writes report.md, report.json, report.csv and PNG plots (throughput per device, scaling
efficiency, loss curves, start-up cost; with profile.steps, the step-time breakdown of
`launch.report.breakdown`). Cells are grouped by contender (`launch.config.contenders`: jax, torch,
torch-compile or a sweep's own), read from each cell's config.yaml; the comparisons of every pair of
contenders, the headline, the compile and checkpoint costs and the dynamic-shapes block are
`launch.report.compare`, whose docstring has the definitions (start-up, wall time, break-even,
efficiency).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from launch.common import files
from launch.common.files import CONFIG_NAME, LOGS_DIR, METRICS_NAME, SWEEP_FILE
from launch.config import contenders
from launch.report import (breakdown as report_profile, compare, projection as report_projection, projection_view,
                           sections)
from launch.report.compare import break_even, kernel_note, wall_time  # noqa: F401  (importable from here)

log = logging.getLogger(__name__)

ROW_FIELDS = ["cell", "contender", "framework", "devices", "variant", "processes", "global_batch", "tokens_per_s",
              "tokens_per_s_per_device", "mfu", "step_time_p50_s", "step_time_p90_s", "compile_s", "compiles",
              "recompiles", "graph_breaks", "cache_hits", "cache_misses", "warmup_excess_s", "time_to_first_step_s",
              "loop_tokens_per_s", "checkpoint_saves", "checkpoint_blocked_s", "post_save_step_ratio", "seq_len_mean",
              "padding_share", "peak_memory_bytes", "final_loss", "final_eval_loss", "steps", "status", "error",
              "est_memory_bytes", "est_limit_bytes", "est_compile_s"]
# Summary fields kept on a row besides ROW_FIELDS (for the comparisons, not the CSV).
EXTRA_FIELDS = ("step_time_mean_s", "graphs", "other_compiles", "other_compile_s", "later_compile_s",
                "checkpoint_wait_s")


class ReportError(Exception):
    pass


FINISHED_RE = re.compile(r"\[scaleout\] (ok|stopped): (\d+) steps")
ERROR_RE = re.compile(r"\[scaleout\].* error|Error\b|error:")
# The report's sections a newcomer should read first, in order (the sweep's last line names them).
READ_FIRST = (sections.HEADLINE, sections.PAIRS)  # what a sweep says to read first


def _log_lines(cell_dir: Path) -> List[str]:
    logs = sorted((cell_dir / LOGS_DIR).glob("*.log")) if (cell_dir / LOGS_DIR).is_dir() else []
    lines: List[str] = []
    for path in logs:
        lines += [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines


def _explain(cell_dir: Path, summary: Optional[Dict[str, Any]], last_step: Optional[int]) -> Tuple[str, Optional[str]]:
    """(status, error) of a cell without an ok summary, saying only what the files support."""
    if summary and summary.get("status") in ("failed", "stopped"):
        error = str(summary.get("error") or "").strip().splitlines()
        return summary["status"], (error[-1] if error else None)
    lines = _log_lines(cell_dir)
    finished = [m for m in (FINISHED_RE.search(line) for line in lines) if m]
    if finished:  # the trainer said it ended, but its records are gone or torn
        return "incomplete", f"metrics lost or incomplete; the log says it finished at step {finished[-1].group(2)}"
    errors = [line for line in lines if ERROR_RE.search(line)]
    if errors:
        return "failed", errors[-1].strip()
    if last_step is not None:
        return "incomplete", f"metrics end at step {last_step} without a summary (still running, or killed)"
    return "not run", ("its processes wrote output but no metrics" if lines else None)


def load_cell(cell_dir: Path) -> Dict[str, Any]:
    cfg = OmegaConf.to_container(OmegaConf.load(cell_dir / CONFIG_NAME))
    recs = files.read_records(cell_dir / METRICS_NAME)
    summaries = [r for r in recs if r.get("kind") == "summary"]
    starts = [r for r in recs if r.get("kind") == "start"]
    s = summaries[-1] if summaries else None
    row: Dict[str, Any] = {k: None for k in (*ROW_FIELDS, *EXTRA_FIELDS)}
    contender = contenders.name_of(cfg)
    prefix = f"{contender}-d{cfg['devices']}-"
    row.update({"cell": cell_dir.name, "contender": contender, "framework": cfg["framework"], "devices": cfg["devices"],
                "variant": cell_dir.name[len(prefix):] if cell_dir.name.startswith(prefix) else "",
                "global_batch": cfg["train"]["global_batch"], "torch_compile": contenders.uses_torch_compile(cfg)})
    if s:
        row.update({k: s.get(k) for k in (*ROW_FIELDS, *EXTRA_FIELDS) if k in s and k not in ("cell", "error")})
    steps, evals = {}, {}
    for r in recs:
        if r.get("kind") == "step" and isinstance(r.get("step"), int):
            steps[r["step"]] = r.get("loss")
        if r.get("kind") == "eval" and isinstance(r.get("step"), int):  # held-out loss (train.eval_every)
            evals[r["step"]] = r.get("loss")
    if not s or s.get("status") != "ok":
        row["status"], row["error"] = _explain(cell_dir, s, max(steps) if steps else None)
    est = files.read_json(cell_dir / files.ESTIMATE_NAME)
    if isinstance(est, dict):
        row["est_memory_bytes"] = (est.get("memory") or {}).get("total")
        row["est_limit_bytes"], row["est_compile_s"] = est.get("limit_bytes"), est.get("compile_s")
        row["_est_method"] = est.get("method")
    row["_loss"] = sorted(steps.items())
    row["_eval"] = sorted(evals.items())
    row["_start"] = starts[-1] if starts else {}
    profiles = [r for r in recs if r.get("kind") == "profile"]  # profile.steps: the traced window's breakdown
    row["_profile"] = profiles[-1] if profiles else None
    row["_profiled_steps"] = s.get("profiled_steps") if s else None
    row["_cfg"] = cfg
    return row


# Workload axes of issue 15: (config key, baseline value, variant value).
WORKLOAD_AXES = (("attention", "causal", "document"), ("norm_impl", "native", "custom"))


def workloads(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per contender and device count, each variant cell against the baseline cell that differs
    from it only in that one model key (model.attention, model.norm_impl): throughput ratio and
    the change in compile and first-step time."""
    ok = [r for r in rows if r["status"] == "ok" and r["tokens_per_s"]]
    out: List[Dict[str, Any]] = []
    for key, base_v, var_v in WORKLOAD_AXES:
        def ident(r, key=key):
            m = dict(r["_cfg"]["model"])
            m.pop(key, None)
            return r["contender"], r["devices"], json.dumps(m, sort_keys=True, default=str)

        base = {ident(r): r for r in ok if r["_cfg"]["model"].get(key, base_v) == base_v}
        for r in ok:
            b = base.get(ident(r))
            if r["_cfg"]["model"].get(key) != var_v or b is None:
                continue
            settings = (r.get("_start") or {}).get("settings") or {}
            others = {k: r["_cfg"]["model"].get(k) for k, _, _ in WORKLOAD_AXES if k != key}
            out.append({"axis": key, "contender": r["contender"], "framework": r["framework"], "devices": r["devices"], "cell": r["cell"],
                        "baseline_cell": b["cell"], "with": others, "throughput_ratio": r["tokens_per_s"] / b["tokens_per_s"],
                        "compile_s": {"baseline": b["compile_s"], "variant": r["compile_s"]},
                        "first_step_s": {"baseline": b["time_to_first_step_s"], "variant": r["time_to_first_step_s"]},
                        "document_mask_impl": settings.get("document_mask_impl") if key == "attention" else None})
    return sorted(out, key=lambda w: (w["axis"], w["contender"], w["devices"], w["cell"]))


def _delta(pair: Dict[str, Any]) -> str:
    a, b = pair.get("baseline"), pair.get("variant")
    if a is None or b is None:
        return "-"
    return f"{b:.2f} s ({b - a:+.2f} s)"


def hardware(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    starts = [r["_start"] for r in rows if r["_start"]]
    kinds = sorted({s.get("device_kind") for s in starts if s.get("device_kind")})
    cores = sorted({s.get("host_cores") for s in starts if s.get("host_cores")})
    hosts = sorted({s.get("host") for s in starts if s.get("host")})
    simulated = any(k == "cpu" for k in kinds) and any(r["devices"] > 1 for r in rows)
    peaks = sorted({(s.get("settings") or {}).get("mfu_peak") for s in starts} - {None})
    hw = {"device_kinds": kinds, "max_devices": max((r["devices"] for r in rows), default=0), "host_cores": cores,
          "mfu_peaks": peaks,
          "hosts": hosts, "simulated_devices_share_host": simulated,
          "versions": starts[-1].get("versions") if starts else {}}
    if simulated:
        hw["warning"] = (f"devices are simulated CPU devices sharing {', '.join(map(str, cores))} host core(s): "
                         "this is a functional dry run of the launcher, not a measurement of hardware scaling")
        hw["plot_warning"] = (f"Simulated CPU devices sharing {', '.join(map(str, cores))} core(s): "
                              "a functional dry run, not a hardware measurement")
    return hw


def write(run_dir: Path, project_to: Optional[List[int]] = None) -> Dict[str, Any]:
    """The report of a run directory; `project_to` (device counts) replaces the cells' report.project_to."""
    run_dir = Path(run_dir)
    dirs = files.cell_dirs(run_dir) if run_dir.is_dir() else []
    dirs = [d for d in dirs if (d / CONFIG_NAME).is_file()]
    if not dirs:
        raise ReportError(f"RUN_DIR={str(run_dir)!r} holds no cells (no <cell>/{CONFIG_NAME}); give a directory written by `scaleout run` or `scaleout sweep`.")
    rows = [load_cell(d) for d in dirs]
    manifest = files.read_json(run_dir / SWEEP_FILE)
    manifest = manifest if isinstance(manifest, dict) else {}
    scaling = manifest.get("scaling") or rows[0]["_cfg"]["sweep"]["scaling"]
    horizon = int(rows[0]["_cfg"]["report"]["horizon_steps"])
    listed = [c.get("name") for c in manifest.get("contenders") or [] if isinstance(c, dict)]
    order = compare.contender_order(rows, listed)
    rows.sort(key=lambda r: (order.index(r["contender"]), r["devices"], r["cell"]))
    by_name = {r["cell"]: r for r in rows}
    first = next((by_name[c["name"]] for c in manifest.get("cells") or []
                  if isinstance(c, dict) and c.get("name") in by_name), rows[0])
    derived = compare.derive(rows, scaling, horizon, order, first["variant"])
    hw = hardware(rows)
    profiled = report_profile.entries(run_dir, rows)
    projected = report_projection.section(rows, scaling, hw, report_projection.settings(rows, project_to),
                                          order)
    plots = _plots(run_dir, rows, derived, profiled, projected, hw.get("plot_warning"))
    _wandb_media(run_dir, rows, plots)
    public = [{k: r.get(k) for k in ROW_FIELDS} for r in rows]
    doc = {"run_dir": str(run_dir), "model": rows[0]["_cfg"]["model"]["name"], "hardware": hw,
           "contenders": [{"name": n, "framework": next(r["framework"] for r in rows if r["contender"] == n),
                           "torch_compile": next(r["torch_compile"] for r in rows if r["contender"] == n),
                           "cells": [r["cell"] for r in rows if r["contender"] == n]} for n in order],
           "cells": public, "derived": derived, "compile": compare.compile_costs(rows),
           "checkpoints": compare.checkpoint_costs(rows), "dynamic_shapes": compare.dynamic_shapes(rows, horizon),
           "plots": [p.name for p in plots], "workloads": workloads(rows),
           "loss_curves": {r["cell"]: r["_loss"] for r in rows},
           "eval_loss_curves": {r["cell"]: r["_eval"] for r in rows if r.get("_eval")},
           "profile": {e["cell"]: e for e in profiled}, "projection": projected}
    files.atomic_write(run_dir / "report.json", json.dumps(doc, indent=2, default=str))
    table = io.StringIO()
    w = csv.DictWriter(table, fieldnames=ROW_FIELDS)
    w.writeheader()
    w.writerows(public)
    files.atomic_write(run_dir / "report.csv", table.getvalue())
    files.atomic_write(run_dir / "report.md", _markdown(doc, rows))
    return {"md": run_dir / "report.md", "json": run_dir / "report.json", "csv": run_dir / "report.csv", "plots": plots}


def _wandb_media(run_dir: Path, rows: List[Dict[str, Any]], plots: List[Path]) -> None:
    """With metrics.wandb.enabled, the plots as images on the W&B group's `report` run (launch.core.wandb_run).
    W&B is an observer here: a failure is a warning, the report stands."""
    cfg = rows[0]["_cfg"]
    settings = (cfg.get("metrics") or {}).get("wandb") or {}
    if not (settings.get("enabled") and plots):
        return
    from launch.core import wandb_run
    try:
        rid = wandb_run.log_report(settings, run_dir, (cfg.get("run") or {}).get("id"), plots)
    except Exception as e:  # noqa: BLE001 - the report is written either way
        log.warning(f"could not log the report's plots to W&B: {type(e).__name__}: {e}")
        return
    if rid:
        log.info(f"W&B: the plots are on run {rid} of group {settings.get('group')} ({settings.get('mode')})")


_fmt = sections.fmt


def _markdown(doc: Dict[str, Any], rows: List[Dict[str, Any]]) -> str:
    hw, d = doc["hardware"], doc["derived"]
    L = [f"# scaleout report: {doc['model']}", "",
         f"Run directory: `{doc['run_dir']}`  ",
         f"Hardware: {', '.join(hw['device_kinds']) or 'unknown'}; up to {hw['max_devices']} device(s); "
         f"host cores {', '.join(map(str, hw['host_cores'])) or '?'}; hosts {', '.join(hw['hosts']) or '?'}  ",
         f"Scaling: {d['scaling']} ({'per-device batch fixed' if d['scaling'] == 'weak' else 'global batch fixed'})  ",
         "Contenders: " + ", ".join(f"{c['name']} ({c['framework']}{', torch.compile' if c['torch_compile'] else ''})"
                                   for c in doc["contenders"]), ""]
    if hw.get("warning"):
        L += [f"> **Warning:** {hw['warning']}.", ""]
    if hw.get("mfu_peaks"):
        L += ["MFU is measured against: " + "; ".join(hw["mfu_peaks"]) + ".", ""]
    L += sections.headline(doc)
    L += ["## Cells", "",
          "| cell | contender | dev | proc | batch | tokens/s | tokens/s/dev | MFU | step p50 | step p90 | compile | first step | peak mem | final loss | status |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["cells"]:
        status = r["status"] if r["status"] == "ok" else f"**{r['status']}**: {r['error'] or ''}".replace("|", "\\|")
        L.append(f"| {r['cell']} | {r['contender']} | {r['devices']} | {_fmt(r['processes'])} | {r['global_batch']} | "
                 f"{_fmt(r['tokens_per_s'])} | {_fmt(r['tokens_per_s_per_device'])} | {_fmt(r['mfu'], 'pct')} | "
                 f"{_fmt(r['step_time_p50_s'])} s | {_fmt(r['step_time_p90_s'])} s | "
                 f"{sections.compile_cell(r['compiles'], r['compile_s'])} | "
                 f"{_fmt(r['time_to_first_step_s'])} s | {_fmt(r['peak_memory_bytes'], 'bytes')} | {_fmt(r['final_loss'])} | {status} |")
    estimated = [r for r in rows if r.get("est_memory_bytes") is not None]
    if estimated:
        L += ["", "## Estimated vs measured", "",
              "Estimates from the fit check before the run (`plan.check_fit`, as `scaleout plan --compile`): per-device "
              "memory and, for JAX, the ahead-of-time compile of the same step.", "",
              "| cell | est. memory/device | limit | measured peak | est. compile | measured compile | estimated by |",
              "|---|---|---|---|---|---|---|"]
        for r in estimated:
            L.append(f"| {r['cell']} | {_fmt(r['est_memory_bytes'], 'bytes')} | {_fmt(r['est_limit_bytes'], 'bytes')} | "
                     f"{_fmt(r['peak_memory_bytes'], 'bytes')} | {_fmt(r['est_compile_s'])} s | {_fmt(r['compile_s'])} s | "
                     f"{r.get('_est_method') or '-'} |")
        if any(k == "cpu" for k in hw["device_kinds"]):
            L += ["", "On CPU the measured peak is the process's peak RSS: it includes the interpreter and libraries "
                  "(a few hundred MiB) and, with simulated devices, every device of the process."]
    L += [""] + sections.pairs(doc) + sections.efficiency(doc) + sections.compiles(doc) + sections.checkpoints(doc)
    L += ["## Loss curves", ""]
    if not any(p["loss_gap"] for p in d["pairs"]):
        L.append("No device count has loss curves of two contenders.")
    for r in rows:
        if r.get("_eval"):
            step, loss = r["_eval"][-1]
            L.append(f"- {r['cell']}: held-out loss {_fmt(loss)} at step {step} (training loss {_fmt(r['final_loss'])}; "
                     f"{len(r['_eval'])} evaluations on fixed held-out batches)")
    L += ["", "Each pair's loss agreement is under Contenders compared (same data, same initial weights)."]
    if doc.get("workloads"):
        L += ["", "## Workloads: document mask and custom op", "",
              "Each variant cell against the cell that differs from it only in `model.attention` (document vs "
              "causal) or `model.norm_impl` (custom vs native): throughput ratio (variant / baseline), then compile "
              "and first-step time of the variant with the change from the baseline in brackets. `mask impl` is what "
              "ran the document mask (torch: flex or sdpa, from `torch.document_mask_impl`).", "",
              "| axis | contender | dev | variant cell | vs | throughput ratio | compile | first step | mask impl |",
              "|---|---|---|---|---|---|---|---|---|"]
        for w in doc["workloads"]:
            axis = "document/causal" if w["axis"] == "attention" else "custom/native norm"
            L.append(f"| {axis} | {w['contender']} | {w['devices']} | {w['cell']} | {w['baseline_cell']} | "
                     f"{w['throughput_ratio']:.3f}x | {_delta(w['compile_s'])} | {_delta(w['first_step_s'])} | "
                     f"{w['document_mask_impl'] or '-'} |")
    L += [""] + sections.dynamic_shapes(doc)
    breakdown = report_profile.PLOT_NAME if report_profile.PLOT_NAME in doc["plots"] else None
    L += report_profile.markdown(list(doc["profile"].values()), breakdown)
    projected = projection_view.PLOT_NAME if projection_view.PLOT_NAME in doc["plots"] else None
    L += projection_view.markdown(doc["projection"], projected)
    L += ["", "## Plots", ""] + [f"![{p}]({p})" for p in doc["plots"] if p not in (breakdown, projected)]
    L += ["", "Start-up cost is the time from process start to the end of the first step (every compile before or in "
          "it included); wall time of n steps = start-up + (n-1) x mean step time. Steady-state figures exclude the "
          "first `train.warmup_exclude` steps, steps during which the train step compiled"
          + (", and the profiled steps (`profile.steps`)." if doc["profile"] else "."), ""]
    return "\n".join(L)


def _plots(run_dir: Path, rows: List[Dict[str, Any]], d: Dict[str, Any], profiled: List[Dict[str, Any]],
           projected: Optional[Dict[str, Any]] = None, warning: Optional[str] = None) -> List[Path]:
    """The PNG plots; `warning` (the simulated-devices one) is printed across the foot of every plot."""
    import functools

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    save = functools.partial(_save_plot, warning=warning)
    base = d["variant"] or ""
    ok = [r for r in rows if r["status"] == "ok" and r["tokens_per_s"] and r["variant"] == base]
    out = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in d["contenders"]:
        pts = sorted((r["devices"], r["tokens_per_s_per_device"]) for r in ok if r["contender"] == name)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
            ax.plot([p[0] for p in pts], [pts[0][1]] * len(pts), ls="--", lw=1, color=ax.lines[-1].get_color(), label=f"{name} ideal")
    ax.set(xlabel="devices", ylabel="tokens/s per device", title="Throughput per device" + (f" ({base})" if base else ""))
    ax.set_xscale("log", base=2)
    ax.legend()
    out.append(save(fig, run_dir / "throughput.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, eff in d["efficiency"].items():
        ax.plot(list(eff), [100 * e for e in eff.values()], marker="o", label=name)
    ax.axhline(100, ls="--", lw=1, color="gray")
    ax.set(xlabel="devices", ylabel="efficiency (%)", title=f"{d['scaling'].capitalize()}-scaling efficiency")
    ax.set_xscale("log", base=2)
    ax.legend()
    out.append(save(fig, run_dir / "efficiency.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["_loss"]:
            steps, losses = zip(*r["_loss"])
            line, = ax.plot(steps, losses, ls="-" if r["framework"] == "jax" else "-." if r["torch_compile"] else "--",
                            label=r["cell"])
            if r.get("_eval"):  # held-out loss next to the training loss, in the same colour
                e_steps, e_losses = zip(*r["_eval"])
                ax.plot(e_steps, e_losses, ls=":", marker="o", ms=3, color=line.get_color(), label=f"{r['cell']} held-out")
    ax.set(xlabel="step", ylabel="loss", title="Loss curves (same data, same init; dotted: held-out)")
    ax.legend(fontsize=7)
    out.append(save(fig, run_dir / "loss.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["cell"] for r in rows]
    comp = [r["compile_s"] or 0 for r in rows]
    ttfs = [r["time_to_first_step_s"] or 0 for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], comp, width=0.4, label="compile (train step)")
    for i, r in enumerate(rows):
        if r.get("compiles") == 0:
            ax.annotate("none", (i - 0.2, 0), ha="center", va="bottom", fontsize=7)
    ax.bar([i + 0.2 for i in x], ttfs, width=0.4, label="time to first step")
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="seconds", title="Start-up cost per cell")
    ax.legend()
    out.append(save(fig, run_dir / "startup.png"))

    if profiled:
        out.append(report_profile.plot(run_dir, profiled, save))
    if projected and projected["contenders"]:
        out.append(projection_view.plot(run_dir, projected, save))
    return out


WARNING_COLOUR = "#b00020"


def _save_plot(fig, path: Path, warning: Optional[str] = None) -> Path:
    if warning:  # on the image itself: a plot travels without the report's warning
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        fig.text(0.5, 0.015, warning, ha="center", va="bottom", fontsize=7, color=WARNING_COLOUR, weight="bold")
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Description": warning} if warning else None)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path

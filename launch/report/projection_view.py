"""How the projection section (`launch.report.projection`) is shown: its markdown in report.md and
`projection.png` (measured points, projected curves, error bands). Nothing here needs jax or torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from launch.core import interconnects

PLOT_NAME = "projection.png"


def _gbs(v: Optional[float]) -> str:
    if v is None or v != v:
        return "unknown"
    if v == float("inf"):
        return "unbounded"
    return f"{v / 1e9:.3g} GB/s"


def _pct(v: Optional[float]) -> str:
    return "-" if v is None or v != v else f"{100 * v:.0f}%"


def _bytes(v: float) -> str:
    return "0" if not v else f"{v / 2**20:,.1f} MiB"


def markdown(sec: Optional[Dict[str, Any]], plot: Optional[str]) -> List[str]:
    if not sec:
        return []
    L = ["", "## Projection beyond the measured device counts", ""]
    if sec.get("warning"):
        L += [f"> **Not a prediction:** {sec['warning']}.", ""]
    L += ["Each contender's step time at N devices is modelled as compute(N) + overhead + (1 - overlap) x the bytes each "
          "device sends per step on each interconnect tier / that tier's bandwidth (`launch.core.projection`; the bytes "
          "follow from the model and the mesh at N, `launch.core.collectives`). Compute is constant per device under "
          "weak scaling and divided by N under strong scaling. Every number the model uses is listed with where it "
          "comes from: measured, fitted from the measured cells, or assumed from the interconnect table. "
          f"Leave-one-out: each measured device count is predicted from a fit to the others (error = predicted / measured "
          f"throughput - 1); with e the largest, the band is projected / (1 + e) to projected / (1 - e), what a "
          f"measurement would be if the projection erred as much, and a contender whose e exceeds "
          f"{100 * sec['max_error']:.0f}% (`report.project_max_error`) is **not trustworthy**. The band is the error "
          "seen inside the measured range: further out, and on a tier no cell measured, it is a floor, not a bound. "
          "The model cannot know contention from other jobs, topology-aware placement or stragglers.", ""]
    if sec.get("variant"):
        L += [f"Projected cells: the `{sec['variant']}` combination of `sweep.extra` (the sweep's first).", ""]
    floor = sec["efficiency_floor"]
    for name, e in sec["contenders"].items():
        L += [f"### {name}", ""]
        L.append(f"- measured: {', '.join(str(m['devices']) for m in e['measured'])} device(s) "
                 f"({', '.join(e['cells'])}); device {e['device_kind']}; mesh rule parallel "
                 + " ".join(f"{k}={v}" for k, v in e["parallel"].items())
                 + f"; {e['devices_per_node']} devices per node ({e['devices_per_node_source']})")
        if e.get("error"):
            L += [f"- **no projection**: {e['error']}", ""]
            continue
        f = e["fit"]
        src = f["source"]
        L.append(f"- compute {1e3 * f['compute_s']:.4g} ms/step at {f['anchor_devices']} device(s) ({src.get('compute')}); "
                 f"overhead {1e3 * f['overhead_s']:.3g} ms/step ({src.get('overhead')})")
        L.append(f"- overlap {_pct(f['overlap'])} of communication hidden ({src.get('overlap')})")
        for t in interconnects.TIERS:
            L.append(f"- bandwidth {e['tiers'][t]}: {_gbs(f['bandwidth_bytes_per_s'].get(t))} per device "
                     f"({src.get('bandwidth.' + t, '-')}); table: {_gbs(e['table']['bandwidth_bytes_per_s'].get(t))} "
                     f"({e['table']['source'][t]})")
        for note in f["notes"]:
            L.append(f"- note: {note}")
        loo = ", ".join(f"{n} dev {'-' if v is None else f'{100 * v:+.1f}%'}" for n, v in e["leave_one_out"].items())
        verdict = "trustworthy" if e["trustworthy"] else f"**not trustworthy** ({e['why_not']})"
        L.append(f"- leave-one-out error: {loo or 'none (fewer than 3 measured device counts)'}; largest "
                 f"{_pct(e['max_abs_error']) if e['max_abs_error'] is not None else '-'}: {verdict}")
        fl = e["floor"] or {}
        if fl.get("devices"):
            where = "measured" if fl.get("measured") else "projected"
            L.append(f"- efficiency falls below {100 * floor:.0f}% at {fl['devices']} devices ({where}; last above: "
                     f"{fl.get('last_above') or '-'})")
        else:
            L.append(f"- efficiency stays at or above {100 * floor:.0f}%: {fl.get('stopped', '-')}")
        L += ["", "| devices | tokens/s/device | band | efficiency | step | compute | exposed comm | bytes/device/step "
              "(intra / inter) | trust |", "|---|---|---|---|---|---|---|---|---|"]
        for p in e["projections"]:
            if "error" in p:
                L.append(f"| {p['devices']} | cannot project: {p['error']} | | | | | | | |")
                continue
            trust = "yes" if p["trustworthy"] else "**no**"
            if p["unmeasured_tiers"]:
                trust += " (" + ", ".join(e["tiers"][t] for t in p["unmeasured_tiers"]) + ": not measured)"
            band = "-" if p["low"] is None else f"{p['low']:,.4g} - " + (f"{p['high']:,.4g}" if p["high"] else "unbounded")
            L.append(f"| {p['devices']} | {p['tokens_per_s_per_device']:,.4g} | {band} | "
                     f"{_pct(p['efficiency'])} | {1e3 * p['step_s']:.4g} ms | {1e3 * p['compute_s']:.4g} ms | "
                     f"{1e3 * p['communication_s']:.4g} ms | {_bytes(p['bytes']['intra'])} / {_bytes(p['bytes']['inter'])} | "
                     f"{trust} |")
        L.append("")
    if sec["ratios"]:
        L += ["### Contenders compared at the projected counts", "", "| devices | a / b | throughput ratio | band | trust |",
              "|---|---|---|---|---|"]
        for r in sec["ratios"]:
            band = "-" if r["low"] is None else f"{r['low']:.3g} - " + (f"{r['high']:.3g}" if r["high"] else "unbounded")
            L.append(f"| {r['devices']} | {r['a']} / {r['b']} | {r['ratio']:.3g}x | {band} | "
                     f"{'yes' if r['trustworthy'] else '**no**'} |")
        L.append("")
    if plot:
        L += [f"![{plot}]({plot})", ""]
    return L


def plot(run_dir: Path, sec: Dict[str, Any], save: Callable[[Any, Path], Path]) -> Path:
    """`projection.png`: measured points (filled), the projected curve (dashed and labelled when not trustworthy),
    its error band and the requested counts (hollow), for throughput per device and efficiency; a dotted line at the
    largest measured count."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, e) in enumerate(sec["contenders"].items()):
        color = f"C{i}"
        m = e["measured"]
        for ax, key in zip(axes, ("tokens_per_s_per_device", "efficiency")):
            scale = 100 if key == "efficiency" else 1
            ax.plot([p["devices"] for p in m], [scale * p[key] for p in m], "o", color=color, label=f"{name} measured")
            curve = e.get("curve") or []
            if not curve:
                continue
            xs = [p["devices"] for p in curve]
            lo_key, hi_key = ("efficiency_low", "efficiency_high") if key == "efficiency" else ("low", "high")
            label = f"{name} projected" + ("" if e["trustworthy"] else " (not trustworthy)")
            ax.plot(xs, [scale * p[key] for p in curve], "-" if e["trustworthy"] else "--", color=color, lw=1.5,
                    label=label)
            asked = [p for p in e["projections"] if "error" not in p]
            ax.plot([p["devices"] for p in asked], [scale * p[key] for p in asked], "o", mfc="none", color=color)
            if e["max_abs_error"] is not None:
                top = 10 * max(scale * p[key] for p in curve)  # an unbounded top runs off the axes
                ax.fill_between(xs, [scale * p[lo_key] for p in curve],
                                [top if p[hi_key] is None else scale * p[hi_key] for p in curve], color=color,
                                alpha=0.15 if e["trustworthy"] else 0.07, lw=0)
    for ax, key in zip(axes, ("tokens_per_s_per_device", "efficiency")):  # the lines decide the axes, not the band
        scale = 100 if key == "efficiency" else 1
        values = [scale * p[key] for e in sec["contenders"].values() for p in [*e["measured"], *(e.get("curve") or [])]]
        if values:
            ax.set_ylim(0, 1.15 * max(values))
    largest = max((m["devices"] for e in sec["contenders"].values() for m in e["measured"]), default=None)
    for ax in axes if largest else ():
        ax.axvline(largest, ls=":", color="black", lw=0.8)  # measured to the left, projected to the right
    axes[1].axhline(100 * sec["efficiency_floor"], ls=":", color="gray", lw=1, label=f"{100 * sec['efficiency_floor']:.0f}% floor")
    for ax, ylabel in zip(axes, ("tokens/s per device", f"{sec['scaling']}-scaling efficiency (%)")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="devices", ylabel=ylabel)
        ax.legend(fontsize=7)
    title = "Projected scaling (band: largest leave-one-out error)"
    if sec.get("warning"):
        title += " - simulated CPU devices: not a prediction"
    fig.suptitle(title, fontsize=10)
    return save(fig, Path(run_dir) / PLOT_NAME)

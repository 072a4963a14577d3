"""report.md's sections about contenders: headline, pairs, compile, checkpoints, dynamic shapes.

Each function takes the report document (`launch.report.report.write`'s `doc`) and returns lines
of Markdown; the figures come from `launch.report.compare`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional


HEADLINE = "Headline"
PAIRS = "Contenders compared"


def fmt(v: Any, kind: str = "") -> str:
    if v is None:
        return "-"
    if kind == "bytes":
        return f"{v / 2**20:.0f} MiB"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if kind == "s":
        return f"{v:.3g} s" if abs(v) < 1000 else f"{v:,.0f} s"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)


def compile_cell(compiles: Optional[int], seconds: Optional[float]) -> str:
    """A cell's compile figure: "none" when it compiled nothing (eager PyTorch)."""
    if compiles is None:
        return fmt(seconds, "s")
    if not compiles:
        return "none"
    return f"{fmt(seconds, 's')} ({compiles})"


def _minutes(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"


def headline(doc: Dict[str, Any]) -> List[str]:
    d = doc["derived"]
    L = [f"## {HEADLINE}", ""]
    if not d["headline"]:
        return L + ["No device count has finished cells of two contenders.", ""]
    n = d["horizon_steps"]
    for devices, h in sorted(d["headline"].items(), key=lambda kv: int(kv[0])):
        w = h["with"]
        line = (f"- {devices} device(s), a {n:,}-step run: **{w['winner']}** finishes first, {w['speedup']:.2f}x "
                f"faster than {w['runner_up']} ({_minutes(w['wall_time_s'][w['winner']])} vs "
                f"{_minutes(w['wall_time_s'][w['runner_up']])}).")
        wo = h.get("without")
        if wo:
            line += (f" Without torch.compile: **{wo['winner']}**, {wo['speedup']:.2f}x faster than {wo['runner_up']} "
                     f"({_minutes(wo['wall_time_s'][wo['winner']])} vs {_minutes(wo['wall_time_s'][wo['runner_up']])}).")
        L.append(line)
    L += ["", f"Wall time = time to first step + ({n:,} - 1) x mean steady step time (`report.horizon_steps`)"
          + (f"; over the `{d['variant']}` cells." if d.get("variant") else "."), ""]
    return L


def pairs(doc: Dict[str, Any]) -> List[str]:
    d = doc["derived"]
    L = [f"## {PAIRS}", "",
         "Every pair of contenders at each device count: throughput ratio (first / second), start-up (time to first "
         "step; compile in brackets, `none` for a contender that compiles nothing), break-even, wall time of a "
         f"{d['horizon_steps']:,}-step run, and how far their losses differ on the same rows.", ""]
    if not d["pairs"]:
        return L + ["No device count has finished cells of two contenders.", ""]
    current = object()
    for p in d["pairs"]:
        if p["variant"] != current:
            current = p["variant"]
            if current:
                L += ["", f"`{current}` cells:", ""]
        a, b = p["a"], p["b"]
        be = p["break_even"]
        slow = be["slower_start"]
        fast = b if slow == a else a
        catch = (f"{slow} starts {p['startup_s'][slow] - p['startup_s'][fast]:.1f} s later and catches up after "
                 f"{be['steps']:,} steps" if be["steps"] != "never"
                 else f"{slow} starts {p['startup_s'][slow] - p['startup_s'][fast]:.1f} s later and never catches up "
                      "(its steps are not faster)")
        gap = p["loss_gap"]
        loss = (f"losses within {100 * gap['max_rel_diff']:.3g}% over {gap['steps_compared']} steps" if gap
                else "no common loss steps")
        L.append(f"- {p['devices']} device(s), **{a} vs {b}**: throughput {p['throughput_ratio']:.2f}x; start-up "
                 f"{a} {p['startup_s'][a]:.1f} s ({compile_cell(p['compiles'][a], p['compile_s'][a])}), {b} "
                 f"{p['startup_s'][b]:.1f} s ({compile_cell(p['compiles'][b], p['compile_s'][b])}); {catch}. "
                 f"{d['horizon_steps']:,} steps: {a} {_minutes(p['wall_time_s'][a])}, {b} "
                 f"{_minutes(p['wall_time_s'][b])}; {loss}.")
        for note in p.get("notes") or []:
            L.append(f"  - {note.rstrip('.')}.")
    return L + [""]


def efficiency(doc: Dict[str, Any]) -> List[str]:
    d = doc["derived"]
    L = ["## Scaling efficiency", ""]
    if d.get("variant"):
        L += [f"Efficiency and the headline use the `{d['variant']}` cells (the sweep's first `sweep.extra` "
              "combination); the pairs above cover every combination.", ""]
    for name, eff in d["efficiency"].items():
        L.append(f"- {name}: " + ", ".join(f"{n} dev {100 * e:.0f}%" for n, e in sorted(eff.items(), key=lambda kv: int(kv[0]))))
    return L + [""]


def compiles(doc: Dict[str, Any]) -> List[str]:
    L = ["## Compile", "",
         "From each cell's `compile` records (one per compilation, from the framework's own instrumentation: JAX's "
         "`jax.monitoring` events, torch.compile's Dynamo compilation metrics). `compiles`: compilations of the train "
         "step (a torch.compile forward with its lazy backward is one); `recompiles`: of code compiled before (a new "
         "shape, a failed guard); graphs and graph breaks: torch.compile's counters; cache: JAX's persistent "
         "compilation cache (hits/misses); other: compiles outside the train step (evaluation, setup). Eager PyTorch "
         "compiles nothing (`none`); its slower first steps are the warm-up excess (the warm-up steps' time over the "
         "steady median), not a compile.", "",
         "| cell | contender | dev | compiles | compile | recompiles | graphs | graph breaks | cache hit/miss | other | warm-up excess | first step |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in doc["compile"]:
        cache = f"{c['cache_hits']}/{c['cache_misses']}" if c.get("cache_hits") is not None else "-"
        other = f"{fmt(c['other_compile_s'], 's')} ({c['other_compiles']})" if c.get("other_compiles") else "-"
        L.append(f"| {c['cell']} | {c['contender']} | {c['devices']} | {fmt(c['compiles'])} | "
                 f"{compile_cell(c['compiles'], c['compile_s'])} | {fmt(c['recompiles'])} | {fmt(c['graphs'])} | "
                 f"{fmt(c['graph_breaks'])} | {cache} | {other} | {fmt(c['warmup_excess_s'], 's')} | "
                 f"{fmt(c['time_to_first_step_s'], 's')} |")
    return L + [""]


def checkpoints(doc: Dict[str, Any]) -> List[str]:
    if not doc["checkpoints"]:
        return []
    L = ["## Checkpoint cost", "",
         "What saving cost each cell apart from its step time: the time the saves blocked the loop, the wait for the "
         "last one at the end, the throughput the loop kept with its intermediate saves (tokens/s over the wall clock "
         "of the steady steps, saves included / steady tokens/s), and the median steady step after the first save / "
         "before it (above 1: the save's background work slowed the steps that followed).", "",
         "| cell | contender | dev | async | saves | blocked | final wait | throughput kept | steps after / before save |",
         "|---|---|---|---|---|---|---|---|---|"]
    for c in doc["checkpoints"]:
        L.append(f"| {c['cell']} | {c['contender']} | {c['devices']} | {fmt(c['async'])} | {c['saves']} | "
                 f"{fmt(c['blocked_s'], 's')} | {fmt(c['wait_s'], 's')} | {fmt(c['throughput_kept'], 'pct')} | "
                 f"{fmt(c['post_save_step_ratio'])} |")
    return L + [""]


def dynamic_shapes(doc: Dict[str, Any]) -> List[str]:
    if not doc["dynamic_shapes"]:
        return []
    L = ["## Workloads: dynamic shapes", "",
         "Cells whose sequence length changes from step to step (`data.seq_lens`), each against the static cell of the "
         "same contender: compiles and their seconds (JAX compiles once per new padded length; torch.compile "
         "recompiles once a shape changes, or compiles dynamic shapes with `torch.compile_dynamic=true`; eager PyTorch "
         "compiles nothing), steady tokens/s (real tokens, padding excluded; steps that compiled left out), tokens/s over "
         "the loop's wall clock (compiles included), the share of computed positions that was padding "
         "(`data.pad_to`), and the break-even against the static cell (time per real token, later compiles counted as "
         "start-up; steps of the static cell's size).", "",
         "| cell | contender | dev | lengths | buckets | compiles | compile | tokens/s | wall-clock tokens/s | padding | static tokens/s | break-even vs static |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in doc["dynamic_shapes"]:
        lengths = (f"{min(e['seq_lens'])}-{max(e['seq_lens'])} uniform" if e["seq_len_dist"] == "uniform"
                   else ", ".join(map(str, e["seq_lens"])))
        be = e["break_even"]
        if be is None:
            even = "-" if e["static_cell"] is None else "no steady steps"
        elif be["steps"] == "never":
            even = f"{be['slower_start']} never catches up"
        else:
            even = f"{be['slower_start']} catches up after {be['steps']:,} steps"
        L.append(f"| {e['cell']} | {e['contender']} | {e['devices']} | {lengths} | "
                 f"{', '.join(map(str, e['pad_to'])) or 'none'} | {fmt(e['compiles'])} | "
                 f"{compile_cell(e['compiles'], e['compile_s'])} | {fmt(e['tokens_per_s'])} | "
                 f"{fmt(e['loop_tokens_per_s'])} | {fmt(e['padding_share'], 'pct')} | "
                 f"{fmt(e['static_tokens_per_s'])} ({e['static_cell'] or 'no static cell'}) | {even} |")
    return L + [""]

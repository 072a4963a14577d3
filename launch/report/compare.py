"""The report's comparisons of contenders (`launch.config.contenders`), from the rows of `launch.report.report`.

- `derive`: per contender the scaling efficiency; per device count (and per sweep.extra variant)
  every pair of contenders: throughput ratio, start-up (time to first step, compile), break-even,
  wall time at the horizon, loss agreement, and notes about the pair (`pair_notes`); the headline:
  who wins at the horizon, with and without torch.compile.
- `compile_costs`: per cell, the compile records' totals (eager PyTorch: none) and the warm-up excess.
- `checkpoint_costs`: per cell with checkpoints, what the saves cost apart from the step time.
- `dynamic_shapes`: each cell with `data.seq_lens` against the static cell of the same contender.

Definitions (also in report.md):
- start-up: `time_to_first_step_s`, from process start to the end of the first step: imports, init,
  restore and every compile before or inside the first step.
- wall time of an n-step run: start-up + (n - 1) * mean steady step time (steady: after the warm-up,
  no step that compiled).
- break-even of a pair: the contender with the larger start-up catches up after
  n = 1 + (startup_slow - startup_fast) / (step_fast_start - step_slow_start) steps if its steps are
  faster; otherwise never.
- weak-scaling efficiency: tokens/s per device at N / at the smallest N; strong: speed-up / (N / N_min).
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any, Dict, List, Optional, Sequence

from launch.config.contenders import BUILTIN_ORDER
from launch.core import attention

# Keys of data that make a cell's shapes dynamic; a static partner differs from it only in these.
SHAPE_KEYS = ("seq_lens", "seq_len_dist", "pad_to")


def break_even(startup_a: float, step_a: float, startup_b: float, step_b: float) -> Dict[str, Any]:
    """Which of a/b has the larger start-up cost and after how many steps it catches up (or never)."""
    slow_is_a = startup_a >= startup_b
    s_up, s_step, o_up, o_step = (startup_a, step_a, startup_b, step_b) if slow_is_a else (startup_b, step_b, startup_a, step_a)
    if s_step >= o_step:
        n: Any = "never"
    else:
        n = max(1, math.ceil(1 + (s_up - o_up) / (o_step - s_step)))
    return {"slower_start": "a" if slow_is_a else "b", "steps": n}


def wall_time(startup: float, step: float, n: int) -> float:
    return startup + (n - 1) * step


def ok(r: Dict[str, Any]) -> bool:
    return r["status"] == "ok" and bool(r.get("tokens_per_s"))


def step_time(r: Dict[str, Any]) -> float:
    return r.get("step_time_mean_s") or r["step_time_p50_s"]


def contender_order(rows: Sequence[Dict[str, Any]], listed: Sequence[str] = ()) -> List[str]:
    """The contenders of the rows: those the sweep listed first (its order), then built-ins, then the rest by name."""
    present = {r["contender"] for r in rows}
    rank: Dict[str, int] = {}
    for name in [*listed, *BUILTIN_ORDER]:
        rank.setdefault(name, len(rank))  # the first place a name has wins (a listed built-in keeps its place)
    return sorted(present, key=lambda n: (rank.get(n, len(rank)), n))


def kernel_note(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """Which attention kernels two compared cells ran (their start records' settings, `launch.core.attention`)
    and whether they are of different classes (fused vs dense): then their ratio is partly the kernel."""
    na, nb = a.get("contender") or a["framework"], b.get("contender") or b["framework"]
    sa, sb = (a.get("_start") or {}).get("settings"), (b.get("_start") or {}).get("settings")
    ka, kb = attention.from_settings(sa), attention.from_settings(sb)
    return {"kernels": {na: ka.label if ka else None, nb: kb.label if kb else None},
            "different_classes": bool(ka and kb and ka.kind != kb.kind),
            "note": attention.pair_note(na, sa, nb, sb)}


def pair_notes(a: Dict[str, Any], b: Dict[str, Any], kernels: Dict[str, Any]) -> List[str]:
    """Notes about what differs between the two cells of a pair besides the contender (shown under the
    pair, kept in report.json): facts a reader needs before taking the ratio as a framework difference,
    e.g. that the two ran attention kernels of different classes."""
    note = kernels.get("note")
    return [note[0].upper() + note[1:]] if note else []


def loss_gap(a: Dict[str, Any], b: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Largest relative difference of two cells' losses over the steps both logged (same rows)."""
    la, lb = dict(a.get("_loss") or []), dict(b.get("_loss") or [])
    common = sorted(set(la) & set(lb))
    common = [s for s in common if la[s] is not None and lb[s] is not None]
    if not common:
        return None
    gaps = [abs(la[s] - lb[s]) / max(abs(lb[s]), 1e-12) for s in common]
    return {"steps_compared": len(common), "max_rel_diff": max(gaps)}


def compare_pair(a: Dict[str, Any], b: Dict[str, Any], horizon: int) -> Dict[str, Any]:
    """Contender a against contender b, both finished cells of one device count and variant."""
    na, nb = a["contender"], b["contender"]
    sa, sb = step_time(a), step_time(b)
    kernels = kernel_note(a, b)
    be = break_even(a["time_to_first_step_s"], sa, b["time_to_first_step_s"], sb)
    return {
        "devices": a["devices"], "variant": a["variant"] or None, "a": na, "b": nb,
        "cells": {na: a["cell"], nb: b["cell"]},
        "throughput_ratio": a["tokens_per_s"] / b["tokens_per_s"],
        "tokens_per_s": {na: a["tokens_per_s"], nb: b["tokens_per_s"]},
        "startup_s": {na: a["time_to_first_step_s"], nb: b["time_to_first_step_s"]},
        "compile_s": {na: a.get("compile_s"), nb: b.get("compile_s")},
        "compiles": {na: a.get("compiles"), nb: b.get("compiles")},
        "step_time_s": {na: sa, nb: sb},
        "break_even": {"slower_start": na if be["slower_start"] == "a" else nb, "steps": be["steps"]},
        "wall_time_s": {na: wall_time(a["time_to_first_step_s"], sa, horizon),
                        nb: wall_time(b["time_to_first_step_s"], sb, horizon)},
        "loss_gap": loss_gap(a, b),
        "attention": kernels,
        "notes": pair_notes(a, b, kernels),
    }


def efficiency(rows: Sequence[Dict[str, Any]], scaling: str) -> Dict[str, Dict[int, float]]:
    """Per contender: scaling efficiency at each device count against its smallest one."""
    out: Dict[str, Dict[int, float]] = {}
    for name in sorted({r["contender"] for r in rows if ok(r)}):
        mine = sorted((r for r in rows if ok(r) and r["contender"] == name), key=lambda r: r["devices"])
        base = mine[0]
        eff = {}
        for r in mine:
            if scaling == "weak":
                eff[r["devices"]] = r["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
            else:
                eff[r["devices"]] = (r["tokens_per_s"] / base["tokens_per_s"]) / (r["devices"] / base["devices"])
        out[name] = eff
    return out


def _winner(cells: List[Dict[str, Any]], horizon: int) -> Optional[Dict[str, Any]]:
    if len(cells) < 2:
        return None
    ranked = sorted(cells, key=lambda r: wall_time(r["time_to_first_step_s"], step_time(r), horizon))
    w, r = ranked[0], ranked[1]
    tw = wall_time(w["time_to_first_step_s"], step_time(w), horizon)
    tr = wall_time(r["time_to_first_step_s"], step_time(r), horizon)
    return {"winner": w["contender"], "runner_up": r["contender"], "speedup": tr / tw,
            "wall_time_s": {c["contender"]: wall_time(c["time_to_first_step_s"], step_time(c), horizon) for c in ranked}}


def headline(rows: Sequence[Dict[str, Any]], horizon: int) -> Dict[int, Dict[str, Any]]:
    """Per device count: who finishes a `horizon`-step run first and by how much (runner-up's wall time
    / winner's), over every contender and over those without torch.compile (`without` is null when no
    contender there used torch.compile, or fewer than two are left)."""
    out: Dict[int, Dict[str, Any]] = {}
    for d in sorted({r["devices"] for r in rows if ok(r)}):
        cells = [r for r in rows if ok(r) and r["devices"] == d]
        every = _winner(cells, horizon)
        if every is None:
            continue
        plain = [r for r in cells if not r["torch_compile"]]
        out[d] = {"with": every, "without": _winner(plain, horizon) if len(plain) < len(cells) else None}
    return out


def derive(rows: List[Dict[str, Any]], scaling: str, horizon: int, order: Sequence[str],
           base_variant: str) -> Dict[str, Any]:
    """Efficiency and headline over the `base_variant` cells (the sweep's first sweep.extra combination),
    pairs for every variant."""
    base = [r for r in rows if r["variant"] == base_variant]
    rank = {name: i for i, name in enumerate(order)}
    pairs = []
    variants = [base_variant] + sorted({r["variant"] for r in rows} - {base_variant})
    for v in variants:
        for d in sorted({r["devices"] for r in rows}):
            cells = sorted((r for r in rows if ok(r) and r["variant"] == v and r["devices"] == d),
                           key=lambda r: rank.get(r["contender"], len(rank)))
            for a, b in itertools.combinations(cells, 2):
                pairs.append(compare_pair(a, b, horizon))
    return {"scaling": scaling, "horizon_steps": horizon, "variant": base_variant or None, "contenders": list(order),
            "efficiency": efficiency(base, scaling), "headline": headline(base, horizon), "pairs": pairs}


def compile_costs(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per cell that reached a summary: the train step's compiles (count, seconds, recompiles), what the
    framework counted (torch.compile graphs and graph breaks; JAX persistent-cache hits and misses), the
    compiles outside the train step, and the warm-up steps' excess over the steady median."""
    out = []
    for r in rows:
        if r.get("compiles") is None and r.get("compile_s") is None:
            continue
        out.append({k: r.get(k) for k in ("cell", "contender", "devices", "variant", "compiles", "compile_s",
                                           "recompiles", "graphs", "graph_breaks", "cache_hits", "cache_misses",
                                           "other_compiles", "other_compile_s", "warmup_excess_s",
                                           "time_to_first_step_s")})
    return out


def checkpoint_costs(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per cell that saved: the saves' blocking time, the final wait, the throughput the loop kept with
    the saves (loop tokens/s, saves included / steady tokens/s) and how much slower the steps after the
    first save were than those before (1.0: not at all)."""
    out = []
    for r in rows:
        if not r.get("checkpoint_saves"):
            continue
        kept = (r["loop_tokens_per_s"] / r["tokens_per_s"]) if r.get("loop_tokens_per_s") and r.get("tokens_per_s") else None
        out.append({"cell": r["cell"], "contender": r["contender"], "devices": r["devices"],
                    "saves": r["checkpoint_saves"], "blocked_s": r.get("checkpoint_blocked_s"),
                    "wait_s": r.get("checkpoint_wait_s"), "throughput_kept": kept,
                    "post_save_step_ratio": r.get("post_save_step_ratio"),
                    "async": (r["_cfg"].get("checkpoint") or {}).get("async")})
    return out


def _shape_ident(r: Dict[str, Any]) -> str:
    cfg = r["_cfg"]
    data = {k: v for k, v in (cfg.get("data") or {}).items() if k not in SHAPE_KEYS}
    return json.dumps([r["contender"], r["devices"], cfg.get("model"), cfg.get("train"), data], sort_keys=True, default=str)


def dynamic_shapes(rows: Sequence[Dict[str, Any]], horizon: int) -> List[Dict[str, Any]]:
    """Each finished cell with data.seq_lens against the static cell (no seq_lens) of the same contender,
    device count and everything else: compiles, compile seconds, steady and wall-clock real tokens/s,
    padding, and after how many steps' worth of the static cell's tokens the dynamic one catches up
    (time per real token; start-up + the compiles after the first step as its start-up cost)."""
    static = {_shape_ident(r): r for r in rows if ok(r) and not (r["_cfg"].get("data") or {}).get("seq_lens")}
    out = []
    for r in rows:
        data = r["_cfg"].get("data") or {}
        if not data.get("seq_lens") or r["status"] != "ok":
            continue
        s = static.get(_shape_ident(r))
        entry = {"cell": r["cell"], "contender": r["contender"], "devices": r["devices"],
                 "seq_lens": list(data["seq_lens"]), "seq_len_dist": data.get("seq_len_dist", "choice"),
                 "pad_to": list(data.get("pad_to") or []), "compiles": r.get("compiles"),
                 "recompiles": r.get("recompiles"), "compile_s": r.get("compile_s"),
                 "tokens_per_s": r.get("tokens_per_s"), "loop_tokens_per_s": r.get("loop_tokens_per_s"),
                 "seq_len_mean": r.get("seq_len_mean"), "padding_share": r.get("padding_share"),
                 "static_cell": s["cell"] if s else None, "static_tokens_per_s": s["tokens_per_s"] if s else None,
                 "static_compile_s": s.get("compile_s") if s else None, "break_even": None}
        if s and r.get("tokens_per_s"):
            per_step = s["tokens_per_s"] * step_time(s)  # real tokens of one static step
            later = r.get("later_compile_s") or 0.0
            be = break_even(r["time_to_first_step_s"] + later, per_step / r["tokens_per_s"],
                            s["time_to_first_step_s"], step_time(s))
            entry["break_even"] = {"slower_start": r["cell"] if be["slower_start"] == "a" else s["cell"],
                                   "steps": be["steps"], "static_steps_of_tokens": True}
        out.append(entry)
    return sorted(out, key=lambda e: (e["contender"], e["devices"], e["cell"]))

"""`python -m bench.contenders [--repeats N] [--steps N] [--record] [--json]`: issue 26's comparison.

JAX against eager PyTorch and PyTorch with torch.compile, on `model=small`, 1 device, fp32, with static
shapes (every step model.seq_len = 256 tokens) and dynamic ones (`data.seq_lens=[64,128,192,256]`,
each step's length drawn from (seed, step)). Each contender handles the dynamic shapes the way its
users would:

    static    jax, torch (eager), torch-compile
    dynamic   jax (a compile per new length), jax-buckets (`data.pad_to=[128,256]`: two programs,
              padding masked out of the loss), torch (eager, as is), torch-compile (torch's default:
              static, then dynamic once a shape changed), torch-compile-dynamic
              (`torch.compile_dynamic=true`)

Every repeat runs the eight cells as real `scaleout run` cells, interleaved (their order rotates from
repeat to repeat), each with a cold compile cache of its own: `jax.compilation_cache=false`, and a fresh
`TORCHINDUCTOR_CACHE_DIR` (Inductor's FX graph cache would otherwise make every torch.compile after the
first a cache hit). Each ratio is the median over the repeats of the ratio of two cells of the same
repeat; absolute figures are medians of the cells. As in `bench.workloads`, the machine is shared: each
cell records the share of the host's cores other processes used while it ran, waits for a quiet moment
first, and is run again (up to `--retries`) when others used more than `--max-others`.

Keys (`fw` a contender, `shape` static or dynamic):
- `tokens_per_s_<fw>_<shape>`: steady real tokens/s (after the warm-up, steps that compiled left out);
  `loop_tokens_per_s_<fw>_<shape>`: over the loop's wall clock, compiles during steps included;
- `compile_s_<fw>_<shape>`, `compiles_<fw>_<shape>`, `ttfs_<fw>_<shape>` (time to first step);
- ratios `jax_over_torch_static`, `jax_over_torch-compile_static`, `torch-compile_over_torch_static` (steady
  tokens/s) and `..._dynamic` (jax-buckets for JAX, torch-compile-dynamic for torch.compile, wall-clock
  tokens/s: what a dynamic-shape run delivers compiles included); `dynamic_over_static_<fw>` per contender
  (wall-clock tokens/s of the dynamic cell / steady tokens/s of the static cell).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

from bench.__main__ import append_history, heading, log, machine_line, median, trainer
from bench.workloads import children_cpu_s, cpu_busy_s, drive, others_share, wait_quiet

SEQ_LENS = "[64,128,192,256]"
BUCKETS = "[128,256]"
CUSTOM = ("sweep.custom_contenders={jax-buckets: {framework: jax, data.pad_to: " + BUCKETS + "}, "
          "torch-compile-dynamic: {framework: torch, torch.compile: true, torch.compile_dynamic: true}}")
CELLS: Tuple[Tuple[str, str], ...] = (  # (contender, shape)
    ("jax", "static"), ("torch", "static"), ("torch-compile", "static"),
    ("jax", "dynamic"), ("jax-buckets", "dynamic"), ("torch", "dynamic"), ("torch-compile", "dynamic"),
    ("torch-compile-dynamic", "dynamic"))
RATIOS = (  # (key, numerator cell, denominator cell, field of each)
    ("jax_over_torch_static", ("jax", "static"), ("torch", "static"), "tokens_per_s"),
    ("jax_over_torch-compile_static", ("jax", "static"), ("torch-compile", "static"), "tokens_per_s"),
    ("torch-compile_over_torch_static", ("torch-compile", "static"), ("torch", "static"), "tokens_per_s"),
    ("jax_over_torch_dynamic", ("jax-buckets", "dynamic"), ("torch", "dynamic"), "loop_tokens_per_s"),
    ("jax_over_torch-compile_dynamic", ("jax-buckets", "dynamic"), ("torch-compile-dynamic", "dynamic"),
     "loop_tokens_per_s"),
    ("torch-compile_over_torch_dynamic", ("torch-compile-dynamic", "dynamic"), ("torch", "dynamic"),
     "loop_tokens_per_s"),
)
STATIC_OF = {"jax": "jax", "jax-buckets": "jax", "torch": "torch", "torch-compile": "torch-compile",
             "torch-compile-dynamic": "torch-compile"}


def overrides(contender: str, shape: str, steps: int) -> List[str]:
    out = ["model=small", "devices=1", f"train.steps={steps}", "train.warmup_exclude=3", "checkpoint.every=0",
           "jax.compilation_cache=false", CUSTOM, f"contender={contender}"]
    if shape == "dynamic":
        out.append(f"data.seq_lens={SEQ_LENS}")
    return out


def run(repeats: int, steps: int, work: Path, max_others: float = 1.0, retries: int = 0,
        patience_s: float = 120.0) -> Dict[str, Any]:
    cells: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    others: List[float] = []
    rerun = disturbed = 0
    waited = 0.0
    for r in range(repeats):
        k = (3 * r) % len(CELLS)  # rotate the order from repeat to repeat
        order = CELLS[k:] + CELLS[:k]
        for contender, shape in order:
            for attempt in range(retries + 1):
                if max_others < 1.0:
                    waited += wait_quiet(max_others, patience_s)
                log(f"repeat {r + 1}/{repeats}: {contender} {shape}" + (f" (attempt {attempt + 1})" if attempt else ""))
                cache = work / "inductor" / f"{contender}-{shape}-{r}-a{attempt}"  # cold: a fresh Inductor cache
                b0, c0, t0 = cpu_busy_s(), children_cpu_s(), time.perf_counter()
                s = trainer(work, f"{contender}-{shape}-{r}-a{attempt}", *overrides(contender, shape, steps),
                            env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
                s["others_cpu_share"] = others_share(b0, c0, t0)
                if s["others_cpu_share"] <= max_others:
                    break
                log(f"  other processes used {100 * s['others_cpu_share']:.0f} % of the cores meanwhile")
                if attempt < retries:
                    rerun += 1
                else:
                    disturbed += 1
            others.append(s["others_cpu_share"])
            cells.setdefault((contender, shape), []).append(s)
    res: Dict[str, Any] = {"repeats": repeats, "steps": steps, "seq_lens": SEQ_LENS, "buckets": BUCKETS,
                           "others_cpu_share_median": median(others), "others_cpu_share_max": max(others),
                           "max_others": max_others, "cells_rerun": rerun, "cells_disturbed": disturbed,
                           "quiet_wait_s": round(waited, 1)}
    raw: Dict[str, Any] = {}

    def div(n: Any, m: Any) -> float:
        return n / m if n is not None and m else float("nan")

    for (contender, shape), runs in cells.items():
        tag = f"{contender}_{shape}"
        for key, field in (("tokens_per_s", "tokens_per_s"), ("loop_tokens_per_s", "loop_tokens_per_s"),
                           ("compile_s", "compile_s"), ("compiles", "compiles"), ("recompiles", "recompiles"),
                           ("ttfs", "time_to_first_step_s"), ("padding_share", "padding_share")):
            values = [x.get(field) for x in runs]
            if all(v is not None for v in values):
                res[f"{key}_{tag}"] = median(values)
                raw[f"{key}_{tag}"] = [round(v, 3) for v in values]
        raw[f"others_cpu_share_{tag}"] = [round(x["others_cpu_share"], 3) for x in runs]
    for key, a, b, field in RATIOS:
        xs = [div(x[field], y[field]) for x, y in zip(cells[a], cells[b])]
        res[key], raw[key] = median(xs), [round(x, 4) for x in xs]
    for contender, shape in CELLS:
        if shape == "dynamic":
            static = cells[(STATIC_OF[contender], "static")]
            xs = [div(x["loop_tokens_per_s"], y["tokens_per_s"]) for x, y in zip(cells[(contender, shape)], static)]
            res[f"dynamic_over_static_{contender}"], raw[f"dynamic_over_static_{contender}"] = median(xs), [round(x, 4) for x in xs]
    res["raw"] = raw
    return res


def _f(res: Dict[str, Any], key: str, fmt: str = ".0f") -> str:
    v = res.get(key)
    return "-" if v is None else format(v, fmt)


def tables(res: Dict[str, Any]) -> List[str]:
    lines = ["| contender | shapes | tokens/s (steady) | tokens/s (wall clock) | compiles | compile s | first step s | vs its static cell |",
             "|---|---|---|---|---|---|---|---|"]
    for contender, shape in CELLS:
        tag = f"{contender}_{shape}"
        vs = _f(res, f"dynamic_over_static_{contender}", ".3f") if shape == "dynamic" else ""
        lines.append(f"| {contender} | {shape} | {_f(res, f'tokens_per_s_{tag}')} | {_f(res, f'loop_tokens_per_s_{tag}')} | "
                     f"{_f(res, f'compiles_{tag}')} | {_f(res, f'compile_s_{tag}', '.1f')} | {_f(res, f'ttfs_{tag}', '.1f')} | {vs} |")
    lines += ["", "| ratio | median | per repeat |", "|---|---|---|"]
    for key, *_ in RATIOS:
        lines.append(f"| `{key}` | **{res[key]:.3f}** | {', '.join(f'{x:.3f}' for x in res['raw'][key])} |")
    return lines


def record(res: Dict[str, Any], argv: List[str]) -> None:
    gate = "" if res["max_others"] >= 1.0 else (
        f"each cell waited for a quiet moment and a cell during which other processes used more than "
        f"{100 * res['max_others']:.0f} % of the cores was run again ({res['cells_rerun']} reruns, "
        f"{res['cells_disturbed']} cells still above that kept, {res['quiet_wait_s']:.0f} s waited); ")
    lines = [heading(f"python -m bench.contenders {' '.join(argv)}".rstrip()),
             machine_line() + f". `model=small`, 1 device, fp32, global batch 8; static: 256 tokens per row; dynamic: "
             f"`data.seq_lens={res['seq_lens']}` (jax-buckets: `data.pad_to={res['buckets']}`); medians of "
             f"{res['repeats']} repeats, {res['steps']} steps each (first 3 and steps that compiled left out of the "
             f"steady state); cells interleaved, their order rotated from repeat to repeat, cold compile caches. The 2 "
             f"cores were shared: {gate}other processes used {100 * res['others_cpu_share_median']:.0f} % of them "
             f"during the median kept cell, {100 * res['others_cpu_share_max']:.0f} % during the worst; "
             f"{res['seconds']:.0f} s in all.\n", *tables(res), ""]
    append_history(lines)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.contenders", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="steps per cell; the first 3 are left out of the steady state")
    ap.add_argument("--max-others", type=float, default=0.1, metavar="SHARE",
                    help="run a cell again when other processes used more than this share of the host's cores "
                         "while it ran, and wait for such a quiet moment before each cell (1: off)")
    ap.add_argument("--retries", type=int, default=2, help="reruns per cell at most (then the cell is kept)")
    ap.add_argument("--record", action="store_true", help="append the result to BENCHMARKS.md")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (always kept when a cell fails)")
    args = ap.parse_args(argv)
    if args.steps < 8:
        ap.error("--steps must be at least 8 (3 warm-up steps and the dynamic cells' compile steps are left out)")
    return drive("scaleout-contenders-", lambda work: run(args.repeats, args.steps, work, args.max_others, args.retries),
                 args, argv, record, tables)

if __name__ == "__main__":
    sys.exit(main())

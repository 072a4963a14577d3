"""`python -m bench.workloads [--repeats N] [--steps N] [--record] [--json]`: issue 15's two workloads.

What packed documents (`model.attention=document`) and the hand-written RMSNorm backward
(`model.norm_impl=custom`) cost in each framework, on `model=small`, 1 device, fp32. Every repeat runs
the six cells jax/torch x (causal, native), (document, native), (causal, custom) as real `scaleout run`
cells, interleaved (framework by framework inside each workload; the order of the workloads and of
the frameworks rotates from repeat to repeat), so each ratio compares two cells run side by side in
the same repeat; every figure is the median over the repeats of those per-repeat ratios (absolute
times: the median of the cells). These machines are shared, and eager PyTorch in particular slows
down several-fold when another process takes one of its cores, so each cell records
`others_cpu_share`, the share of the host's cores that other processes used while it ran (from
/proc/stat); before each cell the bench waits (up to 2 minutes) for a quiet moment, and a cell
during which others used more than `--max-others` (10 %) is run again, up to `--retries` times.

Keys, per framework `fw`:
- `doc_over_causal_fw`: steady-state `tokens_per_s` (mean step time), document / causal; the
  `_p50` variant uses the median step time instead (less sensitive to a busy neighbour on the host);
- `compile_s_{causal,document}_fw`, `compile_doc_over_causal_fw`; `ttfs_{causal,document}_fw`
  (time to first step, from process start);
- `custom_over_native_fw` (and `_p50`), `compile_s_custom_fw`, `compile_custom_over_native_fw`,
  `ttfs_custom_fw`.
A JAX `compile_s` is the ahead-of-time compile before the first step; a PyTorch one is
torch.compile's (Dynamo's own records, inside the first step) with `torch.compile=true`, and 0 with
the default (eager: nothing compiles; the compile ratios are then undefined). `--set KEY=VALUE` adds
an override to every cell (e.g. `--set torch.compile=true`).

--record appends the result (command, machine, versions, date) to the history in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

from bench.__main__ import append_history, heading, log, machine_line, median, trainer

FRAMEWORKS = ("jax", "torch")
WORKLOADS: Tuple[Tuple[str, str, str], ...] = (  # (label, model.attention, model.norm_impl)
    ("causal", "causal", "native"), ("document", "document", "native"), ("custom", "causal", "custom"))


def cpu_busy_s() -> float:
    """CPU seconds all processes on this host have used (from /proc/stat; 0 where there is none)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def others_share(busy0: float, own0: float, t0: float) -> float:
    """The share of the host's cores that processes other than ours used since (busy0, own0, t0)."""
    others = (cpu_busy_s() - busy0) - (children_cpu_s() - own0)
    return max(0.0, others) / ((os.cpu_count() or 1) * (time.perf_counter() - t0))


def wait_quiet(limit: float, patience_s: float) -> float:
    """Wait (up to patience_s) for a 2-second window in which other processes use at most `limit`
    of the cores; returns the seconds waited."""
    t_start = time.perf_counter()
    while True:
        b0, c0, t0 = cpu_busy_s(), children_cpu_s(), time.perf_counter()
        time.sleep(2.0)
        if others_share(b0, c0, t0) <= limit or time.perf_counter() - t_start > patience_s:
            return time.perf_counter() - t_start


def run(repeats: int, steps: int, extra: List[str], work: Path, max_others: float = 1.0, retries: int = 0,
        patience_s: float = 120.0) -> Dict[str, Any]:
    """Run the cells. A cell during which other processes used more than `max_others` of the cores is
    run again, up to `retries` times (then the last attempt is kept and counted as disturbed); before
    every cell we wait up to `patience_s` for a quiet moment."""
    base = ["model=small", "devices=1", f"train.steps={steps}", "train.warmup_exclude=3", "checkpoint.every=0",
            "jax.compilation_cache=false", *extra]
    cells: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    others: List[float] = []  # per kept cell: the share of the host's cores other processes used meanwhile
    rerun = disturbed = 0
    waited = 0.0
    for r in range(repeats):
        # rotate the order from repeat to repeat, so no workload or framework always runs first
        order = WORKLOADS[r % len(WORKLOADS):] + WORKLOADS[:r % len(WORKLOADS)]
        fws = FRAMEWORKS if r % 2 == 0 else FRAMEWORKS[::-1]
        for label, attention, norm in order:
            for fw in fws:
                for attempt in range(retries + 1):
                    if max_others < 1.0:
                        waited += wait_quiet(max_others, patience_s)
                    log(f"repeat {r + 1}/{repeats}: {fw} {label}" + (f" (attempt {attempt + 1})" if attempt else ""))
                    b0, c0, t0 = cpu_busy_s(), children_cpu_s(), time.perf_counter()
                    s = trainer(work, f"{fw}-{label}-{r}-a{attempt}", f"framework={fw}", *base,
                                f"model.attention={attention}", f"model.norm_impl={norm}")
                    s["others_cpu_share"] = others_share(b0, c0, t0)
                    if s["others_cpu_share"] <= max_others:
                        break
                    log(f"  other processes used {100 * s['others_cpu_share']:.0f} % of the cores meanwhile")
                    if attempt < retries:
                        rerun += 1
                    else:
                        disturbed += 1
                others.append(s["others_cpu_share"])
                cells.setdefault((fw, label), []).append(s)
    res: Dict[str, Any] = {"repeats": repeats, "steps": steps, "overrides": extra,
                           "others_cpu_share_median": median(others), "others_cpu_share_max": max(others),
                           "max_others": max_others, "cells_rerun": rerun, "cells_disturbed": disturbed,
                           "quiet_wait_s": round(waited, 1)}
    raw: Dict[str, Any] = {}
    for fw in FRAMEWORKS:
        c, d, u = cells[(fw, "causal")], cells[(fw, "document")], cells[(fw, "custom")]

        def ratios(a: List[Dict[str, Any]], b: List[Dict[str, Any]], key: str, inverse: bool = False) -> List[float]:
            def div(n: Any, m: Any) -> float:
                return n / m if n is not None and m else float("nan")
            return [div(y[key], x[key]) if inverse else div(x[key], y[key]) for x, y in zip(a, b)]

        per = {
            "doc_over_causal": ratios(d, c, "tokens_per_s"),
            "doc_over_causal_p50": ratios(d, c, "step_time_p50_s", inverse=True),
            "compile_doc_over_causal": ratios(d, c, "compile_s"),
            "custom_over_native": ratios(u, c, "tokens_per_s"),
            "custom_over_native_p50": ratios(u, c, "step_time_p50_s", inverse=True),
            "compile_custom_over_native": ratios(u, c, "compile_s"),
        }
        for key, xs in per.items():
            res[f"{key}_{fw}"] = median(xs)
            raw[f"{key}_{fw}"] = [round(x, 4) for x in xs]
        for label, runs in (("causal", c), ("document", d), ("custom", u)):
            res[f"tokens_per_s_{label}_{fw}"] = median([s["tokens_per_s"] for s in runs])
            res[f"compile_s_{label}_{fw}"] = median([s["compile_s"] for s in runs])
            res[f"ttfs_{label}_{fw}"] = median([s["time_to_first_step_s"] for s in runs])
            raw[f"tokens_per_s_{label}_{fw}"] = [round(s["tokens_per_s"], 1) for s in runs]
            raw[f"compile_s_{label}_{fw}"] = [round(s["compile_s"], 3) for s in runs]
            raw[f"others_cpu_share_{label}_{fw}"] = [round(s["others_cpu_share"], 3) for s in runs]
        res[f"mask_impl_{fw}"] = d[0]["settings"].get("document_mask_impl", "dot_product_attention" if fw == "jax" else "?")
    res["torch_compile"] = torch_compile(extra)
    res["raw"] = raw
    return res


def torch_compile(extra: List[str]) -> bool:
    for o in reversed(extra):
        if o.startswith("torch.compile="):
            return o.split("=", 1)[1].strip().lower() in ("true", "1", "yes")
    from launch.config.schema import TorchConfig
    return bool(TorchConfig().compile)


def tables(res: Dict[str, Any]) -> List[str]:
    lines = ["| framework | mask | causal tokens/s | document tokens/s | document / causal (p50) | compile s causal → document (ratio) | first step s causal → document |",
             "|---|---|---|---|---|---|---|"]
    for fw in FRAMEWORKS:
        lines.append(
            f"| {fw} | {res[f'mask_impl_{fw}']} | {res[f'tokens_per_s_causal_{fw}']:.0f} | {res[f'tokens_per_s_document_{fw}']:.0f} | "
            f"**{res[f'doc_over_causal_{fw}']:.3f}** ({res[f'doc_over_causal_p50_{fw}']:.3f}) | "
            f"{res[f'compile_s_causal_{fw}']:.2f} → {res[f'compile_s_document_{fw}']:.2f} ({res[f'compile_doc_over_causal_{fw}']:.2f}) | "
            f"{res[f'ttfs_causal_{fw}']:.2f} → {res[f'ttfs_document_{fw}']:.2f} |")
    lines += ["", "| framework | native tokens/s | custom tokens/s | custom / native (p50) | compile s native → custom (ratio) | first step s native → custom |",
              "|---|---|---|---|---|---|"]
    for fw in FRAMEWORKS:
        lines.append(
            f"| {fw} | {res[f'tokens_per_s_causal_{fw}']:.0f} | {res[f'tokens_per_s_custom_{fw}']:.0f} | "
            f"**{res[f'custom_over_native_{fw}']:.3f}** ({res[f'custom_over_native_p50_{fw}']:.3f}) | "
            f"{res[f'compile_s_causal_{fw}']:.2f} → {res[f'compile_s_custom_{fw}']:.2f} ({res[f'compile_custom_over_native_{fw}']:.2f}) | "
            f"{res[f'ttfs_causal_{fw}']:.2f} → {res[f'ttfs_custom_{fw}']:.2f} |")
    return lines


def record(res: Dict[str, Any], argv: List[str]) -> None:
    mode = "torch.compile=true (lazy compile inside the first step)" if res["torch_compile"] else \
        "torch.compile=false (eager: no compile, compile_s 0)"
    raw = res["raw"]
    gate = "" if res["max_others"] >= 1.0 else (
        f"each cell waited for a quiet moment and a cell during which other processes used more than "
        f"{100 * res['max_others']:.0f} % of the cores was run again ({res['cells_rerun']} reruns, "
        f"{res['cells_disturbed']} cells still above that kept, {res['quiet_wait_s']:.0f} s waited); ")
    spread = "; ".join(f"`{k}` {', '.join(f'{x:.3f}' for x in raw[k])}"
                       for k in raw if k.startswith(("doc_over_causal_", "custom_over_native_")) and "_p50" not in k)
    lines = [heading(f"python -m bench.workloads {' '.join(argv)}".rstrip()),
             machine_line() + f". `model=small`, 1 device, fp32, global batch 8 x 256 tokens; medians of "
             f"{res['repeats']} repeats, {res['steps']} steps each (first 3 left out of the steady state); cells "
             f"interleaved, their order rotated from repeat to repeat. The 2 cores were shared: {gate}other processes "
             f"used {100 * res['others_cpu_share_median']:.0f} % of them during the median kept cell, "
             f"{100 * res['others_cpu_share_max']:.0f} % during the worst; {res['seconds']:.0f} s in all. PyTorch: {mode}; document mask ran as "
             f"`{res['mask_impl_torch']}` (`torch.document_mask_impl=auto`: torch 2.13's CPU build has no "
             f"flex_attention backward). JAX: `jax.nn.dot_product_attention` with a dense segment mask.\n",
             *tables(res),
             f"\nPer-repeat ratios: {spread}.\n"]
    append_history(lines)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.workloads", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="steps per cell; the first 3 are left out of the steady state")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra config override for every cell (repeatable), e.g. torch.compile=true")
    ap.add_argument("--max-others", type=float, default=0.1, metavar="SHARE",
                    help="run a cell again when other processes used more than this share of the host's cores "
                         "while it ran, and wait for such a quiet moment before each cell (1: off)")
    ap.add_argument("--retries", type=int, default=3, help="reruns per cell at most (then the cell is kept)")
    ap.add_argument("--record", action="store_true", help="append the result to BENCHMARKS.md")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (always kept when a cell fails)")
    args = ap.parse_args(argv)
    if args.steps < 5:
        ap.error("--steps must be at least 5 (3 warm-up steps are left out)")
    return drive("scaleout-workloads-", lambda work: run(args.repeats, args.steps, args.set, work, args.max_others,
                                                       args.retries), args, argv, record, tables)


def drive(prefix: str, go, args, argv, record_fn, tables_fn) -> int:
    """A side-by-side benchmark's frame: a scratch directory, `go(work)` -> the result, the load before and
    after, the result recorded (--record) and printed (--json or tables); the directory kept on a failure."""
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix=prefix))
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    try:
        res = go(work)
    except Exception:
        log(f"a cell failed; its run directory is kept under {work / 'runs'}")
        raise
    res["load_before"], res["load_after"] = load_before, " ".join(f"{x:.1f}" for x in os.getloadavg())
    res["seconds"] = round(time.time() - t0, 1)
    if args.keep:
        log(f"run directories kept under {work / 'runs'}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if args.record:
        record_fn(res, sys.argv[1:] if argv is None else argv)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print("\n".join(tables_fn(res)))
        print(f"({res['seconds']:.0f} s)")
    return 0

if __name__ == "__main__":
    sys.exit(main())

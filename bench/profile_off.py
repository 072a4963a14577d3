"""Does profiling cost anything when it is off? And what does a traced step cost when it is on?

`python -m bench.profile_off [--base REF] [--repeats N] [--steps N] [--record] [--json]` runs
`small` on 1 device in both frameworks with the code of REF (default: the commit before
`profile.steps` existed, checked out in a temporary git worktree) and with this tree, interleaved
(the order alternates each repeat), `profile` unset in both; each figure is the median over
repeats of the ratio of the two cells run side by side. A third cell per repeat traces steps
8..10 and gives the traced steps' time over the steady-state step time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from bench.__main__ import ROOT, append_history, heading, log, machine_line, median, trainer
from launch.common.files import read_records


def first_profiling_commit() -> str:
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", "launch/profile.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    if not out:
        raise SystemExit("bench.profile_off: launch/profile.py is not in this repository's history; give --base REF.")
    return out[-1] + "^"


def run(base: str, repeats: int, steps: int) -> Dict[str, Any]:
    common = ["model=small", "devices=1", f"train.steps={steps}", "train.warmup_exclude=3", "checkpoint.every=0",
              "jax.compilation_cache=false"]
    raw: Dict[str, List[float]] = {}
    add = lambda key, value: raw.setdefault(key, []).append(value)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="scaleout-bench-prof-") as tmp:
        work, old = Path(tmp), Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), base], cwd=ROOT, check=True, capture_output=True)
        try:
            sha = subprocess.run(["git", "rev-parse", "--short", base], cwd=ROOT, capture_output=True, text=True).stdout.strip()
            for r in range(repeats):
                log(f"repeat {r + 1}/{repeats}: {base} ({sha}) vs this tree, profile unset; then profile.steps=[8,10]")
                for fw in ("jax", "torch"):
                    cells = {}
                    for which in (("base", "now") if r % 2 == 0 else ("now", "base")):
                        env = {"PYTHONPATH": str(old)} if which == "base" else None
                        cells[which] = trainer(work, f"{fw}-{which}-{r}", f"framework={fw}", *common, env=env)
                    add(f"off_loop_{fw}", cells["now"]["loop_tokens_per_s"] / cells["base"]["loop_tokens_per_s"])
                    add(f"off_step_{fw}", cells["now"]["tokens_per_s"] / cells["base"]["tokens_per_s"])
                    name = f"{fw}-on-{r}"
                    on = trainer(work, name, f"framework={fw}", *common, "profile.steps=[8,10]")
                    recs = read_records(work / "runs" / name / f"{fw}-d1" / "metrics.jsonl")
                    traced = [x["step_time_s"] for x in recs if x["kind"] == "step" and x.get("profiled")]
                    prof = next(x for x in recs if x["kind"] == "profile")
                    add(f"on_traced_{fw}", median(traced) / on["step_time_p50_s"])
                    add(f"on_overhead_s_{fw}", prof["overhead_s"])
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)
    res: Dict[str, Any] = {k: median(v) for k, v in raw.items()}
    res.update(base=f"{base} ({sha})", repeats=repeats, steps=steps)
    return res


ROWS = {
    "off_loop": "this tree ÷ base, `loop_tokens_per_s`, profile unset",
    "off_step": "this tree ÷ base, steady-state `tokens_per_s`, profile unset",
    "on_traced": "traced step time ÷ steady step time, profile.steps=[8,10]",
    "on_overhead_s": "seconds to start, stop, write and break down the trace (left out of the loop's rate)",
}


def record(res: Dict[str, Any], argv: List[str]) -> None:
    lines = [heading(f"python -m bench.profile_off {' '.join(argv)}"),
             machine_line() + f". `small`, 1 device, base {res['base']}; medians of {res['repeats']} repeats, "
             f"{res['steps']} steps each.\n", "| figure | jax | torch |", "|---|---|---|"]
    for key, what in ROWS.items():
        lines.append(f"| {what} | {res[f'{key}_jax']:.3f} | {res[f'{key}_torch']:.3f} |")
    append_history(lines + [""])


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_off", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="git ref of the code to compare with (default: the commit before profile.steps)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--record", action="store_true", help="append the result to BENCHMARKS.md")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.steps < 12:
        ap.error("--steps must be at least 12 (3 warm-up steps, steps 8-10 traced, steady steps after them)")
    res = run(args.base or first_profiling_commit(), args.repeats, args.steps)
    if args.record:
        record(res, sys.argv[1:] if argv is None else argv)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for key, what in ROWS.items():
            print(f"{key:14} jax {res[f'{key}_jax']:7.3f}  torch {res[f'{key}_torch']:7.3f}   {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

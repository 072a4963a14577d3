"""`python -m bench [--quick] [--json] [--record]`: scaleout measured against the limits, side by side.

Every figure is the median of several repeats and every ratio compares two things measured in
this run, interleaved (A B A B ...), because these machines are shared and noisy. Trainer figures
come from real `scaleout run` cells (their metrics.jsonl summary); `loop_tokens_per_s` is
wall-clock throughput of the steady steps with checkpoint saves included.

--record appends the result (with command, machine, versions, date) to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {  # key: (comparison, threshold) as issue 8 sets them for this machine
    "overhead_jax": (">=", 0.97), "overhead_torch": (">=", 0.97),
    "mfu_jax": (">=", 0.55), "mfu_torch": (">=", 0.75),
    "compile_depth_ratio": ("<=", 1.5), "cache_ttfs_ratio": ("<=", 0.3),
    "shard_bytes_ratio_jax": ("<=", 1.05), "shard_bytes_ratio_torch": ("<=", 1.05),
    "strong4_jax": (">=", 0.8), "strong4_torch": (">=", 0.6),
    "ckpt_overhead_jax": (">=", 0.95), "ckpt_overhead_torch": (">=", 0.95),
    "jax_over_torch": (None, None),
}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def trainer(work: Path, name: str, *overrides: str, env: Dict[str, str] | None = None) -> Dict[str, Any]:
    """Run one scaleout cell for real and return its last summary."""
    args = [sys.executable, "-m", "launch", "run", f"run.dir={work}/runs", f"checkpoint.dir={work}/ckpt/{name}",
            f"run.name={name}", *overrides]
    p = subprocess.run(args, cwd=work, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if p.returncode:
        raise RuntimeError(f"{name} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    cell = next(l.split("cell ", 1)[1].split(":", 1)[0] for l in p.stdout.splitlines() if l.startswith("[scaleout] cell "))
    recs = [json.loads(l) for l in (work / "runs" / name / cell / "metrics.jsonl").read_text().splitlines()]
    start = next((r for r in recs if r["kind"] == "start"), {})
    return {"settings": start.get("settings", {}), **[r for r in recs if r["kind"] == "summary"][-1]}


def reference(framework: str, steps: int) -> float:
    module = {"jax": "bench.ref_jax", "torch": "bench.ref_torch"}[framework]
    p = subprocess.run([sys.executable, "-m", module, "--preset", "small", "--steps", str(steps)], cwd=ROOT,
                       capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{module} failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["tokens_per_s"]


def median(xs: List[float]) -> float:
    return float(statistics.median(xs))


def compile_depth(repeats: int) -> Dict[str, float]:
    """JAX train-step compile time at 32 vs 4 scanned layers (small width), in a fresh process each."""
    code = r"""
import json, sys, time, tempfile
import jax
from launch import config
from launch.launcher.rundir import cell_config
from jaxrun.train import JaxEngine
layers = int(sys.argv[1])
cfg = cell_config(config.load(["model=small", f"model.n_layers={layers}", "jax.compilation_cache=false",
                               f"checkpoint.dir={tempfile.mkdtemp()}"]), "x")
e = JaxEngine(cfg, None)
print(json.dumps({"compile_s": e.compile()}))
"""
    out: Dict[int, List[float]] = {4: [], 32: []}
    for _ in range(repeats):
        for layers in (4, 32):
            p = subprocess.run([sys.executable, "-c", code, str(layers)], cwd=ROOT, capture_output=True, text=True,
                               env={**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"})
            if p.returncode:
                raise RuntimeError(p.stderr[-2000:])
            out[layers].append(json.loads(p.stdout.strip().splitlines()[-1])["compile_s"])
    return {"compile_s_4": median(out[4]), "compile_s_32": median(out[32]),
            "compile_depth_ratio": median(out[32]) / median(out[4])}


def run(quick: bool) -> Dict[str, Any]:
    repeats = 2 if quick else 3
    steps = 13 if quick else 30
    ckpt_steps = 21 if quick else 41  # async checkpoints at 10, 20 (, 30, 40) inside the timed loop
    small = ["model=small", f"train.steps={steps}", "train.warmup_exclude=3", "checkpoint.every=0", "jax.compilation_cache=false"]
    res: Dict[str, Any] = {}
    raw: Dict[str, List[float]] = {}

    def add(key: str, value: float) -> None:
        raw.setdefault(key, []).append(value)

    with tempfile.TemporaryDirectory(prefix="scaleout-bench-") as tmp:
        work = Path(tmp)
        for r in range(repeats):
            log(f"repeat {r + 1}/{repeats}: 1-device trainers, reference loops, async checkpoints")
            for fw in ("jax", "torch"):
                s = trainer(work, f"{fw}-plain-{r}", f"framework={fw}", "devices=1", *small)
                add(f"loop_tps_{fw}", s["loop_tokens_per_s"])
                add(f"step_tps_{fw}", s["tokens_per_s"])
                add(f"mfu_{fw}", s["mfu"])
                add(f"peak_{fw}", s["peak_flops_per_device"])
                add(f"ref_tps_{fw}", reference(fw, steps - 3))
                s = trainer(work, f"{fw}-ckpt-{r}", f"framework={fw}", "devices=1", *small, "checkpoint.every=10",
                            "checkpoint.async=true", f"train.steps={ckpt_steps}")
                add(f"ckpt_tps_{fw}", s["loop_tokens_per_s"])
            log(f"repeat {r + 1}/{repeats}: 4 simulated devices vs the 1-device run above, same global batch")
            for fw in ("jax", "torch"):
                four = trainer(work, f"{fw}-s4-{r}", f"framework={fw}", "devices=4", *small)
                add(f"strong4_{fw}", four["tokens_per_s"] / raw[f"step_tps_{fw}"][-1])
                w = four["bytes_per_device"]
                add(f"shard_bytes_ratio_{fw}", w["total"] * 4 / (four["params"] * 4 * 4))
        log("persistent compilation cache: cold then warm process")
        for r in range(repeats):
            cache = work / f"cache-{r}"
            cold = trainer(work, f"cache-cold-{r}", "model=small", "train.steps=2", f"jax.cache_dir={cache}", "checkpoint.every=0")
            warm = trainer(work, f"cache-warm-{r}", "model=small", "train.steps=2", f"jax.cache_dir={cache}", "checkpoint.every=0")
            add("cache_ttfs_ratio", warm["time_to_first_step_s"] / cold["time_to_first_step_s"])
            add("ttfs_cold", cold["time_to_first_step_s"])
            add("ttfs_warm", warm["time_to_first_step_s"])
        log("compile time vs depth")
        res.update(compile_depth(1 if quick else repeats))
    for fw in ("jax", "torch"):
        res[f"overhead_{fw}"] = median([a / b for a, b in zip(raw[f"loop_tps_{fw}"], raw[f"ref_tps_{fw}"])])
        res[f"mfu_{fw}"] = median(raw[f"mfu_{fw}"])
        res[f"strong4_{fw}"] = median(raw[f"strong4_{fw}"])
        res[f"shard_bytes_ratio_{fw}"] = median(raw[f"shard_bytes_ratio_{fw}"])
        res[f"ckpt_overhead_{fw}"] = median([a / b for a, b in zip(raw[f"ckpt_tps_{fw}"], raw[f"loop_tps_{fw}"])])
        res[f"tokens_per_s_{fw}"] = median(raw[f"step_tps_{fw}"])
        res[f"reference_tokens_per_s_{fw}"] = median(raw[f"ref_tps_{fw}"])
        res[f"cpu_peak_flops_{fw}"] = median(raw[f"peak_{fw}"])
    res["jax_over_torch"] = median([a / b for a, b in zip(raw["step_tps_jax"], raw["step_tps_torch"])])
    res["cache_ttfs_ratio"] = median(raw["cache_ttfs_ratio"])
    res["ttfs_cold_s"], res["ttfs_warm_s"] = median(raw["ttfs_cold"]), median(raw["ttfs_warm"])
    res["repeats"], res["steps"], res["quick"] = repeats, steps, quick
    return res


def verdicts(res: Dict[str, Any]) -> Dict[str, str]:
    out = {}
    for key, (op, limit) in TARGETS.items():
        if op is None:
            out[key] = "report"
        else:
            ok = res[key] >= limit if op == ">=" else res[key] <= limit
            out[key] = f"{'met' if ok else 'MISSED'} ({op} {limit})"
    return out


def machine() -> Dict[str, Any]:
    import importlib.metadata as md
    versions = {}
    for pkg in ("jax", "flax", "optax", "orbax-checkpoint", "torch", "numpy"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = "-"
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "versions": versions}


def machine_line() -> str:
    """The "Machine: <cpu>, <n> cores, no accelerator; Python ...; <versions>" line of a history entry."""
    m = machine()
    return (f"Machine: {m['cpu']}, {m['cores']} cores, no accelerator; Python {m['python']}; " +
            ", ".join(f"{k} {x}" for k, x in m["versions"].items()))


def heading(command: str) -> str:
    return f"\n## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC — `{command}`\n"


def append_history(lines: List[str]) -> None:
    """Append an entry to the history at the end of BENCHMARKS.md (newest last)."""
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else ""
    marker = "<!-- history: newest last -->"
    if marker not in text:
        text = text.rstrip() + f"\n\n# History\n\n{marker}\n"
    path.write_text(text + "\n".join(lines))


def record(res: Dict[str, Any], argv: List[str]) -> None:
    v = verdicts(res)
    lines = [heading(f"python -m bench {' '.join(argv)}"),
             machine_line() + f". Medians of {res['repeats']} repeats, {res['steps']} steps each.\n",
             "| key | value | target |", "|---|---|---|"]
    for key in TARGETS:
        lines.append(f"| `{key}` | {res[key]:.3f} | {v[key]} |")
    extra = {k: x for k, x in res.items() if k not in TARGETS and k not in ("repeats", "steps", "quick")}
    lines.append("\nAlso measured: " + ", ".join(f"`{k}` {x:.4g}" for k, x in extra.items()) + "\n")
    append_history(lines)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and steps: under 5 minutes on 2 cores")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--record", action="store_true", help="append the result to BENCHMARKS.md")
    args = ap.parse_args(argv)
    t0 = time.time()
    res = run(args.quick)
    res["seconds"] = round(time.time() - t0, 1)
    if args.record:
        record(res, sys.argv[1:] if argv is None else argv)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        v = verdicts(res)
        for key in TARGETS:
            print(f"{key:26} {res[key]:8.3f}  {v[key]}")
        print(f"({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

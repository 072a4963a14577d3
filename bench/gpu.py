"""`python -m bench.gpu [--models 125m,300m] [--steps 40] [--batch 16] [--record]`: the one-GPU check.

Runs `125m` and `300m` in bf16 on one GPU for both frameworks through the local target (a real
`scaleout sweep`; on a host with several GPUs its one-device cells see only the first,
`CUDA_VISIBLE_DEVICES`, so JAX neither opens nor preallocates the others), then prints tokens/s, MFU (against the datasheet peak), compile time, time to
first step and peak device memory per framework, side by side. `--record` appends the table with
the command, the GPU, the versions and the date to BENCHMARKS.md. Refuses, in one sentence, to run
where no NVIDIA GPU is visible: a CPU run is not this benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]


def gpu_name() -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else ""


def run_model(model: str, steps: int, batch: int, root: Path) -> List[Dict[str, Any]]:
    args = [sys.executable, "-m", "launch", "sweep", f"model={model}", "model.dtype=bf16", "sweep.devices=[1]",
            "sweep.frameworks=[jax,torch]", f"train.steps={steps}", f"train.global_batch={batch}",
            "checkpoint.every=0", f"run.dir={root}", f"run.name=gpu-{model}", "report.horizon_steps=10000"]
    p = subprocess.run(args, cwd=ROOT, text=True)
    doc = json.loads((root / f"gpu-{model}" / "report.json").read_text())
    if p.returncode:
        print(f"[bench.gpu] {model}: some cells failed (see {root / f'gpu-{model}'})", file=sys.stderr)
    return [{"model": model, **r} for r in doc["cells"]]


def table(rows: List[Dict[str, Any]]) -> str:
    def f(v, scale=1.0, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v / scale)
    lines = ["| model | framework | status | tokens/s | MFU | compile s | first step s | peak memory GiB | final loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['framework']} | {r['status']} | {f(r['tokens_per_s'], fmt='{:.0f}')} | "
                     f"{f(r['mfu'], 0.01)}% | {f(r['compile_s'])} | {f(r['time_to_first_step_s'])} | "
                     f"{f(r['peak_memory_bytes'], 2**30, '{:.2f}')} | {f(r['final_loss'], fmt='{:.4f}')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="125m,300m")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences of the preset's seq_len)")
    ap.add_argument("--record", action="store_true", help="append the result to BENCHMARKS.md")
    args = ap.parse_args(argv)
    gpu = gpu_name()
    if not gpu:
        print("bench.gpu: no NVIDIA GPU is visible here (nvidia-smi finds none); run it on a GPU machine.", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="scaleout-gpu-") as tmp:
        rows = [r for m in args.models.split(",") for r in run_model(m.strip(), args.steps, args.batch, Path(tmp))]
    text = table(rows)
    print(text)
    if args.record:
        cmd = "python -m bench.gpu " + " ".join(argv if argv is not None else sys.argv[1:])
        versions = subprocess.run([sys.executable, "-c", "import jax, torch; print(f'jax {jax.__version__}, torch {torch.__version__}')"],
                                  capture_output=True, text=True).stdout.strip()
        section = (f"\n## One GPU, bf16: {gpu} ({datetime.date.today().isoformat()})\n\n`{cmd}` on {platform.node()}, "
                   f"{versions}, {args.steps} steps, global batch {args.batch}; medians over the steady steps.\n\n{text}\n")
        with open(ROOT / "BENCHMARKS.md", "a") as out:
            out.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())

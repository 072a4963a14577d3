"""Run inside a SLURM task: print one JSON line with what the task sees (tests/test_cluster.py).

Standard library only, so it starts fast and needs neither jax nor torch. Fields: the SLURM/GPU environment
variables a trainer reads, the node list expanded the way SLURM expands it, the address every node name resolves
to from inside the task (what MASTER_ADDR / the JAX coordinator will be), and, for each GPU index in
CUDA_VISIBLE_DEVICES, whether the node's fake device file exists (scripts/slurm-local.sh makes
/dev/fakegpu/<node>/gpu<i>).

With `--select` it also imports the launcher (launch.core.gpus, and launch.targets.slurm.job for the environment each
trainer is started with) and adds, per framework, what that trainer would select: the local GPU index, JAX's
`local_device_ids`, and the node's number of that GPU (field "select"; tests/test_slurm_multinode.py).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ENV = ("SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_JOB_NODELIST",
       "SLURM_STEP_NODELIST", "SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_CPUS_PER_TASK",
       "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "GPU_DEVICE_ORDINAL",
       "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_NODE")


def resolve(name):
    try:
        return socket.gethostbyname(name)
    except OSError as e:
        return f"unresolved: {e}"


def select():
    """{framework: launch.core.gpus.describe_selection(the environment CellJob gives that framework's trainer)}."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from launch.core import gpus
    from launch.targets.slurm.job import CellJob

    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")  # submitit's environment, as under its own srun
    out = {}
    for framework in ("jax", "torch"):
        env = CellJob("/nonexistent", framework).trainer_env()
        try:
            out[framework] = gpus.describe_selection(env)
        except gpus.GpuBindingError as e:
            out[framework] = {"error": str(e)}
        out[framework]["env"] = {k: env.get(k) for k in ("LOCAL_RANK", "RANK", "SCALEOUT_DISTRIBUTED")}
    return out


def main():
    env = {k: os.environ.get(k) for k in ENV}
    nodes = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"] or ""],
                           capture_output=True, text=True).stdout.split()
    node = env["SLURMD_NODENAME"] or ""
    gpus = [g for g in (env["CUDA_VISIBLE_DEVICES"] or "").split(",") if g]
    record = {
        "env": env,
        "nodes": nodes,
        "resolved": {n: resolve(n) for n in nodes},
        "hostname": socket.gethostname(),
        "devices": {g: os.path.exists(f"/dev/fakegpu/{node}/gpu{g}") for g in gpus},
    }
    if "--select" in sys.argv[1:]:
        record["select"] = select()
    print(json.dumps(record, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()

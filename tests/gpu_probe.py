"""Run inside a SLURM task: print one JSON line with what the task sees (tests/test_cluster.py).

Standard library only, so it starts fast and needs neither jax nor torch. Fields: the SLURM/GPU environment
variables a trainer reads, the node list expanded the way SLURM expands it, the address every node name resolves
to from inside the task (what MASTER_ADDR / the JAX coordinator will be), and, for each GPU index in
CUDA_VISIBLE_DEVICES, whether the node's fake device file exists (scripts/slurm-local.sh makes
/dev/fakegpu/<node>/gpu<i>).
"""

import json
import os
import socket
import subprocess

ENV = ("SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_JOB_NODELIST",
       "SLURM_STEP_NODELIST", "SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_CPUS_PER_TASK",
       "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "GPU_DEVICE_ORDINAL",
       "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_NODE")


def resolve(name):
    try:
        return socket.gethostbyname(name)
    except OSError as e:
        return f"unresolved: {e}"


def main():
    env = {k: os.environ.get(k) for k in ENV}
    nodes = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"] or ""],
                           capture_output=True, text=True).stdout.split()
    node = env["SLURMD_NODENAME"] or ""
    gpus = [g for g in (env["CUDA_VISIBLE_DEVICES"] or "").split(",") if g]
    print(json.dumps({
        "env": env,
        "nodes": nodes,
        "resolved": {n: resolve(n) for n in nodes},
        "hostname": socket.gethostname(),
        "devices": {g: os.path.exists(f"/dev/fakegpu/{node}/gpu{g}") for g in gpus},
    }, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()

"""The environment contract between the launcher, the targets and the trainer processes.

A trainer is started with a config path and these variables (besides what `jax.distributed` and
`torch.distributed` read themselves: RANK, WORLD_SIZE, MASTER_ADDR, SLURM_*, ...).
"""

from __future__ import annotations

import os

# How the processes of a cell find each other: "local" (explicit coordinator below), "slurm"
# (jax.distributed's SLURM detection / submitit's rendezvous) or "tpu" (Cloud TPU detection).
DISTRIBUTED = "SCALEOUT_DISTRIBUTED"
# Explicit JAX coordinator for several local processes (and the TPU emulation).
COORDINATOR = "SCALEOUT_COORDINATOR"
NUM_PROCESSES = "SCALEOUT_NUM_PROCESSES"
PROCESS_ID = "SCALEOUT_PROCESS_ID"
# Fault injection for tests: KIND@STEP[:pN][:cell=NAME] (see launch.core.loop.Fault).
FAULT = "SCALEOUT_FAULT"
# Log verbosity the launcher passes down: a logging level name (INFO, DEBUG, WARNING).
LOG_LEVEL = "SCALEOUT_LOG_LEVEL"
# Prefix of the paths the TPU chip-freeing command touches (/dev/accel*, /tmp/libtpu_lockfile): empty on a
# real TPU VM; the gcloud emulation points it at each worker's sandbox.
TPU_SYSROOT = "SCALEOUT_TPU_SYSROOT"
# The share of each GPU JAX preallocates; the JAX trainer sets it from model.gpu_memory_fraction.
XLA_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# Where `jaxrun.aot` keeps its results (plan.cache_dir); empty: no cache.
COMPILE_CACHE = "SCALEOUT_COMPILE_CACHE"
# Set only by the gcloud emulation (tests/fake_gcloud), which has no TPU chips: "cpu" runs a framework=torch
# TPU cell's ranks (started exactly as on a slice) on the CPU with gloo in place of torch_tpu's tpu_dist.
TPU_STANDIN = "SCALEOUT_TPU_STANDIN"
# The launcher's PID: a trainer whose launcher is gone stops (no orphans).
PARENT_PID = "SCALEOUT_PARENT_PID"
# jax's own: "cpu" for a cell that has no accelerator (launch.core.gpus.cpu_only), so that jax never loads libtpu.
JAX_PLATFORMS = "JAX_PLATFORMS"


def process_index() -> int:
    """This process's index before any distributed runtime exists (0 when started alone)."""
    # RANK first: only torch launchers set it, and a PyTorch rank on a TPU worker is one of several there
    # (the worker's index, what the others say, is not its rank).
    for name in ("RANK", PROCESS_ID, "SLURM_PROCID", "TPU_WORKER_ID", "CLOUD_TPU_TASK_ID"):
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0

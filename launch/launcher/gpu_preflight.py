"""GPU checks before anything is written or queued (`plan`, `run`, `sweep`): what would make a GPU
comparison unfair or fail at step 1, said in one sentence each.

- `check_attention`: `model.attention_impl=fused` on a device/dtype where a framework has no fused
  kernel at all is refused (ConfigError); the trainers still probe the kernel on their device.
- `warnings`: the NCCL caveat of `slurm.gpu_binding=task` (each task sees only its own GPU, so NCCL
  cannot use CUDA IPC / NVLink between the tasks of a node: NVIDIA/nccl#129, #1066), and, where
  `nvidia-smi` exists on this machine, a driver too old for the installed CUDA builds.

The platform of a cell is what the config says it will run on: a TPU slice, the GPU `plan.device`
names, a SLURM cell with `slurm.gpus_per_node`, a local cell on a host with GPUs
(`launch.core.gpus.gpus_expected`), else CPU.
"""

from __future__ import annotations

import os
from typing import List

from launch.config import ConfigError
from launch.config.schema import Config
from launch.core import attention, gpus


def platform_of(cfg: Config) -> str:
    if cfg.target == "tpu":
        return "tpu"
    if cfg.plan.device and not cfg.plan.device.lower().startswith("tpu"):
        return "gpu"  # the cell is planned for the GPU plan.device names
    if cfg.target == "slurm":
        return "gpu" if cfg.slurm.gpus_per_node else "cpu"
    return "gpu" if gpus.gpus_expected(os.environ) else "cpu"


def check_attention(cfg: Config, platform: str = "") -> None:
    m = cfg.model
    try:
        attention.candidates(cfg.framework, platform or platform_of(cfg), m.dtype, m.attention, m.attention_impl,
                             cfg.torch.document_mask_impl)
    except attention.AttentionUnavailable as e:
        raise ConfigError(str(e)) from None


NCCL_TASK_BINDING = ("slurm.gpu_binding=task gives each task only its own GPU (--gpus-per-task=1), so NCCL cannot use "
                     "CUDA IPC / NVLink between the {n} tasks of a node and falls back to slower paths "
                     "(NVIDIA/nccl#129, #1066); slurm.gpu_binding=node (the default) keeps the node's GPUs visible to "
                     "every task.")


def warnings(cfg: Config) -> List[str]:
    """Sentences to log before a GPU cell is planned or queued (nothing is refused)."""
    out = []
    per_node = min(cfg.devices, cfg.slurm.devices_per_node)
    if cfg.target == "slurm" and cfg.slurm.gpus_per_node and cfg.slurm.gpu_binding == "task" and per_node > 1:
        out.append(NCCL_TASK_BINDING.format(n=per_node))
    problem = gpus.driver_problem(os.environ)
    if problem:
        out.append(problem[0].upper() + problem[1:])
    return out

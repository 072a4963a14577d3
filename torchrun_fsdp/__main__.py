"""Entry point: `python -m torch.distributed.run ... -m torchrun_fsdp --config CELL/config.yaml`.

The rendezvous comes from the environment torchrun (or, under SLURM,
`submitit.helpers.TorchDistributedEnvironment().export()`) sets: RANK, WORLD_SIZE, MASTER_ADDR...
CPU uses gloo, CUDA uses NCCL, a TPU slice TorchTPU's tpu_dist (`torchrun_fsdp.tpu`). Started by hand without RANK, it runs as a single process.
Everything around that (signal handlers first, logging, the failed summary of a failed start, the
loop) is `launch.core.engine.run_trainer`, shared with the JAX trainer.
"""

import os
import time
from typing import Optional


def _free_port() -> int:
    """A port nothing listens on now: one process started by hand must not collide with another's store."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def setup_distributed(cfg) -> None:
    import torch
    import torch.distributed as dist

    from launch.core.engine import sharing_processes, threads_per_process

    from torchrun_fsdp import tpu

    placement = tpu.placement() if tpu.on_tpu() else None  # TorchTPU's environment checked before joining
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # started by hand as one process
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()))
        backend = placement.backend if placement else "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    if not torch.cuda.is_available() and (placement is None or placement.standin):
        torch.set_num_threads(threads_per_process(cfg, sharing_processes(dist.get_world_size())))
    if dist.get_world_size() != cfg.devices:
        raise RuntimeError(f"devices={cfg.devices} but {dist.get_world_size()} ranks were started")


def build(cfg, cell_dir):
    """The framework's part of starting up: refuse a CPU-only PyTorch on a host with GPUs, join the
    process group, build the engine."""
    from launch.core import gpus
    gpus.check_driver(os.environ)  # a CUDA build this driver cannot run: one sentence, before CUDA starts
    import torch
    gpus.check_platform("torch", "cuda" if torch.cuda.is_available() else "cpu", os.environ)
    setup_distributed(cfg)
    from torchrun_fsdp.train import TorchEngine
    return TorchEngine(cfg, cell_dir)


def teardown() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv=None, process_start: Optional[float] = None) -> int:
    from launch.core import engine  # light: the stop-signal handlers are installed before anything slow
    return engine.run_trainer("torch", "python -m torchrun_fsdp", build, argv=argv, process_start=process_start,
                              teardown=teardown)


if __name__ == "__main__":
    started = time.perf_counter()  # first: time to first step counts from here
    from launch.common import envvars
    from launch.core import engine
    engine.exit_on_error(lambda: main(process_start=started), f"rank {envvars.process_index()}")

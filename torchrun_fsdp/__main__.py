"""Entry point: `python -m torch.distributed.run ... -m torchrun_fsdp --config CELL/config.yaml`.

The rendezvous comes from the environment torchrun (or, under SLURM,
`submitit.helpers.TorchDistributedEnvironment().export()`) sets: RANK, WORLD_SIZE, MASTER_ADDR...
CPU uses gloo, CUDA uses NCCL. Started by hand without RANK, it runs as a single process.
"""

import os
import time
from typing import Optional


def setup_distributed(cfg) -> None:
    import torch
    import torch.distributed as dist

    from launch.engine import threads_per_process

    if not dist.is_initialized():
        if "RANK" not in os.environ:  # started by hand as one process
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    if not torch.cuda.is_available():
        torch.set_num_threads(threads_per_process(cfg, dist.get_world_size()))
    if dist.get_world_size() != cfg.devices:
        raise RuntimeError(f"devices={cfg.devices} but {dist.get_world_size()} ranks were started")


def main(argv=None, process_start: Optional[float] = None) -> int:
    if process_start is None:
        process_start = time.perf_counter()
    from launch import engine

    stopper = engine.Stopper().install()  # before anything slow: a signal from here on stops cleanly
    engine.die_with_launcher(stopper)
    from launch import envvars, log, loop

    rank = envvars.process_index()
    log.setup(process_index=rank)
    cfg, cell_dir = engine.read_cell("python -m torchrun_fsdp", argv)
    with engine.early_failure("torch", cfg, cell_dir, rank):
        setup_distributed(cfg)
        from torchrun_fsdp.train import TorchEngine
        trainer = TorchEngine(cfg, cell_dir)
    try:
        loop.run(trainer, cfg, cell_dir, process_start=process_start, stopper=stopper)
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    started = time.perf_counter()  # first: time to first step counts from here
    from launch import engine, envvars
    engine.exit_on_error(lambda: main(process_start=started), f"rank {envvars.process_index()}")

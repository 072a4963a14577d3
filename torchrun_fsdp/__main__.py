"""Entry point: `python -m torch.distributed.run ... -m torchrun_fsdp --config CELL/config.yaml`.

The rendezvous comes from the environment torchrun (or, under SLURM,
`submitit.helpers.TorchDistributedEnvironment().export()`) sets: RANK, WORLD_SIZE, MASTER_ADDR...
CPU uses gloo, CUDA uses NCCL.
"""

from launch.loop import PROCESS_START  # noqa: F401  (first: time to first step counts from here)

import os


def setup_distributed(cfg) -> None:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if "RANK" not in os.environ:  # started by hand as one process
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    if not torch.cuda.is_available():
        threads = cfg.local.threads or max(1, (os.cpu_count() or 1) // dist.get_world_size())
        torch.set_num_threads(threads)
    if dist.get_world_size() != cfg.devices:
        raise RuntimeError(f"devices={cfg.devices} but {dist.get_world_size()} ranks were started")


def main(argv=None) -> int:
    from launch import loop

    cfg, cell_dir = loop.read_cell("python -m torchrun_fsdp", argv)
    try:
        setup_distributed(cfg)
        from torchrun_fsdp.train import TorchEngine
        engine = TorchEngine(cfg, cell_dir)
    except Exception as e:
        loop.record_early_failure("torch", cfg, cell_dir, e, int(os.environ.get("RANK", "0")) == 0)
        raise
    try:
        loop.run(engine, cfg, cell_dir)
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from launch.loop import exit_on_error
    exit_on_error(main, f"rank {os.environ.get('RANK', '0')}")

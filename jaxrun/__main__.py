"""Entry point: `python -m jaxrun --config CELL/config.yaml`.

Joins the distributed runtime when there is more than one process: explicit coordinator
settings from the local launcher or the TPU emulation (SCALEOUT_COORDINATOR,
SCALEOUT_NUM_PROCESSES, SCALEOUT_PROCESS_ID), or `jax.distributed.initialize()`'s own detection
when the SLURM or TPU target says so (SCALEOUT_DISTRIBUTED=slurm|tpu). On CPU the collectives go
over gloo.
"""

from launch.loop import PROCESS_START  # noqa: F401  (first: time to first step counts from here)

import os


def setup_distributed() -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if os.environ.get("SCALEOUT_COORDINATOR"):
        jax.distributed.initialize(coordinator_address=os.environ["SCALEOUT_COORDINATOR"],
                                   num_processes=int(os.environ["SCALEOUT_NUM_PROCESSES"]),
                                   process_id=int(os.environ["SCALEOUT_PROCESS_ID"]))
    elif os.environ.get("SCALEOUT_DISTRIBUTED") == "slurm" and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize(**slurm_local_device_ids())  # SLURM auto-detection
    elif os.environ.get("SCALEOUT_DISTRIBUTED") == "tpu":
        jax.distributed.initialize()  # Cloud TPU auto-detection (worker 0 is the coordinator)


def slurm_local_device_ids() -> dict:
    """Under SLURM, one task per device: a task that sees several GPUs uses the one of its local id.

    (When SLURM binds each task to its own GPU, the task sees one device and JAX needs no hint.)
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("SLURM_STEP_GPUS") or ""
    local_id = os.environ.get("SLURM_LOCALID")
    if local_id is not None and len([g for g in visible.split(",") if g]) > 1:
        return {"local_device_ids": [int(local_id)]}
    return {}


def setup_cache(cfg) -> None:
    import jax

    if cfg.jax.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", cfg.jax.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(argv=None) -> int:
    from launch import loop

    cfg, cell_dir = loop.read_cell("python -m jaxrun", argv)
    try:
        setup_distributed()
        setup_cache(cfg)
        from jaxrun.train import JaxEngine
        engine = JaxEngine(cfg, cell_dir)
    except Exception as e:
        loop.record_early_failure("jax", cfg, cell_dir, e, int(os.environ.get("SCALEOUT_PROCESS_ID", os.environ.get("SLURM_PROCID", "0"))) == 0)
        raise
    loop.run(engine, cfg, cell_dir)
    return 0


if __name__ == "__main__":
    from launch.loop import exit_on_error
    exit_on_error(main, f"process {os.environ.get('SCALEOUT_PROCESS_ID', os.environ.get('SLURM_PROCID', '0'))}")

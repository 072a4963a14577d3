"""Entry point: `python -m jaxrun --config CELL/config.yaml`.

Joins the distributed runtime when there is more than one process: explicit coordinator
settings from the local launcher or the TPU emulation (SCALEOUT_COORDINATOR,
SCALEOUT_NUM_PROCESSES, SCALEOUT_PROCESS_ID), or `jax.distributed.initialize()`'s own detection
when the SLURM or TPU target says so (SCALEOUT_DISTRIBUTED=slurm|tpu). On CPU the collectives go
over gloo. Everything around that (signal handlers first, logging, the failed summary of a failed
start, the loop) is `launch.core.engine.run_trainer`, shared with the PyTorch trainer.
"""

import os
import time
from pathlib import Path
from typing import Optional

# XLA flags every serious JAX GPU setup uses (MaxText, JAX's GPU performance guide): the
# latency-hiding scheduler overlaps FSDP's all-gathers and reduce-scatters with compute, as FSDP2's
# prefetching does on the PyTorch side; without it the comparison is biased against JAX.
GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",)
PROFILE_XLA_FLAG = "--xla_cpu_enable_xprof_traceme=true"


def gpu_host() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*"))


def setup_xla_flags(cfg) -> None:
    """XLA_FLAGS before JAX starts a backend: the environment's, then the GPU defaults (on a GPU host,
    unless a flag is already given), the CPU op tracing flag when `profile.steps` is set, then `jax.xla_flags`. The result is recorded in metrics.jsonl."""
    given = os.environ.get("XLA_FLAGS", "")
    extra = cfg.jax.xla_flags or ""
    flags = [given]
    if gpu_host():
        flags += [f for f in GPU_XLA_FLAGS if f.split("=")[0] not in given + " " + extra]
    if cfg.profile.steps and PROFILE_XLA_FLAG.split("=")[0] not in given + " " + extra:
        flags.append(PROFILE_XLA_FLAG)  # XLA:CPU traces each executed op only with it (jaxrun.profile)
    flags.append(extra)
    os.environ["XLA_FLAGS"] = " ".join(f for f in flags if f)


def setup_distributed() -> None:
    import jax

    from launch.common import envvars
    from launch.core import gpus

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service takes SIGTERM for itself; scaleout's own stop (launch.core.engine.Stopper, the
    # loop's collective stop) handles it the same way in both frameworks
    jax.config.update("jax_enable_preemption_service", False)
    if os.environ.get(envvars.COORDINATOR):
        jax.distributed.initialize(coordinator_address=os.environ[envvars.COORDINATOR],
                                   num_processes=int(os.environ[envvars.NUM_PROCESSES]),
                                   process_id=int(os.environ[envvars.PROCESS_ID]))
    elif os.environ.get(envvars.DISTRIBUTED) == "slurm" and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        # SLURM auto-detection, with this task's local GPU: jax's own guess, [SLURM_LOCALID], is wrong when SLURM
        # binds one GPU per task (local id 1 would ask for GPU 1 of a one-GPU view); None on a CPU node
        jax.distributed.initialize(local_device_ids=gpus.jax_local_device_ids(os.environ))
    elif os.environ.get(envvars.DISTRIBUTED) == "tpu":
        jax.distributed.initialize()  # Cloud TPU auto-detection (worker 0 is the coordinator)


def setup_cache(cfg) -> None:
    import jax

    if cfg.jax.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", cfg.jax.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def build(cfg, cell_dir):
    """The framework's part of starting up: join the runtime, set the cache, build the engine."""
    setup_xla_flags(cfg)
    setup_distributed()
    import jax

    from launch.core import gpus
    gpus.check_platform("jax", jax.default_backend(), os.environ)  # GPUs here but a CPU-only jaxlib: stop at once
    setup_cache(cfg)
    from jaxrun.train import JaxEngine
    return JaxEngine(cfg, cell_dir)


def main(argv=None, process_start: Optional[float] = None) -> int:
    from launch.core import engine  # light: the stop-signal handlers are installed before anything slow
    return engine.run_trainer("jax", "python -m jaxrun", build, argv=argv, process_start=process_start)


if __name__ == "__main__":
    started = time.perf_counter()  # first: time to first step counts from here
    from launch.common import envvars
    from launch.core import engine
    engine.exit_on_error(lambda: main(process_start=started), f"process {envvars.process_index()}")

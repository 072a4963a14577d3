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


def setup_platform() -> None:
    """JAX on the CPU alone (`JAX_PLATFORMS=cpu`) for a process that sees no accelerator, unless the environment
    names platforms already or this is a TPU worker: see launch.core.gpus.cpu_only (libtpu's errors in CPU runs)."""
    from launch.common import envvars
    from launch.core import gpus
    if os.environ.get(envvars.JAX_PLATFORMS) or os.environ.get(envvars.DISTRIBUTED) == "tpu":
        return
    if not gpus.cpu_only(os.environ):
        return  # an accelerator jax should find (or, for a CPU-only jaxlib, gpus.check_platform's refusal)
    os.environ[envvars.JAX_PLATFORMS] = "cpu"
    import jax
    jax.config.update("jax_platforms", "cpu")  # in case jax was imported before the variable was set


def setup_memory_fraction(cfg) -> None:
    """`model.gpu_memory_fraction` as XLA_PYTHON_CLIENT_MEM_FRACTION, before JAX starts a backend: the
    share of each GPU JAX preallocates (its own default is 0.75), the same the PyTorch trainer allows."""
    import logging

    from launch.common import envvars
    value = f"{cfg.model.gpu_memory_fraction:g}"
    given = os.environ.get(envvars.XLA_MEM_FRACTION)
    if given is not None and given != value:
        logging.getLogger("jaxrun").warning(f"{envvars.XLA_MEM_FRACTION}={given} in the environment is replaced by "
                                            f"model.gpu_memory_fraction={value} (the same share in both frameworks)")
    os.environ[envvars.XLA_MEM_FRACTION] = value


def distributed_args(env, devices: int) -> Optional[dict]:
    """The arguments of `jax.distributed.initialize` for this process, or None for a lone process.

    - explicit coordinator (local.processes > 1, the TPU emulation): each process drives its own
      devices/processes GPUs of the host (`launch.core.gpus.jax_local_device_ids`: process i the ones
      from i * k), never every GPU it sees; None (CPU devices) where it sees no GPU;
    - SLURM: auto-detection, with this task's local GPU (jax's own guess, [SLURM_LOCALID], is wrong when
      SLURM binds one GPU per task: local id 1 would ask for GPU 1 of a one-GPU view); None on a CPU node;
    - Cloud TPU: auto-detection (worker 0 is the coordinator)."""
    from launch.common import envvars
    from launch.core import gpus

    if env.get(envvars.COORDINATOR):
        processes = int(env[envvars.NUM_PROCESSES])
        return {"coordinator_address": env[envvars.COORDINATOR], "num_processes": processes,
                "process_id": int(env[envvars.PROCESS_ID]),
                "local_device_ids": gpus.jax_local_device_ids(env, devices_per_process=max(1, devices // processes))}
    if env.get(envvars.DISTRIBUTED) == "slurm" and int(env.get("SLURM_NTASKS", "1")) > 1:
        return {"local_device_ids": gpus.jax_local_device_ids(env)}
    if env.get(envvars.DISTRIBUTED) == "tpu":
        return {}
    return None


def setup_distributed(cfg) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service takes SIGTERM for itself; scaleout's own stop (launch.core.engine.Stopper, the
    # loop's collective stop) handles it the same way in both frameworks
    jax.config.update("jax_enable_preemption_service", False)
    args = distributed_args(os.environ, cfg.devices)
    if args is not None:
        jax.distributed.initialize(**args)


def setup_cache(cfg) -> None:
    import jax

    if cfg.jax.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", cfg.jax.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    else:  # off means off, even where the environment names a cache (JAX_COMPILATION_CACHE_DIR)
        jax.config.update("jax_enable_compilation_cache", False)


def build(cfg, cell_dir):
    """The framework's part of starting up: join the runtime, set the cache, build the engine."""
    from launch.core import gpus
    gpus.check_driver(os.environ)  # a CUDA build this driver cannot run: one sentence, before CUDA starts
    setup_xla_flags(cfg)
    setup_platform()
    setup_memory_fraction(cfg)
    setup_distributed(cfg)
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

"""Which GPUs a trainer process sees and which one it must use, decided from its environment alone.

One task (process) per device is scaleout's layout on GPUs, and the scheduler can give a task its
GPUs in two ways (`slurm.gpu_binding`):

- `task` (`--gpus-per-task=1`): SLURM gives every task its own GPU; the task sees exactly one
  (`CUDA_VISIBLE_DEVICES=1` on the second task of a node) and must use local device 0;
- `node` (`--gpus-per-node=N`): every task of a node sees all N of the node's GPUs
  (`CUDA_VISIBLE_DEVICES=0,1,...`) and must use the one of its local rank (`SLURM_LOCALID`).

`torchrun` on one host is the second case (every process sees every GPU, `LOCAL_RANK` picks).
A process that sees no GPU uses none (`None`). Indices returned here are *local*: positions in
the process's own view of the GPUs (what `torch.device("cuda", i)` and JAX's `local_device_ids`
mean), never the node's numbering, which `physical_gpu` gives.

jax's SLURM detection sets `local_device_ids=[SLURM_LOCALID]` on its own, which is wrong in the
`task` mode (local id 1 asks for GPU 1 of a one-GPU view): `jax_local_device_ids` is what
`jax.distributed.initialize(local_device_ids=...)` must be given instead.

`check_platform` stops a trainer that sees GPUs but whose framework runs on the CPU (a CPU-only
jaxlib or torch build), so a CPU run is never compared with a GPU run.

Standard library only (no jax or torch): every function takes the environment as a mapping, so it
can be called before a framework is imported and tested with plain dicts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Mapping, Optional

from launch.common import envvars

# Where a process's GPU restriction comes from, most specific first: the CUDA runtime's own
# variable, then what SLURM sets for the step (node numbering) and for AMD/OpenCL.
VISIBILITY_VARIABLES = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "GPU_DEVICE_ORDINAL")
# Values SLURM or a user sets to mean "no GPU" (NoDevFiles: GRES allocated without device files).
NO_GPU_VALUES = {"", "nodevfiles", "none", "void", "-1"}
# The variable holding a process's rank among the processes of its node, by who started it
# (envvars.DISTRIBUTED): SLURM tasks carry SLURM_LOCALID; torchrun sets LOCAL_RANK; the local
# target's JAX processes all run on this host, so their process id is their local rank. A local run
# inside an `srun` shell inherits SLURM_LOCALID=0 for every process: it is not read there.
LOCAL_RANK_VARIABLES = {
    "slurm": ("SLURM_LOCALID", "LOCAL_RANK"),
    "local": ("LOCAL_RANK", envvars.PROCESS_ID),
    "tpu": ("LOCAL_RANK",),
}
DEFAULT_LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")
GPU_PLATFORMS = {"gpu", "cuda", "rocm"}
# The pinned versions (constraints.txt) the install hints name: jax's CUDA plugin must match jaxlib exactly.
JAX_VERSION, TORCH_VERSION = "0.10.2", "2.13.0"
CU126_INDEX = "https://download.pytorch.org/whl/cu126"
# Exact commands for a framework build with GPU support, per CUDA major version: 13 is the `gpu` extra
# (PyPI's torch 2.13.0 for Linux x86_64 is itself a CUDA 13.0 build), 12 the documented alternative.
INSTALL_HINT = {
    ("jax", 13): f"pip install 'jax[cuda13]=={JAX_VERSION}'",
    ("jax", 12): f"pip install 'jax[cuda12]=={JAX_VERSION}'",
    ("torch", 13): f"pip install 'torch=={TORCH_VERSION}'",
    ("torch", 12): f"pip install 'torch=={TORCH_VERSION}' --index-url {CU126_INDEX}",
}
# The oldest NVIDIA Linux driver each CUDA major version runs on (minor-version compatibility: CUDA 13.x
# needs >= 580, CUDA 12.x >= 525.60.13; NVIDIA's CUDA toolkit release notes).
MIN_DRIVER = {13: (580, 0, 0), 12: (525, 60, 13)}
DRIVER_QUERY = ["--query-gpu=driver_version", "--format=csv,noheader"]


class GpuBindingError(RuntimeError):
    """A task's local rank has no GPU of its own in what it sees."""


def _split(value: str) -> List[str]:
    """A device list as CUDA reads it: comma-separated, ending at the first invalid (negative) entry."""
    out: List[str] = []
    for item in (v.strip() for v in value.split(",")):
        if item.lower() in NO_GPU_VALUES or item.startswith("-"):
            break
        out.append(item)
    return out


def restricting_variable(env: Mapping[str, str]) -> Optional[str]:
    """The variable that decides which GPUs the process sees (the first of VISIBILITY_VARIABLES
    that is set, even to an empty value); None when none is set (the process sees every GPU)."""
    return next((name for name in VISIBILITY_VARIABLES if name in env), None)


def visible_gpus(env: Mapping[str, str]) -> List[str]:
    """The GPUs the process is restricted to, as the variable lists them (indices or UUIDs);
    empty when no variable is set or it hides every GPU (`CUDA_VISIBLE_DEVICES=`, `-1`, `NoDevFiles`)."""
    name = restricting_variable(env)
    return _split(env[name]) if name else []


def nvidia_smi_gpus(env: Mapping[str, str], timeout_s: float = 15.0) -> List[str]:
    """The `GPU i: ...` lines of `nvidia-smi -L` (found on env's PATH); empty when it is absent or fails."""
    exe = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if exe is None:
        return []
    try:
        p = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if p.returncode:
        return []
    return [line.strip() for line in p.stdout.splitlines() if line.strip().startswith("GPU ")]


def driver_version(env: Mapping[str, str], timeout_s: float = 15.0) -> Optional[str]:
    """The NVIDIA driver version `nvidia-smi --query-gpu=driver_version --format=csv,noheader` reports
    (one line per GPU, the same on each: e.g. `580.95.05`); None where nvidia-smi is absent or fails."""
    exe = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if exe is None:
        return None
    try:
        p = subprocess.run([exe, *DRIVER_QUERY], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in p.stdout.splitlines() if line.strip()]
    return lines[0] if p.returncode == 0 and lines else None


def _version_tuple(text: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in text.split("."))


def installed_cuda() -> Dict[str, int]:
    """The CUDA major version of each installed framework build with GPU support, from the installed
    distributions' metadata (nothing is imported): jax from its CUDA plugin (`jax-cuda13-plugin` /
    `jax-cuda12-plugin`), torch from its local version (`+cu126`) or, for PyPI's plain wheel, the
    `-cu13`/`cuda-toolkit` requirements it carries. A CPU-only build is absent from the result."""
    from importlib import metadata
    out: Dict[str, int] = {}
    for major in (13, 12):
        try:
            metadata.version(f"jax-cuda{major}-plugin")
        except metadata.PackageNotFoundError:
            continue
        out["jax"] = major
        break
    try:
        major = cuda_major_of_torch(metadata.version("torch"), metadata.requires("torch") or [])
    except metadata.PackageNotFoundError:
        return out
    if major is not None:
        out["torch"] = major
    return out


def cuda_major_of_torch(version: str, requires: List[str]) -> Optional[int]:
    """The CUDA major version of a torch build from its version (`2.13.0+cu126`) and requirements (PyPI's plain
    `2.13.0` requires `cuda-toolkit[...]==13.0.3` and `nvidia-*-cu13`); None for a CPU build (`+cpu`)."""
    local = re.search(r"\+cu(\d\d)", version)
    if local:
        return int(local.group(1))
    if "+" in version:
        return None
    found = re.search(r"-cu(\d\d)\b|cuda-toolkit[^,;]*==\s*(\d+)\.", " ".join(requires))
    return int(found.group(1) or found.group(2)) if found else None


def driver_problem(env: Mapping[str, str], builds: Optional[Mapping[str, int]] = None) -> Optional[str]:
    """One sentence when the NVIDIA driver here (nvidia-smi) is too old for an installed CUDA build
    (`installed_cuda()` unless `builds` is given), naming the frameworks and the driver they need;
    None when there is no nvidia-smi, no CUDA build, or the driver is new enough."""
    version = driver_version(env)
    if version is None:
        return None
    builds = installed_cuda() if builds is None else builds
    short = sorted((fw, major) for fw, major in builds.items() if _version_tuple(version) < MIN_DRIVER[major])
    if not short:
        return None
    names = " and ".join(f"{'JAX' if fw == 'jax' else 'PyTorch'} (CUDA {major})" for fw, major in short)
    need = max(MIN_DRIVER[major] for _, major in short)
    alt = ("; with a driver >= 525.60.13 the CUDA 12 builds work: "
           + " and ".join(f"`{INSTALL_HINT[(fw, 12)]}`" for fw, _ in short) if any(m == 13 for _, m in short) else "")
    return (f"the NVIDIA driver here is {version} but the installed {names} needs a driver >= "
            f"{'.'.join(map(str, need)).removesuffix('.0.0')}: update the driver{alt}.")


def check_driver(env: Mapping[str, str]) -> None:
    """At trainer start, before the framework starts CUDA: stop with one sentence when the driver is too old."""
    problem = driver_problem(env)
    if problem:
        raise RuntimeError(problem[0].upper() + problem[1:])


def gpu_count(env: Mapping[str, str], device_count: Optional[int] = None) -> int:
    """How many GPUs the process sees: the restriction's length when a variable is set, else
    `device_count` (the framework's own count, when the caller has one), else `nvidia-smi -L`'s."""
    if restricting_variable(env) is not None:
        return len(visible_gpus(env))
    if device_count is not None:
        return device_count
    return len(nvidia_smi_gpus(env))


def local_rank(env: Mapping[str, str]) -> Optional[int]:
    """The process's rank among the processes of its node, from the variables of whatever
    started it (LOCAL_RANK_VARIABLES); None when nothing says (a lone process)."""
    names = LOCAL_RANK_VARIABLES.get(env.get(envvars.DISTRIBUTED, ""), DEFAULT_LOCAL_RANK_VARIABLES)
    for name in names:
        value = (env.get(name) or "").strip()
        if value.isdigit():
            return int(value)
    return None


def local_gpu_index(env: Mapping[str, str], device_count: Optional[int] = None) -> Optional[int]:
    """The local index of the GPU this process must use: 0 when it sees exactly one (SLURM bound
    a GPU to the task, `--gpus-per-task=1`), its local rank when it sees several (`--gpus-per-node`,
    torchrun; 0 for a lone process), None when it sees none.

    Raises GpuBindingError when the local rank is past the GPUs it sees (tasks would share a GPU)."""
    n = gpu_count(env, device_count)
    if n == 0:
        return None
    if n == 1:
        return 0
    rank = local_rank(env)
    if rank is None:
        return 0
    if rank >= n:
        raise GpuBindingError(
            f"this process is local rank {rank} of its node but sees only {n} GPUs "
            f"({_describe(env)}); give every process its own GPU (one task per GPU: slurm.devices_per_node "
            "at most the GPUs of a node) or bind one GPU per task (slurm.gpu_binding=task).")
    return rank


def jax_local_device_ids(env: Mapping[str, str], device_count: Optional[int] = None,
                         devices_per_process: int = 1) -> Optional[List[int]]:
    """What `jax.distributed.initialize(local_device_ids=...)` needs: the local indices of the GPUs this
    process drives. One per process (scaleout's SLURM layout): [local_gpu_index], so [0] for a task that
    sees exactly one GPU; with `devices_per_process=k` (several local JAX processes splitting one host's
    GPUs) the k GPUs from local_rank * k. None when it sees no GPU, or is the only process of its host
    and drives every GPU it sees (let JAX take them all).

    Raises GpuBindingError when the process's share is past the GPUs it sees."""
    n = gpu_count(env, device_count)
    if n == 0:
        return None
    rank = local_rank(env)
    if devices_per_process == 1:
        if n > 1 and rank is None:
            return None
        return [local_gpu_index(env, n)]  # type: ignore[list-item]
    if rank is None:
        return None
    first = rank * devices_per_process
    if first + devices_per_process > n:
        raise GpuBindingError(
            f"this process is local rank {rank} of its node and drives {devices_per_process} GPUs, but it sees only "
            f"{n} ({_describe(env)}); give the processes of a node at most {n} GPUs together.")
    return list(range(first, first + devices_per_process))


def physical_gpu(env: Mapping[str, str], device_count: Optional[int] = None) -> Optional[str]:
    """The node's name for the GPU this process uses: SLURM's node numbering (SLURM_STEP_GPUS) when
    it lists the same number of GPUs as the process sees, else the visible entry; None without a GPU."""
    n = gpu_count(env, device_count)
    index = local_gpu_index(env, n)
    if index is None:
        return None
    step = _split(env.get("SLURM_STEP_GPUS", ""))
    visible = visible_gpus(env)
    if len(step) == n:
        return step[index]
    return visible[index] if index < len(visible) else str(index)


def first_gpus(env: Mapping[str, str], count: int) -> Optional[str]:
    """CUDA_VISIBLE_DEVICES for processes that must use only the first `count` GPUs this environment
    sees (a local cell of `count` devices on a bigger host: JAX would otherwise open, and preallocate
    memory on, every GPU it sees); None when it sees none, or no more than `count`."""
    name = restricting_variable(env)
    seen = visible_gpus(env) if name else [str(i) for i in range(len(nvidia_smi_gpus(env)))]
    if len(seen) <= count:
        return None
    return ",".join(seen[:count])


def gpus_expected(env: Mapping[str, str]) -> bool:
    """Whether the process should be running on GPUs: its restriction lists some
    (CUDA_VISIBLE_DEVICES / SLURM_STEP_GPUS), or, with no restriction set, `nvidia-smi -L` lists some.
    A restriction that hides every GPU (`CUDA_VISIBLE_DEVICES=`) means no."""
    if restricting_variable(env) is not None:
        return bool(visible_gpus(env))
    return bool(nvidia_smi_gpus(env))


GPU_DEVICE_FILES = ("nvidia[0-9]*", "kfd")  # NVIDIA GPUs; AMD's compute interface
TPU_DEVICE_FILES = ("accel[0-9]*", "vfio/[0-9]*")  # TPU chips: v4 and before; v5e and later


def cpu_only(env: Mapping[str, str], dev: Path = Path("/dev")) -> bool:
    """Whether a process with `env` on this host has nothing but the CPU: no TPU chips, and no GPU (none named by
    its restriction variable when one is set, else no GPU device files). Such a process gets
    `JAX_PLATFORMS=cpu` (envvars.JAX_PLATFORMS): jax otherwise starts every backend it finds installed, and
    libtpu (the tpu-aot extra) prints errors about TPU hosts that do not exist into every CPU run."""
    if any(any(dev.glob(p)) for p in TPU_DEVICE_FILES):
        return False
    if restricting_variable(env) is not None:
        return not visible_gpus(env)
    return not any(any(dev.glob(p)) for p in GPU_DEVICE_FILES)


def _describe(env: Mapping[str, str]) -> str:
    name = restricting_variable(env)
    return f"{name}={env[name]}" if name else "nvidia-smi lists them"


def check_platform(framework: str, platform: str, env: Mapping[str, str]) -> None:
    """Refuse to train on the CPU when the process has GPUs: a framework build without GPU support
    would otherwise run (slowly) on the CPU and be compared with the other framework on the GPUs.

    `platform` is the framework's own name for where it runs (`jax.default_backend()`:
    cpu/gpu/tpu; torch: cpu/cuda). Only `cpu` with GPUs expected is refused."""
    if platform.lower() != "cpu" or not gpus_expected(env):
        return
    name = "JAX" if framework == "jax" else "PyTorch" if framework == "torch" else framework
    version = driver_version(env)
    major = 12 if version is not None and _version_tuple(version) < MIN_DRIVER[13] else 13
    hint = INSTALL_HINT.get((framework, major), f"a {framework} build with GPU support")
    why = f"driver {version}: CUDA {major}" if version else f"CUDA {major}, driver >= 580"
    raise RuntimeError(
        f"The {framework} trainer sees GPUs ({_describe(env)}) but {name} runs on the CPU platform: install its GPU "
        f"build (`{hint}`, {why}; if one is installed, its warnings above say why it did not start) or hide the GPUs "
        "with CUDA_VISIBLE_DEVICES= to run on the CPU on purpose.")


def describe_selection(env: Mapping[str, str], device_count: Optional[int] = None) -> dict:
    """What a trainer in this environment would use, as plain data (for probes and logs)."""
    device_count = gpu_count(env, device_count)  # nvidia-smi at most once
    return {
        "visible": visible_gpus(env),
        "restricted_by": restricting_variable(env),
        "local_rank": local_rank(env),
        "local_gpu_index": local_gpu_index(env, device_count),
        "jax_local_device_ids": jax_local_device_ids(env, device_count),
        "physical_gpu": physical_gpu(env, device_count),
    }


__all__ = [
    "GpuBindingError", "visible_gpus", "restricting_variable", "nvidia_smi_gpus", "gpu_count", "local_rank",
    "local_gpu_index", "jax_local_device_ids", "physical_gpu", "first_gpus", "gpus_expected", "check_platform",
    "describe_selection", "driver_version", "installed_cuda", "driver_problem", "check_driver", "INSTALL_HINT",
    "cpu_only",
]

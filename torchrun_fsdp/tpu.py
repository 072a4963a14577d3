"""PyTorch on Cloud TPU through TorchTPU (`torch_tpu`): the device, the process-group backend, the mesh.

On a slice (`SCALEOUT_DISTRIBUTED=tpu`), each rank is one chip: torchrun started it with the
environment TorchTPU's multi-host start needs (`launch.core.torch_tpu_env`, checked here first, as
torch_tpu would, so a mismatch is one sentence rather than a hang in the rendezvous). The trainer
then runs unchanged on device `tpu` with backend `tpu_dist`: FSDP2 `fully_shard`, DTensor and DCP
work there (TorchTPU's own examples and tests do exactly that), and the (data, fsdp) mesh takes its
rank layout from `torch.tpu.distributed.topology_aware_mesh`, so neighbours in the mesh are
neighbours on the ICI fabric.

torch_tpu cannot run without chips (0 devices; any `tpu` tensor op aborts the process), so the
gcloud emulation sets `SCALEOUT_TPU_STANDIN=cpu` in its workers: the same torchrun command, the
same environment (checked the same way), but device `cpu` and backend `gloo`, with the mesh in
plain rank order. Nothing else differs, and nothing but the emulation sets that variable.

torch_tpu is imported here only (the trainer's other modules never name it); with it installed,
every `import torch` of that environment loads it (a `torch.backends` entry point), which is why
the workers' PyTorch venv is its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Tuple

from launch.common import envvars
from launch.core import torch_tpu_env

BACKEND = "tpu_dist"  # torch_tpu's process-group backend for device "tpu"


@dataclass(frozen=True)
class Placement:
    device_type: str  # "tpu", or "cpu" for the emulation's stand-in
    backend: str  # "tpu_dist" or "gloo"
    standin: bool


def on_tpu(env: Mapping[str, str] = os.environ) -> bool:
    """Started by the TPU target (a slice, or its emulation)."""
    return env.get(envvars.DISTRIBUTED) == "tpu"


def placement(env: Mapping[str, str] = os.environ) -> Placement:
    """Check this rank's TorchTPU environment; where it runs and which backend joins the ranks."""
    try:
        torch_tpu_env.check(env)
    except torch_tpu_env.LaunchEnvError as e:
        raise RuntimeError(f"this rank's TorchTPU environment is wrong: {e}") from None
    if env.get(envvars.TPU_STANDIN) == "cpu":
        return Placement("cpu", "gloo", standin=True)
    import torch
    if not hasattr(torch, "tpu"):
        try:
            import torch_tpu  # noqa: F401  (autoloaded as torch.tpu unless TORCH_DEVICE_BACKEND_AUTOLOAD=0)
        except ImportError:
            raise RuntimeError("framework=torch on target=tpu needs torch_tpu in tpu.python's environment; keep the "
                               "default tpu.setup (which installs torch-tpu.txt into ~/scaleout/venv-torch) or install "
                               "torch_tpu==0.2.0 in yours.") from None
    if not torch.tpu.is_available() or torch.tpu.device_count() < 1:
        raise RuntimeError("torch_tpu finds no TPU chip on this worker (another process may hold them)")
    return Placement("tpu", BACKEND, standin=False)


def device(p: Placement):
    """This rank's device: its chip (LOCAL_RANK; one process per chip), or the CPU stand-in."""
    import torch
    if p.standin:
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.tpu.set_device(index)
    return torch.device("tpu", index)


def mesh(p: Placement, shape: Tuple[int, int], names: Tuple[str, str]):
    """The (data, fsdp) DeviceMesh, ranks laid out by topology_aware_mesh on a slice."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    if p.standin:
        return init_device_mesh("cpu", shape, mesh_dim_names=names)
    import torch
    layout = torch.tpu.distributed.topology_aware_mesh(tuple(shape))
    return DeviceMesh("tpu", layout, mesh_dim_names=names)


def synchronize(p: Placement) -> None:
    if not p.standin:
        import torch
        torch.tpu.synchronize()


def device_kind(p: Placement, generation: str) -> str:
    """The chip's name for the datasheet (launch.core.flops): torch_tpu's, else the slice's generation."""
    if p.standin:
        return "cpu"
    import torch
    try:
        return str(torch.tpu.get_device_name())
    except Exception:  # the datasheet also knows generations by name
        return f"tpu {generation}"

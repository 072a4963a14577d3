"""The PyTorch trainer's profiler: `torch.profiler` traces and their breakdown (see `launch.core.profile`).

The trace is a Chrome/Perfetto JSON file, `CELL/profile/traces/rank<i>.pt.trace.json.gz`: every
rank's in one directory that holds nothing else, which is what Holistic Trace Analysis reads as one
multi-rank trace and torch-tb-profiler shows as one run with its Distributed view (the
`.pt.trace.json` name is the one that plugin looks for; Perfetto opens the file as is). The rank's
breakdown stays in `CELL/profile/process-<i>/breakdown.json`. CUDA kernels are recorded on GPU hosts.

Steps are marked twice. The profiler's own `ProfilerStep#N` spans (a schedule that records every
step, `prof.step()` before each traced step after the first, numbered as scaleout numbers steps,
as torchtitan sets `step_num` on resume) are what torch-tb-profiler and HTA divide a trace by; each
covers the loop's whole iteration (the step and what follows it until the next one: logging,
evaluation, a checkpoint), the last until the profiler stops. `scaleout/step#N` spans only the
train-step call the step timer measures, and is what the breakdown reads.

An op is, on a GPU host, a device event (`cat` kernel, gpu_memcpy, gpu_memset: the GPU's own
timeline; host-side aten calls only launch them); on a CPU host, an aten/c10d operator (`cat`
cpu_op), since there the host threads are the device. Categories by name: collectives for c10d,
gloo and NCCL work and FSDP2's all-gather/reduce-scatter spans; matmul/attention for
mm/addmm/bmm/baddbmm/matmul/linear, scaled-dot-product and flex attention and GEMM/attention
kernels (cutlass, cuBLAS, flash); everything else other compute. Not comparable with JAX: on a
CPU host, eager PyTorch's Python and dispatcher time between operators is `idle` here, where
XLA has no such gaps inside one compiled program, and an operator that contains a matmul (e.g.
aten::linear) counts as matmul for its whole duration, as an XLA fusion holding a dot does.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from launch.core import profile

MATMUL = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_?scaled_dot_product\w*|_?flash\w*|_efficient_attention\w*)$"
                    r"|flex_attention|gemm|cutlass|cublas|xmma|fmha|flash|sm\d+_xmma|ampere_|hopper_", re.I)
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _record_every_step(step: int) -> torch.profiler.ProfilerAction:
    return torch.profiler.ProfilerAction.RECORD


def category(name: str) -> str:
    """The breakdown category of an operator or kernel, by name."""
    if profile.COLLECTIVE.search(name):
        return "collectives"
    if MATMUL.search(name):
        return "matmul_attention"
    return "other_compute"


class TorchCapture:
    """`torch.profiler.profile` over the profile window of one rank."""

    def __init__(self, directory: Path, rank: int, device: torch.device):
        self.directory = Path(directory)
        self.rank = rank
        self.cuda = device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # a schedule makes the profiler mark its own steps (ProfilerStep#N); this one records every step
        self.prof = torch.profiler.profile(activities=activities, schedule=_record_every_step)
        self.path = profile.traces_dir(self.directory) / f"rank{rank}.pt.trace.json.gz"
        self.active = False

    def start(self, first: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.prof.step_num = first  # ProfilerStep#<first> is the window's first step
        self.prof.start()
        self.active = True

    def next_step(self, n: int) -> None:
        """Close ProfilerStep#<n-1> and open ProfilerStep#<n>."""
        if self.active:
            self.prof.step()

    def step(self, n: int):
        return torch.profiler.record_function(f"{profile.STEP_SPAN}#{n}")

    def data(self):
        return torch.profiler.record_function(profile.DATA_SPAN) if self.active else contextlib.nullcontext()

    def stop(self) -> List[Path]:
        if self.active:
            self.active = False
            self.prof.stop()
            self.prof.export_chrome_trace(str(self.path))
        return [self.path] if self.path.exists() else []

    def breakdown(self) -> List[Dict[str, Any]]:
        events, _ = profile.load_trace(self.path)
        on_device = self.cuda and any(e.get("cat") in DEVICE_CATS for e in events)
        return profile.breakdown(events, lambda e: classify(e, on_device))


def classify(e: Dict[str, Any], on_device: bool) -> Optional[str]:
    name, cat = str(e.get("name", "")), e.get("cat")
    if name == profile.DATA_SPAN:
        return "host_data"
    if on_device:
        return category(name) if cat in DEVICE_CATS else None
    if cat == "cpu_op":
        return category(name)
    if cat == "user_annotation" and name.startswith("FSDP::") and profile.COLLECTIVE.search(name):
        return "collectives"  # FSDP2's all-gather / reduce-scatter, around the c10d calls
    return None

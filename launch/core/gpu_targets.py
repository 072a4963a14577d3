"""NVIDIA GPUs that `plan --compile` compiles for without having one: XLA:GPU target descriptions.

A deviceless XLA:GPU compile (`jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=TEXT, topology="1x<hosts>x<gpus per host>")`, `JAX_PLATFORMS=cpu`) needs the GPU
described as a `stream_executor.GpuTargetConfigProto` in text form. `target_config` renders one from
the facts below: what the device itself reports through the CUDA device query (compute capability,
SMs, clock, memory in bytes as `cudaMemGetInfo` sees it, L2, shared memory, bandwidth). They are
the same figures XLA keeps for its own deviceless tests in openxla/xla
`xla/backends/gpu/target_config/specs/*.txtpb` (Apache-2.0); only the fields that the pinned
jaxlib's proto knows are rendered (its proto predates e.g. `collective_memory_granularity`, which
XLA's current files carry).

Standard library only: the launcher picks the target from `plan.device`, the compiling subprocess
(`jaxrun.aot`) only reads the text it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional


@dataclass(frozen=True)
class GpuTarget:
    name: str  # the device's own name (what jax's device_kind and torch.cuda.get_device_name report)
    compute_capability: tuple
    sms: int
    clock_ghz: float
    memory_bytes: int  # device memory as the device reports it (a little under the datasheet's GB)
    memory_bandwidth: int  # bytes/s
    l2_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    fp32_units_per_sm: int
    cudnn: tuple = (9, 10, 0)


HOPPER = dict(compute_capability=(9, 0), sms=132, clock_ghz=1.98, l2_bytes=52428800, shared_memory_per_sm=233472,
              shared_memory_per_block_optin=232448, fp32_units_per_sm=128)
AMPERE = dict(compute_capability=(8, 0), sms=108, clock_ghz=1.41, l2_bytes=41943040, shared_memory_per_sm=167936,
              shared_memory_per_block_optin=166912, fp32_units_per_sm=64)

# plan.device (matched like launch.core.flops' datasheet: the longest key the name contains) -> target
TARGETS: Dict[str, GpuTarget] = {
    "h100": GpuTarget("NVIDIA H100 80GB HBM3", memory_bytes=84942979072, memory_bandwidth=3352320000000, **HOPPER),
    "h200": GpuTarget("NVIDIA H200 141GB HBM3e", memory_bytes=151397597184, memory_bandwidth=4800000000000, **HOPPER),
    "a100": GpuTarget("NVIDIA A100-SXM4-40GB", memory_bytes=42331013120, memory_bandwidth=1555200000000, **AMPERE),
    "a100-80gb": GpuTarget("NVIDIA A100-SXM4-80GB", memory_bytes=85100068864, memory_bandwidth=2039040000000, **AMPERE),
    "a100-sxm4-80gb": GpuTarget("NVIDIA A100-SXM4-80GB", memory_bytes=85100068864, memory_bandwidth=2039040000000, **AMPERE),
    "b200": GpuTarget("NVIDIA B200", compute_capability=(10, 0), sms=148, clock_ghz=1.965, memory_bytes=191514411008,
                      memory_bandwidth=7672320000000, l2_bytes=132644864, shared_memory_per_sm=233472,
                      shared_memory_per_block_optin=232448, fp32_units_per_sm=128),
}
# Names that contain a key above but are other parts (PCIe / NVL variants: other clocks, memory, SMs).
NOT_DESCRIBED = ("h100 pcie", "h100 nvl", "h200 nvl", "a100-pcie", "a100 pcie")


def lookup(device: str) -> Optional[GpuTarget]:
    """The target for a `plan.device` name (h100, H200, a100-80gb, b200, ...), or None."""
    kind = device.lower()
    if any(k in kind for k in NOT_DESCRIBED):
        return None
    for key in sorted(TARGETS, key=len, reverse=True):
        if key in kind:
            return TARGETS[key]
    return None


def known() -> str:
    return ", ".join(sorted(TARGETS))


def target_config(t: GpuTarget) -> str:
    """The GpuTargetConfigProto text of `t`, for `get_topology_desc(platform="cuda", target_config=...)`."""
    major, minor = t.compute_capability
    info = [
        ("threads_per_block_limit", 1024), ("threads_per_warp", 32), ("shared_memory_per_block", 49152),
        ("shared_memory_per_core", t.shared_memory_per_sm), ("threads_per_core_limit", 2048), ("core_count", t.sms),
        ("fpus_per_core", t.fp32_units_per_sm), ("block_dim_limit_x", 2147483647), ("block_dim_limit_y", 65535),
        ("block_dim_limit_z", 65535), ("memory_bandwidth", t.memory_bandwidth), ("l2_cache_size", t.l2_bytes),
        ("clock_rate_ghz", t.clock_ghz), ("device_memory_size", t.memory_bytes),
        ("shared_memory_per_block_optin", t.shared_memory_per_block_optin),
    ]
    lines = ["gpu_device_info {"] + [f"  {k}: {v}" for k, v in info]
    lines += ["  cuda_compute_capability {", f"    major: {major}", f"    minor: {minor}", "  }",
              "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536", "}",
              'platform_name: "CUDA"',
              "dnn_version_info {", f"  major: {t.cudnn[0]}", f"  minor: {t.cudnn[1]}", f"  patch: {t.cudnn[2]}", "}",
              f'device_description_str: "{t.name}"']
    return "\n".join(lines) + "\n"

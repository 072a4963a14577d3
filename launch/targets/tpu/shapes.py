"""What scaleout knows about Cloud TPU: slice shapes, software versions and zones per generation.

Sources (checked 2025): cloud.google.com/tpu/docs/runtimes ("TPU software versions": the version
to use with JAX per generation) and cloud.google.com/tpu/docs/regions-zones ("TPU regions and
zones"). The zone table is a union of that page's editions; a zone it does not name is passed on
to gcloud with no claim either way, a zone it names for other generations only is refused.

Values the user leaves unset (null) are derived from the generation: `tpu.runtime_version` from
RUNTIME_VERSIONS, `tpu.zone` from the first zone of ZONES.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from launch.config import ConfigError
from launch.config.schema import Config

TYPE_RE = re.compile(r"(v4|v5p|v5litepod|v6e)-(\d+)")

GENERATIONS = {
    # generation: (type prefix, TensorCores per chip in the name, valid chip counts, chips per host)
    "v5e": ("v5litepod", 1, (1, 4, 8, 16, 32, 64, 128, 256), 4),
    "v6e": ("v6e", 1, (1, 4, 8, 16, 32, 64, 128, 256), 4),
    "v4": ("v4", 2, tuple(2 ** k for k in range(2, 12)), 4),
    "v5p": ("v5p", 2, tuple(2 ** k for k in range(2, 13)), 4),
}
PREFIX_GEN = {v[0]: k for k, v in GENERATIONS.items()}

# generation: (the software version for JAX, other versions known to be for this generation)
RUNTIME_VERSIONS = {
    "v4": ("tpu-ubuntu2204-base", ("v2-alpha-tpuv4", "tpu-vm-v4-base")),
    "v5e": ("v2-alpha-tpuv5-lite", ()),
    "v5p": ("v2-alpha-tpuv5", ()),
    "v6e": ("v2-alpha-tpuv6e", ()),
}
RUNTIME_GEN = {v: g for g, (default, others) in RUNTIME_VERSIONS.items() for v in (default, *others)}

# generation: zones that offer it (the first is the default when tpu.zone is unset)
ZONES = {
    "v4": ("us-central2-b",),
    "v5e": ("us-west4-a", "us-west4-b", "us-central1-a", "us-south1-a", "us-west1-c", "us-east5-a", "us-east5-b",
            "us-east5-c"),
    "v5p": ("us-east5-a", "us-central1-a", "us-east5-b", "us-east5-c", "us-south1-a"),
    "v6e": ("us-east1-d", "us-central1-b", "us-east5-a", "us-east5-b", "us-east5-c", "us-east4-a", "us-east4-b",
            "us-west1-c", "europe-west4-a"),
}
KNOWN_ZONES = {z for zones in ZONES.values() for z in zones}

# Where the default tpu.setup puts the worker's Python environment, relative to the unpacked code
# (~/scaleout/<code version>/): ~/scaleout/venv, shared by every code version.
VENV_PYTHON = "../venv/bin/python"
VENV_TORCH_PYTHON = "../venv-torch/bin/python"  # framework=torch: torch + torch_tpu, in a venv of their own
MIN_PYTHON = (3, 11)  # what the pinned stack (constraints.txt: jax 0.10) needs; TPU VM images have 3.10


@dataclass(frozen=True)
class Slice:
    accelerator_type: str
    chips: int  # JAX devices (one per chip; v4/v5p megacore)
    workers: int  # hosts, one JAX process each
    generation: str


def _slice_for(gen: str, chips: int) -> Slice:
    prefix, cores, _, per_host = GENERATIONS[gen]
    single_host = chips <= (8 if cores == 1 else 4)
    return Slice(f"{prefix}-{chips * cores}", chips, 1 if single_host else chips // per_host, gen)


def slice_of(cfg: Config) -> Slice:
    t = cfg.tpu
    if t.accelerator_type:
        m = TYPE_RE.fullmatch(t.accelerator_type)
        if not m:
            raise ConfigError(f"tpu.accelerator_type={t.accelerator_type!r} is not valid; write e.g. v5litepod-16, v6e-8, v4-32 or v5p-8.")
        gen = PREFIX_GEN[m.group(1)]
        cores = GENERATIONS[gen][1]
        chips = int(m.group(2)) // cores
        if chips not in GENERATIONS[gen][2] or int(m.group(2)) % cores:
            raise ConfigError(f"tpu.accelerator_type={t.accelerator_type!r} is not a {gen} slice shape.")
        if chips != cfg.devices:
            raise ConfigError(f"tpu.accelerator_type={t.accelerator_type} has {chips} chips but devices={cfg.devices}; make them agree.")
        return _slice_for(gen, chips)
    valid = GENERATIONS[t.generation][2]
    if cfg.devices not in valid:
        raise ConfigError(f"devices={cfg.devices} is not a {t.generation} slice size; valid chip counts: {', '.join(map(str, valid))}.")
    return _slice_for(t.generation, cfg.devices)


def is_unset(cfg: Config, key: str) -> bool:
    """True when tpu.<key> is null: derived from the generation (or the default setup)."""
    return getattr(cfg.tpu, key, None) is None


def runtime_version(cfg: Config) -> str:
    """tpu.runtime_version, or the generation's software version for JAX when it is unset."""
    return RUNTIME_VERSIONS[slice_of(cfg).generation][0] if is_unset(cfg, "runtime_version") else cfg.tpu.runtime_version


def zone(cfg: Config) -> str:
    """tpu.zone, or the first zone that offers the generation when it is unset."""
    return ZONES[slice_of(cfg).generation][0] if is_unset(cfg, "zone") else cfg.tpu.zone


def check_runtime_and_zone(cfg: Config) -> None:
    """Refuse a software version known to be another generation's, and a known zone that does not offer this one."""
    gen = slice_of(cfg).generation
    version = runtime_version(cfg)
    other = RUNTIME_GEN.get(version)
    if other is not None and other != gen:
        raise ConfigError(f"tpu.runtime_version={version} is the software version for {other} TPUs, not {gen}; "
                          f"leave it unset for {gen}'s ({RUNTIME_VERSIONS[gen][0]}) or name a {gen} version.")
    z = zone(cfg)
    if z in KNOWN_ZONES and z not in ZONES[gen]:
        raise ConfigError(f"tpu.zone={z} does not offer {gen} TPUs (Cloud TPU lists {gen} in {', '.join(ZONES[gen])}); "
                          f"set tpu.zone to one of those or leave it unset for {ZONES[gen][0]}.")


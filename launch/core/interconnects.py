"""The interconnect datasheet: how fast one device can send to its peers, per tier, with sources.

Two tiers carry a training step's collectives (`launch.core.collectives`):

    intra   within a node (GPUs: NVLink or PCIe between the GPUs of one server) or, on TPU, ICI
            within a slice/pod (the chips' own torus links)
    inter   across nodes: the network (InfiniBand, RoCE, Ethernet) or, on TPU, the data-center
            network (DCN) between slices

Every figure is bytes per second **per device, in one direction**: what one device can push into a
collective while every other device does the same (the "bus bandwidth" of nccl-tests). Vendors
quote NVLink and ICI as a bidirectional total per device; those are halved here. Network rates are
per NIC; the table assumes one NIC of that rate per device (a rail-optimised DGX/HGX node: eight
GPUs, eight NICs), so a node whose devices share fewer NICs gets less than the table says.

These are datasheet peaks. What a collective achieves is lower (protocol overhead, message sizes,
topology); `launch.core.projection` uses the table only where the sweep did not measure a tier,
and then scales it by how far below the table the measured tier came in.

Sources (the Cloud TPU figures were read from Google's pages when this table was written; the others
are the vendors' published figures):
- NVLink per generation: NVIDIA, "NVLink and NVLink Switch" (nvidia.com/en-us/data-center/nvlink):
  NVLink 3 (A100) 600 GB/s, NVLink 4 (H100/H200 SXM) 900 GB/s, NVLink 5 (Blackwell) 1.8 TB/s,
  total bidirectional per GPU; NVLink bridges: H100 NVL 600 GB/s, H200 NVL 900 GB/s (their product briefs).
- PCIe: PCI-SIG, x16 links: Gen4 64 GB/s, Gen5 128 GB/s bidirectional (L4 and A10G are Gen4 x16,
  H100 PCIe Gen5 x16: their NVIDIA product briefs).
- InfiniBand: NVIDIA ConnectX-6 (HDR, 200 Gb/s), ConnectX-7 (NDR, 400 Gb/s), ConnectX-8 (XDR,
  800 Gb/s) product briefs; DGX A100: 8 x HDR, DGX H100/H200/B200: 8 x NDR compute NICs.
- AWS p5: EFA 3,200 Gbps per 8-GPU instance (AWS p5 documentation) = 400 Gb/s per GPU.
- Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e): v5e ICI 400
  GB/s bidirectional per chip, 2 x 100 Gbps NICs per 8-chip host, pod 256 chips; v5p ICI 1,200
  GB/s bidirectional per chip, DCN 50 Gbps per chip, 8,960 chips per pod, largest slice 6,144;
  v6e ICI 800 GB/s bidirectional per chip, 4 x 200 Gbps NICs per 8-chip host, pod 256 chips; v4
  pod 4,096 chips, six ICI links per chip at 400 Gb/s each way (Jouppi et al., "TPU v4", ISCA
  2023) = 300 GB/s per direction; v4's DCN rate per chip is not published.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from launch.core.flops import _datasheet as matching

GB = 1e9
TIERS = ("intra", "inter")


@dataclass(frozen=True)
class Link:
    """One interconnect: its name, bytes/s per device in one direction, and where the figure is from."""
    name: str
    bytes_per_s: Optional[float]
    source: str


def _gbit(gbps: float) -> float:
    return gbps * 1e9 / 8


# Within a node (GPU) or a slice (TPU), matched against the device kind string (longest key first).
INTRA: Dict[str, Link] = {
    "gb200": Link("NVLink 5", 900 * GB, "NVLink 5: 1.8 TB/s bidirectional per GPU (NVIDIA NVLink page)"),
    "b200": Link("NVLink 5", 900 * GB, "NVLink 5: 1.8 TB/s bidirectional per GPU (NVIDIA NVLink page)"),
    "h200 nvl": Link("NVLink bridge", 450 * GB, "H200 NVL: NVLink bridge 900 GB/s bidirectional (H200 NVL brief)"),
    "h200": Link("NVLink 4", 450 * GB, "NVLink 4: 900 GB/s bidirectional per GPU (NVIDIA NVLink page)"),
    "h100 nvl": Link("NVLink bridge", 300 * GB, "H100 NVL: NVLink bridge 600 GB/s bidirectional (H100 NVL brief)"),
    "h100 pcie": Link("PCIe Gen5 x16", 64 * GB, "PCIe Gen5 x16: 128 GB/s bidirectional (H100 PCIe brief)"),
    "h100": Link("NVLink 4", 450 * GB, "NVLink 4: 900 GB/s bidirectional per GPU (NVIDIA NVLink page)"),
    "a100-pcie": Link("PCIe Gen4 x16", 32 * GB, "PCIe Gen4 x16: 64 GB/s bidirectional (A100 PCIe brief)"),
    "a100 pcie": Link("PCIe Gen4 x16", 32 * GB, "PCIe Gen4 x16: 64 GB/s bidirectional (A100 PCIe brief)"),
    "a100": Link("NVLink 3", 300 * GB, "NVLink 3: 600 GB/s bidirectional per GPU (NVIDIA NVLink page)"),
    "l4": Link("PCIe Gen4 x16", 32 * GB, "PCIe Gen4 x16: 64 GB/s bidirectional (L4 brief)"),
    "a10g": Link("PCIe Gen4 x16", 32 * GB, "PCIe Gen4 x16: 64 GB/s bidirectional (A10G)"),
    "tpu v4": Link("ICI v4", 300 * GB, "6 ICI links x 400 Gb/s each way per chip (TPU v4, ISCA 2023)"),
    "tpu v5 lite": Link("ICI v5e", 200 * GB, "ICI 400 GB/s bidirectional per chip (Cloud TPU v5e docs)"),
    "tpu v5e": Link("ICI v5e", 200 * GB, "ICI 400 GB/s bidirectional per chip (Cloud TPU v5e docs)"),
    "tpu v5p": Link("ICI v5p", 600 * GB, "ICI 1,200 GB/s bidirectional per chip (Cloud TPU v5p docs)"),
    "tpu v5": Link("ICI v5p", 600 * GB, "ICI 1,200 GB/s bidirectional per chip (Cloud TPU v5p docs)"),
    "tpu v6 lite": Link("ICI v6e", 400 * GB, "ICI 800 GB/s bidirectional per chip (Cloud TPU v6e docs)"),
    "tpu v6e": Link("ICI v6e", 400 * GB, "ICI 800 GB/s bidirectional per chip (Cloud TPU v6e docs)"),
}

# Across nodes / slices, by name (`report.network` picks one).
NETWORKS: Dict[str, Link] = {
    "ib-hdr": Link("InfiniBand HDR", _gbit(200), "HDR 200 Gb/s per NIC, one NIC per device (ConnectX-6)"),
    "ib-ndr": Link("InfiniBand NDR", _gbit(400), "NDR 400 Gb/s per NIC, one NIC per device (ConnectX-7)"),
    "ib-xdr": Link("InfiniBand XDR", _gbit(800), "XDR 800 Gb/s per NIC, one NIC per device (ConnectX-8)"),
    "roce-200": Link("RoCE 200 GbE", _gbit(200), "200 Gb/s Ethernet per NIC, one NIC per device"),
    "roce-400": Link("RoCE 400 GbE", _gbit(400), "400 Gb/s Ethernet per NIC, one NIC per device"),
    "eth-100": Link("Ethernet 100 Gb/s", _gbit(100), "100 Gb/s per device"),
    "efa-p5": Link("AWS EFA (p5)", _gbit(400), "3,200 Gbps per 8-GPU p5 instance (AWS docs) = 400 Gb/s per GPU"),
    "dcn-v5e": Link("DCN v5e", _gbit(25), "2 x 100 Gbps NICs per 8-chip v5e host (Cloud TPU v5e docs) = 25 Gb/s per chip"),
    "dcn-v5p": Link("DCN v5p", _gbit(50), "DCN 50 Gbps per chip (Cloud TPU v5p docs)"),
    "dcn-v6e": Link("DCN v6e", _gbit(100), "4 x 200 Gbps NICs per 8-chip v6e host (Cloud TPU v6e docs) = 100 Gb/s per chip"),
}

# The network a device kind usually sits on when `report.network` does not say.
DEFAULT_NETWORK: Dict[str, str] = {
    "gb200": "ib-ndr", "b200": "ib-ndr", "h200": "ib-ndr", "h100": "ib-ndr", "a100": "ib-hdr",
    "l4": "eth-100", "a10g": "eth-100",
    "tpu v5 lite": "dcn-v5e", "tpu v5e": "dcn-v5e", "tpu v5p": "dcn-v5p", "tpu v5": "dcn-v5p",
    "tpu v6 lite": "dcn-v6e", "tpu v6e": "dcn-v6e",
}

# TPU: chips that one ICI domain (a slice inside one pod) can hold; beyond it, slices talk over DCN.
TPU_ICI_DOMAIN: Dict[str, int] = {"tpu v4": 4096, "tpu v5 lite": 256, "tpu v5e": 256, "tpu v5p": 6144,
                                  "tpu v5": 6144, "tpu v6 lite": 256, "tpu v6e": 256}


def is_tpu(device_kind: str) -> bool:
    return device_kind.lower().startswith("tpu")


def tier_names(device_kind: str) -> Dict[str, str]:
    """What each tier is called on this kind of device."""
    if is_tpu(device_kind):
        return {"intra": "ICI (within a slice)", "inter": "DCN (across slices)"}
    return {"intra": "within a node", "inter": "across nodes"}


def intra_link(device_kind: str) -> Optional[Link]:
    """The within-node (or ICI) link of a device kind; None when the table does not know it (CPU)."""
    return matching(INTRA, device_kind)


def inter_link(device_kind: str, network: Optional[str] = None) -> Optional[Link]:
    """The across-node link: `network` (a NETWORKS name) when given, else the device kind's usual one;
    None when neither says (CPU, TPU v4)."""
    name = network or matching(DEFAULT_NETWORK, device_kind)
    return NETWORKS[name] if name else None


def tpu_domain(device_kind: str) -> Optional[int]:
    """Chips one TPU ICI domain holds, or None for a device kind that is not a known TPU."""
    return matching(TPU_ICI_DOMAIN, device_kind)

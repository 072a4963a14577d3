"""The one FLOPs formula, used by both trainers, `plan` and the report.

FLOPs per token for a training step (forward + backward) = 6 * N + 12 * n_layers * seq_len * d_model

N counts every matmul parameter: the attention and MLP weights of every block and the lm head;
the input-embedding lookup and the norms are not matmuls and are excluded. The second term is the
attention scores (QK^T) and the weighted sum (AV): 2 matmuls * 2 FLOPs * 3 (fwd + bwd) * seq_len *
d_model per layer per token, with no discount for the causal mask (the PaLM / nanoGPT / torchtitan
convention). Rematerialisation does not change it: MFU counts model FLOPs, not hardware FLOPs.

Document masking (`model.attention=document`) does not change it either, in both frameworks: the
attention term keeps counting full causal attention over the whole row, as PaLM's convention does
for packed sequences. The FLOPs a document mask saves depend on the document lengths of each batch
(with documents of length L in a row of T, about L/T of the causal work is needed), and which of
them an implementation actually skips differs (flex_attention and splash attention skip masked
blocks; SDPA with a dense mask and XLA's dot_product_attention compute them and discard the
result). Counting the same model FLOPs for both masks keeps MFU a throughput figure on one scale:
a document-mask run that skips work shows it as a higher MFU and tokens/s, never as a smaller
denominator.

Tokens are real tokens. With dynamic shapes (`data.seq_lens`) the batch of step s has length L(s)
and global_batch * L(s) real tokens; the attention term uses L(s) for that step's tokens
(`flops_per_token(m, L)`), and tokens/s and MFU of a run are sums over its steady steps: real tokens
/ seconds, and the model FLOPs of those tokens / seconds / devices / peak. Padding
(`data.pad_to`) is never counted, neither as tokens nor as FLOPs: a padded run computes more than
it is credited with, and that waste shows as a lower tokens/s and MFU than an unpadded run's.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from launch.config.schema import ModelConfig
from launch.core.params import count_params

# Dense peak per device (FLOP/s) from vendor datasheets for each matmul precision a cell can run
# (`precision_of`): bf16 (tensor cores / MXU), tf32 (tensor cores; fp32 inputs with
# model.matmul_precision=tf32) and fp32 (fp32 arithmetic, model.matmul_precision=highest). NVIDIA
# quotes tensor-core figures "with sparsity": the dense figure is half of it. Matched against the
# device kind string that jax / torch report. TPU datasheets give bf16 only: an fp32 cell on a TPU
# is measured against it, and the report says so. CPU runs use a matmul calibrated in the same run.
PRECISIONS = ("bf16", "tf32", "fp32")
PEAK_FLOPS = {
    "gb200": {"bf16": 2500e12, "tf32": 1250e12, "fp32": 80e12},  # the Blackwell GPU of a GB200 superchip
    "b200": {"bf16": 2250e12, "tf32": 1125e12, "fp32": 75e12},  # HGX B200
    "h200 nvl": {"bf16": 835e12, "tf32": 418e12, "fp32": 60e12},
    "h200": {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12},  # SXM
    "h100 nvl": {"bf16": 835e12, "tf32": 418e12, "fp32": 60e12},
    "h100 pcie": {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "h100": {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12},  # SXM ("NVIDIA H100 80GB HBM3"); longer keys win
    "a100": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "l4": {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "a10g": {"bf16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "tpu v4": {"bf16": 275e12},
    "tpu v5 lite": {"bf16": 197e12},
    "tpu v5e": {"bf16": 197e12},
    "tpu v5p": {"bf16": 459e12},
    "tpu v5": {"bf16": 459e12},
    "tpu v6 lite": {"bf16": 918e12},
    "tpu v6e": {"bf16": 918e12},
}


# Memory per device (bytes) from vendor datasheets, matched the same way: what `plan --compile` and
# the sweep's fit check (`plan.check_fit`) compare a cell's per-device estimate against. The
# runtime keeps a little of it for itself (XLA:TPU reports e.g. 15.75 of v5e's 16 GiB as usable).
GIB = 2**30
HBM_BYTES = {
    "gb200": 186 * GIB,
    "b200": 180 * GIB,
    "h200": 141 * GIB,
    "h100 nvl": 94 * GIB,
    "h100": 80 * GIB,
    "a100-sxm4-80gb": 80 * GIB,
    "a100-pcie-80gb": 80 * GIB,
    "a100 80gb": 80 * GIB,
    "a100-80gb": 80 * GIB,
    "a100": 40 * GIB,  # the 40 GB part; the 80 GB ones say so in their name
    "l4": 24 * GIB,
    "a10g": 24 * GIB,
    "tpu v4": 32 * GIB,
    "tpu v5 lite": 16 * GIB,
    "tpu v5e": 16 * GIB,
    "tpu v5p": 95 * GIB,
    "tpu v5": 95 * GIB,
    "tpu v6 lite": 32 * GIB,
    "tpu v6e": 32 * GIB,
}


def flops_per_token(m: ModelConfig, seq_len: Optional[int] = None) -> int:
    """Model FLOPs per real token of a training step on sequences of `seq_len` (default model.seq_len)."""
    n = count_params(m)["matmul"]
    return 6 * n + 12 * m.n_layers * (seq_len or m.seq_len) * m.d_model


def _datasheet(table: Dict[str, Any], device_kind: str) -> Optional[Any]:
    """The entry of `table` whose key the device kind string contains, the most specific (longest) key first."""
    kind = device_kind.lower()
    for key in sorted(table, key=len, reverse=True):
        if key in kind:
            return table[key]
    return None


def precision_of(m: ModelConfig) -> str:
    """The matmul precision a cell runs: bf16 compute, else fp32 inputs as TF32 or as full fp32."""
    if m.dtype == "bf16":
        return "bf16"
    return "tf32" if m.matmul_precision == "tf32" else "fp32"


def peak_for(device_kind: str, precision: str = "bf16") -> Tuple[Optional[float], Optional[str]]:
    """(dense peak FLOP/s of one device at `precision`, the precision of the figure used): a TPU,
    whose datasheet has bf16 only, gives its bf16 peak for every precision; (None, None) when unknown."""
    row = _datasheet(PEAK_FLOPS, device_kind)
    if row is None:
        return None, None
    if precision in row:
        return row[precision], precision
    return row["bf16"], "bf16"


def datasheet_peak(device_kind: str, precision: str = "bf16") -> Optional[float]:
    """Dense peak FLOP/s of one device at `precision` for a device kind string, or None when unknown."""
    return peak_for(device_kind, precision)[0]


def peak_basis(device_kind: str, precision: str) -> str:
    """What an MFU figure is measured against, in words (recorded and shown in the report)."""
    peak, used = peak_for(device_kind, precision)
    if peak is None:
        return f"no datasheet peak for {device_kind}"
    note = "" if used == precision else f" (the datasheet gives no {precision} figure; the cell ran {precision})"
    return f"datasheet dense {used} peak of {device_kind}, {peak / 1e12:g} TFLOP/s{note}"


def mfu(tokens_per_s_per_device: float, m: ModelConfig, peak_flops_per_device: float) -> float:
    return tokens_per_s_per_device * flops_per_token(m) / peak_flops_per_device


def datasheet_hbm(device_kind: str) -> Optional[int]:
    """Datasheet memory of one device (bytes) for a device kind string, or None when unknown."""
    return _datasheet(HBM_BYTES, device_kind)

"""The one FLOPs formula, used by both trainers, `plan` and the report.

FLOPs per token for a training step (forward + backward) = 6 * N + 12 * n_layers * seq_len * d_model

N counts every matmul parameter: the attention and MLP weights of every block and the lm head;
the input-embedding lookup and the norms are not matmuls and are excluded. The second term is the
attention scores (QK^T) and the weighted sum (AV): 2 matmuls * 2 FLOPs * 3 (fwd + bwd) * seq_len *
d_model per layer per token, with no discount for the causal mask (the PaLM / nanoGPT / torchtitan
convention). Rematerialisation does not change it: MFU counts model FLOPs, not hardware FLOPs.
"""

from __future__ import annotations

from typing import Optional

from launch.params import count_params
from launch.schema import ModelConfig

# Dense bf16 peak per device (FLOP/s) from vendor datasheets, matched against the device kind
# string that jax / torch report. fp32 runs are still measured against this number (it is the
# hardware's peak); CPU runs use a matmul calibrated in the same run instead.
PEAK_FLOPS = {
    "h200": 989e12,
    "h100": 989e12,
    "a100": 312e12,
    "l4": 121e12,
    "a10g": 125e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,
    "tpu v6e": 918e12,
}


def flops_per_token(m: ModelConfig) -> int:
    n = count_params(m)["matmul"]
    return 6 * n + 12 * m.n_layers * m.seq_len * m.d_model


def datasheet_peak(device_kind: str) -> Optional[float]:
    kind = device_kind.lower()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in kind:
            return PEAK_FLOPS[key]
    return None


def mfu(tokens_per_s_per_device: float, m: ModelConfig, peak_flops_per_device: float) -> float:
    return tokens_per_s_per_device * flops_per_token(m) / peak_flops_per_device

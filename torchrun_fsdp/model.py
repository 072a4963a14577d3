"""The Llama-style decoder in PyTorch, the same math as `jaxrun.model`.

Parameter names and (in, out) layouts follow `launch.core.params`, so `x @ W` reads the same in both
frameworks and weights move between them without transposes. RoPE uses the rotate-half layout.

`model.attention=document`: `forward` also takes `segment_ids` and `positions` (batch, seq) from
`launch.data.batches.DocBatch`; RoPE uses the per-document positions and attention is document-causal,
by one of two implementations (`torch.document_mask_impl`, resolved by the trainer):
- flex: `torch.nn.attention.flex_attention` with a `BlockMask` built once per step from the
  segment ids (`create_block_mask`); blocks that are masked out entirely are skipped. It is
  always compiled (`torch.compile(flex_attention)`, or inside the compiled block with
  `torch.compile=true`). torch 2.13's CPU build runs it forward only ("FlexAttention does not
  support backward on CPU"), so training on CPU uses sdpa.
- sdpa: `scaled_dot_product_attention` with a dense (batch, 1, seq, seq) boolean mask
  (same document and causal): every block is computed.
Which SDPA backend runs is not left to SDPA's own choice: the trainer resolves `model.attention_impl`
(`launch.core.attention`), probes the kernel on its device (`probe_attention`) and enables that one
backend alone (`use_attention_kernel`): `flash` / `efficient` (fused) or `math` (dense), so the kernel
recorded in the start record is the one that ran (SDPA raises rather than fall back to another).
`model.norm_impl=custom` uses `torchrun_fsdp.ops.rms_norm_custom` (a torch.library op with a
hand-written backward).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from launch.config.schema import ModelConfig
from torchrun_fsdp.ops import rms_norm_custom

DOCUMENT_MASK_IMPLS = ("flex", "sdpa")
_compiled_flex = None


def flex_attention_compiled():
    """`flex_attention` under torch.compile (eager flex_attention is a slow reference)."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def document_block_mask(segment_ids: torch.Tensor):
    """The document-causal BlockMask of flex_attention: same document and not in the future."""
    from torch.nn.attention.flex_attention import create_block_mask
    B, T = segment_ids.shape

    def document_causal(b, h, q_idx, kv_idx):
        return (segment_ids[b, q_idx] == segment_ids[b, kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(document_causal, B, None, T, T, device=segment_ids.device)


def document_dense_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool for SDPA: True where query i may attend to key j."""
    T = segment_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()
    return ((segment_ids[:, :, None] == segment_ids[:, None, :]) & causal)[:, None]


SDPA_KERNELS = ("flash", "efficient", "math")


def _sdpa_backend(kernel: str):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[kernel]


def probe_attention(kernel: str, m: ModelConfig, device: torch.device, documents: bool) -> Optional[str]:
    """None when `kernel` runs forward and backward for this model's attention shapes (one row) in its
    compute dtype on `device`, else the first line of why not. flex is not probed on CUDA (it is
    compiled on the first step); torch 2.13's CPU build has no flex_attention backward."""
    if kernel == "flex":
        return None if device.type == "cuda" else "flex_attention has no backward on CPU in this torch"
    from torch.nn.attention import sdpa_kernel
    H, hd, T = m.n_heads, m.d_model // m.n_heads, m.seq_len
    dtype = torch.bfloat16 if m.dtype == "bf16" else torch.float32
    q = torch.randn(1, H, T, hd, dtype=dtype, device=device, requires_grad=True)
    mask = torch.ones(1, 1, T, T, dtype=torch.bool, device=device).tril() if documents else None
    try:
        with sdpa_kernel([_sdpa_backend(kernel)]):
            out = (F.scaled_dot_product_attention(q, q, q, attn_mask=mask) if documents
                   else F.scaled_dot_product_attention(q, q, q, is_causal=True))
            out.float().sum().backward()
    except RuntimeError as e:
        return (str(e).strip().splitlines() or ["RuntimeError"])[0][:300]
    return None


def use_attention_kernel(kernel: str) -> None:
    """Enable exactly one SDPA backend for this process (flash, efficient or math; flex uses none):
    SDPA then runs that kernel or raises, never another one silently."""
    if kernel not in SDPA_KERNELS:
        return
    torch.backends.cuda.enable_flash_sdp(kernel == "flash")
    torch.backends.cuda.enable_mem_efficient_sdp(kernel == "efficient")
    torch.backends.cuda.enable_math_sdp(kernel == "math")
    torch.backends.cuda.enable_cudnn_sdp(False)


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, impl: str = "native"):
        super().__init__()
        self.eps, self.impl = eps, impl
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "custom":
            return rms_norm_custom(x, self.weight, self.eps)
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None, positions=None):
    """cos, sin (seq, head_dim), or (batch, 1, seq, head_dim) for explicit `positions` (batch, seq)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    pos = torch.arange(seq_len, dtype=torch.float32, device=device) if positions is None else positions.float()
    freqs = pos[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    if positions is not None:
        emb = emb[:, None]  # broadcast over heads
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, heads, seq, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.n_heads = m.n_heads
        self.wq, self.wk, self.wv, self.wo = (_param(m.d_model, m.d_model) for _ in range(4))

    def forward(self, x, cos, sin, mask=None):
        B, T, D = x.shape
        H = self.n_heads
        q = (x @ self.wq).view(B, T, H, D // H).transpose(1, 2)
        k = (x @ self.wk).view(B, T, H, D // H).transpose(1, 2)
        v = (x @ self.wv).view(B, T, H, D // H).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if mask is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif isinstance(mask, torch.Tensor):
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:  # a flex_attention BlockMask
            a = flex_attention_compiled()(q, k, v, block_mask=mask)
        return a.transpose(1, 2).reshape(B, T, D) @ self.wo


class FeedForward(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.w1, self.w3 = _param(m.d_model, m.d_ff), _param(m.d_model, m.d_ff)
        self.w2 = _param(m.d_ff, m.d_model)

    def forward(self, x):
        return (F.silu(x @ self.w1) * (x @ self.w3)) @ self.w2


class TransformerBlock(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(m.d_model, m.norm_eps, m.norm_impl)
        self.attention = Attention(m)
        self.ffn_norm = RMSNorm(m.d_model, m.norm_eps, m.norm_impl)
        self.feed_forward = FeedForward(m)

    def forward(self, x, cos, sin, mask=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, m: ModelConfig, document_mask_impl: str = "sdpa"):
        super().__init__()
        if document_mask_impl not in DOCUMENT_MASK_IMPLS:
            raise ValueError(f"document_mask_impl={document_mask_impl!r}: use one of {', '.join(DOCUMENT_MASK_IMPLS)}.")
        self.m, self.document_mask_impl = m, document_mask_impl
        self.tok_embeddings = _param(m.vocab_size, m.d_model)
        self.layers = nn.ModuleList(TransformerBlock(m) for _ in range(m.n_layers))
        self.norm = RMSNorm(m.d_model, m.norm_eps, m.norm_impl)
        self.output = _param(m.d_model, m.vocab_size)

    def forward(self, tokens: torch.Tensor, segment_ids: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab) float32. With `segment_ids` a
        token attends only to earlier tokens of its own document; `positions` are RoPE positions."""
        m = self.m
        x = F.embedding(tokens, self.tok_embeddings)
        cos, sin = rope_tables(tokens.shape[1], m.d_model // m.n_heads, m.rope_theta, tokens.device, positions)
        mask = None
        if segment_ids is not None:
            mask = (document_block_mask(segment_ids) if self.document_mask_impl == "flex"
                    else document_dense_mask(segment_ids))
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return (self.norm(x) @ self.output).float()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

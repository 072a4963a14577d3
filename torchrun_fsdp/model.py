"""The Llama-style decoder in PyTorch, the same math as `jaxrun.model`.

Parameter names and (in, out) layouts follow `launch.params`, so `x @ W` reads the same in both
frameworks and weights move between them without transposes. RoPE uses the rotate-half layout.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from launch.schema import ModelConfig


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
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

    def forward(self, x, cos, sin):
        B, T, D = x.shape
        H = self.n_heads
        q = (x @ self.wq).view(B, T, H, D // H).transpose(1, 2)
        k = (x @ self.wk).view(B, T, H, D // H).transpose(1, 2)
        v = (x @ self.wv).view(B, T, H, D // H).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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
        self.attention_norm = RMSNorm(m.d_model, m.norm_eps)
        self.attention = Attention(m)
        self.ffn_norm = RMSNorm(m.d_model, m.norm_eps)
        self.feed_forward = FeedForward(m)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.m = m
        self.tok_embeddings = _param(m.vocab_size, m.d_model)
        self.layers = nn.ModuleList(TransformerBlock(m) for _ in range(m.n_layers))
        self.norm = RMSNorm(m.d_model, m.norm_eps)
        self.output = _param(m.d_model, m.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab) float32."""
        m = self.m
        x = F.embedding(tokens, self.tok_embeddings)
        cos, sin = rope_tables(tokens.shape[1], m.d_model // m.n_heads, m.rope_theta, tokens.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return (self.norm(x) @ self.output).float()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

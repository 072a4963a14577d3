"""The Llama-style decoder in Flax NNX, layers stacked on a leading axis and scanned.

token embedding -> n_layers x [RMSNorm -> causal attention with RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> lm head. No biases.

Attention is `jax.nn.dot_product_attention(..., is_causal=True, implementation=KERNEL)` with the
kernel `model.attention_impl` resolved to (`launch.core.attention`; the trainer probes it on its
device and records it): `cudnn`, cuDNN's fused flash attention (GPU, bf16), or `xla`, XLA's dense
path (every score materialised; what `implementation=None` falls back to in jax 0.10).

`model.attention=document`: the call also takes `segment_ids` and `positions` (batch, seq) from
`launch.data.batches.DocBatch`; RoPE uses the per-document positions and attention gets the boolean
mask segment_q == segment_k on top of `is_causal` (cuDNN takes it as a dense mask: fused, but every
block is computed; `jax.nn.dot_product_attention` has no segment-id argument). On TPU the kernel that skips the masked blocks instead of computing and discarding them is
splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`, `SegmentIds(q, kv)` with a
`CausalMask`): scaleout does not call it yet, so a TPU run computes every block of the dense mask.
`model.norm_impl=custom` uses `jaxrun.ops.rms_norm_custom` (a `jax.custom_vjp`). Weights are fp32
(the master copy); `model.dtype=bf16` casts them to bf16 for the matmuls. Parameter names
and (in, out) layouts follow `launch.core.params`, with per-block entries stacked on axis 0.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrun.ops import rms_norm_custom
from launch.config.schema import ModelConfig

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _normal(rngs: nnx.Rngs, shape, std) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class RMSNorm(nnx.Module):
    def __init__(self, shape):
        self.weight = nnx.Param(jnp.ones(shape, jnp.float32))


class Attention(nnx.Module):
    def __init__(self, m: ModelConfig, rngs: nnx.Rngs):
        L, d = m.n_layers, m.d_model
        out_std = m.init_std / (2 * m.n_layers) ** 0.5
        self.wq = nnx.Param(_normal(rngs, (L, d, d), m.init_std))
        self.wk = nnx.Param(_normal(rngs, (L, d, d), m.init_std))
        self.wv = nnx.Param(_normal(rngs, (L, d, d), m.init_std))
        self.wo = nnx.Param(_normal(rngs, (L, d, d), out_std))


class FeedForward(nnx.Module):
    def __init__(self, m: ModelConfig, rngs: nnx.Rngs):
        L, d, f = m.n_layers, m.d_model, m.d_ff
        out_std = m.init_std / (2 * m.n_layers) ** 0.5
        self.w1 = nnx.Param(_normal(rngs, (L, d, f), m.init_std))
        self.w3 = nnx.Param(_normal(rngs, (L, d, f), m.init_std))
        self.w2 = nnx.Param(_normal(rngs, (L, f, d), out_std))


class Layers(nnx.Module):
    """All blocks' weights, stacked: every parameter has a leading n_layers axis."""

    def __init__(self, m: ModelConfig, rngs: nnx.Rngs):
        self.attention_norm = RMSNorm((m.n_layers, m.d_model))
        self.attention = Attention(m, rngs)
        self.ffn_norm = RMSNorm((m.n_layers, m.d_model))
        self.feed_forward = FeedForward(m, rngs)


class Transformer(nnx.Module):
    def __init__(self, m: ModelConfig, rngs: nnx.Rngs):
        self.tok_embeddings = nnx.Param(_normal(rngs, (m.vocab_size, m.d_model), m.init_std))
        self.layers = Layers(m, rngs)
        self.norm = RMSNorm((m.d_model,))
        self.output = nnx.Param(_normal(rngs, (m.d_model, m.vocab_size), m.init_std))

    def __call__(self, tokens: jax.Array, m: ModelConfig,
                 constrain: Callable[[jax.Array], jax.Array] = lambda x: x,
                 segment_ids: Optional[jax.Array] = None, positions: Optional[jax.Array] = None,
                 attention_kernel: str = "xla") -> jax.Array:
        """tokens (batch, seq) int32 -> logits (batch, seq, vocab) float32. With `segment_ids`
        (batch, seq) a token attends only to earlier tokens of its own document; `positions`
        (batch, seq) replace 0..seq-1 as RoPE positions; `attention_kernel` is the `implementation`
        of `jax.nn.dot_product_attention` (xla | cudnn)."""
        dtype = DTYPES[m.dtype]
        x = constrain(jnp.take(self.tok_embeddings[...], tokens, axis=0).astype(dtype))
        cos, sin = rope_tables(tokens.shape[1], m.d_model // m.n_heads, m.rope_theta, positions)
        mask = None if segment_ids is None else document_mask(segment_ids)
        lp = self.layers
        stacked = {
            "attention_norm": lp.attention_norm.weight[...], "ffn_norm": lp.ffn_norm.weight[...],
            "wq": lp.attention.wq[...], "wk": lp.attention.wk[...], "wv": lp.attention.wv[...],
            "wo": lp.attention.wo[...], "w1": lp.feed_forward.w1[...], "w2": lp.feed_forward.w2[...],
            "w3": lp.feed_forward.w3[...],
        }

        def block_fn(x, p):
            return constrain(block(x, p, cos, sin, m, mask, attention_kernel)), None

        if m.remat != "none":
            block_fn = jax.checkpoint(block_fn, policy=REMAT_POLICIES[m.remat])
        if m.scan_layers:
            x, _ = jax.lax.scan(block_fn, x, stacked)
        else:
            for i in range(m.n_layers):
                x, _ = block_fn(x, jax.tree.map(lambda a: a[i], stacked))
        x = norm(x, self.norm.weight[...], m)
        return (x @ self.output[...].astype(dtype)).astype(jnp.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight).astype(x.dtype)


def norm(x: jax.Array, weight: jax.Array, m: ModelConfig) -> jax.Array:
    """RMSNorm by `model.norm_impl`: autodiff of `rms_norm`, or the hand-written backward."""
    if m.norm_impl == "custom":
        return rms_norm_custom(x, weight, m.norm_eps)
    return rms_norm(x, weight, m.norm_eps)


def document_mask(segment_ids: jax.Array) -> jax.Array:
    """(batch, 1, seq, seq) bool: query i may see key j of the same document (causality is added
    by `is_causal`)."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, :, :]


def rope_tables(seq_len: int, head_dim: int, theta: float, positions: Optional[jax.Array] = None):
    """cos, sin of shape (seq, head_dim), or (batch, seq, head_dim) for explicit `positions`."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    pos = jnp.arange(seq_len, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)
    freqs = pos[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # (..., seq, head_dim), the rotate-half layout
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x (batch, seq, heads, head_dim); rotate-half convention (as in Llama's HF port and torchtitan's real form)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    if cos.ndim == 2:
        c, s = cos[None, :, None, :], sin[None, :, None, :]
    else:  # per-row positions
        c, s = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * c + rotated.astype(jnp.float32) * s).astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: Optional[jax.Array], kernel: str) -> jax.Array:
    """Causal attention of (batch, seq, heads, head_dim) q, k, v with `kernel` (xla | cudnn)."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=kernel)


def probe_attention(kernel: str, m: ModelConfig, device, documents: bool) -> Optional[str]:
    """None when `kernel` compiles, forward and backward, for this model's attention shapes (one row)
    in its dtype on `device`; else the first line of the reason (e.g. cuDNN missing or refusing)."""
    H, hd = m.n_heads, m.d_model // m.n_heads
    x = jax.ShapeDtypeStruct((1, m.seq_len, H, hd), DTYPES[m.dtype], sharding=jax.sharding.SingleDeviceSharding(device))
    mask = (jax.ShapeDtypeStruct((1, 1, m.seq_len, m.seq_len), jnp.bool_, sharding=x.sharding) if documents else None)

    def loss(q, k, v, mask):
        return attend(q, k, v, mask, kernel).astype(jnp.float32).sum()

    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, mask).compile()
    except Exception as e:  # what the kernel's own checks say (shapes, dtype, cuDNN version, no cuDNN)
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    return None


def block(x: jax.Array, p: dict, cos, sin, m: ModelConfig, mask: Optional[jax.Array] = None,
          attention_kernel: str = "xla") -> jax.Array:
    """One transformer block; `p` holds this layer's weights (no layer axis)."""
    dtype = x.dtype
    B, T, _ = x.shape
    H, hd = m.n_heads, m.d_model // m.n_heads
    h = norm(x, p["attention_norm"], m)
    q = (h @ p["wq"].astype(dtype)).reshape(B, T, H, hd)
    k = (h @ p["wk"].astype(dtype)).reshape(B, T, H, hd)
    v = (h @ p["wv"].astype(dtype)).reshape(B, T, H, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    a = attend(q, k, v, mask, attention_kernel).reshape(B, T, H * hd)
    x = x + a @ p["wo"].astype(dtype)
    h = norm(x, p["ffn_norm"], m)
    g = jax.nn.silu(h @ p["w1"].astype(dtype)) * (h @ p["w3"].astype(dtype))
    return x + g @ p["w2"].astype(dtype)


def cross_entropy(logits: jax.Array, targets: jax.Array, masked: bool = False) -> jax.Array:
    """Mean next-token cross-entropy in fp32. `masked`: targets < 0 (padding,
    `launch.data.batches.IGNORE`) are left out, the mean is over the real targets (torch's
    `ignore_index`)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if not masked:
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
    real = targets >= 0
    nll = -jnp.take_along_axis(logp, jnp.where(real, targets, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(real, nll, 0.0)) / jnp.maximum(jnp.sum(real), 1)

"""Hand-written ops of the JAX model: RMSNorm with a custom backward (`model.norm_impl=custom`).

`rms_norm_custom` is a `jax.custom_vjp`: the forward saves only x, the weight and the per-row
reciprocal RMS, and the backward is written out instead of derived by autodiff:

    r = 1 / sqrt(mean(x^2) + eps),  y = x * r,  out = y * w
    dw = sum over rows of (g * y),  dy = g * w,  dx = r * (dy - y * mean(dy * y))

All of it in fp32, cast back to the input dtypes, as the native version does.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm_custom(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    out, _ = _forward(x, weight, eps)
    return out


def _forward(x, weight, eps):
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * r * weight.astype(jnp.float32)).astype(x.dtype), r


def _fwd(x, weight, eps):
    out, r = _forward(x, weight, eps)
    return out, (x, weight, r)


def _bwd(eps, res, g):
    x, weight, r = res
    g32 = g.astype(jnp.float32)
    y = x.astype(jnp.float32) * r
    dw = jnp.sum(g32 * y, axis=tuple(range(g.ndim - 1)))
    dy = g32 * weight.astype(jnp.float32)
    dx = r * (dy - y * jnp.mean(dy * y, axis=-1, keepdims=True))
    return dx.astype(x.dtype), dw.astype(weight.dtype)


rms_norm_custom.defvjp(_fwd, _bwd)

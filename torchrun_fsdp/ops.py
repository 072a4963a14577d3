"""Hand-written ops of the PyTorch model: RMSNorm with a custom backward (`model.norm_impl=custom`).

Written the way torch wants a custom op to be, so that `torch.compile(fullgraph=True)` keeps it in
the graph with no break: two `torch.library.custom_op`s (forward and backward), each with a fake
(meta) implementation for tracing, tied together with `register_autograd`. The math is
`jaxrun.ops`': r = 1/sqrt(mean(x^2) + eps), y = x r, out = y w; dw = sum(g y),
dx = r (g w - y mean(g w y)); fp32 inside, the input dtypes outside.
"""

from __future__ import annotations

from typing import Tuple

import torch


@torch.library.custom_op("scaleout::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * r * weight.float()).to(x.dtype)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("scaleout::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    x32, g32 = x.float(), grad.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = x32 * r
    dw = (g32 * y).reshape(-1, x.shape[-1]).sum(0)
    dy = g32 * weight.float()
    dx = r * (dy - y * (dy * y).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw.to(weight.dtype)


@rms_norm_backward_op.register_fake
def _(grad, x, weight, eps):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(grad.contiguous(), x, weight, ctx.eps)
    return dx, dw, None


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm_custom(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_op(x, weight, eps)

"""A minimal reference: the same model math as a plain eager PyTorch loop, no FSDP, no scaleout.

`python -m bench.ref_torch --preset small --steps N` prints {"tokens_per_s": ...} (wall clock over
N steps after 3 warm-up steps).
"""

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from launch import config
from launch.core.params import init_param, named_params
from launch.data.batches import Batches
from torchrun_fsdp.train import MATMUL_PRECISION


def rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    cfg = config.load([f"model={args.preset}"])
    m, t = cfg.model, cfg.train
    torch.set_float32_matmul_precision(MATMUL_PRECISION[m.matmul_precision])  # as the trainer
    p = {n: torch.tensor(init_param(m, t.seed, n, s), requires_grad=True) for n, s in named_params(m)}
    decay = [p[n] for n, s in named_params(m) if s.decay]
    rest = [p[n] for n, s in named_params(m) if not s.decay]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2),
                            eps=t.eps, weight_decay=t.weight_decay, foreach=True)
    T, D, H = m.seq_len, m.d_model, m.n_heads
    f = torch.outer(torch.arange(T, dtype=torch.float32), 1.0 / 10000.0 ** (torch.arange(0, D // H, 2) / (D // H)))
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()

    def rope(x):
        return x * cos + torch.cat([-x[..., D // H // 2:], x[..., :D // H // 2]], -1) * sin

    def loss_fn(x, y):
        B = x.shape[0]
        h = F.embedding(x, p["tok_embeddings"])
        for i in range(m.n_layers):
            L = lambda n: p[f"layers.{i}.{n}"]
            a = rms(h, L("attention_norm.weight"))
            q, k, v = ((a @ L(f"attention.{n}")).view(B, T, H, D // H).transpose(1, 2) for n in ("wq", "wk", "wv"))
            o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
            h = h + o.transpose(1, 2).reshape(B, T, D) @ L("attention.wo")
            a = rms(h, L("ffn_norm.weight"))
            h = h + (F.silu(a @ L("feed_forward.w1")) * (a @ L("feed_forward.w3"))) @ L("feed_forward.w2")
        logits = rms(h, p["norm.weight"]) @ p["output"]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))

    data = Batches(cfg.data, m.vocab_size, m.seq_len)
    batches = [tuple(torch.from_numpy(a.astype(np.int64)) for a in data.split(s, 0, t.global_batch)) for s in range(args.steps + 3)]

    def step(x, y):
        loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(p.values()), t.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for s in range(3):
        step(*batches[s])
    t0 = time.perf_counter()
    for s in range(3, args.steps + 3):
        loss = step(*batches[s])
    dt = time.perf_counter() - t0
    print(json.dumps({"tokens_per_s": args.steps * t.global_batch * m.seq_len / dt, "loss": float(loss.detach())}))


if __name__ == "__main__":
    main()

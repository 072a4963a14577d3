"""A minimal reference: the same model math as a plain `jax.jit` train step, no scaleout machinery.

`python -m bench.ref_jax --preset small --steps N` prints {"tokens_per_s": ...} (wall clock over
N steps after 3 warm-up steps, one sync at the end, data already on the device).
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import optax

from jaxrun.train import MATMUL_PRECISION
from launch import config
from launch.core.params import init_param, init_stacked, param_table
from launch.data.batches import Batches


def rms(x, w, eps=1e-5):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def rope(x, T, hd):
    f = jnp.outer(jnp.arange(T, dtype=jnp.float32), 1.0 / 10000.0 ** (jnp.arange(0, hd, 2) / hd))
    cos, sin = jnp.cos(jnp.concatenate([f, f], -1))[None, :, None], jnp.sin(jnp.concatenate([f, f], -1))[None, :, None]
    return x * cos + jnp.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin


def loss_fn(p, x, y, H):
    B, T = x.shape
    h = p["tok_embeddings"][x]
    D = h.shape[-1]

    def block(h, l):
        a = rms(h, l["attention_norm"])
        q, k, v = (rope((a @ l[n]).reshape(B, T, H, D // H), T, D // H) if n != "wv" else (a @ l[n]).reshape(B, T, H, D // H)
                   for n in ("wq", "wk", "wv"))
        h = h + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, D) @ l["wo"]
        a = rms(h, l["ffn_norm"])
        return h + (jax.nn.silu(a @ l["w1"]) * (a @ l["w3"])) @ l["w2"], None

    h, _ = jax.lax.scan(block, h, p["layers"])
    logits = rms(h, p["norm"]) @ p["output"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    cfg = config.load([f"model={args.preset}"])
    m, t = cfg.model, cfg.train
    jax.config.update("jax_default_matmul_precision", MATMUL_PRECISION[m.matmul_precision])  # as the trainer
    p = {"layers": {}}
    for spec in param_table(m):
        short = spec.name.split(".")[-2] if spec.name.endswith(".weight") else spec.name.split(".")[-1]
        if spec.per_layer:
            p["layers"][short] = jnp.asarray(init_stacked(m, t.seed, spec))
        else:
            p[spec.name.split(".")[0]] = jnp.asarray(init_param(m, t.seed, spec.name, spec))
    tx = optax.chain(optax.clip_by_global_norm(t.clip_norm), optax.adamw(t.lr, t.beta1, t.beta2, t.eps, t.weight_decay))
    opt = tx.init(p)

    @jax.jit
    def step(p, opt, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y, m.n_heads)
        u, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, u), opt, loss

    data = Batches(cfg.data, m.vocab_size, m.seq_len)
    batches = [tuple(jnp.asarray(a) for a in data.split(s, 0, t.global_batch)) for s in range(args.steps + 3)]
    for s in range(3):
        p, opt, loss = step(p, opt, *batches[s])
    loss.block_until_ready()
    t0 = time.perf_counter()
    for s in range(3, args.steps + 3):
        p, opt, loss = step(p, opt, *batches[s])
    loss.block_until_ready()
    dt = time.perf_counter() - t0
    print(json.dumps({"tokens_per_s": args.steps * t.global_batch * m.seq_len / dt, "loss": float(loss)}))


if __name__ == "__main__":
    main()

"""Per-rank peak memory of the PyTorch trainer for a world size this machine does not have.

    python -m torchrun_fsdp.memory CELL.yaml   -> a JSON list with one estimate on stdout (launch.launcher.aot runs it)

One process stands in for rank 0 of `devices` ranks, as torchtitan's memory estimator does:
- a fake process group (`init_process_group("fake", ...)`): every collective returns at once, so
  FSDP2 shards, all-gathers and reduce-scatters exactly as for `devices` ranks without any peer;
- `FakeTensorMode`: tensors have shapes, dtypes and devices but no storage, and nothing is
  computed, so a 1b model's step costs seconds and no memory;
- the trainer's own model and wrapping (`torchrun_fsdp.model.Transformer`, `parallel.parallelize`:
  activation checkpointing, FSDP2 or HSDP, mixed precision), AdamW, and the trainer's step
  (grad-accumulation micro-batches with gradient sync on the last only, clip, AdamW step) done
  twice, so the second step runs with optimizer state allocated;
- `torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker` counts every tensor alive at each
  moment by category (sharded/unsharded parameters, gradients, activations, temporaries,
  all-gather and reduce-scatter buffers, optimizer state, inputs); the estimate is its peak total.

What it leaves out: the framework's own footprint (CUDA context, allocator rounding and
fragmentation, on CPU the interpreter and libraries) and `torch.compile` (estimated eager; the
compiled blocks fuse ops and usually need less). Should the tracker fail on some build, the
estimate falls back to `analytic` (state bytes plus an activation formula) and says so.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from launch import config as config_mod
from launch.config.schema import Config
from launch.core.params import count_params
from torchrun_fsdp import parallel
from torchrun_fsdp.model import Transformer, cross_entropy

log = logging.getLogger(__name__)
DEVICE = "cpu"  # fake tensors on the CPU device type: a CPU-only build cannot make CUDA ones


def _optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW as `TorchEngine` builds it (foreach; the weight-decay groups do not change its memory)."""
    t = cfg.train
    return torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                             weight_decay=t.weight_decay, foreach=True)


def _step(model, optimizer, inputs, targets, cfg: Config, after_micro_batch=lambda: None) -> None:
    """`TorchEngine.train_step` without the host-side parts (data, logging, checkpoints)."""
    t = cfg.train
    rows = inputs.shape[0]
    for j in range(t.grad_accum):
        sel = slice(None) if t.grad_accum == 1 else torch.arange(j, rows, t.grad_accum, device=inputs.device)
        if t.grad_accum > 1 and hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(j == t.grad_accum - 1)
        loss = cross_entropy(model(inputs[sel]), targets[sel])
        (loss / t.grad_accum).backward()
        after_micro_batch()
    torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm if t.clip_norm > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def tracked(cfg: Config) -> Dict[str, Any]:
    """The peak of one rank under FSDPMemTracker, FakeTensorMode and a fake process group."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    world = cfg.devices
    mesh = parallel.build_mesh(cfg, DEVICE)
    m = cfg.model
    rows = cfg.train.global_batch // world
    with FakeTensorMode():
        with torch.device("meta"):
            model = Transformer(m)
        parallel.parallelize(model, cfg, mesh)
        model.to_empty(device=DEVICE)
        optimizer = _optimizer(model, cfg)
        inputs = torch.randint(0, m.vocab_size, (rows, m.seq_len), device=DEVICE)
        targets = torch.randint(0, m.vocab_size, (rows, m.seq_len), device=DEVICE)
        tracker = FSDPMemTracker(mod=model, optm=optimizer)
        tracker.track_inputs((inputs, targets))
        with tracker:
            for _ in range(2):  # the second step has optimizer state (as every step after the first)
                # the tracker's per-module stats allow one forward per module between resets (its
                # global peak is kept across them): reset after every micro-batch
                _step(model, optimizer, inputs, targets, cfg, after_micro_batch=tracker.reset_mod_stats)
        peak = tracker.get_tracker_snapshot("peak")
    per_device = next(iter(peak.values()))
    breakdown = {str(getattr(k, "value", k)): int(v) for k, v in per_device.items() if str(getattr(k, "value", k)) != "Total"}
    return {"total": int(per_device["Total"]), "breakdown": breakdown,
            "method": f"FSDPMemTracker, FakeTensorMode, fake process group of {world}"}


def analytic(cfg: Config) -> Dict[str, Any]:
    """Fallback: fp32 state (weights, grads, AdamW mu and nu) of one shard plus saved activations.

    Activations per token per block (elements): without remat, the tensors autograd keeps in
    fp32/bf16 -- two norm outputs and the residual (3d), q, k, v before and after RoPE (5d), the
    attention output (d), the MLP's two up-projections, their SiLU and product (4 d_ff); with
    `full`, only each block's input (d) plus one block recomputed. Logits (V) are kept three times
    (logits, log-softmax, their gradient) in fp32.
    """
    m, t = cfg.model, cfg.train
    world = cfg.devices
    mesh = config_mod.mesh_shape(cfg)
    params = count_params(m)["total"]
    state = 4 * 4 * params // mesh["fsdp"]
    tokens = t.global_batch // world // t.grad_accum * m.seq_len
    act_bytes = 2 if m.dtype == "bf16" else 4
    per_block = 9 * m.d_model + 4 * m.d_ff
    if m.remat == "full":
        acts = tokens * (m.n_layers * m.d_model + per_block) * act_bytes
    else:
        acts = tokens * m.n_layers * per_block * act_bytes
    logits = 3 * tokens * m.vocab_size * 4
    return {"total": state + acts + logits, "breakdown": {"state": state, "activations": acts, "logits": logits},
            "method": "analytic: fp32 state of one shard + an activation formula (the tracker failed)"}


def estimate_cell(cfg: Config) -> Dict[str, Any]:
    if cfg.torch.compile:
        cfg = config_mod.replace(cfg, {"torch.compile": False})
        compiled_note = ["torch.compile=true: estimated eager (compiled blocks fuse ops and usually need less)"]
    else:
        compiled_note = []
    dist.init_process_group("fake", rank=0, world_size=cfg.devices)
    t0 = time.perf_counter()
    notes = list(compiled_note)
    try:
        est = tracked(cfg)
    except Exception as e:  # a torch build where the tracker does not work: say why, then estimate analytically
        log.warning("FSDPMemTracker failed; falling back to the analytic estimate:\n" + traceback.format_exc(limit=4))
        est = analytic(cfg)
        notes.append(f"FSDPMemTracker failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                     "this is the analytic fallback")
    finally:
        dist.destroy_process_group()
    notes.append("tensor memory only: add the runtime's own footprint (CUDA context and allocator slack on GPU; "
                 "interpreter and libraries on CPU)")
    if cfg.target != "local":
        notes.append("estimated with CPU kernels; CUDA's attention kernels keep slightly different buffers")
    if getattr(cfg.model, "attention", "causal") != "causal":
        notes.append(f"model.attention={cfg.model.attention}: estimated with plain causal attention (the document "
                     "masks' own buffers are not counted)")
    return {"framework": "torch", "target": cfg.target, "devices": cfg.devices,
            "where": f"rank 0 of {cfg.devices} (simulated in one process)", "device_kind": None,
            "mesh": config_mod.mesh_shape(cfg), "method": est["method"], "estimate_s": time.perf_counter() - t0,
            "memory": {"total": est["total"]}, "breakdown": est["breakdown"], "flops": None, "notes": notes}


def main(argv: List[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    print(json.dumps([estimate_cell(config_mod.load_resolved(path)) for path in argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

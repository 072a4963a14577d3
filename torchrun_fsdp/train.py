"""Model build, FSDP2 wrapping, optimizer and the train step of the PyTorch trainer (the `Engine`).

The model is built on the meta device, sharded with FSDP2, then materialised: every rank fills
only its own shard from the framework-neutral numpy init (`launch.core.params`), so no rank ever holds
the whole model. Conventions shared with the JAX trainer: torch's clip_grad_norm_ (norm + 1e-6),
AdamW with eps outside the sqrt and decoupled decay on matmul weights only, lr from
`launch.core.loop.lr_at` set on every step, fp32 matmul precision from `model.matmul_precision`.

Shapes: with `data.seq_lens` each step's batch has its own length and eager PyTorch runs it as it is;
`torch.compile` recompiles when a shape changes and then treats it as dynamic (torch's default) or,
with `torch.compile_dynamic=true`, compiles dynamic shapes from the start. Padded targets
(`data.pad_to`) are `launch.data.batches.IGNORE`, the `ignore_index` of `F.cross_entropy`.
Every compilation is reported from Dynamo's own records (`torchrun_fsdp.compiles`).
"""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Dict

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from launch.config.schema import Config
from launch.core import attention, engine, gpus
from launch.core.flops import precision_of
from launch.core.params import init_param, named_params
from launch.data.batches import Batches, document_batch
from torchrun_fsdp import parallel, tpu
from torchrun_fsdp.checkpoint import Checkpointer
from torchrun_fsdp.compiles import CompileLog
from torchrun_fsdp.model import Transformer, cross_entropy, probe_attention, use_attention_kernel
from torchrun_fsdp.profile import TorchCapture

# model.matmul_precision -> torch.set_float32_matmul_precision (`high` allows TF32), the same
# choice the JAX trainer makes with jax_default_matmul_precision.
MATMUL_PRECISION = {"highest": "highest", "tf32": "high"}


def local_values(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full tensor, laid out as `param` is (DTensor shard or plain)."""
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return full


class TorchEngine:
    framework = "torch"

    def __init__(self, cfg: Config, cell_dir: Path):
        self.cfg, self.cell_dir = cfg, cell_dir
        torch.set_float32_matmul_precision(MATMUL_PRECISION[cfg.model.matmul_precision])
        self.settings = {"matmul_precision": cfg.model.matmul_precision,
                         "float32_matmul_precision": torch.get_float32_matmul_precision()}
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.process_index, self.process_count = self.rank, self.world
        self.placement = tpu.placement() if tpu.on_tpu() else None
        if self.placement is not None:  # a TPU slice through TorchTPU (or the emulation's CPU stand-in)
            self.device = tpu.device(self.placement)
            self.device_kind = tpu.device_kind(self.placement, cfg.tpu.generation)
            self.settings["gpu_memory_fraction"] = None  # no GPU: nothing to limit
        elif torch.cuda.is_available():
            # launch.core.gpus decides: 0 for a task bound to its own GPU (it sees only that one), else the local rank
            index = gpus.local_gpu_index(os.environ, torch.cuda.device_count())
            self.device = torch.device("cuda", 0 if index is None else index)
            torch.cuda.set_device(self.device)
            self.device_kind = torch.cuda.get_device_name(self.device)
            # model.gpu_memory_fraction: the share JAX preallocates (XLA_PYTHON_CLIENT_MEM_FRACTION), the same here
            torch.cuda.set_per_process_memory_fraction(cfg.model.gpu_memory_fraction, self.device)
            self.settings["gpu_memory_fraction"] = cfg.model.gpu_memory_fraction
        else:
            self.device = torch.device("cpu")
            self.device_kind = "cpu"
            self.settings["gpu_memory_fraction"] = None  # no GPU: nothing to limit
        self.settings["mfu_peak"] = engine.mfu_peak_basis(self.device.type == "cpu", self.device_kind,
                                                          precision_of(cfg.model))
        if self.placement is not None:
            from launch.config import mesh_shape
            shape = mesh_shape(cfg)
            self.mesh = tpu.mesh(self.placement, (shape["data"], shape["fsdp"]), ("data", "fsdp"))
        else:
            self.mesh = parallel.build_mesh(cfg, self.device.type)
        self.attention = resolve_attention(cfg, self.device)
        use_attention_kernel(self.attention.name)
        if self.attention.name != "flex":  # an SDPA kernel takes the document mask (refuses flex on CPU)
            resolve_document_mask_impl(cfg.torch.document_mask_impl, self.device.type)
        self.document_mask_impl = "flex" if self.attention.name == "flex" else "sdpa"
        self.settings.update({"attention": cfg.model.attention, "norm_impl": cfg.model.norm_impl,
                              "attention_impl": cfg.model.attention_impl, **self.attention.settings(),
                              "document_mask_impl": self.document_mask_impl if cfg.model.attention == "document" else None})
        m = cfg.model
        with torch.device("meta"):
            model = Transformer(m, self.document_mask_impl)
        parallel.parallelize(model, cfg, self.mesh)
        self.compile_log = CompileLog()
        model.to_empty(device=self.device)
        self.model = model
        self._init_weights()
        decay_names = {name for name, spec in named_params(m) if spec.decay}
        groups = {True: [], False: []}
        for name, p in model.named_parameters():
            groups[_canonical(name) in decay_names].append(p)
        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            [{"params": groups[True], "weight_decay": t.weight_decay}, {"params": groups[False], "weight_decay": 0.0}],
            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)
        self.data = Batches(cfg.data, m.vocab_size, m.seq_len)
        dp = self.world
        self.rows_per_rank = t.global_batch // dp
        self.ckpt = Checkpointer(cfg, self.model, self.optimizer, self.rank, self.device.type)
        self.capture = None  # the profiler while profile.steps runs (launch.core.profile)

    def _init_weights(self) -> None:
        m, seed = self.cfg.model, self.cfg.train.seed
        specs = dict(named_params(m))
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                canon = _canonical(name)
                full = torch.from_numpy(init_param(m, seed, canon, specs[canon])).to(self.device)
                (p.to_local() if isinstance(p, DTensor) else p).copy_(local_values(p, full))

    # ------------------------------------------------------------------ Engine
    def compile(self) -> float:
        return 0.0  # eager; torch.compile compiles lazily, inside the first steps (compile_events)

    def compile_events(self):
        return self.compile_log.drain()

    def compile_totals(self) -> Dict:
        return self.compile_log.totals()

    def restore(self) -> int:
        return self.ckpt.restore_latest()

    def profiler(self, directory: Path) -> TorchCapture:
        """A `torch.profiler` capture of this rank's steps (launch.core.profile)."""
        self.capture = TorchCapture(directory, self.rank, self.device)
        return self.capture

    def _batch(self, step: int):
        """This rank's rows of the batch of `step` on the device: inputs, targets and (with
        model.attention=document) {segment_ids, positions}."""
        start = self.rank * self.rows_per_rank
        doc = {}
        if self.cfg.model.attention == "document":
            d = document_batch(self.data, self.cfg, step, start, start + self.rows_per_rank)
            inputs, targets = d.inputs, d.targets
            doc = {"segment_ids": torch.from_numpy(d.segment_ids.astype(np.int64)).to(self.device),
                   "positions": torch.from_numpy(d.positions).to(self.device)}
        else:
            inputs, targets = self.data.split(step, start, start + self.rows_per_rank)
        inputs = torch.from_numpy(inputs.astype(np.int64)).to(self.device)
        targets = torch.from_numpy(targets.astype(np.int64)).to(self.device)
        return inputs, targets, doc

    def train_step(self, step: int, lr: float):
        t = self.cfg.train
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        with self.capture.data() if self.capture else contextlib.nullcontext():
            inputs, targets, doc = self._batch(step)
        accum = t.grad_accum
        loss_sum = torch.zeros((), device=self.device)
        for j in range(accum):
            sel = slice(None) if accum == 1 else torch.arange(j, self.rows_per_rank, accum, device=self.device)
            if accum > 1 and hasattr(self.model, "set_requires_gradient_sync"):  # FSDP: reduce once per step
                self.model.set_requires_gradient_sync(j == accum - 1)
            loss = cross_entropy(self.model(inputs[sel], **{k: v[sel] for k, v in doc.items()}), targets[sel])
            (loss / accum).backward()
            loss_sum += loss.detach()
        max_norm = t.clip_norm if t.clip_norm > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(gnorm, DTensor):
            gnorm = gnorm.full_tensor()
        self.ckpt.before_update()  # an async save's staged copy is complete before the weights change
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_sum / accum
        if self.world > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG if self.device.type == "cuda" else dist.ReduceOp.SUM)
            if self.device.type != "cuda":
                loss /= self.world  # gloo has no AVG
        self.ckpt.poll()
        return float(loss), float(gnorm)

    def eval_loss(self, index: int) -> float:
        """Mean loss of held-out batch `index` (train.eval_batch_size rows, this rank's share of
        them): forward only, under the training's FSDP sharding, averaged over ranks."""
        rows = self.cfg.train.eval_batch_size // self.world
        start = self.rank * rows
        inputs, targets = self.data.eval_split(index, start, start + rows)
        inputs = torch.from_numpy(inputs.astype(np.int64)).to(self.device)
        targets = torch.from_numpy(targets.astype(np.int64)).to(self.device)
        with torch.no_grad():
            loss = cross_entropy(self.model(inputs), targets).float()
        if self.world > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            loss /= self.world
        return float(loss)

    def save(self, step: int, final: bool = False) -> None:
        self.ckpt.save(step, engine.checkpoint_metadata(self.cfg, self.framework, self.world, self.versions(), step),
                       final=final)

    def finish(self) -> None:
        self.ckpt.close()

    def versions(self) -> Dict[str, str]:
        return {"torch": torch.__version__, "python": platform.python_version()}

    def any_process(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def peak_flops_per_device(self) -> float:
        from launch.core.flops import datasheet_peak
        if self.device.type == "cuda":
            return datasheet_peak(self.device_kind, precision_of(self.cfg.model)) or 0.0
        if self.device.type == "tpu":
            return datasheet_peak(self.device_kind, precision_of(self.cfg.model)) or datasheet_peak(
                f"tpu {self.cfg.tpu.generation}", precision_of(self.cfg.model)) or 0.0
        with _all_host_cores():
            return engine.cpu_peak_per_device(self.cfg.devices, self.rank, self.world, matmul=_cpu_matmul,
                                              barrier=dist.barrier, broadcast=_broadcast_from_rank0)

    def bytes_per_device(self) -> Dict[str, int]:
        def local_bytes(t: torch.Tensor) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        w = sum(local_bytes(p) for p in self.model.parameters())
        opt = sum(local_bytes(v) for s in self.optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)
        return engine.bytes_per_device(weights=w, optimizer=opt)

    def peak_memory_bytes(self) -> int:
        cuda = self.device.type == "cuda"
        return engine.peak_memory_bytes(int(torch.cuda.max_memory_allocated(self.device)) if cuda else None)


def resolve_attention(cfg: Config, device: torch.device) -> attention.Kernel:
    """`model.attention_impl` for this device: the first candidate (`launch.core.attention`) that runs
    for the cell's attention shapes here (`probe_attention`). Raises AttentionUnavailable for `fused`
    where none does."""
    m = cfg.model
    options = attention.candidates("torch", device.type, m.dtype, m.attention, m.attention_impl,
                                   cfg.torch.document_mask_impl)
    documents = m.attention == "document"
    return attention.choose(options, lambda k: probe_attention(k.name, m, device, documents),
                            m.attention_impl, device.type, m.dtype, m.attention)


def resolve_document_mask_impl(choice: str, device_type: str) -> str:
    """torch.document_mask_impl -> flex | sdpa. torch 2.13's CPU build has no flex_attention
    backward ("FlexAttention does not support backward on CPU"), so auto means sdpa there."""
    if choice == "auto":
        return "flex" if device_type == "cuda" else "sdpa"
    if choice == "flex" and device_type == "tpu":
        raise ValueError("torch.document_mask_impl=flex is not available on TPU: TorchTPU runs flex_attention as SDPA; "
                         "use torch.document_mask_impl=sdpa (or auto).")
    if choice == "flex" and device_type == "cpu":
        raise ValueError("torch.document_mask_impl=flex cannot train on CPU: this torch has no flex_attention "
                         "backward on CPU; use torch.document_mask_impl=sdpa (or auto).")
    return choice


def _canonical(name: str) -> str:
    """FSDP/AC/compile wrappers add prefixes (`_checkpoint_wrapped_module.`, `_orig_mod.`); drop them."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _cpu_matmul(n: int):
    """One n x n fp32 matmul (what `launch.core.metrics.calibrate_matmul` times)."""
    a = torch.ones(n, n)
    return lambda: torch.mm(a, a)


@contextlib.contextmanager
def _all_host_cores():
    """The host's matmul peak is measured with every core (a rank normally has its share of them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _broadcast_from_rank0(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.broadcast(t, src=0)
    return float(t[0])

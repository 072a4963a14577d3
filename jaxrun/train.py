"""State, optimizer and the jitted train step of the JAX trainer (the `Engine` of `launch.core.loop`).

The train step is one `jax.jit` with explicit in/out shardings and donated state:
grads (accumulated over `train.grad_accum` micro-batches) -> global-norm clip -> AdamW.
Conventions shared with the PyTorch trainer (they keep the loss curves equal):
- clip: g * min(1, clip_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_;
- AdamW: eps added to sqrt(v_hat) after bias correction; decoupled decay p *= 1 - lr * wd,
  applied to matmul weights only (not norms, not the embedding);
- the learning rate of every step comes from `launch.core.loop.lr_at`, passed in as an argument;
- fp32 matmul precision from `model.matmul_precision` (`highest`: no TF32), set explicitly.

Shapes: a static run compiles its one train step ahead of the first step. With `data.seq_lens` each
new (padded) length is a new program: the step for it is compiled the first time a batch of that
length comes, inside that step, as a user of `jax.jit` gets it; `data.pad_to` buckets bound how many
there are (the padding's targets are masked out of the loss). Every compilation is reported from
JAX's own monitoring events (`jaxrun.compiles`).
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrun import checkpoint, mesh as mesh_mod
from jaxrun.compiles import CompileMonitor
from jaxrun.model import Transformer, cross_entropy, probe_attention
from jaxrun.profile import JaxCapture
from launch.common import envvars
from launch.config.schema import Config
from launch.core import attention, engine
from launch.core.flops import precision_of
from launch.core.params import init_param, init_stacked, param_table
from launch.data.batches import Batches, document_batch, is_dynamic

CLIP_EPS = 1e-6
# model.matmul_precision -> jax_default_matmul_precision. JAX's own default lets fp32 matmuls run
# as TF32 on recent GPUs while PyTorch's does not; both trainers set it explicitly and the same.
MATMUL_PRECISION = {"highest": "highest", "tf32": "tensorfloat32"}


def make_optimizer(cfg: Config, decay_mask) -> optax.GradientTransformation:
    t = cfg.train
    return optax.chain(optax.scale_by_adam(b1=t.beta1, b2=t.beta2, eps=t.eps),
                       optax.add_decayed_weights(t.weight_decay, mask=decay_mask))


class TrainStep:
    """The train step the trainer runs: model graph, abstract state, shardings, optimizer and the
    jitted step with its in/out shardings and donated state. `JaxEngine` compiles and runs it;
    `jaxrun.aot` lowers exactly this object for devices this machine does not have."""

    def __init__(self, cfg: Config, mesh, attention_kernel: str = "xla"):
        self.cfg, self.mesh, self.attention_kernel = cfg, mesh, attention_kernel
        m = cfg.model
        self.graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(m, nnx.Rngs(0))))
        self.param_sh = mesh_mod.param_shardings(mesh, cfg, abstract)
        decay = {spec.stacked_name: spec.decay for spec in param_table(m)}
        self.decay_mask = jax.tree.map_with_path(lambda p, _: decay[mesh_mod.path_name(p)], abstract)
        self.tx = make_optimizer(cfg, self.decay_mask)
        self.abstract_params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, self.param_sh)
        abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
        rep = mesh_mod.replicated(mesh)
        self.opt_sh = optax.tree_map_params(self.tx, lambda _, s: s, abstract_opt, self.param_sh,
                                            transform_non_params=lambda _: rep)
        self.abstract_opt = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_opt, self.opt_sh)
        self.batch_sh = mesh_mod.batch_sharding(mesh)
        self.microbatch_sh = mesh_mod.microbatch_sharding(mesh)
        # model.attention=document: a sixth argument, (segment_ids, positions), sharded as the batch
        self.documents = cfg.model.attention == "document"
        self.masked = is_dynamic(cfg.data)  # padded targets (IGNORE) are left out of the loss
        doc_sh = ((self.batch_sh, self.batch_sh),) if self.documents else ()
        self.fn = jax.jit(self._train_step, in_shardings=(self.param_sh, self.opt_sh, self.batch_sh, self.batch_sh, None) + doc_sh,
                          out_shardings=(self.param_sh, self.opt_sh, rep, rep), donate_argnums=(0, 1))

    def lower(self, seq_len: int = 0):
        """The step lowered for its abstract arguments: the state and a (global_batch, seq_len) batch
        (default model.seq_len, the longest a run has)."""
        B, T = self.cfg.train.global_batch, seq_len or self.cfg.model.seq_len
        batch = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=self.batch_sh)
        doc = ((batch, batch),) if self.documents else ()
        return self.fn.lower(self.abstract_params, self.abstract_opt, batch, batch, jax.ShapeDtypeStruct((), jnp.float32), *doc)

    def _loss(self, params, inputs, targets, segment_ids=None, positions=None):
        model = nnx.merge(self.graphdef, params)
        logits = model(inputs, self.cfg.model, mesh_mod.activation_constraint(self.mesh), segment_ids, positions,
                       self.attention_kernel)
        return cross_entropy(logits, targets, masked=self.masked)

    def _train_step(self, params, opt_state, inputs, targets, lr, doc=()):
        accum = self.cfg.train.grad_accum
        grad_fn = jax.value_and_grad(self._loss)
        if accum == 1:
            loss, grads = grad_fn(params, inputs, targets, *doc)
        else:
            def micro(x):  # (B, T) -> (accum, B/accum, T): micro-batch j takes rows j, j+accum, ...
                x = x.reshape(x.shape[0] // accum, accum, x.shape[1]).swapaxes(0, 1)
                return jax.lax.with_sharding_constraint(x, self.microbatch_sh)

            def body(carry, mb):
                loss_sum, g_sum = carry
                l, g = grad_fn(params, *mb)
                return (loss_sum + l, jax.tree.map(jnp.add, g_sum, g)), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            batch = (micro(inputs), micro(targets)) + tuple(micro(a) for a in doc)
            (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), batch)
            loss, grads = loss / accum, jax.tree.map(lambda g: g / accum, grads)
        gnorm = optax.tree.norm(grads)
        if self.cfg.train.clip_norm > 0:
            scale = jnp.minimum(1.0, self.cfg.train.clip_norm / (gnorm + CLIP_EPS))
            grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, loss, gnorm


def resolve_attention(cfg: Config, device) -> attention.Kernel:
    """`model.attention_impl` for this device: the first candidate (`launch.core.attention`) that
    compiles for the cell's attention shapes here (`jaxrun.model.probe_attention`; the dense path
    needs no probe). Raises AttentionUnavailable for `fused` where none does."""
    m = cfg.model
    options = attention.candidates("jax", device.platform, m.dtype, m.attention, m.attention_impl)
    documents = m.attention == "document"
    return attention.choose(options, lambda k: None if k.kind == attention.DENSE else
                            probe_attention(k.name, m, device, documents),
                            m.attention_impl, device.platform, m.dtype, m.attention)


class JaxEngine:
    framework = "jax"

    def __init__(self, cfg: Config, cell_dir: Path):
        self.cfg, self.cell_dir = cfg, cell_dir
        self.monitor = CompileMonitor()  # first: every compilation from here on is reported
        jax.config.update("jax_default_matmul_precision", MATMUL_PRECISION[cfg.model.matmul_precision])
        self.settings = {"matmul_precision": cfg.model.matmul_precision,
                         "jax_default_matmul_precision": jax.config.jax_default_matmul_precision,
                         "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax_platforms": os.environ.get("JAX_PLATFORMS", "")}
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        self.mesh = mesh_mod.make_mesh(cfg)
        self.device_kind = self.mesh.devices.flat[0].device_kind
        self.platform = self.mesh.devices.flat[0].platform
        gpu = self.platform == "gpu"  # model.gpu_memory_fraction, set before JAX started (jaxrun.__main__)
        self.settings.update({"gpu_memory_fraction": cfg.model.gpu_memory_fraction if gpu else None,
                              envvars.XLA_MEM_FRACTION: os.environ.get(envvars.XLA_MEM_FRACTION) if gpu else None})
        self.settings["mfu_peak"] = engine.mfu_peak_basis(self.platform == "cpu", self.device_kind,
                                                          precision_of(cfg.model))
        m = cfg.model
        self.attention = resolve_attention(cfg, self.mesh.local_devices[0])  # a device this process can compile for
        self.program = TrainStep(cfg, self.mesh, self.attention.name)
        p = self.program
        self.param_sh, self.opt_sh, self.batch_sh, self.tx = p.param_sh, p.opt_sh, p.batch_sh, p.tx
        self.abstract_params, self.abstract_opt = p.abstract_params, p.abstract_opt
        self.settings.update({"attention": m.attention, "norm_impl": m.norm_impl, "attention_impl": m.attention_impl,
                              **self.attention.settings(),
                              "document_mask_impl": "jax.nn.dot_product_attention(mask)" if m.attention == "document" else None})
        self.data = Batches(cfg.data, m.vocab_size, m.seq_len)
        self.params = self.opt_state = None
        self.compiled = None  # the train step most recently run
        self.executables: Dict[int, Any] = {}  # padded length -> compiled train step
        self._any_fn = None
        self._eval_fn = None  # jitted on the first evaluation
        self.capture = None  # the profiler while profile.steps runs (launch.core.profile)
        self._own_events: List[Dict[str, Any]] = []
        self.ckpt = checkpoint.Checkpointer(cfg, self.abstract_state())

    # ------------------------------------------------------------------ Engine
    def abstract_state(self) -> Dict[str, Any]:
        return {"params": self.abstract_params, "opt_state": self.abstract_opt}

    def compile(self) -> float:
        """The train step ahead of the first step, for a run of one shape; with data.seq_lens each
        length compiles when its first batch comes (0 here)."""
        if self.cfg.data.seq_lens:
            return 0.0
        return self._compile_for(self.cfg.model.seq_len, "train step, ahead of the first step")

    def _compile_for(self, seq_len: int, reason: str) -> float:
        t0 = time.perf_counter()
        self.compiled = self.executables[seq_len] = self.program.lower(seq_len).compile()
        seconds = time.perf_counter() - t0
        recompile = len(self.executables) > 1
        self._own_events.append(self.monitor.take_train_step(seconds, reason, recompile))
        return seconds

    def compile_events(self) -> List[Dict[str, Any]]:
        own, self._own_events = self._own_events, []
        return own + self.monitor.drain()

    def compile_totals(self) -> Dict[str, Any]:
        return {"shapes_compiled": len(self.executables)}

    def init_state(self) -> None:
        m, seed = self.cfg.model, self.cfg.train.seed
        if m.init == "native":
            def make():
                return nnx.state(Transformer(m, nnx.Rngs(seed)), nnx.Param)
            self.params = jax.jit(make, out_shardings=self.param_sh)()
        else:
            specs = {spec.stacked_name: spec for spec in param_table(m)}

            def value(path, sds):
                spec = specs[mesh_mod.path_name(path)]
                host = init_stacked(m, seed, spec) if spec.per_layer else init_param(m, seed, spec.name, spec)
                # each device receives only its shard of the host array
                return jax.make_array_from_callback(sds.shape, sds.sharding, lambda idx: host[idx])

            self.params = jax.tree.map_with_path(value, self.abstract_params)
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_sh)(self.params)

    def restore(self) -> int:
        state, step = self.ckpt.restore_latest()
        if state is None:
            self.init_state()
            return 0
        self.params, self.opt_state = state["params"], state["opt_state"]
        return step

    def _batch(self, step: int):
        """inputs, targets (and with model.attention=document segment_ids, positions) as global arrays."""
        B = self.cfg.train.global_batch
        cache: Dict[Tuple[int, int], Tuple[np.ndarray, ...]] = {}
        documents = self.program.documents

        def rows(idx):
            sl = idx[0]
            key = (sl.start or 0, sl.stop if sl.stop is not None else B)
            if key not in cache:
                if documents:
                    d = document_batch(self.data, self.cfg, step, *key)
                    cache[key] = (d.inputs, d.targets, d.segment_ids, d.positions)
                else:
                    cache[key] = self.data.split(step, *key)
            return cache[key]

        shape = (B, self.data.step_shape(step)[1])
        return tuple(jax.make_array_from_callback(shape, self.batch_sh, lambda idx, i=i: rows(idx)[i])
                     for i in range(4 if documents else 2))

    def profiler(self, directory: Path) -> JaxCapture:
        """A `jax.profiler` capture of the train step on this process's first device (launch.core.profile)."""
        self.capture = JaxCapture(directory, self.compiled, self.mesh.local_devices[0])
        return self.capture

    def train_step(self, step: int, lr: float):
        with self.capture.data() if self.capture else contextlib.nullcontext():
            inputs, targets, *doc = self._batch(step)
        length = inputs.shape[1]
        if length not in self.executables:  # a new shape: compiled now, inside this step
            real, _ = self.data.step_shape(step)
            self._compile_for(length, f"new shape ({inputs.shape[0]}, {length})" +
                              (f" for length {real}" if real != length else ""))
        self.compiled = self.executables[length]
        self.params, self.opt_state, loss, gnorm = self.compiled(self.params, self.opt_state, inputs, targets, np.float32(lr),
                                                                 *([tuple(doc)] if doc else []))
        return _scalar(loss), _scalar(gnorm)

    def eval_loss(self, index: int) -> float:
        """Mean loss of held-out batch `index` (train.eval_batch_size rows): the training loss
        function, forward only, with the training's parameter and batch shardings."""
        if self._eval_fn is None:
            self._eval_fn = jax.jit(self.program._loss, in_shardings=(self.param_sh, self.batch_sh, self.batch_sh),
                                    out_shardings=mesh_mod.replicated(self.mesh))
        E = self.cfg.train.eval_batch_size
        cache: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray]] = {}

        def rows(idx):
            sl = idx[0]
            key = (sl.start or 0, sl.stop if sl.stop is not None else E)
            if key not in cache:
                cache[key] = self.data.eval_split(index, *key)
            return cache[key]

        shape = (E, self.cfg.model.seq_len)
        inputs = jax.make_array_from_callback(shape, self.batch_sh, lambda idx: rows(idx)[0])
        targets = jax.make_array_from_callback(shape, self.batch_sh, lambda idx: rows(idx)[1])
        return _scalar(self._eval_fn(self.params, inputs, targets))

    def save(self, step: int, final: bool = False) -> None:  # Orbax's async save runs in threads: nothing to spare
        self.ckpt.save(step, {"params": self.params, "opt_state": self.opt_state},
                       engine.checkpoint_metadata(self.cfg, self.framework, self.process_count, self.versions(), step))

    def finish(self) -> None:
        self.ckpt.close()

    def versions(self) -> Dict[str, str]:
        import flax
        import orbax.checkpoint as ocp
        return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
                "orbax": getattr(ocp, "__version__", "?"), "python": platform.python_version()}

    def any_process(self, flag: bool) -> bool:
        """One tiny collective over the training mesh: the max of every process's flag."""
        if self._any_fn is None:
            self._flag_sh = mesh_mod.per_device_sharding(self.mesh)
            self._any_fn = jax.jit(jnp.max, out_shardings=mesh_mod.replicated(self.mesh))
        local = np.full((len(self.mesh.local_devices),), int(flag), np.int32)
        return bool(_scalar(self._any_fn(jax.make_array_from_process_local_data(self._flag_sh, local))))

    def peak_flops_per_device(self) -> float:
        from launch.core.flops import datasheet_peak
        if self.platform != "cpu":
            return datasheet_peak(self.device_kind, precision_of(self.cfg.model)) or 0.0
        return engine.cpu_peak_per_device(self.cfg.devices, self.process_index, self.process_count,
                                          matmul=_cpu_matmul, barrier=_barrier, broadcast=_broadcast_from_process0)

    def bytes_per_device(self) -> Dict[str, int]:
        dev = self.mesh.devices.flat[0] if self.process_index == 0 else jax.local_devices()[0]

        def on_device(tree) -> int:
            total = 0
            for leaf in jax.tree.leaves(tree):
                for shard in leaf.addressable_shards:
                    if shard.device == dev:
                        total += shard.data.nbytes
            return total

        return engine.bytes_per_device(weights=on_device(self.params), optimizer=on_device(self.opt_state))

    def peak_memory_bytes(self) -> int:
        stats = self.mesh.devices.flat[0].memory_stats() if self.platform != "cpu" else None
        return engine.peak_memory_bytes(stats.get("peak_bytes_in_use") if stats else None)


def _scalar(x: jax.Array) -> float:
    return float(np.asarray(x.addressable_data(0)))


def _cpu_matmul(n: int):
    """One synced n x n fp32 matmul on this process's first device (what `calibrate_matmul` times)."""
    a = jax.device_put(jnp.ones((n, n), jnp.float32), jax.local_devices()[0])
    f = jax.jit(lambda x: x @ x)
    return lambda: f(a).block_until_ready()


def _barrier() -> None:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("scaleout-calibrate")


def _broadcast_from_process0(value: float) -> float:
    from jax.experimental import multihost_utils
    return float(multihost_utils.broadcast_one_to_all(np.float32(value)))

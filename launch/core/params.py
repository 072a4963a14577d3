"""The parameter table shared by both trainers, and the framework-neutral initialisation.

Names and shapes are written down once here. Layout is (in, out) for every matmul weight, so
`x @ W` is the same expression in JAX and PyTorch and no converter transposes anything. The JAX
trainer stacks the per-layer entries on a leading `layers` axis; PyTorch keeps them per block.

The default initialisation draws every parameter with numpy from `(seed, name)`, so both
frameworks, every device count and every process start from the same weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

import numpy as np

from launch.config.schema import ModelConfig

# Logical axis of each dimension; launch.launcher.plan and jaxrun.mesh map them onto mesh axes.
EMBED, HEADS, MLP, VOCAB, NORM, LAYERS = "embed", "heads", "mlp", "vocab", "norm", "layers"


@dataclass(frozen=True)
class ParamSpec:
    name: str  # per-block entries use the placeholder "{i}"
    shape: Tuple[int, ...]
    axes: Tuple[str, ...]  # logical axis per dimension
    init: str  # "normal" | "scaled_normal" (output projections) | "ones"
    matmul: bool  # counts in N of the FLOPs formula
    decay: bool  # gets weight decay

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name

    @property
    def stacked_name(self) -> str:
        """The JAX name, per-block entries stacked on a leading layers axis: `layers.attention.wq`."""
        return self.name.replace(".{i}", "")


def param_table(m: ModelConfig) -> Tuple[ParamSpec, ...]:
    d, f, v = m.d_model, m.d_ff, m.vocab_size
    return (
        ParamSpec("tok_embeddings", (v, d), (VOCAB, EMBED), "normal", matmul=False, decay=False),
        ParamSpec("layers.{i}.attention_norm.weight", (d,), (NORM,), "ones", False, False),
        ParamSpec("layers.{i}.attention.wq", (d, d), (EMBED, HEADS), "normal", True, True),
        ParamSpec("layers.{i}.attention.wk", (d, d), (EMBED, HEADS), "normal", True, True),
        ParamSpec("layers.{i}.attention.wv", (d, d), (EMBED, HEADS), "normal", True, True),
        ParamSpec("layers.{i}.attention.wo", (d, d), (HEADS, EMBED), "scaled_normal", True, True),
        ParamSpec("layers.{i}.ffn_norm.weight", (d,), (NORM,), "ones", False, False),
        ParamSpec("layers.{i}.feed_forward.w1", (d, f), (EMBED, MLP), "normal", True, True),
        ParamSpec("layers.{i}.feed_forward.w3", (d, f), (EMBED, MLP), "normal", True, True),
        ParamSpec("layers.{i}.feed_forward.w2", (f, d), (MLP, EMBED), "scaled_normal", True, True),
        ParamSpec("norm.weight", (d,), (NORM,), "ones", False, False),
        ParamSpec("output", (d, v), (EMBED, VOCAB), "normal", True, True),
    )


def named_params(m: ModelConfig) -> Iterator[Tuple[str, ParamSpec]]:
    """Every concrete parameter name (per-block entries expanded) with its spec."""
    for spec in param_table(m):
        if spec.per_layer:
            for i in range(m.n_layers):
                yield spec.name.format(i=i), spec
        else:
            yield spec.name, spec


def param_shapes(m: ModelConfig) -> List[Tuple[str, Tuple[int, ...]]]:
    """(concrete name, shape) of every parameter, in table order."""
    return [(name, spec.shape) for name, spec in named_params(m)]


def count_params(m: ModelConfig) -> Dict[str, int]:
    total = matmul = 0
    for _, spec in named_params(m):
        n = int(np.prod(spec.shape))
        total += n
        matmul += n if spec.matmul else 0
    return {"total": total, "matmul": matmul}


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def init_param(m: ModelConfig, seed: int, name: str, spec: ParamSpec) -> np.ndarray:
    """The initial value of one concrete parameter, float32, identical in every framework.

    With `model.init=hf:DIR` it is that Hugging Face Llama directory's weight (`launch.core.hf_weights`; the
    config check at load time made sure every weight is there with this shape) and `seed` is unused.
    """
    if m.init not in ("numpy", "native"):  # hf:DIR (`native` is the JAX trainer's; PyTorch inits with numpy)
        from launch.core import hf_weights as hf
        return hf.read_param(m.init, name)
    if spec.init == "ones":
        return np.ones(spec.shape, np.float32)
    std = m.init_std / np.sqrt(2 * m.n_layers) if spec.init == "scaled_normal" else m.init_std
    return (_rng(seed, name).standard_normal(spec.shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def init_stacked(m: ModelConfig, seed: int, spec: ParamSpec) -> np.ndarray:
    """A per-block parameter for all layers, stacked on axis 0 (the JAX layout)."""
    return np.stack([init_param(m, seed, spec.name.format(i=i), spec) for i in range(m.n_layers)])


def stack(per_layer: Dict[str, np.ndarray], m: ModelConfig) -> Dict[str, np.ndarray]:
    """PyTorch layout (`layers.3.attention.wq`) -> JAX layout (`layers.attention.wq`, layer axis first)."""
    out = {}
    for spec in param_table(m):
        if spec.per_layer:
            out[spec.stacked_name] = np.stack([np.asarray(per_layer[spec.name.format(i=i)]) for i in range(m.n_layers)])
        else:
            out[spec.name] = np.asarray(per_layer[spec.name])
    return out


def unstack(stacked: Dict[str, np.ndarray], m: ModelConfig) -> Dict[str, np.ndarray]:
    """JAX layout -> PyTorch layout; the inverse of `stack`."""
    out = {}
    for spec in param_table(m):
        if spec.per_layer:
            arr = np.asarray(stacked[spec.stacked_name])
            for i in range(m.n_layers):
                out[spec.name.format(i=i)] = arr[i]
        else:
            out[spec.name] = np.asarray(stacked[spec.name])
    return out

"""Which attention kernel each framework runs: `model.attention_impl` resolved for a device and dtype.

A throughput difference between two cells is a framework difference only when both ran the same
class of attention kernel. Two classes:

- fused: one kernel that never materialises the (seq x seq) scores in memory: cuDNN's flash
  attention (JAX, `jax.nn.dot_product_attention(implementation="cudnn")`: GPU, bf16/fp16 only),
  PyTorch SDPA's flash / memory-efficient backends (flash also on CPU), flex_attention (PyTorch,
  document masks on CUDA);
- dense: the plain math, every score materialised: XLA's path of `jax.nn.dot_product_attention`
  (`implementation="xla"`, what `None` falls back to in jax 0.10) and SDPA's math backend.

`model.attention_impl`:
- `auto`: each framework's first fused kernel that serves the device, dtype and mask, else dense;
- `fused`: the same, but a cell where a framework has no fused kernel is refused in one sentence;
- `dense`: the plain math in both frameworks, for an exact like-for-like comparison.

`candidates` is the static part (what to try, in order; testable anywhere); the trainers run a
small probe of each candidate on their real device and shapes (`choose`) and record the one that
ran in the start record's `settings` (`attention_kernel`, `attention_class`). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

FUSED, DENSE = "fused", "dense"
CHOICES = ("auto", "fused", "dense")
GPU_PLATFORMS = ("gpu", "cuda")
HALF_DTYPES = ("bf16", "fp16")


@dataclass(frozen=True)
class Kernel:
    """One attention implementation: the framework's name for it and its class."""

    framework: str
    name: str  # jax: cudnn | xla; torch: flash | efficient | flex | math
    kind: str  # fused | dense

    @property
    def label(self) -> str:
        return f"{self.name} ({self.kind})"

    def settings(self) -> dict:
        """What a trainer records in its start record's settings."""
        return {"attention_kernel": self.name, "attention_class": self.kind}


class AttentionUnavailable(ValueError):
    """`model.attention_impl=fused` where a framework has no fused kernel for the cell."""


def _dense(framework: str) -> Kernel:
    return Kernel(framework, "xla" if framework == "jax" else "math", DENSE)


def fused_candidates(framework: str, platform: str, dtype: str, attention: str,
                     document_mask_impl: str = "auto") -> List[Kernel]:
    """The fused kernels a framework has for this platform (jax.default_backend() / torch device
    type: cpu, gpu/cuda, tpu), compute dtype and mask (`causal` | `document`), best first."""
    platform = platform.lower()
    if framework == "jax":
        # cuDNN's flash attention: GPU, half precision; a document mask goes in as a dense mask (bias)
        return [Kernel("jax", "cudnn", FUSED)] if platform in GPU_PLATFORMS and dtype in HALF_DTYPES else []
    if framework != "torch":
        return []
    gpu = platform in GPU_PLATFORMS
    if attention == "document":
        if gpu:  # flex skips masked blocks; SDPA's efficient backend takes a dense boolean mask
            return [Kernel("torch", "flex", FUSED)] if document_mask_impl in ("auto", "flex") else [Kernel("torch", "efficient", FUSED)]
        return [Kernel("torch", "flash", FUSED)] if platform == "cpu" and document_mask_impl != "flex" else []
    if gpu:  # flash needs half precision; the memory-efficient kernel also takes fp32
        return ([Kernel("torch", "flash", FUSED)] if dtype in HALF_DTYPES else []) + [Kernel("torch", "efficient", FUSED)]
    return [Kernel("torch", "flash", FUSED)] if platform == "cpu" else []  # SDPA's flash kernel for CPU


def candidates(framework: str, platform: str, dtype: str, attention: str, choice: str,
               document_mask_impl: str = "auto") -> List[Kernel]:
    """What to try, in order, for `model.attention_impl=choice`: the first that runs is used.

    Raises AttentionUnavailable for `fused` where the framework has no fused kernel at all."""
    if choice not in CHOICES:
        raise ValueError(f"model.attention_impl={choice!r}: use one of {', '.join(CHOICES)}.")
    if choice == "dense":
        return [_dense(framework)]
    fused = fused_candidates(framework, platform, dtype, attention, document_mask_impl)
    if choice == "fused":
        if not fused:
            raise AttentionUnavailable(unavailable(framework, platform, dtype, attention))
        return fused
    return fused + [_dense(framework)]


def unavailable(framework: str, platform: str, dtype: str, attention: str, why: str = "") -> str:
    name = "JAX" if framework == "jax" else "PyTorch"
    hint = (" (cuDNN's kernel needs a GPU and model.dtype=bf16)" if framework == "jax" else "")
    return (f"model.attention_impl=fused: {name} has no fused attention kernel for {attention} attention in "
            f"{dtype} on {platform}{hint}{': ' + why if why else ''}; use model.attention_impl=auto (fused where "
            "available, else dense) or dense (the plain math in both frameworks).")


def choose(options: Sequence[Kernel], works: Callable[[Kernel], Optional[str]], choice: str,
           platform: str, dtype: str, attention: str) -> Kernel:
    """The first of `options` whose probe passes: `works(kernel)` returns None when the kernel runs
    on the real device with the cell's shapes, else why not. Under `fused`, none passing is refused."""
    reasons = []
    for k in options:
        why = works(k)
        if why is None:
            return k
        reasons.append(f"{k.name}: {why}")
    framework = options[0].framework if options else "?"
    raise AttentionUnavailable(unavailable(framework, platform, dtype, attention, "; ".join(reasons)))


def from_settings(settings: Optional[dict]) -> Optional[Kernel]:
    """The kernel a cell recorded (start record's settings), or None for a cell from before this key."""
    s = settings or {}
    if not s.get("attention_kernel"):
        return None
    return Kernel(s.get("framework", ""), s["attention_kernel"], s.get("attention_class") or "?")


def pair_note(a_name: str, a: Optional[dict], b_name: str, b: Optional[dict]) -> Optional[str]:
    """The report's kernel note for two cells compared with each other (`a`, `b`: their start
    records' settings): which kernels ran, and a warning when they are of different classes."""
    ka, kb = from_settings(a), from_settings(b)
    if ka is None and kb is None:
        return None
    text = f"attention kernels: {a_name} {ka.label if ka else 'not recorded'}, {b_name} {kb.label if kb else 'not recorded'}"
    if ka and kb and ka.kind != kb.kind:
        text += (" -- **different classes (fused vs dense)**: part of this ratio is the attention kernel, not the "
                 "framework; model.attention_impl=dense (or fused) runs the same class in both")
    return text

"""Hugging Face Llama weights as scaleout's: the name mapping both ways, and reading a model directory.

scaleout's model is `transformers`' `LlamaForCausalLM` with `num_key_value_heads = n_heads`,
untied embeddings, SiLU and no biases. The names map one to one; every matmul weight is
transposed, since scaleout stores (in, out) and `nn.Linear` stores (out, in):

    tok_embeddings                    model.embed_tokens.weight
    layers.{i}.attention_norm.weight  model.layers.{i}.input_layernorm.weight
    layers.{i}.attention.w{q,k,v,o}   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   (T)
    layers.{i}.ffn_norm.weight        model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.feed_forward.w1/w3/w2  model.layers.{i}.mlp.{gate,up,down}_proj.weight     (T)
    norm.weight                       model.norm.weight
    output                            lm_head.weight                                      (T)

This is trainer core because both trainers start from such a directory: `model.init=hf:DIR` reads
it through `read_param` (called by `launch.core.params.init_param`, so both trainers' numpy init
paths load it), after `init_problem` (called by the launcher's input checks,
`launch.launcher.inputs`) has refused a directory scaleout's model cannot represent. Writing one
(`scaleout export`) is `launch.interop`. Numpy and `safetensors` (imported where used), never jax,
torch or `transformers`.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from launch.config.schema import ModelConfig

PREFIX = "hf:"  # model.init=hf:DIR
CONFIG_JSON = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors an HF Llama directory may hold that carry no weights (old checkpoints kept RoPE tables).
IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

# scaleout per-layer suffix -> (HF per-layer suffix, transposed)
_LAYER = {
    "attention_norm.weight": ("input_layernorm.weight", False),
    "attention.wq": ("self_attn.q_proj.weight", True),
    "attention.wk": ("self_attn.k_proj.weight", True),
    "attention.wv": ("self_attn.v_proj.weight", True),
    "attention.wo": ("self_attn.o_proj.weight", True),
    "ffn_norm.weight": ("post_attention_layernorm.weight", False),
    "feed_forward.w1": ("mlp.gate_proj.weight", True),
    "feed_forward.w3": ("mlp.up_proj.weight", True),
    "feed_forward.w2": ("mlp.down_proj.weight", True),
}
_GLOBAL = {
    "tok_embeddings": ("model.embed_tokens.weight", False),
    "norm.weight": ("model.norm.weight", False),
    "output": ("lm_head.weight", True),
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class HFError(ValueError):
    """A Hugging Face directory scaleout cannot write or read: one sentence, exit code 2."""


# --------------------------------------------------------------------------- names

def hf_name(name: str) -> Tuple[str, bool]:
    """scaleout's per-layer name (`layers.3.attention.wq`) -> (HF name, transposed)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER:
        hf, t = _LAYER[m.group(2)]
        return f"model.layers.{m.group(1)}.{hf}", t
    raise KeyError(f"{name!r} is not a scaleout parameter name")


def scaleout_name(hf: str) -> Tuple[str, bool]:
    """The inverse of `hf_name`: HF name -> (scaleout per-layer name, transposed)."""
    for ours, (theirs, t) in _GLOBAL.items():
        if hf == theirs:
            return ours, t
    m = _HF_LAYER_RE.match(hf)
    if m:
        for ours, (theirs, t) in _LAYER.items():
            if m.group(2) == theirs:
                return f"layers.{m.group(1)}.{ours}", t
    raise KeyError(f"{hf!r} is not a Llama weight scaleout's model has")


def to_hf(params: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """scaleout per-layer params -> HF tensors (matmul weights transposed to (out, in), contiguous)."""
    out = {}
    for name, value in params.items():
        hf, t = hf_name(name)
        value = np.asarray(value)
        out[hf] = np.ascontiguousarray(value.T if t else value)
    return out


def from_hf(tensors: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """HF tensors -> scaleout per-layer params, float32, (in, out) layout."""
    out = {}
    for hf, value in tensors.items():
        if IGNORED.match(hf):
            continue
        name, t = scaleout_name(hf)
        value = np.asarray(value).astype(np.float32)
        out[name] = np.ascontiguousarray(value.T if t else value)
    return out


Shapes = Iterable[Tuple[str, Tuple[int, ...]]]  # (scaleout per-layer name, shape): `launch.core.params.param_shapes`


def expected_shapes(shapes: Shapes) -> Dict[str, Tuple[int, ...]]:
    """HF name -> the shape it has (HF layout), from scaleout's names and shapes."""
    out = {}
    for name, shape in shapes:
        hf, t = hf_name(name)
        out[hf] = tuple(reversed(shape)) if t else tuple(shape)
    return out


# --------------------------------------------------------------------------- config.json

def _number(key: str, value: Any, whole: bool = False) -> Any:
    """A config.json field that must be a number (an integer when `whole`), or HFError naming it."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(value, float) and not (math.isfinite(value) and (value.is_integer() or not whole)):
        ok = False
    if not ok:
        raise HFError(f"its config.json has {key}={json.dumps(value)}, which is not {'an integer' if whole else 'a number'}")
    return int(value) if whole else float(value)


def _rope_theta(c: Dict[str, Any]) -> Optional[float]:
    """RoPE's base: `rope_parameters.rope_theta` (transformers >= 5) before `rope_theta`; each checked when given."""
    top = _number("rope_theta", c["rope_theta"]) if c.get("rope_theta") is not None else None
    params = c.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return _number("rope_parameters.rope_theta", params["rope_theta"])
    return top


def _rope_kind(c: Dict[str, Any]) -> Optional[str]:
    """The RoPE variant when it is not plain RoPE (scaled, YaRN, llama3...), else None."""
    for key in ("rope_parameters", "rope_scaling"):
        v = c.get(key)
        if isinstance(v, dict):
            kind = v.get("rope_type") or v.get("type") or "default"
            if kind != "default":
                return f"{key}.rope_type={kind}"
    return None


def model_keys(c: Dict[str, Any]) -> Dict[str, Any]:
    """The scaleout `model.*` values an HF Llama config.json describes.

    Raises HFError, in one sentence, for what scaleout's model does not have: another architecture,
    grouped-query attention, tied embeddings, biases, another activation, scaled RoPE.
    """
    where = "its config.json"
    arch = c.get("architectures") or []
    if not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        raise HFError(f"{where} has architectures={json.dumps(arch)}, which is not a list of class names "
                      "such as [\"LlamaForCausalLM\"]")
    if c.get("model_type") != "llama" and "LlamaForCausalLM" not in arch:
        raise HFError(f"{where} describes model_type={c.get('model_type')!r} ({', '.join(arch) or 'no architectures'}), "
                      "not a Llama (LlamaForCausalLM), the only architecture scaleout's model is")
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in needed if c.get(k) is None]
    if missing:
        raise HFError(f"{where} lacks {missing[0]} (LlamaConfig fields {', '.join(needed)} are needed)")
    sizes = {k: _number(k, c[k], whole=True) for k in needed}
    bad = next((k for k, v in sizes.items() if v < 1), None)
    if bad:
        raise HFError(f"{where} has {bad}={sizes[bad]}, which is not a positive integer")
    heads = sizes["num_attention_heads"]
    kv = _number("num_key_value_heads", c["num_key_value_heads"], whole=True) \
        if c.get("num_key_value_heads") is not None else heads
    if kv != heads:
        raise HFError(f"{where} has num_key_value_heads={kv} != num_attention_heads={heads} (grouped-query attention), "
                      "which scaleout's model does not have (one KV head per query head)")
    if c.get("tie_word_embeddings", False):
        raise HFError(f"{where} has tie_word_embeddings=true; scaleout's model keeps the lm head apart from the "
                      "embedding (untied), so it cannot start from tied weights")
    biases = [k for k in ("attention_bias", "mlp_bias") if c.get(k)]
    if biases:
        raise HFError(f"{where} has {' and '.join(f'{k}=true' for k in biases)}; scaleout's model has no biases")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise HFError(f"{where} has hidden_act={act!r}; scaleout's SwiGLU MLP uses silu")
    rope = _rope_kind(c)
    if rope:
        raise HFError(f"{where} has {rope}; scaleout's model has plain RoPE only")
    d, n = sizes["hidden_size"], heads
    eps = _number("rms_norm_eps", c["rms_norm_eps"]) if c.get("rms_norm_eps") is not None else 1e-6
    keys = {"model.d_model": d, "model.n_layers": sizes["num_hidden_layers"], "model.n_heads": n,
            "model.d_ff": sizes["intermediate_size"], "model.vocab_size": sizes["vocab_size"], "model.norm_eps": eps}
    head_dim = c.get("head_dim")
    if head_dim is not None and _number("head_dim", head_dim, whole=True) * n != d:
        raise HFError(f"{where} has head_dim={head_dim} with hidden_size={d} and num_attention_heads={n}; "
                      "scaleout's model needs head_dim = hidden_size / num_attention_heads")
    theta = _rope_theta(c)
    keys["model.rope_theta"] = theta if theta is not None else 10000.0
    return keys


def _current(m: ModelConfig, key: str) -> Any:
    return getattr(m, key.split(".", 1)[1])


def check_config(c: Dict[str, Any], m: ModelConfig) -> None:
    """Refuse an HF config that is not exactly this model config, naming the overrides that fit it."""
    want = model_keys(c)
    wrong = {k: v for k, v in want.items()
             if not (math.isclose(_current(m, k), v, rel_tol=1e-9) if isinstance(v, float) else _current(m, k) == v)}
    if wrong:
        have = ", ".join(f"{k}={_current(m, k)}" for k in wrong)
        fix = " ".join(f"{k}={v}" for k, v in wrong.items())
        raise HFError(f"it holds a model of another shape than this config ({have}); set {fix} to match it")


# --------------------------------------------------------------------------- reading safetensors

def inside(fname: Any) -> bool:
    """Whether an index's file name stays inside the model directory: a relative path without '..'
    (symbolic links, as in the Hugging Face cache, are followed as the directory's own)."""
    if not isinstance(fname, str) or not fname or "\0" in fname or "\\" in fname:
        return False
    parts = PurePosixPath(fname).parts
    return not PurePosixPath(fname).is_absolute() and ".." not in parts and parts != ()


class Reader:
    """The weights of an HF model directory (model.safetensors, or shards with an index), read lazily.

    `shapes()` reads only the files' headers; `get(name)` one tensor (memory-mapped), bf16/fp16
    widened to float32.
    """

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise HFError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
            if not isinstance(weight_map, dict):
                raise HFError(f"{index} has a weight_map that is not a mapping of tensor names to file names")
            for name, fname in weight_map.items():
                if not inside(fname):
                    raise HFError(f"{index} puts {name} in {json.dumps(fname)}, which is not a file name inside "
                                  f"{self.dir}; an index names files of its own directory only")
            self.weight_map: Dict[str, str] = dict(weight_map)
        elif (self.dir / SINGLE_FILE).is_file():
            self.weight_map = {}
            with self._open(SINGLE_FILE) as f:
                self.weight_map = {k: SINGLE_FILE for k in f.keys()}
        else:
            raise HFError(f"{self.dir} holds no {SINGLE_FILE} nor {INDEX_FILE} (scaleout reads safetensors "
                          "weights, not PyTorch .bin files)")
        missing = sorted({f for f in self.weight_map.values() if not (self.dir / f).is_file()})
        if missing:
            raise HFError(f"{self.dir} lacks {', '.join(missing)}, which its {INDEX_FILE} names")

    def _open(self, fname: str):
        from safetensors import safe_open
        try:
            return safe_open(str(self.dir / fname), framework="np")
        except Exception as e:  # the Rust binding raises its own error types for a damaged file
            raise HFError(f"{self.dir / fname} is not a readable safetensors file ({e})") from None

    def shapes(self) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """HF name -> (shape, safetensors dtype such as F32/BF16), from the headers only."""
        out = {}
        by_file: Dict[str, List[str]] = {}
        for k, f in self.weight_map.items():
            by_file.setdefault(f, []).append(k)
        for fname, names in by_file.items():
            with self._open(fname) as f:
                present = set(f.keys())
                for k in names:
                    if k not in present:
                        raise HFError(f"{self.dir / fname} does not hold {k}, which {INDEX_FILE} puts there")
                    s = f.get_slice(k)
                    out[k] = (tuple(s.get_shape()), s.get_dtype())
        return out

    def get(self, name: str) -> np.ndarray:
        fname = self.weight_map[name]
        with self._open(fname) as f:
            s = f.get_slice(name)
            if s.get_dtype() == "BF16":  # safetensors returns numpy's bfloat16, which ml_dtypes registers
                importlib.import_module("ml_dtypes")
            return np.asarray(f.get_tensor(name)).astype(np.float32)


def read_config(directory: Path) -> Dict[str, Any]:
    path = Path(directory) / CONFIG_JSON
    if not path.is_file():
        raise HFError(f"{path} does not exist; give a directory written by `scaleout export` or a Hugging Face "
                      "Llama model directory (config.json + model.safetensors)")
    try:
        c = json.loads(path.read_text())
    except ValueError as e:
        raise HFError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(c, dict):
        raise HFError(f"{path} does not hold a JSON object")
    return c


def check_dir(directory: Path, m: ModelConfig, param_shapes: Shapes) -> None:
    """Everything `model.init=hf:DIR` needs, checked from config.json and the safetensors headers
    (no weights read): a Llama scaleout's model can be, of exactly this config's shape
    (`param_shapes`: its parameters' names and shapes)."""
    check_config(read_config(directory), m)
    shapes = Reader(directory).shapes()
    biases = sorted(k for k in shapes if k.endswith(".bias"))
    if biases:
        raise HFError(f"its weights hold biases ({biases[0]}{', ...' if len(biases) > 1 else ''}); scaleout's model has none")
    want = expected_shapes(param_shapes)
    missing = [k for k in want if k not in shapes]
    if missing:
        tied = " (tied embeddings: no lm_head.weight)" if missing == ["lm_head.weight"] else ""
        raise HFError(f"its weights lack {missing[0]}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}{tied}")
    extra = sorted(k for k in shapes if k not in want and not IGNORED.match(k))
    if extra:
        raise HFError(f"its weights hold {extra[0]}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}, "
                      "which scaleout's model does not have")
    for k, shape in want.items():
        if shapes[k][0] != shape:
            raise HFError(f"its weight {k} has shape {list(shapes[k][0])}, not {list(shape)} as this model config needs")
    bad = sorted({dt for _, dt in shapes.values() if dt not in ("F32", "BF16", "F16", "F64")})
    if bad:
        raise HFError(f"its weights are stored as {bad[0]}; scaleout reads float weights (F32, BF16, F16)")


def init_problem(value: str, m: ModelConfig, param_shapes: Shapes) -> Optional[str]:
    """Why `model.init=value` cannot start this model (`param_shapes`: its parameters' names and
    shapes), as one sentence, or None when it can.

    `numpy` and `native` always can; `hf:DIR` needs a Llama directory of exactly this shape.
    """
    if value in ("numpy", "native"):
        return None
    if not value.startswith(PREFIX) or not value[len(PREFIX):].strip():
        return (f"model.init={value!r} is not valid; choose one of: numpy, native, hf:DIR "
                "(a Hugging Face Llama directory, e.g. one written by `scaleout export`).")
    path = value[len(PREFIX):]
    if "://" in path:
        return f"model.init={value!r} is not valid: hf:DIR reads a local directory; download it first."
    directory = Path(path).expanduser()
    if not directory.is_dir():
        return f"model.init={value!r} is not valid: {path} is not a directory; give a Hugging Face Llama model directory."
    try:
        check_dir(directory, m, param_shapes)
    except HFError as e:
        return f"model.init={value!r} cannot start this model: {e}."
    return None


@functools.lru_cache(maxsize=4)
def _reader(directory: str) -> Reader:
    return Reader(Path(directory))


def read_param(value: str, name: str) -> np.ndarray:
    """The initial value of scaleout parameter `name` (per-layer name) from `model.init=hf:DIR`:
    float32, scaleout's (in, out) layout."""
    reader = _reader(os.path.abspath(os.path.expanduser(value[len(PREFIX):])))
    hf, t = hf_name(name)
    v = reader.get(hf)
    return np.ascontiguousarray(v.T if t else v)

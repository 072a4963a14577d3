"""Writing a Hugging Face Llama directory: config.json and safetensors files (`scaleout export`).

The names, the layout and reading such a directory back are `launch.core.hf_weights` (the trainers
start from one with `model.init=hf:DIR`); this module only writes. Numpy and `safetensors`
(imported where used), never jax, torch or `transformers`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from launch.config.schema import ModelConfig
from launch.core.hf_weights import INDEX_FILE, SINGLE_FILE, HFError

SHARD_FILE = "model-{:05d}-of-{:05d}.safetensors"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Everything an export writes (what --force replaces); other files in the directory are left alone.
WRITTEN = re.compile(r"^(config\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
                     r"tokenizer\.json|tokenizer_config\.json|generation_config\.json)$")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default ("5GB")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def hf_config(m: ModelConfig, dtype: str = "fp32") -> Dict[str, Any]:
    """The `LlamaConfig` fields of this model (config.json of an exported directory)."""
    torch_dtype = DTYPES[dtype]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_heads,
        "head_dim": m.d_model // m.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": m.seq_len,
        "initializer_range": m.init_std,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": None,
        # transformers >= 5 reads RoPE from rope_parameters; older versions from rope_theta
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": torch_dtype,  # transformers < 5
        "dtype": torch_dtype,  # transformers >= 5
    }



def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000000' -> bytes (the units transformers' max_shard_size takes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise HFError(f"--max-shard-size={text!r} is not a size; write e.g. 5GB, 500MB or a number of bytes")
    unit = (m.group(2) or "").upper()
    base = 1024 if "I" in unit else 1000
    power = {"": 0, "KB": 1, "KIB": 1, "MB": 2, "MIB": 2, "GB": 3, "GIB": 3, "TB": 4, "TIB": 4}[unit]
    n = int(float(m.group(1)) * base**power)
    if n <= 0:
        raise HFError(f"--max-shard-size={text!r} is not valid: it must be more than 0 bytes")
    return n


def cast(value: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the export dtype (bf16 rounds to nearest even, through ml_dtypes)."""
    if dtype == "fp32":
        return np.ascontiguousarray(value, dtype=np.float32)
    import ml_dtypes
    return np.ascontiguousarray(np.asarray(value, np.float32).astype(ml_dtypes.bfloat16))


def shard(tensors: Iterable[Tuple[str, int]], max_bytes: int) -> List[List[str]]:
    """Names grouped into files of at most `max_bytes` each (a tensor larger than that gets its own)."""
    files: List[List[str]] = [[]]
    size = 0
    for name, nbytes in tensors:
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def write_safetensors(tensors: Dict[str, np.ndarray], out_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      metadata: Optional[Dict[str, str]] = None) -> List[str]:
    """Write `tensors` (HF names, in order) as model.safetensors, or as shards plus
    model.safetensors.index.json when they exceed `max_shard_bytes`; returns the file names written."""
    from safetensors.numpy import save_file

    meta = {"format": "pt", **(metadata or {})}
    groups = shard(((k, v.nbytes) for k, v in tensors.items()), max_shard_bytes)
    if len(groups) == 1:
        save_file(tensors, str(out_dir / SINGLE_FILE), metadata=meta)
        return [SINGLE_FILE]
    names, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        fname = SHARD_FILE.format(i, len(groups))
        save_file({k: tensors[k] for k in group}, str(out_dir / fname), metadata=meta)
        names.append(fname)
        weight_map.update({k: fname for k in group})
    total = sum(v.nbytes for v in tensors.values())
    (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return names + [INDEX_FILE]

"""The special tokens of an export: what transformers and llama.cpp need to stop generating and to batch.

scaleout's data has one special token, the end-of-text token that `scaleout prepare-data` writes
after every document (`<|endoftext|>`, its id in the token file's sidecar as `eos_id`). A model
trained on it has seen that token at the end of each document and before the next one, which is
GPT-2's convention, and so an export declares it as GPT-2's tokenizer does:

- end of sequence: `eos_token_id` / `eos_token` (generation stops there);
- beginning of sequence: the same token (`bos_token_id`), which is what precedes every document
  but the first in training; the tokenizer adds no BOS by itself (`add_bos_token: false`), as the
  trainer never did;
- padding: the same token (`pad_token_id`), with left padding for batched generation (the
  attention mask hides the pads, so any id would do; this one is in the vocabulary).

They are written into `config.json` (LlamaConfig's `bos/eos/pad_token_id`: transformers' defaults
there are 1 and 2, which are ordinary tokens of a vocabulary trained here), `generation_config.json`
(what `generate` reads, in transformers 4.x and 5.x) and `tokenizer_config.json` (the token strings,
`model_input_names` without `token_type_ids`, which transformers 4.57's `generate` refuses).

Byte-tokenised data (`--tokenizer bytes`) has no tokenizer file and no end-of-text token: the ids
are written as null, so that nothing stops at a byte, and `byte_note` says what a user does instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from launch.config.schema import Config

GENERATION_CONFIG = "generation_config.json"
# What the tokenizer returns: no token_type_ids (transformers 4.57's generate rejects them as unused kwargs)
MODEL_INPUT_NAMES = ["input_ids", "attention_mask"]


class SpecialTokensError(ValueError):
    """The data's end-of-text token does not fit the tokenizer being exported: one sentence."""


@dataclass(frozen=True)
class EndOfText:
    id: int
    token: Optional[str]  # its string in tokenizer.json; None without a tokenizer
    source: str  # where the id came from, for the export's message


def end_of_text(cfg: Config, tokenizer: Optional[Path]) -> Optional[EndOfText]:
    """The token that ended each training document, or None when the data had none (bytes,
    synthetic causal). In the order the trainer itself resolves it: `data.eos_id`, the token
    file's sidecar `eos_id`; then the tokenizer's own `<|endoftext|>`; then, for
    `model.attention=document` on synthetic data, the last id of the vocabulary."""
    from launch.data import tokenizer as tokenize

    d = cfg.data
    found: Optional[tuple] = None
    if d.eos_id is not None:
        found = (int(d.eos_id), "data.eos_id")
    elif d.source == "file" and d.path and "://" not in d.path:
        meta = tokenize.read_sidecar(d.path)
        if isinstance(meta, dict) and isinstance(meta.get("eos_id"), int):
            found = (meta["eos_id"], f"the sidecar {tokenize.sidecar_path(d.path).name}")
    tok = _load(tokenizer) if tokenizer is not None else None
    if found is None and tok is not None and tok.token_to_id(tokenize.EOS) is not None:
        found = (tok.token_to_id(tokenize.EOS), f"{tokenize.EOS} in {Path(tokenizer).name}")
    if found is None and cfg.model.attention == "document" and d.source != "file":
        found = (cfg.model.vocab_size - 1, "the end-of-document token of model.attention=document")
    if found is None:
        return None
    eos_id, source = found
    if not 0 <= eos_id < cfg.model.vocab_size:
        raise SpecialTokensError(f"the end-of-text id {eos_id} (from {source}) is outside model.vocab_size="
                                 f"{cfg.model.vocab_size}; the cell's data and model do not belong together.")
    token = None
    if tok is not None:
        token = tok.id_to_token(eos_id)
        if token is None:
            raise SpecialTokensError(f"the end-of-text id {eos_id} (from {source}) is not in {tokenizer}, which has "
                                     f"{tok.get_vocab_size()} tokens; the tokenizer beside the token file is not the one "
                                     "that wrote it.")
    return EndOfText(eos_id, token, source)


def _load(path: Path):
    from launch.data import tokenizer as tokenize
    try:
        return tokenize.load_tokenizer(path)
    except tokenize.PrepareError as e:
        raise SpecialTokensError(str(e)) from None


def config_ids(eot: Optional[EndOfText]) -> Dict[str, Optional[int]]:
    """The LlamaConfig / GenerationConfig fields: the end-of-text id three times, or null."""
    i = eot.id if eot else None
    return {"bos_token_id": i, "eos_token_id": i, "pad_token_id": i}


def generation_config(eot: Optional[EndOfText]) -> Dict[str, Any]:
    """generation_config.json: where `generate` stops and what it pads with."""
    return dict(config_ids(eot))


def tokenizer_config(eot: Optional[EndOfText], max_length: int) -> Dict[str, Any]:
    """tokenizer_config.json for the exported tokenizer.json (a fast, byte-level BPE)."""
    c: Dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "model_input_names": list(MODEL_INPUT_NAMES),
        "padding_side": "left",  # a decoder-only model generates after the prompt: pads go before it
        "add_bos_token": False,  # the trainer never added one (llama.cpp's converter reads this too)
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # byte-level: decode(encode(text)) == text
    }
    if eot is not None and eot.token is not None:
        c.update(bos_token=eot.token, eos_token=eot.token, pad_token=eot.token)
    return c


def byte_note(cfg: Config) -> Optional[str]:
    """What a user of a byte-tokenised export does (there is no tokenizer to ship), or None."""
    from launch.data import tokenizer as tokenize

    d = cfg.data
    meta = tokenize.read_sidecar(d.path) if d.source == "file" and d.path and "://" not in d.path else None
    if not (isinstance(meta, dict) and meta.get("tokenizer") == "bytes"):
        return None
    return ("the run's data is byte-tokenised, so no tokenizer ships: a token id is a UTF-8 byte (encode with "
            "list(text.encode('utf-8')), decode with bytes(ids).decode('utf-8', 'replace')), and there is no "
            "end-of-text token to stop at, so give generate max_new_tokens")

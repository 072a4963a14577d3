"""llama.cpp: an export's tokenizer maps to llama.cpp's `gpt-2` pre-tokenizer, and llama.cpp's own
converter (run through `launch.interop.gguf`) writes a GGUF that the `gguf` package reads back with
that pre-tokenizer, the export's end-of-text token and its vocabulary.

The converter is not on PyPI as a package of its own (it ships inside the llama-cpp-python source
distribution, 77 MB): the conversion test runs where SCALEOUT_LLAMA_CPP names a llama.cpp directory
holding convert_hf_to_gguf.py, which `make test` takes from the pinned sdist; without it the test skips
saying so, and fails under CI.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import in_ci

from launch import config
from launch.core import hf_weights
from launch.core.params import init_param, named_params
from launch.data import tokenizer as tokenize
from launch.interop import gguf as to_gguf, hf_files, special_tokens

# llama.cpp's convert_hf_to_gguf.py hashes the ids of this text to identify a pre-tokenizer (its chktxt)
CHECK_TEXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 '
              '333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
              '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
              '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
# GPT-2's pre-tokenizer regex: what llama.cpp's `gpt-2` pre-tokenizer (LLAMA_VOCAB_PRE_TYPE_GPT2) splits with
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@pytest.fixture
def bpe(tmp_path):
    (tmp_path / "a.txt").write_text(CHECK_TEXT * 3 + "The quick brown fox jumps over the lazy dog. " * 50)
    tokenize.prepare([str(tmp_path / "a.txt")], str(tmp_path / "t.bin"), "bpe", 320, 0.0)
    return tmp_path / "tokenizer.json"


def test_scaleout_bpe_splits_text_as_gpt2_does(bpe):
    import regex

    tok = tokenize.load_tokenizer(bpe)
    ours = [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(CHECK_TEXT)]
    byte_level = tokenize.load_tokenizer(bpe).pre_tokenizer  # its pieces are in GPT-2's byte alphabet
    gpt2 = ["".join(p for p, _ in byte_level.pre_tokenize_str(piece)) for piece in regex.findall(GPT2_SPLIT, CHECK_TEXT)]
    assert ours == gpt2 and len(ours) > 50
    assert to_gguf.gpt2_byte_level(bpe)
    t = json.loads(bpe.read_text())
    t["pre_tokenizer"]["add_prefix_space"] = True  # another split: not llama.cpp's gpt-2
    (bpe.parent / "other.json").write_text(json.dumps(t))
    assert not to_gguf.gpt2_byte_level(bpe.parent / "other.json")


def test_a_directory_without_a_converter_or_a_tokenizer_is_one_sentence(tmp_path, bpe):
    with pytest.raises(to_gguf.GGUFError, match=r"holds no convert_hf_to_gguf\.py; give a llama\.cpp checkout"):
        to_gguf.find_converter(tmp_path)
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(to_gguf.GGUFError, match=r"has no tokenizer\.json \(byte-tokenised data ships none\)"):
        to_gguf.convert(tmp_path, tmp_path / "hf", tmp_path / "m.gguf")


def _export_like(directory: Path, tok_json: Path):
    """The files `scaleout export` writes, from the same functions, for a tiny model with random weights."""
    cfg = config.load(["data.source=file", f"data.path={tok_json.parent / 't.bin'}", "model.vocab_size=320"])
    m = cfg.model
    directory.mkdir()
    params = {name: init_param(m, 0, name, spec) for name, spec in named_params(m)}
    hf_files.write_safetensors(hf_weights.to_hf(params), directory)
    eot = special_tokens.end_of_text(cfg, tok_json)
    (directory / "config.json").write_text(json.dumps({**hf_files.hf_config(m), **special_tokens.config_ids(eot)}))
    (directory / "generation_config.json").write_text(json.dumps(special_tokens.generation_config(eot)))
    (directory / "tokenizer.json").write_bytes(tok_json.read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps(special_tokens.tokenizer_config(eot, m.seq_len)))
    return m, eot, params


def test_llama_cpp_converter_writes_a_gguf_with_the_gpt2_pre_tokenizer(tmp_path, bpe):
    llama_cpp = os.environ.get("SCALEOUT_LLAMA_CPP")
    if not llama_cpp:
        msg = ("SCALEOUT_LLAMA_CPP is not set: give it a llama.cpp directory holding convert_hf_to_gguf.py (`make test` "
               "sets it to the one it takes from the pinned llama-cpp-python sdist, .cache/llama.cpp-<version>)")
        if in_ci():
            pytest.fail(msg + "; CI must run llama.cpp's converter")
        pytest.skip(msg)
    from gguf import GGUFReader

    m, eot, params = _export_like(tmp_path / "hf", bpe)
    out = to_gguf.convert(Path(llama_cpp), tmp_path / "hf", tmp_path / "m.gguf")
    r = GGUFReader(out)
    field = lambda k: r.get_field(k).contents()  # noqa: E731
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "gpt-2"
    assert field("tokenizer.ggml.eos_token_id") == field("tokenizer.ggml.bos_token_id") == eot.id
    assert field("tokenizer.ggml.add_bos_token") is False
    tok = tokenize.load_tokenizer(bpe)
    tokens = field("tokenizer.ggml.tokens")
    assert tokens[:tok.get_vocab_size()] == [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    assert field("llama.block_count") == m.n_layers and field("llama.embedding_length") == m.d_model
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    np.testing.assert_array_equal(np.asarray(emb.data).reshape(m.vocab_size, m.d_model), params["tok_embeddings"])

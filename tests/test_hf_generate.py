"""An export that generates and stops: the data's end-of-text token as EOS/BOS/pad in config.json,
generation_config.json and tokenizer_config.json, read by `transformers` itself.

The slow test trains a `tiny` cell in each framework on a token file of one-sentence documents (so
the model learns to end a sentence with `<|endoftext|>`), exports it, and generates with the
installed transformers: the one-call form `generate(**tok(prompt, return_tensors="pt"))` works (no
`token_type_ids`), sampled generations stop at the first end-of-text token they draw, and a batch of
prompts of different lengths, left-padded, generates what each prompt does alone.
"""

import json
import random

import numpy as np
import pytest
from conftest import in_ci, run_cell

from launch import config
from launch.data import corpus, tokenizer as tokenize
from launch.interop import special_tokens


def _transformers():
    if in_ci():
        import transformers
    else:
        transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _short_documents(tmp_path, docs=3000):
    """A token file of one-sentence documents (BPE trained here), each followed by <|endoftext|>."""
    r = random.Random(0)
    src = tmp_path / "docs.jsonl"
    with open(src, "w") as f:
        for _ in range(docs):
            text = f"{r.choice(corpus.NAMES)} {r.choice(corpus.VERBS)} the {r.choice(corpus.ANIMALS)}."
            f.write(json.dumps({"text": text}) + "\n")
    out = tmp_path / "data" / "tokens.bin"
    tokenize.prepare([str(src)], str(out), "bpe", 300, 0.0)
    return out


# --------------------------------------------------------------------------- the files (no training)

def test_end_of_text_comes_from_the_sidecar_and_names_the_tokenizer_string(tmp_path):
    data = _short_documents(tmp_path, docs=200)
    meta = tokenize.read_sidecar(data)
    cfg = config.load(["data.source=file", f"data.path={data}", "model.vocab_size=320"])
    eot = special_tokens.end_of_text(cfg, data.parent / "tokenizer.json")
    assert (eot.id, eot.token) == (meta["eos_id"], "<|endoftext|>") and "sidecar" in eot.source
    assert special_tokens.config_ids(eot) == {"bos_token_id": eot.id, "eos_token_id": eot.id, "pad_token_id": eot.id}
    tc = special_tokens.tokenizer_config(eot, 32)
    assert tc["model_input_names"] == ["input_ids", "attention_mask"] and tc["padding_side"] == "left"
    assert tc["eos_token"] == tc["bos_token"] == tc["pad_token"] == "<|endoftext|>" and tc["add_bos_token"] is False
    # data.eos_id wins, as in training; an id the tokenizer does not have is one sentence
    cfg = config.load(["data.source=file", f"data.path={data}", "model.vocab_size=320", "data.eos_id=310"])
    with pytest.raises(special_tokens.SpecialTokensError, match=r"end-of-text id 310 \(from data.eos_id\) is not in"):
        special_tokens.end_of_text(cfg, data.parent / "tokenizer.json")
    assert special_tokens.byte_note(cfg) is None


def test_byte_tokenised_data_has_no_special_tokens_and_says_what_to_do(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 200)
    tokenize.prepare([str(tmp_path / "a.txt")], str(tmp_path / "t.bin"), "bytes", val_fraction=0.0)
    cfg = config.load(["data.source=file", f"data.path={tmp_path / 't.bin'}"])
    assert special_tokens.end_of_text(cfg, None) is None
    assert special_tokens.config_ids(None) == {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    note = special_tokens.byte_note(cfg)
    assert "a token id is a UTF-8 byte" in note and "max_new_tokens" in note
    assert special_tokens.end_of_text(config.load(), None) is None  # synthetic causal data: none
    doc = special_tokens.end_of_text(config.load(["model.attention=document"]), None)
    assert doc.id == 255 and doc.token is None  # what the document mask trained with


# --------------------------------------------------------------------------- generating (trains)

@pytest.mark.slow
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_an_export_generates_stops_at_end_of_text_and_batches(tmp_path, scaleout, framework):
    transformers = _transformers()
    import torch

    data = _short_documents(tmp_path)
    eos = tokenize.read_sidecar(data)["eos_id"]
    run_cell(tmp_path, f"framework={framework}", "data.source=file", f"data.path={data}", "model.vocab_size=320",
             "train.steps=40", "checkpoint.every=0", "checkpoint.async=false", "run.name=gen")
    out = tmp_path / "hf"
    code, stdout, err = scaleout("export", str(tmp_path / "runs" / "gen" / f"{framework}-d1"), str(out))
    assert code == 0, err
    [line] = [l for l in stdout.splitlines() if l.startswith("exported step 40 of ")]
    listed = line.split(": ", 1)[1].split(", ")
    assert sorted(listed) == sorted(["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                     "tokenizer_config.json"]), stdout  # each file once
    assert f"end-of-text token '<|endoftext|>' (id {eos}, from the sidecar tokens.bin.meta.json)" in stdout
    for name in ("config.json", "generation_config.json"):
        c = json.loads((out / name).read_text())
        assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (eos, eos, eos), name

    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert tok.eos_token_id == tok.pad_token_id == tok.bos_token_id == eos
    assert model.generation_config.eos_token_id == model.generation_config.pad_token_id == eos

    # the one-call form (transformers 4.57 refused it when the tokenizer returned token_type_ids)
    prompt = tok("Ada sees", return_tensors="pt")
    assert set(prompt) == {"input_ids", "attention_mask"}
    with torch.no_grad():
        greedy = model.generate(**prompt, max_new_tokens=24, do_sample=False)[0].tolist()
    assert tok.decode(greedy, skip_special_tokens=True).startswith("Ada sees")

    # sampled: every generation ends at the first end-of-text token it draws, or runs to the limit without one
    stopped = 0
    for seed in range(12):
        torch.manual_seed(seed)
        with torch.no_grad():
            new = model.generate(**tok("Ada", return_tensors="pt"), max_new_tokens=24, do_sample=True)[0, 1:].tolist()
        assert eos not in new[:-1], (seed, new)
        if new[-1] == eos:
            stopped += 1
        else:
            assert len(new) == 24, (seed, new)
    assert stopped >= 6, stopped  # one-sentence documents: most samples end their sentence

    # a batch of prompts of different lengths: left-padded, each row generates what its prompt does alone
    prompts = ["Ada", "the quick brown fox sees"]
    batch = tok(prompts, padding=True, return_tensors="pt")
    assert batch["attention_mask"][0, 0] == 0 and batch["input_ids"][0, 0] == eos  # padding on the left, with EOS
    with torch.no_grad():
        rows = model.generate(**batch, max_new_tokens=8, do_sample=False)[:, batch["input_ids"].shape[1]:].tolist()
    for p, row in zip(prompts, rows):
        alone = tok(p, return_tensors="pt")
        with torch.no_grad():
            want = model.generate(**alone, max_new_tokens=8, do_sample=False)[0, alone["input_ids"].shape[1]:].tolist()
        assert row[:len(want)] == want and all(t == eos for t in row[len(want):]), (p, row, want)
    assert np.isfinite(model(**batch).logits.detach().numpy()).all()

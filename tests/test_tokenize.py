"""`scaleout prepare-data` with tokenizers (bytes, a trained BPE, an existing tokenizer.json), its
sidecar, and the checks data.source=file makes with it."""

import json

import numpy as np
import pytest

from launch import config
from launch.data import corpus, tokenizer as tokenize
from launch.data.batches import Batches

TEXT = "Hello, world!\nThe quick brown fox — jumps over the lazy dog.  Tabs\tand ünïcödé 日本語 🙂\n\n  spaces  \n"


@pytest.fixture
def docs(tmp_path):
    return corpus.write(tmp_path / "corpus.jsonl", docs=300)


def test_bpe_round_trip_and_sidecar(tmp_path, docs, scaleout):
    plain = tmp_path / "plain.txt"
    plain.write_text(TEXT * 50)
    out = tmp_path / "data" / "tokens.bin"
    code, stdout, err = scaleout("prepare-data", str(docs), str(plain), str(out), "--tokenizer", "bpe",
                                 "--vocab-size", "600", "--val-fraction", "0.1")
    assert code == 0, err
    meta = json.loads((tmp_path / "data" / "tokens.bin.meta.json").read_text())
    tok = tokenize.load_tokenizer(tmp_path / "data" / "tokenizer.json")
    assert meta["vocab_size"] == tok.get_vocab_size() == 600 and meta["dtype"] == "uint16"
    assert meta["eos_id"] == tok.token_to_id("<|endoftext|>") and meta["documents"] == 301
    for text in (TEXT, corpus.document(0, 5), "no trailing newline", "  leading spaces\r\nCRLF"):
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text  # byte-level: exact
    ids = np.fromfile(out, np.uint16)
    assert ids.size == meta["tokens"] and int(ids.max()) == meta["max_token"]
    assert (ids == meta["eos_id"]).sum() == meta["documents"]
    # documents are the inputs in order, each followed by EOS
    eos = np.flatnonzero(ids == meta["eos_id"])
    first = tok.decode(ids[: eos[0]].tolist(), skip_special_tokens=False)
    assert first == json.loads(docs.read_text().splitlines()[0])["text"]
    assert tok.decode(ids[eos[-2] + 1: eos[-1]].tolist()) == TEXT * 50
    # held out: the last ~10%, starting at a document's first token
    assert 0.85 * ids.size < meta["val_start"] < 0.9 * ids.size + 1 and ids[meta["val_start"] - 1] == meta["eos_id"]
    assert "model.vocab_size=640" in stdout
    # the same tokenizer again, as a path: the same tokens
    out2 = tmp_path / "again" / "t.bin"
    assert scaleout("prepare-data", str(docs), str(plain), str(out2), "--tokenizer",
                    str(tmp_path / "data" / "tokenizer.json"), "--val-fraction", "0.1")[0] == 0
    assert np.array_equal(np.fromfile(out2, np.uint16), ids)
    assert json.loads((tmp_path / "again" / "t.bin.meta.json").read_text())["tokenizer_sha256"] == meta["tokenizer_sha256"]
    assert (tmp_path / "again" / "tokenizer.json").is_file()  # beside the tokens, for `scaleout export`


def test_large_plain_file_streams_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenize, "CHUNK_CHARS", 1000)
    monkeypatch.setattr(tokenize, "GROUP_CHARS", 3000)
    text = "".join(corpus.document(1, i) for i in range(60))
    (tmp_path / "big.txt").write_text(text)
    meta = tokenize.prepare([str(tmp_path / "big.txt")], str(tmp_path / "t.bin"), "bpe", 400, 0.0)
    tok = tokenize.load_tokenizer(tmp_path / "tokenizer.json")
    ids = np.fromfile(tmp_path / "t.bin", np.uint16)
    assert meta["documents"] == 1 and ids[-1] == meta["eos_id"] and meta["val_start"] == ids.size
    assert tok.decode(ids[:-1].tolist()) == text  # chunked encoding loses nothing
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_bytes_is_todays_behaviour_plus_a_sidecar(tmp_path, scaleout):
    (tmp_path / "a.txt").write_bytes(b"abc\xc3\xa9")
    assert scaleout("prepare-data", str(tmp_path / "a.txt"), str(tmp_path / "t.bin"), "--val-fraction", "0")[0] == 0
    assert np.fromfile(tmp_path / "t.bin", np.uint16).tolist() == [97, 98, 99, 0xC3, 0xA9]
    meta = tokenize.read_sidecar(tmp_path / "t.bin")
    assert meta["vocab_size"] == 256 and meta["eos_id"] is None and meta["tokenizer"] == "bytes"
    assert not (tmp_path / "tokenizer.json").exists()


def _listing(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_prepare_data_refusals_exit_2_and_write_nothing(tmp_path, docs, scaleout):
    before = _listing(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    before = _listing(tmp_path)
    cases = [
        ([str(tmp_path / "missing.txt"), str(tmp_path / "o.bin")], "does not exist"),
        ([str(bad), str(tmp_path / "o.bin")], "bad.jsonl:2 is not a JSON object with a `text` field"),
        ([str(docs), str(tmp_path / "o.bin"), "--tokenizer", "bpe", "--vocab-size", "100"], "at least 257 tokens"),
        ([str(docs), str(tmp_path / "o.bin"), "--tokenizer", "nope.json"], "neither bytes, bpe nor"),
        ([str(docs), str(tmp_path / "o.bin"), "--val-fraction", "1.5"], "--val-fraction=1.5 is not valid"),
        ([str(docs), str(tmp_path), "--tokenizer", "bpe"], "is a directory"),
        ([str(tmp_path / "o.bin")], "needs INPUT... OUT"),
    ]
    for argv, message in cases:
        code, _, err = scaleout("prepare-data", *argv)
        assert code == 2 and message in err and err.count("\n") == 1, (argv, err)
        assert _listing(tmp_path) == before, argv


@pytest.fixture
def prepared(tmp_path, docs):
    out = tmp_path / "d" / "tokens.bin"
    tokenize.prepare([str(docs)], str(out), "bpe", 700, 0.1)
    return out


def test_file_source_refusals_through_the_cli(tmp_path, prepared, scaleout):
    """Each refusal: one sentence, exit 2, nothing written (no run directory)."""
    base = ["run", f"run.dir={tmp_path / 'runs'}", "data.source=file", f"data.path={prepared}"]
    cases = [
        (["model.vocab_size=512"], "model.vocab_size=512 is smaller than the tokenizer's vocabulary of 700"),
        (["model.vocab_size=704", "data.dtype=uint32"], "holds uint16 tokens"),
        (["model.vocab_size=704", "model.seq_len=100000"], "needs at least 100002"),
        (["model.vocab_size=704", "model.seq_len=8192", "train.eval_every=5"], "held-out tokens, too few for one eval row"),
    ]
    for extra, message in cases:
        code, _, err = scaleout(*base, *extra)
        assert code == 2 and message in err and err.count("\n") == 1, (extra, err)
        assert not (tmp_path / "runs").exists()
    # issue 13 item 8: a token >= model.vocab_size, from a file without a sidecar (memmap max)
    raw = tmp_path / "raw.bin"
    np.array([1, 2, 300, 4] * 100, np.uint16).tofile(raw)
    code, _, err = scaleout("run", f"run.dir={tmp_path / 'runs'}", "data.source=file", f"data.path={raw}")
    assert code == 2 and "holds token 300, outside model.vocab_size=256" in err
    code, _, err = scaleout("run", f"run.dir={tmp_path / 'runs'}", "data.source=file", f"data.path={raw}",
                            "model.vocab_size=512", "train.eval_every=2")
    assert code == 2 and "has no sidecar" in err
    # ... and from a sidecar whose max_token is above the model's vocabulary
    meta = tokenize.read_sidecar(prepared)
    (tmp_path / "d" / "tokens.bin.meta.json").write_text(json.dumps(dict(meta, vocab_size=10, max_token=900)))
    code, _, err = scaleout(*base, "model.vocab_size=704")
    assert code == 2 and "holds token 900, outside model.vocab_size=704" in err
    assert not (tmp_path / "runs").exists()


def test_held_out_rows_never_appear_in_training_batches(prepared):
    cfg = config.load(["data.source=file", f"data.path={prepared}", "model.vocab_size=704", "model.seq_len=16"])
    meta = tokenize.read_sidecar(prepared)
    b = Batches(cfg.data, 704, 16)
    assert b.val_start == meta["val_start"]
    tokens = np.fromfile(prepared, np.uint16)
    held = {tuple(tokens[o: o + 17]) for o in range(meta["val_start"], len(tokens) - 16)}
    train_rows = np.concatenate([b.rows(s, 0, 64) for s in range(50)])
    # every training window lies wholly before val_start: find each row's offset
    starts = {tuple(tokens[o: o + 17]): o for o in range(0, len(tokens) - 16)}
    assert all(starts[tuple(r)] + 17 <= meta["val_start"] for r in train_rows)
    ev = np.concatenate([b.eval_rows(i, 0, 8) for i in range(4)])
    assert all(tuple(r) in held for r in ev)
    assert np.array_equal(b.eval_rows(2, 3, 8), Batches(cfg.data, 704, 16).eval_rows(2, 0, 8)[3:])  # any slicing


def test_synthetic_eval_stream_is_disjoint_and_fixed():
    cfg = config.load()
    b = Batches(cfg.data, 256, 32)
    ev = b.eval_rows(0, 0, 8)
    assert np.array_equal(ev, Batches(cfg.data, 256, 32).eval_rows(0, 0, 8))
    assert np.array_equal(np.concatenate([b.eval_rows(0, 0, 3), b.eval_rows(0, 3, 8)]), ev)
    train = {tuple(r) for s in range(20) for r in b.rows(s, 0, 8)}
    assert not any(tuple(r) in train for r in ev)
    # the seed words cannot coincide with training's (numpy pads seeds shorter than 4 words with zeros)
    from launch.data.batches import EVAL_STREAM
    assert not np.array_equal(b.rows(EVAL_STREAM, 0, 1)[0], b.eval_rows(0, 0, 1)[0])
    # the same chain: a model learns both from the same transitions
    follows = np.mean(b.perm[ev[:, :-1]] == ev[:, 1:])
    assert 0.7 < follows < 0.9

"""`scaleout prepare-data` with tokenizers (bytes, a trained BPE, an existing tokenizer.json), its
sidecar, and the checks data.source=file makes with it."""

import json
import os
import stat

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
    (tmp_path / "sub").mkdir()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    before = _listing(tmp_path)
    cases = [
        ([str(tmp_path / "missing.txt"), str(tmp_path / "o.bin")], "does not exist"),
        ([str(bad), str(tmp_path / "o.bin")], "bad.jsonl:2 is not a JSON object with a `text` field"),
        ([str(docs), str(tmp_path / "o.bin"), "--tokenizer", "bpe", "--vocab-size", "100"], "needs from 257 tokens"),
        # issue 24.16: the message says what is valid on both sides; a directory INPUT is named as one
        ([str(docs), str(tmp_path / "o.bin"), "--tokenizer", "bpe", "--vocab-size", "99999999999"],
         "--vocab-size=99999999999 is not valid: a byte-level BPE needs from 257 tokens (256 bytes and end-of-text) "
         "to 4294967296"),
        ([str(tmp_path / "sub"), str(tmp_path / "o.bin")], f"INPUT={str(tmp_path / 'sub')!r} is a directory; give the text"),
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


def test_prepare_data_never_writes_over_what_exists(tmp_path, docs, scaleout):
    """Issue 24.9: an existing OUT is refused unless --force, and even then only a regular file is replaced
    (a named pipe, a symbolic link: as root, `prepare-data x /dev/null` replaced /dev/null)."""
    precious = tmp_path / "precious.bin"
    precious.write_bytes(b"mine")
    code, out, err = scaleout("prepare-data", str(docs), str(precious))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"OUT={str(precious)!r} already exists; give a new path, or --force to replace it" in err
    assert precious.read_bytes() == b"mine" and not tokenize.sidecar_path(precious).exists()
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    link = tmp_path / "link.bin"
    link.symlink_to(precious)
    for path, kind in ((pipe, "a named pipe"), (link, "a symbolic link")):
        for force in ((), ("--force",)):
            code, _, err = scaleout("prepare-data", str(docs), str(path), *force)
            assert code == 2 and f"OUT={str(path)!r} is {kind}, not a regular file" in err, (path, force, err)
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode) and link.is_symlink() and precious.read_bytes() == b"mine"
    # nor beside it: a sidecar place that is not a regular file
    os.mkfifo(tokenize.sidecar_path(tmp_path / "t.bin"))
    code, _, err = scaleout("prepare-data", str(docs), str(tmp_path / "t.bin"))
    assert code == 2 and "t.bin.meta.json is a named pipe, not a regular file" in err and not (tmp_path / "t.bin").exists()
    # --force replaces a regular file, and the sidecar then records the new file's identity
    assert scaleout("prepare-data", str(docs), str(precious), "--force")[0] == 0
    meta = tokenize.read_sidecar(precious)
    assert meta["bytes"] == precious.stat().st_size == 2 * meta["tokens"]
    assert meta["sha256"] == tokenize.file_hash(precious)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_jsonl_with_a_byte_order_mark_or_a_lone_surrogate(tmp_path, scaleout):
    """Issue 24.16: a UTF-8 BOM is not part of the first line; 24.15: a lone surrogate (JSON's \\ud800)
    is one sentence naming the line, not a UnicodeEncodeError traceback."""
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"text": "ab"}\n{"text": "c"}\n')
    assert scaleout("prepare-data", str(bom), str(tmp_path / "t.bin"), "--val-fraction", "0")[0] == 0
    assert np.fromfile(tmp_path / "t.bin", np.uint16).tolist() == [97, 98, 99]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "a\\ud800"}\n')
    for tok in ("bytes", "bpe"):
        code, out, err = scaleout("prepare-data", str(bad), str(tmp_path / f"{tok}.bin"), "--tokenizer", tok,
                                  "--vocab-size", "300")
        assert code == 2 and out == "" and "Traceback" not in err and err.count("\n") == 1, err
        assert f"{bad}:2 has a `text` field with a lone surrogate ('\\ud800' at character 1)" in err, err
        assert not (tmp_path / f"{tok}.bin").exists()


@pytest.mark.parametrize("change,message", [
    ({"vocab_size": "700"}, 'whose vocab_size="700" is not an integer of at least 1'),
    ({"max_token": "9"}, 'whose max_token="9" is not an integer'),
    ({"val_start": "abc"}, 'whose val_start="abc" is not an integer of at least 0'),
    ({"val_start": None}, "whose val_start=null is not an integer"),
    ({"val_start": 1e400}, "whose val_start=Infinity is not an integer"),
    ({"eos_id": "x"}, 'whose eos_id="x" is not a token id or null'),
    ({"sha256": 5}, "whose sha256=5 is not a string"),
    ("[1, 2]", "that holds list, not a JSON object"),
    ("{", "that is not valid JSON"),
])
def test_a_sidecar_of_the_wrong_shape_is_one_sentence(tmp_path, prepared, scaleout, change, message):
    """Issue 24.15: sidecar fields of the wrong type were tracebacks at config load."""
    side = tokenize.sidecar_path(prepared)
    meta = json.loads(side.read_text())
    side.write_text(change if isinstance(change, str) else json.dumps({**meta, **change}))
    code, out, err = scaleout("plan", "data.source=file", f"data.path={prepared}", "model.vocab_size=704")
    assert code == 2 and out == "" and "Traceback" not in err and err.count("\n") == 1, err
    assert f"data.path={str(prepared)!r} has a sidecar tokens.bin.meta.json {message}" in err, err
    assert "rerun `scaleout prepare-data`" in err


def test_a_token_file_changed_after_its_sidecar_is_refused(tmp_path, prepared, scaleout):
    """Issue 24.9: the sidecar records the file's size: a file rewritten by something else is refused at load."""
    with open(prepared, "ab") as f:
        f.write(b"\0\0")
    code, _, err = scaleout("plan", "data.source=file", f"data.path={prepared}", "model.vocab_size=704")
    size = prepared.stat().st_size
    assert code == 2 and f"is {size} bytes, but its sidecar tokens.bin.meta.json says prepare-data wrote {size - 2}" in err

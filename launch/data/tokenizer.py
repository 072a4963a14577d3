"""`scaleout prepare-data`: text in, a flat token file plus a sidecar out, and the sidecar's checks.

    scaleout prepare-data INPUT... OUT --tokenizer bytes|bpe|PATH/tokenizer.json [--vocab-size N] [--val-fraction F]

- Inputs: plain text files (one document per file) and JSON-lines files (`.jsonl`/`.json`, one
  document per line, its `text` field).
- `bytes`: one token per byte, vocabulary 256, no end-of-text token (documents are concatenated),
  as before. `bpe`: a byte-level BPE trained here with Hugging Face `tokenizers` on the inputs
  (nothing downloaded), saved as `tokenizer.json` beside OUT. A path: encode with that
  tokenizer.json (copied beside OUT, so `scaleout export` finds it).
- Documents are separated by the tokenizer's end-of-text token (`<|endoftext|>`), written after
  each document.
- Streaming: documents are read lazily, big plain-text files in chunks that end at a line end,
  encoded in groups with `encode_batch` (parallel in Rust) and appended to a temporary file in
  OUT's directory, which is renamed onto OUT at the end (readers see no partial file).
- OUT is uint16 when the vocabulary fits, else uint32. The sidecar `OUT.meta.json` holds the
  vocabulary size, dtype, EOS id, token and document counts, the largest token, the tokenizer's
  hash and `val_start`: tokens [val_start, n) are the held-out split (the last `--val-fraction`,
  moved back to the start of the document it cut), training rows never touch it.

`file_problem(cfg)` is what `data.source=file` checks at config load: a one-sentence refusal or None.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
SIDECAR_SUFFIX = ".meta.json"
TOKENIZER_NAME = "tokenizer.json"
CHUNK_CHARS = 1 << 20  # a plain-text file is read (and encoded) in pieces of about this many characters
GROUP_CHARS = 8 << 20  # characters handed to one encode_batch call
DEFAULT_VAL_FRACTION = 0.005


class PrepareError(Exception):
    """A mistake in prepare-data's arguments or inputs: one sentence."""


def sidecar_path(out: str | Path) -> Path:
    return Path(str(out) + SIDECAR_SUFFIX)


def read_sidecar(path: str | Path) -> Optional[Dict[str, Any]]:
    p = sidecar_path(path)
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# --------------------------------------------------------------------------- reading documents

def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".json", ".ndjson")


def documents(paths: Sequence[str | Path]) -> Iterator[List[str]]:
    """Each document as a list of text pieces (a big plain-text file comes in line-aligned chunks)."""
    for p in map(Path, paths):
        if _is_jsonl(p):
            with open(p, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)["text"]
                    except (ValueError, KeyError, TypeError):
                        raise PrepareError(f"{p}:{lineno} is not a JSON object with a `text` field; "
                                           "JSON-lines inputs need one {\"text\": ...} object per line.") from None
                    if not isinstance(text, str):
                        raise PrepareError(f"{p}:{lineno} has a `text` field that is not a string.")
                    yield [text]
        else:
            yield list(_chunks(p))


def _chunks(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", newline="") as f:
        buf = ""
        while True:
            piece = f.read(CHUNK_CHARS)
            if not piece:
                break
            buf += piece
            cut = buf.rfind("\n")
            if cut >= 0 and len(buf) >= CHUNK_CHARS:
                yield buf[: cut + 1]
                buf = buf[cut + 1:]
        if buf:
            yield buf


def _texts(paths: Sequence[str | Path]) -> Iterator[str]:
    for doc in documents(paths):
        yield from doc


# --------------------------------------------------------------------------- tokenizers

def train_bpe(paths: Sequence[str | Path], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenisation, no normaliser: decode(encode(t)) == t) trained on `paths`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t0 = time.perf_counter()
    tok.train_from_iterator(_texts(paths), trainer=trainer)
    log.info(f"trained a byte-level BPE of {tok.get_vocab_size()} tokens in {time.perf_counter() - t0:.1f} s")
    return tok


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise PrepareError(f"--tokenizer {str(path)!r} is not a tokenizer.json that Hugging Face tokenizers can read ({str(e).splitlines()[0][:120]}).") from None


def file_hash(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- prepare

def _check_args(inputs: Sequence[str], out: str, tokenizer: str, vocab_size: int, val_fraction: float) -> None:
    for p in inputs:
        if not Path(p).is_file():
            raise PrepareError(f"INPUT={p!r} does not exist; give text files or JSON-lines files with a `text` field.")
    if Path(out).is_dir():
        raise PrepareError(f"OUT={out!r} is a directory; give the path of the token file to write, e.g. {Path(out) / 'tokens.bin'}.")
    if str(Path(out).resolve()) in {str(Path(p).resolve()) for p in inputs}:
        raise PrepareError(f"OUT={out!r} is also an INPUT; give a new path for the token file.")
    if not 0 <= val_fraction < 1:
        raise PrepareError(f"--val-fraction={val_fraction} is not valid: it must be at least 0 and below 1, e.g. 0.005.")
    if tokenizer == "bpe" and not 257 <= vocab_size <= 1 << 32:
        raise PrepareError(f"--vocab-size={vocab_size} is not valid: a byte-level BPE needs at least 257 tokens (256 bytes and end-of-text).")
    if tokenizer not in ("bytes", "bpe") and not Path(tokenizer).is_file():
        raise PrepareError(f"--tokenizer {tokenizer!r} is neither bytes, bpe nor an existing tokenizer.json file.")


def prepare(inputs: Sequence[str], out: str, tokenizer: str = "bytes", vocab_size: int = 8192,
            val_fraction: float = DEFAULT_VAL_FRACTION, dtype: Optional[str] = None) -> Dict[str, Any]:
    """Tokenise `inputs` into `out` (+ sidecar, + tokenizer.json beside it); returns the sidecar."""
    _check_args(inputs, out, tokenizer, vocab_size, val_fraction)
    out_p = Path(out)
    tok_dest = out_p.parent / TOKENIZER_NAME
    t_start = time.perf_counter()
    if tokenizer == "bytes":
        tok, vocab, eos, tok_hash = None, 256, None, "bytes"
    else:
        tok = train_bpe(inputs, vocab_size) if tokenizer == "bpe" else load_tokenizer(tokenizer)
        vocab = tok.get_vocab_size()
        eos = tok.token_to_id(EOS)
        if eos is None:
            raise PrepareError(f"--tokenizer {tokenizer!r} has no {EOS} token; documents need an end-of-text token to separate them.")
        tok_json = tok.to_str()
        tok_hash = hashlib.sha256(tok_json.encode()).hexdigest()
        if tok_dest.exists() and hashlib.sha256(tok_dest.read_bytes()).hexdigest() != tok_hash \
                and (tokenizer == "bpe" or Path(tokenizer).resolve() != tok_dest.resolve()):
            raise PrepareError(f"{tok_dest} already holds another tokenizer; write OUT into another directory "
                               "(each token file keeps its tokenizer.json beside it).")
    dt = dtype or dtype_for(vocab)
    if np.iinfo(np.dtype(dt)).max < vocab - 1:
        raise PrepareError(f"--dtype {dt} cannot hold the vocabulary of {vocab} tokens; use uint32.")
    out_p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_p.name}.", suffix=".tmp", dir=out_p.parent)
    t_enc = time.perf_counter()
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            n_tokens, n_docs, max_tok = _encode_into(f, inputs, tok, eos, np.dtype(dt))
            f.flush()
            os.fsync(f.fileno())
        encode_s = time.perf_counter() - t_enc
        val_start = _val_start(tmp, np.dtype(dt), n_tokens, val_fraction, eos)
        meta = {"format": "scaleout-tokens/1", "tokenizer": "bytes" if tok is None else TOKENIZER_NAME,
                "tokenizer_sha256": tok_hash, "vocab_size": vocab, "dtype": dt, "eos_id": eos,
                "tokens": n_tokens, "documents": n_docs, "max_token": max_tok, "val_fraction": val_fraction,
                "val_start": val_start, "inputs": [str(p) for p in inputs]}
        if tok is not None and (tokenizer == "bpe" or Path(tokenizer).resolve() != tok_dest.resolve()):
            from launch.common.files import atomic_write
            atomic_write(tok_dest, tok_json)
        os.replace(tmp, out_p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    from launch.common.files import write_json
    write_json(sidecar_path(out_p), meta)
    log.info(f"wrote {n_tokens:,} tokens ({n_docs:,} documents, {dt}) to {out_p} in {time.perf_counter() - t_start:.1f} s "
             f"(encoding {n_tokens / max(encode_s, 1e-9):,.0f} tokens/s); held out tokens {val_start:,}..{n_tokens:,}")
    return dict(meta, encode_s=encode_s, total_s=time.perf_counter() - t_start)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _encode_into(f, inputs, tok, eos: Optional[int], dtype: np.dtype):
    """Encode every document into the open file `f`; returns (tokens, documents, max token)."""
    n_tokens = n_docs = 0
    max_tok = -1
    total_bytes = sum(Path(p).stat().st_size for p in inputs)
    read_bytes, last_log = 0, time.perf_counter()
    group: List[str] = []
    ends: List[bool] = []  # whether group[i] ends a document (an EOS follows it)
    chars = 0

    def flush():
        nonlocal n_tokens, max_tok, read_bytes, last_log
        if tok is None:
            arrays = [np.frombuffer(t.encode("utf-8"), np.uint8) for t in group]
        else:
            arrays = [np.asarray(e.ids, np.uint32) for e in tok.encode_batch(group, add_special_tokens=False)]
        parts = []
        for a, end in zip(arrays, ends):
            parts.append(a)
            if end and eos is not None:
                parts.append(np.array([eos], np.uint32))
        if parts:
            ids = np.concatenate(parts).astype(dtype)
            if ids.size:
                max_tok = max(max_tok, int(ids.max()))
            f.write(ids.tobytes())
            n_tokens += int(ids.size)
        read_bytes += sum(len(t.encode("utf-8")) for t in group)
        group.clear()
        ends.clear()
        now = time.perf_counter()
        if now - last_log > 5:
            last_log = now
            log.info(f"prepare-data: {100 * min(1.0, read_bytes / max(total_bytes, 1)):.0f}% of the input, {n_tokens:,} tokens")

    for doc in documents(inputs):
        n_docs += 1
        if not doc:
            doc = [""]
        for i, piece in enumerate(doc):
            group.append(piece)
            ends.append(i == len(doc) - 1)
            chars += len(piece)
            if chars >= GROUP_CHARS:
                flush()
                chars = 0
    flush()
    return n_tokens, n_docs, max_tok


def _val_start(path: str, dtype: np.dtype, n: int, fraction: float, eos: Optional[int]) -> int:
    """Where the held-out tokens begin: the last `fraction` of the file, moved back to the start of
    the document the cut falls in (just after an EOS) when that document is not the whole file."""
    if fraction <= 0 or n == 0:
        return n
    cut = n - max(1, math.ceil(n * fraction))
    if eos is None or cut <= 0:
        return max(cut, 0)
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    lo = cut
    while lo > 0:
        start = max(0, lo - (1 << 20))
        hits = np.flatnonzero(tokens[start:lo] == eos)
        if hits.size:
            return start + int(hits[-1]) + 1
        lo = start
    return cut  # one document: cut inside it


# --------------------------------------------------------------------------- checks for data.source=file

_MAX_CACHE: Dict[tuple, int] = {}


def scan_max(path: str, dtype: str) -> int:
    """The largest token of a file without a sidecar (memory-mapped, in pieces; once per process and file)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, dtype)
    if key not in _MAX_CACHE:
        tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        step = 1 << 26
        _MAX_CACHE[key] = max((int(tokens[i: i + step].max()) for i in range(0, len(tokens), step)), default=-1)
    return _MAX_CACHE[key]


def split_bounds(path: str, dtype: str) -> tuple:
    """(tokens in the file, first held-out token): the whole file trains when there is no sidecar."""
    n = os.path.getsize(path) // np.dtype(dtype).itemsize
    meta = read_sidecar(path)
    val_start = int(meta["val_start"]) if meta and "val_start" in meta else n
    return n, min(val_start, n)


def file_problem(cfg) -> Optional[str]:
    """Why `data.source=file` cannot train this config (one sentence), or None."""
    d, m, t = cfg.data, cfg.model, cfg.train
    path = d.path
    meta = read_sidecar(path)
    itemsize = np.dtype(d.dtype).itemsize
    size = os.path.getsize(path)
    if meta:
        if meta.get("dtype") != d.dtype:
            return (f"data.path={path!r} holds {meta.get('dtype')} tokens (its sidecar {sidecar_path(path).name} says so), "
                    f"not data.dtype={d.dtype}; set data.dtype={meta.get('dtype')}.")
        if m.vocab_size < meta.get("vocab_size", 0):
            return (f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's vocabulary of {meta['vocab_size']} "
                    f"for data.path={path!r}; set model.vocab_size={meta['vocab_size']} or more.")
    if size % itemsize:
        return f"data.path={path!r} is {size} bytes, not a whole number of {d.dtype} tokens; check data.dtype."
    n, val_start = split_bounds(path, d.dtype)
    need = m.seq_len + 2
    if val_start < need:
        where = f"{val_start} training tokens (before the held-out split)" if val_start < n else f"{n} tokens"
        return f"data.path={path!r} holds {where}; model.seq_len={m.seq_len} needs at least {need}."
    if t.eval_every and not meta:
        return (f"data.path={path!r} has no sidecar {sidecar_path(path).name} with a held-out split; rerun "
                "`scaleout prepare-data` on its text, or set train.eval_every=0.")
    if t.eval_every and n - val_start < need:
        return (f"data.path={path!r} has {n - val_start} held-out tokens, too few for one eval row of model.seq_len={m.seq_len} "
                f"(needs {need}); rerun prepare-data with a larger --val-fraction, or set train.eval_every=0.")
    top = meta["max_token"] if meta and "max_token" in meta else scan_max(path, d.dtype)
    if top >= m.vocab_size:
        return (f"data.path={path!r} holds token {top}, outside model.vocab_size={m.vocab_size}; "
                f"set model.vocab_size={top + 1} or more, or check data.dtype.")
    return None


"""`scaleout prepare-data`: text in, a flat token file plus a sidecar out, and the sidecar's checks.

    scaleout prepare-data INPUT... OUT --tokenizer bytes|bpe|PATH/tokenizer.json [--vocab-size N] [--val-fraction F] [--force]

- Inputs: plain text files (one document per file) and JSON-lines files (`.jsonl`/`.json`, one
  document per line, its `text` field; a UTF-8 byte-order mark at the start is allowed).
- OUT must not exist unless `--force`, and is only ever a regular file: prepare-data never writes
  over a directory, a device, a pipe or a symbolic link (nor does it for the sidecar or tokenizer.json).
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
  moved back to the start of the document it cut), training rows never touch it. It also holds the
  token file's identity, `bytes` and `sha256` (a digest of its content taken as it was written):
  `token_file_identity` hands it to the trainers, which record it in the start record and in every
  checkpoint and refuse to resume a checkpoint on a token file that is no longer the one it trained on.

`file_problem(cfg)` is what `data.source=file` checks at config load: a one-sentence refusal or None
(a sidecar whose fields are not what prepare-data writes is one too: `sidecar_problem`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import stat
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
    """The sidecar of token file `path` as a mapping, or None when there is none (or it is no JSON object:
    `sidecar_problem` says so at config load)."""
    p = sidecar_path(path)
    if not p.is_file():
        return None
    try:
        meta = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


# Sidecar fields that are whole numbers, and the least each may be (max_token is -1 for an empty file).
_SIDECAR_INTS = {"vocab_size": 1, "tokens": 0, "documents": 0, "max_token": -1, "val_start": 0, "bytes": 0}
_SIDECAR_STRS = ("format", "tokenizer", "tokenizer_sha256", "dtype", "sha256")


def sidecar_problem(path: str | Path) -> Optional[str]:
    """Why the sidecar of token file `path` cannot be used (one sentence), or None (also when there is none)."""
    p = sidecar_path(path)
    if not p.is_file():
        return None
    fix = "rerun `scaleout prepare-data` on its text to rewrite both"
    try:
        meta = json.loads(p.read_text())
    except UnicodeDecodeError:
        return f"data.path={str(path)!r} has a sidecar {p.name} that is not UTF-8 JSON; {fix}."
    except ValueError as e:
        return f"data.path={str(path)!r} has a sidecar {p.name} that is not valid JSON ({e}); {fix}."
    if not isinstance(meta, dict):
        return f"data.path={str(path)!r} has a sidecar {p.name} that holds {type(meta).__name__}, not a JSON object; {fix}."
    for key, least in _SIDECAR_INTS.items():
        v = meta.get(key)
        if key in meta and not (type(v) is int and v >= least):
            return (f"data.path={str(path)!r} has a sidecar {p.name} whose {key}={json.dumps(v)} is not an integer "
                    f"of at least {least}; {fix}.")
    eos = meta.get("eos_id")
    if eos is not None and not (type(eos) is int and eos >= 0):
        return f"data.path={str(path)!r} has a sidecar {p.name} whose eos_id={json.dumps(eos)} is not a token id or null; {fix}."
    for key in _SIDECAR_STRS:
        if key in meta and not isinstance(meta[key], str):
            return f"data.path={str(path)!r} has a sidecar {p.name} whose {key}={json.dumps(meta[key])} is not a string; {fix}."
    return None


def token_file_identity(data) -> Optional[Dict[str, Any]]:
    """What a run records of its token file (`data`: the config's data section) to know it again: its size
    and the content digest its sidecar took when prepare-data wrote it (None without a sidecar, or one
    written before digests). None for synthetic data. Cheap: a stat and the sidecar, no hashing."""
    if data.source != "file" or not data.path or "://" in data.path:
        return None
    meta = read_sidecar(data.path) or {}
    digest = meta.get("sha256")
    return {"bytes": os.path.getsize(data.path), "sha256": digest if isinstance(digest, str) else None}


def same_token_file(recorded: Any, now: Optional[Dict[str, Any]]) -> bool:
    """Whether a recorded identity (`token_file_identity`, from a checkpoint) is the file's identity `now`:
    the same size and, where both have one, the same digest. A record that has none (synthetic data, a
    checkpoint written before identities) matches anything."""
    if not isinstance(recorded, dict):
        return True
    if now is None:
        return False
    if recorded.get("bytes") != now["bytes"]:
        return False
    return recorded.get("sha256") is None or now["sha256"] is None or recorded["sha256"] == now["sha256"]


def describe_identity(identity: Any) -> str:
    if not isinstance(identity, dict):
        return "unknown"
    digest = identity.get("sha256")
    return f"{identity.get('bytes')} bytes" + (f", sha256 {digest[:12]}" if isinstance(digest, str) else "")


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# --------------------------------------------------------------------------- reading documents

def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".json", ".ndjson")


def documents(paths: Sequence[str | Path]) -> Iterator[List[str]]:
    """Each document as a list of text pieces (a big plain-text file comes in line-aligned chunks)."""
    for p in map(Path, paths):
        if _is_jsonl(p):
            with open(p, encoding="utf-8-sig") as f:  # a byte-order mark before the first line is not part of it
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
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as e:  # JSON's \ud800 escapes: a lone surrogate is no character
                        raise PrepareError(f"{p}:{lineno} has a `text` field with a lone surrogate "
                                           f"({ascii(text[e.start])} at character {e.start}), which is not text; fix or "
                                           "drop that line.") from None
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

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _not_regular(path: Path) -> Optional[str]:
    """What `path` is when it exists and is not a regular file ("a character device"), else None."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _check_out(out: str, force: bool, tok_dest: Optional[Path]) -> None:
    """OUT (and the sidecar, and tokenizer.json beside it) may be written: new, or with --force a regular file."""
    kind = _not_regular(Path(out))
    if kind == "a directory":
        raise PrepareError(f"OUT={out!r} is a directory; give the path of the token file to write, e.g. {Path(out) / 'tokens.bin'}.")
    if kind:
        raise PrepareError(f"OUT={out!r} is {kind}, not a regular file; prepare-data writes only a new token file "
                           "(or, with --force, over a regular file): give a new path.")
    if os.path.lexists(out) and not force:
        raise PrepareError(f"OUT={out!r} already exists; give a new path, or --force to replace it (a run that trained "
                           "on it then refuses to resume on the new tokens).")
    for other in (sidecar_path(out), tok_dest):
        kind = _not_regular(other) if other is not None else None
        if kind:
            raise PrepareError(f"{other} is {kind}, not a regular file, and prepare-data would write it beside OUT={out!r}; "
                               "give OUT in another directory.")


def _check_args(inputs: Sequence[str], out: str, tokenizer: str, vocab_size: int, val_fraction: float,
                force: bool = False) -> None:
    for p in inputs:
        if Path(p).is_dir():
            raise PrepareError(f"INPUT={p!r} is a directory; give the text or JSON-lines files in it (e.g. {Path(p) / '*.txt'}).")
        if not Path(p).is_file():
            raise PrepareError(f"INPUT={p!r} does not exist; give text files or JSON-lines files with a `text` field.")
    tok_dest = Path(out).parent / TOKENIZER_NAME
    writes_tokenizer = tokenizer == "bpe" or tokenizer != "bytes" and Path(tokenizer).resolve() != tok_dest.resolve()
    _check_out(out, force, tok_dest if writes_tokenizer else None)
    if str(Path(out).resolve()) in {str(Path(p).resolve()) for p in inputs}:
        raise PrepareError(f"OUT={out!r} is also an INPUT; give a new path for the token file.")
    if not 0 <= val_fraction < 1:
        raise PrepareError(f"--val-fraction={val_fraction} is not valid: it must be at least 0 and below 1, e.g. 0.005.")
    if tokenizer == "bpe" and not 257 <= vocab_size <= 1 << 32:
        raise PrepareError(f"--vocab-size={vocab_size} is not valid: a byte-level BPE needs from 257 tokens (256 bytes and "
                           f"end-of-text) to {1 << 32} (the most a uint32 token file holds), e.g. 8192.")
    if tokenizer not in ("bytes", "bpe") and not Path(tokenizer).is_file():
        raise PrepareError(f"--tokenizer {tokenizer!r} is neither bytes, bpe nor an existing tokenizer.json file.")


def prepare(inputs: Sequence[str], out: str, tokenizer: str = "bytes", vocab_size: int = 8192,
            val_fraction: float = DEFAULT_VAL_FRACTION, dtype: Optional[str] = None, force: bool = False) -> Dict[str, Any]:
    """Tokenise `inputs` into `out` (+ sidecar, + tokenizer.json beside it); returns the sidecar.
    An existing `out` is refused unless `force` (and then only a regular file is replaced)."""
    _check_args(inputs, out, tokenizer, vocab_size, val_fraction, force)
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
            n_tokens, n_docs, max_tok, digest = _encode_into(f, inputs, tok, eos, np.dtype(dt))
            f.flush()
            os.fsync(f.fileno())
        encode_s = time.perf_counter() - t_enc
        val_start = _val_start(tmp, np.dtype(dt), n_tokens, val_fraction, eos)
        meta = {"format": "scaleout-tokens/1", "tokenizer": "bytes" if tok is None else TOKENIZER_NAME,
                "tokenizer_sha256": tok_hash, "vocab_size": vocab, "dtype": dt, "eos_id": eos,
                "tokens": n_tokens, "documents": n_docs, "max_token": max_tok, "val_fraction": val_fraction,
                "val_start": val_start, "inputs": [str(p) for p in inputs],
                "bytes": n_tokens * np.dtype(dt).itemsize, "sha256": digest}
        if tok is not None and (tokenizer == "bpe" or Path(tokenizer).resolve() != tok_dest.resolve()):
            from launch.common.files import atomic_write
            atomic_write(tok_dest, tok_json)
        _check_out(out, force, None)  # still nothing but a regular file (or nothing) at OUT
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
    """Encode every document into the open file `f`; returns (tokens, documents, max token, sha256 of the bytes written)."""
    n_tokens = n_docs = 0
    digest = hashlib.sha256()
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
            data = ids.tobytes()
            f.write(data)
            digest.update(data)
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
    return n_tokens, n_docs, max_tok, digest.hexdigest()


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
    val_start = meta.get("val_start") if meta else None
    return n, min(val_start, n) if type(val_start) is int else n


def file_problem(cfg) -> Optional[str]:
    """Why `data.source=file` cannot train this config (one sentence), or None."""
    d, m, t = cfg.data, cfg.model, cfg.train
    path = d.path
    problem = sidecar_problem(path)
    if problem:
        return problem
    meta = read_sidecar(path)
    itemsize = np.dtype(d.dtype).itemsize
    size = os.path.getsize(path)
    if meta and "bytes" in meta and meta["bytes"] != size:
        return (f"data.path={path!r} is {size} bytes, but its sidecar {sidecar_path(path).name} says prepare-data wrote "
                f"{meta['bytes']}: the file changed after its sidecar was written; rerun `scaleout prepare-data` on its text.")
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


"""Stateless data: the batch at step s is a pure function of (data seed, s).

Row r of the global batch at step s comes from its own generator seeded with (seed, s, r), so a
process builds only the rows it owns, any device count sees the same global batch, and resuming
needs nothing but the step number.

Sources:
- synthetic: a seeded Markov chain over the vocabulary (next token = perm[token] with
  probability 0.8, else uniform), so the loss has something to learn (from ln V towards ~1.5 nats).
- file: a flat token file (uint16 or uint32, memory-mapped); each row is a window at a seeded
  random offset. `scaleout prepare-data TEXT OUT.bin` writes one from text, one token per byte.

Packed documents (`model.attention=document`, `Batches.documents`): a row is a run of documents,
each ending with the end-of-document token `eos_id` (which belongs to the document it ends). The
synthetic source cuts its rows into documents of seeded geometric lengths (mean
`data.mean_doc_len`, drawn from their own generator seeded with (seed, step, row, DOC_STREAM)) and
writes `eos_id` at each document's last position (the chain never emits it elsewhere); the file
source splits its windows on the `eos_id` tokens already in the file (the window's first document
is usually the tail of one that began before it). `segment_ids` number the documents of a row
from 0; `positions` restart at 0 in each document (`model.doc_positions=reset`, the default) or
run 0..seq_len-1 (`global`). Nothing is padded: every target, including the one after an
end-of-document token (the next document's first token, predicted from the finished document
only), is counted by the loss.

Dynamic shapes (`data.seq_lens`): the batch of step s has one sequence length L(s) for all its rows,
drawn from `data.seq_lens` by a generator seeded with (seed, s, LEN_STREAM, LEN_STREAM) (`step_seq_len`),
so every contender and device count sees the same lengths; its rows are the first L(s) + 1 tokens of
the rows above (the same tokens, shorter). With `data.pad_to` the batch is padded at the end of
each row to the smallest bucket P >= L(s) (`padded_len`): inputs with token 0, targets with IGNORE,
which the loss leaves out in both frameworks (a causal model's real positions never see the
padding after them, so their logits and the loss equal the unpadded batch's). Real tokens per step
are global_batch * L(s); padding is never counted as a token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

import numpy as np

from launch.common.files import atomic_write
from launch.config.schema import DataConfig

FOLLOW_P = 0.8  # synthetic: probability that the next token follows the chain
EVAL_STREAM = 0xE7A1  # held-out batches: seeds (data seed, EVAL_STREAM, index, row, EVAL_STREAM): 5 words, the last
# non-zero, so never equal to training's 3-word or the documents' 4-word seeds (numpy pads seeds shorter than 4 with 0s)
DOC_STREAM = 0xD0C  # synthetic documents: the extra seed word of the document-length generator
LEN_STREAM = 0x1E9  # data.seq_lens: the step's length from (seed, step, LEN_STREAM, LEN_STREAM) (4 words, the last
# never DOC_STREAM and never 0, so unlike the rows' and documents' seeds)
IGNORE = -100  # padded targets: left out of the loss (torch's cross_entropy ignore_index; JAX masks them)
PAD_TOKEN = 0  # padded inputs (any valid id: no real position attends to them)


def step_seq_len(data: DataConfig, seq_len: int, step: int) -> int:
    """The real sequence length of the batch of `step`: `seq_len` (model.seq_len), or drawn from
    `data.seq_lens` (choice: one of them; uniform: any from min to max) by (seed, step)."""
    if not data.seq_lens:
        return seq_len
    g = np.random.default_rng([data.seed, step, LEN_STREAM, LEN_STREAM])
    if data.seq_len_dist == "uniform":
        return int(g.integers(min(data.seq_lens), max(data.seq_lens) + 1))
    return int(data.seq_lens[int(g.integers(0, len(data.seq_lens)))])


def padded_len(data: DataConfig, length: int) -> int:
    """The length a batch of real length `length` is padded to: the smallest bucket of `data.pad_to`
    that holds it, or `length` itself without buckets."""
    fits = [b for b in data.pad_to if b >= length]
    return min(fits) if fits else length


def is_dynamic(data: DataConfig) -> bool:
    """Whether step batches may differ in shape or carry padding (the trainers then mask the loss)."""
    return bool(data.seq_lens or data.pad_to)


@dataclass(frozen=True)
class DocBatch:
    """Rows of packed documents, each array (rows, seq_len): the model's inputs, the next-token
    targets, the document index of every input position and its RoPE position."""

    inputs: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray


def resolve_eos_id(data: DataConfig, vocab_size: int) -> int:
    """The end-of-document token: `data.eos_id`; else, for a token file, the `eos_id` of its
    tokenizer sidecar (`scaleout prepare-data`) when it has one; else the last id of the vocabulary."""
    if data.eos_id is not None:
        return int(data.eos_id)
    if data.source == "file" and data.path:
        try:
            from launch.data.tokenizer import read_sidecar
        except ImportError:  # a tree without tokenizer sidecars
            read_sidecar = None
        meta = read_sidecar(data.path) if read_sidecar else None
        if isinstance(meta, dict) and isinstance(meta.get("eos_id"), int):
            return meta["eos_id"]
    return vocab_size - 1


def document_batch(batches: "Batches", cfg, step: int, start: int, stop: int) -> DocBatch:
    """`Batches.documents` with the keys of a full config (data.eos_id, data.mean_doc_len, model.doc_positions)."""
    return batches.documents(step, start, stop, resolve_eos_id(cfg.data, cfg.model.vocab_size),
                             cfg.data.mean_doc_len, cfg.model.doc_positions)


def segments_from_eos(rows: np.ndarray, eos_id: int) -> np.ndarray:
    """Document index of every position: an end-of-document token belongs to the document it ends."""
    is_eos = (rows == eos_id).astype(np.int32)
    return np.concatenate([np.zeros_like(is_eos[:, :1]), np.cumsum(is_eos, axis=1)[:, :-1]], axis=1)


def document_positions(segment_ids: np.ndarray) -> np.ndarray:
    """Position of every token within its own document (0 at each document's first token)."""
    T = segment_ids.shape[1]
    idx = np.broadcast_to(np.arange(T, dtype=np.int32), segment_ids.shape)
    new_doc = np.ones(segment_ids.shape, bool)
    new_doc[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    starts = np.maximum.accumulate(np.where(new_doc, idx, 0), axis=1)
    return (idx - starts).astype(np.int32)


class Batches:
    def __init__(self, data: DataConfig, vocab_size: int, seq_len: int):
        self.cfg, self.vocab, self.seq_len = data, vocab_size, seq_len
        self.tokens = None
        if data.source == "file":
            self.tokens = np.memmap(data.path, dtype=np.dtype(data.dtype), mode="r")
            if len(self.tokens) < seq_len + 2:
                raise ValueError(f"data.path={data.path!r} holds {len(self.tokens)} tokens; model.seq_len={seq_len} needs at least {seq_len + 2}.")
            from launch.data.tokenizer import split_bounds
            self.val_start = split_bounds(data.path, data.dtype)[1]  # tokens from here on are held out (sidecar)
        else:
            self.perm = np.random.default_rng([data.seed, 0x5CA1E]).permutation(vocab_size).astype(np.int32)

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the global batch at `step`: int32 tokens of shape (rows, seq_len + 1)."""
        out = np.empty((stop - start, self.seq_len + 1), np.int32)
        if self.tokens is not None:
            hi = self.val_start - self.seq_len - 1  # a window ends before the held-out split
            for i, r in enumerate(range(start, stop)):
                off = int(np.random.default_rng([self.cfg.seed, step, r]).integers(0, hi))
                out[i] = self.tokens[off: off + self.seq_len + 1]
            if out.max(initial=0) >= self.vocab:
                raise ValueError(f"data.path={self.cfg.path!r} holds token {int(out.max())}, outside model.vocab_size={self.vocab}.")
            return out
        n, T = stop - start, self.seq_len + 1
        follow = np.empty((n, T), bool)
        noise = np.empty((n, T), np.int32)
        for i, r in enumerate(range(start, stop)):
            g = np.random.default_rng([self.cfg.seed, step, r])
            noise[i] = g.integers(0, self.vocab, T, dtype=np.int32)
            follow[i] = g.random(T) < FOLLOW_P
        out[:, 0] = noise[:, 0]
        for t in range(1, T):
            out[:, t] = np.where(follow[:, t], self.perm[out[:, t - 1]], noise[:, t])
        return out

    def split(self, step: int, start: int, stop: int) -> Tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of the training batch of `step`, each (rows, P): P = seq_len, or with
        data.seq_lens the step's length L padded to its bucket (targets IGNORE beyond L)."""
        rows = self.rows(step, start, stop)
        L = step_seq_len(self.cfg, self.seq_len, step)
        P = padded_len(self.cfg, L)
        inputs, targets = rows[:, :L], rows[:, 1:L + 1]
        if P > L:
            pad = ((0, 0), (0, P - L))
            inputs = np.pad(inputs, pad, constant_values=PAD_TOKEN)
            targets = np.pad(targets, pad, constant_values=IGNORE)
        return inputs, targets

    def step_shape(self, step: int) -> Tuple[int, int]:
        """(real length, padded length) of the batch of `step`."""
        L = step_seq_len(self.cfg, self.seq_len, step)
        return L, padded_len(self.cfg, L)

    # ------------------------------------------------------------------ held-out batches (evaluation)
    def eval_rows(self, index: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of held-out batch `index`: a function of (data seed, index, row) only, so
        every framework and device count sees the same ones. file: windows inside the held-out split
        (the sidecar's val_start..end); synthetic: the same chain drawn from a seed stream disjoint
        from training's (see EVAL_STREAM)."""
        out = np.empty((stop - start, self.seq_len + 1), np.int32)
        if self.tokens is not None:
            lo, hi = self.val_start, len(self.tokens) - self.seq_len - 1
            if hi <= lo:
                raise ValueError(f"data.path={self.cfg.path!r} has {len(self.tokens) - self.val_start} held-out tokens; "
                                 f"model.seq_len={self.seq_len} needs at least {self.seq_len + 2}.")
            for i, r in enumerate(range(start, stop)):
                off = int(np.random.default_rng([self.cfg.seed, EVAL_STREAM, index, r, EVAL_STREAM]).integers(lo, hi))
                out[i] = self.tokens[off: off + self.seq_len + 1]
            return out
        T = self.seq_len + 1
        for i, r in enumerate(range(start, stop)):
            g = np.random.default_rng([self.cfg.seed, EVAL_STREAM, index, r, EVAL_STREAM])
            noise = g.integers(0, self.vocab, T, dtype=np.int32)
            follow = g.random(T) < FOLLOW_P
            out[i, 0] = noise[0]
            for t in range(1, T):
                out[i, t] = self.perm[out[i, t - 1]] if follow[t] else noise[t]
        return out

    def eval_split(self, index: int, start: int, stop: int) -> Tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of held-out batch `index`, rows [start, stop), each (rows, seq_len)."""
        rows = self.eval_rows(index, start, stop)
        return rows[:, :-1], rows[:, 1:]

    def documents(self, step: int, start: int, stop: int, eos_id: int, mean_doc_len: int,
                  positions: str = "reset") -> DocBatch:
        """Rows [start, stop) at `step` as packed documents (see the module docstring); a pure
        function of (seed, step, row) like `rows`."""
        if not 0 <= eos_id < self.vocab:
            raise ValueError(f"data.eos_id={eos_id} is outside model.vocab_size={self.vocab}; give a token id below it.")
        rows = self.rows(step, start, stop)
        if self.tokens is None:
            rows[rows == eos_id] = (eos_id + 1) % self.vocab  # the chain never ends a document by itself
            T = rows.shape[1]
            for i, r in enumerate(range(start, stop)):
                g = np.random.default_rng([self.cfg.seed, step, r, DOC_STREAM])
                lengths = g.geometric(1.0 / max(1, mean_doc_len), size=T)
                ends = np.cumsum(lengths) - 1
                rows[i, ends[ends < T]] = eos_id
        seg = segments_from_eos(rows[:, :-1], eos_id)
        pos = document_positions(seg) if positions == "reset" else np.broadcast_to(
            np.arange(seg.shape[1], dtype=np.int32), seg.shape).copy()
        return DocBatch(rows[:, :-1], rows[:, 1:], seg, pos)


def prepare_bytes(text_path: str, out_path: str, dtype: str = "uint16") -> int:
    """Byte-tokenise a text file (one token per byte, vocab 256) into a flat token file, atomically."""
    tokens = np.frombuffer(Path(text_path).read_bytes(), dtype=np.uint8).astype(np.dtype(dtype))
    atomic_write(out_path, tokens.tobytes())
    return int(tokens.size)

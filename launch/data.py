"""Stateless data: the batch at step s is a pure function of (data seed, s).

Row r of the global batch at step s comes from its own generator seeded with (seed, s, r), so a
process builds only the rows it owns, any device count sees the same global batch, and resuming
needs nothing but the step number.

Sources:
- synthetic: a seeded Markov chain over the vocabulary (next token = perm[token] with
  probability 0.8, else uniform), so the loss has something to learn (from ln V towards ~1.5 nats).
- file: a flat token file (uint16 or uint32, memory-mapped); each row is a window at a seeded
  random offset. `scaleout prepare-data TEXT OUT.bin` writes one from text, one token per byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Tuple

import numpy as np

from launch.files import atomic_write
from launch.schema import DataConfig

FOLLOW_P = 0.8  # synthetic: probability that the next token follows the chain


class Batches:
    def __init__(self, data: DataConfig, vocab_size: int, seq_len: int):
        self.cfg, self.vocab, self.seq_len = data, vocab_size, seq_len
        self.tokens = None
        if data.source == "file":
            self.tokens = np.memmap(data.path, dtype=np.dtype(data.dtype), mode="r")
            if len(self.tokens) < seq_len + 2:
                raise ValueError(f"data.path={data.path!r} holds {len(self.tokens)} tokens; model.seq_len={seq_len} needs at least {seq_len + 2}.")
        else:
            self.perm = np.random.default_rng([data.seed, 0x5CA1E]).permutation(vocab_size).astype(np.int32)

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the global batch at `step`: int32 tokens of shape (rows, seq_len + 1)."""
        out = np.empty((stop - start, self.seq_len + 1), np.int32)
        if self.tokens is not None:
            hi = len(self.tokens) - self.seq_len - 1
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
        """(inputs, targets), each (rows, seq_len)."""
        rows = self.rows(step, start, stop)
        return rows[:, :-1], rows[:, 1:]


def prepare_bytes(text_path: str, out_path: str, dtype: str = "uint16") -> int:
    """Byte-tokenise a text file (one token per byte, vocab 256) into a flat token file, atomically."""
    tokens = np.frombuffer(Path(text_path).read_bytes(), dtype=np.uint8).astype(np.dtype(dtype))
    atomic_write(out_path, tokens.tobytes())
    return int(tokens.size)

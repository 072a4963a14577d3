"""How `checkpoint.async=true` saves with DCP without slowing the training that goes on meanwhile.

`dcp.async_save` by default copies the state into fresh CPU tensors and writes them from a thread of
the trainer process. That thread shares the process, its interpreter lock and its intra-op thread
pool with training: on a CPU host every step after the first save ran about 25 % slower (issue 26,
BENCHMARKS.md). `AsyncSaver` saves the way torchtitan's `async_with_pinned_mem` does instead:

- the write runs in DCP's checkpoint process (`AsyncCheckpointerType.PROCESS`: one daemon process per
  rank, started at the first save and reused, with a gloo group of its own), not in a thread of the
  trainer;
- the state is staged by one `DefaultStager` kept for the whole run, into shared memory (so the
  checkpoint process reads it without a copy through the pipe) that is reused from save to save; on
  a GPU into pinned memory too, copied on a side stream while the next step computes
  (`use_async_staging`, `use_non_blocking_copy`); `wait_for_staging` is called before the optimizer
  changes the weights, as torchtitan does.

The trainer's gloo group for the save (`dist.new_group(backend="gloo")`) coordinates the ranks'
checkpoint processes; `close` waits for nothing (the caller waits for the upload) and releases the
stager's buffers.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse


class AsyncSaver:
    def __init__(self, device_type: str):
        self.group = dist.new_group(backend="gloo")
        gpu = device_type == "cuda"
        self.options = StagingOptions(use_pinned_memory=gpu, use_shared_memory=True, use_async_staging=gpu,
                                      use_non_blocking_copy=gpu)
        self.stager: Optional[DefaultStager] = None
        self.staging: Optional[Future] = None

    def start(self, state: Any, checkpoint_id: str, storage_writer: Any = None) -> Future:
        """Stage `state` and hand it to the checkpoint process, which writes it to `checkpoint_id` (through
        `storage_writer` where one is given: gs://); returns the future of the write."""
        if self.stager is None:
            self.stager = DefaultStager(self.options)
        got = dcp.async_save(state, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                             process_group=self.group, async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        if isinstance(got, AsyncSaveResponse):
            self.staging = got.staging_completion
            return got.upload_completion
        return got

    @property
    def started(self) -> bool:
        """Whether a save went through the checkpoint process (which then runs until the trainer ends)."""
        return self.stager is not None

    def wait_for_staging(self) -> None:
        """Before the weights change: the staged copy of the last save must be complete."""
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def close(self) -> None:
        self.wait_for_staging()
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()

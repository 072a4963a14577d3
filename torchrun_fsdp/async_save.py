"""How `checkpoint.async=true` saves with DCP without slowing the training that goes on meanwhile.

`dcp.async_save` by default copies the state into fresh CPU tensors and writes them from a thread of
the trainer process. That thread shares the process, its interpreter lock and its intra-op thread
pool with training: on a CPU host every step after the first save ran about 25 % slower (issue 26,
BENCHMARKS.md). `AsyncSaver` saves the way torchtitan's `async_with_pinned_mem` does instead:

- the write runs in DCP's checkpoint process (`AsyncCheckpointerType.PROCESS`: one daemon process per
  rank, reused from save to save, with a gloo group of its own), not in a thread of the trainer;
- that process is started when the trainer starts (`start_process`, all ranks together) where the run
  saves before its end: DCP would start it inside the first save, and its interpreter, torch import and
  gloo set-up (seconds of CPU) then ran during the steps after it -- the 3 steps after the first save
  of a `small` CPU run took 2.1, 2.2 and 1.7 s instead of 0.6 s (`python -m bench`'s
  `ckpt_overhead_torch` 0.81). Started before the first step, it is start-up time, as it is. (What a
  save still costs on a CPU host is the write itself, on the cores training uses: ~0.2-0.3 s of the
  steps after it for `small`; a lower priority for the writer only spread that over more steps);
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

    def start_process(self) -> None:
        """Start DCP's checkpoint process now (every rank calls this at the same point: it is a collective on the
        save's group) rather than inside the first save. Done through DCP's own executor module, whose process
        the first `dcp.async_save` then finds running; where a torch lacks it, the first save starts one."""
        try:
            from torch.distributed.checkpoint import _async_process_executor as executor
            make, info = executor._AsyncCheckpointProcess, executor._ProcessGroupInitInfo
        except (ImportError, AttributeError):
            return
        if getattr(executor, "_CHECKPOINT_PROCESS", None) is None:
            executor._CHECKPOINT_PROCESS = make(pg_init_info=info(self.group))

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

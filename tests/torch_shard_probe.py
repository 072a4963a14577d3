"""Run under torchrun with 4 ranks: build the FSDP2 model for fsdp=4 and write each weight's full and local
shape (rank 0, to argv[1]); then build the trainer for parallel.data=4 and for HSDP (data=2 x fsdp=2) and write
each rank's rows of a training batch (argv[1].rows<rank>.json): rows per rank and the input tokens it trains on."""

import json
import sys
import tempfile

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from launch import config
from launch.launcher.rundir import cell_config
from torchrun_fsdp.__main__ import setup_distributed
from torchrun_fsdp.train import TorchEngine

tmp = tempfile.mkdtemp()
base = ["framework=torch", "devices=4", f"checkpoint.dir={tmp}", "checkpoint.async=false", "train.global_batch=8"]
cfg = cell_config(config.load(base), "probe")
setup_distributed(cfg)
engine = TorchEngine(cfg, None)
shapes = {}
for name, p in engine.model.named_parameters():
    assert isinstance(p, DTensor), name
    shapes[name] = (list(p.shape), list(p.to_local().shape))
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(shapes, f)
rows = {}
for name, axes in (("data4", ["parallel.data=4", "parallel.fsdp=1"]), ("hsdp", ["parallel.data=2", "parallel.fsdp=2"])):
    e = TorchEngine(cell_config(config.load([*base, *axes]), name), None)
    inputs, _, _ = e._batch(3)  # the rows this rank trains on at step 3
    rows[name] = {"rows_per_rank": e.rows_per_rank, "inputs": inputs.tolist()}
with open(f"{sys.argv[1]}.rows{dist.get_rank()}.json", "w") as f:
    json.dump(rows, f)
dist.destroy_process_group()

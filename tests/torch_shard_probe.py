"""Run under torchrun: build the FSDP2 model for fsdp=4 and write each weight's full and local shape."""

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
cfg = cell_config(config.load(["framework=torch", "devices=4", f"checkpoint.dir={tmp}", "checkpoint.async=false"]), "probe")
setup_distributed(cfg)
engine = TorchEngine(cfg, None)
shapes = {}
for name, p in engine.model.named_parameters():
    assert isinstance(p, DTensor), name
    shapes[name] = (list(p.shape), list(p.to_local().shape))
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(shapes, f)
dist.destroy_process_group()

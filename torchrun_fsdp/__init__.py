"""The PyTorch trainer: `torchrun ... -m torchrun_fsdp --config CELL/config.yaml`."""

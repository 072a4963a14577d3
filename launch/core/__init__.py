"""The trainer core: what `jaxrun` and `torchrun_fsdp` share, and the only part of `launch` besides
data, config and common that a trainer imports.

    engine       the Engine protocol a framework implements, the trainer's start and stop
    loop         the training loop: steps, timing, warm-up, checkpoints, evaluation, profiling
    params       parameter names and shapes (the one table), framework-neutral init
    flops        FLOPs per token (the one formula) and the accelerator datasheet
    interconnects  the interconnect datasheet: NVLink/PCIe, networks, TPU ICI/DCN, per device
    collectives  the bytes each collective of a step moves, from the parameter table and the mesh
    projection   the step-time cost model fitted to measured cells, and its leave-one-out check
    metrics      the one writer of metrics.jsonl (and TensorBoard)
    sharding     logical axes -> mesh axes (JAX) and the mesh shape rules
    profile      profiler windows and the step-time breakdown
    gpus         which GPUs a process sees, and the platform checks
    hf_weights   Hugging Face Llama weights as initial values (model.init=hf:DIR)
    tensorboard  TensorBoard event files

Never imports the launcher, targets, report or interop.
"""

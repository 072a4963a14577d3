"""scaleout's launcher and the framework-neutral core the two trainers share.

Parts, each a package; imports go down this list only (checked by tests/test_layering.py):

    launcher/   the `scaleout` command line and the orchestrator: cli, sweep, plan, status, lock,
                the run directory (rundir), the input checks, plan --compile (aot)
    targets/    where cells run: local, slurm/ (submitit), tpu/ (gcloud)
    report/     report.md / .json / .csv and plots from a run directory; the profile section;
                the trace server
    interop/    what leaves scaleout for other tools: the Hugging Face export
    core/       the trainer core both frameworks import: engine, loop, params, flops, metrics,
                sharding, profile, gpus, tensorboard, Hugging Face weights as initial values
    data/       batches as a pure function of (seed, step), the tokenizer, the demo corpus
    config/     the schema and its loading and validation
    common/     file names and atomic writes, environment variable names, logging

`jaxrun` and `torchrun_fsdp` import only core, data, config and common. Nothing here imports
jax or torch at import time.
"""

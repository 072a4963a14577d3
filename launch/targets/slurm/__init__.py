"""target=slurm through submitit: the target (`target`: executor, preflight, submit), what runs in each
task (`job`), and the queue (`queue`: jobs.json, squeue/sacct)."""

"""The typed schema of a scaleout config: every key, its type and default.

`configs/base.yaml` carries the same keys with a one-line comment each (a test keeps the two in
step); the group files under `configs/` override parts of it. Validation that needs more than a
type (choices, divisibility, paths) lives in `launch.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class ModelConfig:
    name: str = "tiny"  # preset this model came from (set by `model=<preset>`)
    d_model: int = 64  # width of the residual stream
    n_layers: int = 2  # transformer blocks
    n_heads: int = 4  # attention heads (head_dim = d_model / n_heads)
    d_ff: int = 128  # hidden width of the SwiGLU MLP
    vocab_size: int = 256  # tokens; 256 fits byte-tokenised text
    seq_len: int = 32  # tokens per sequence
    dtype: str = "fp32"  # compute dtype: fp32 | bf16 (master weights stay fp32)
    scan_layers: bool = True  # JAX: scan over stacked layers (compile time flat in depth)
    remat: str = "none"  # rematerialisation: none | full | dots
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-5  # RMSNorm epsilon
    init_std: float = 0.02  # std of the normal init (output projections are scaled by 1/sqrt(2*n_layers))
    init: str = "numpy"  # numpy (framework-neutral, identical in both) | native (sharded on device)


@dataclass
class ParallelConfig:
    data: int = 1  # pure data-parallel replicas
    fsdp: int = -1  # fully-sharded data parallel; -1 fills what the others leave of `devices`
    tensor: int = 1  # tensor parallel (JAX only)


@dataclass
class TrainConfig:
    steps: int = 20  # optimizer steps; the LR schedule spans this many
    stop_after: Optional[int] = None  # end cleanly after this step with a checkpoint, as if preempted
    global_batch: int = 8  # sequences per optimizer step, over all devices
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 2  # linear warm-up steps
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at `steps`
    weight_decay: float = 0.1  # decoupled AdamW decay on matmul weights (not norms, not embeddings)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon, added to sqrt(v_hat)
    clip_norm: float = 1.0  # global gradient-norm clip; 0 disables
    seed: int = 0  # weight-init seed
    warmup_exclude: int = 3  # first steps left out of steady-state timing (compile included)
    log_every: int = 1  # write a step record every this many steps


@dataclass
class DataConfig:
    source: str = "synthetic"  # synthetic | file
    path: Optional[str] = None  # token file for source=file (see `scaleout prepare-data`)
    dtype: str = "uint16"  # token dtype of the file: uint16 | uint32
    seed: int = 1234  # data seed: the batch at step s is a function of (seed, s) only


@dataclass
class CheckpointConfig:
    dir: str = "checkpoints"  # root; a cell writes to <dir>/<run.name>/<cell>
    every: int = 10  # save every this many steps (and at the end); 0 saves only at the end
    keep: int = 2  # complete checkpoints kept
    async_: bool = field(default=True, metadata={"yaml": "async"})  # write in the background
    load_from: Optional[str] = None  # when the cell has no checkpoint yet, start from the latest one here


@dataclass
class RunConfig:
    dir: str = "runs"  # where run directories go
    name: str = "${model.name}"  # run directory name under run.dir; reusing it resumes


@dataclass
class LocalConfig:
    processes: int = 1  # JAX: processes to split the devices over (gloo collectives)
    threads: int = 0  # intra-op threads per process; 0 = host cores / processes


@dataclass
class MetricsConfig:
    tensorboard: bool = False  # also write TensorBoard event files per cell


@dataclass
class JaxConfig:
    compilation_cache: bool = True  # persistent compilation cache
    cache_dir: str = "${checkpoint.dir}/.jax_cache"  # where the persistent cache lives


@dataclass
class TorchConfig:
    compile: bool = False  # torch.compile each block (time recorded as compile time)


@dataclass
class SlurmConfig:
    partition: Optional[str] = None  # --partition
    account: Optional[str] = None  # --account
    qos: Optional[str] = None  # --qos
    time_min: int = 60  # --time in minutes
    devices_per_node: int = 8  # tasks (one per device) on each node
    gpus_per_node: int = 0  # --gpus-per-node; 0 on CPU clusters
    cpus_per_task: int = 1  # --cpus-per-task
    mem_gb: Optional[int] = None  # --mem in GB per node
    constraint: Optional[str] = None  # --constraint
    exclusive: bool = False  # --exclusive
    setup: List[str] = field(default_factory=list)  # shell lines run before the tasks start
    additional: Dict[str, Any] = field(default_factory=dict)  # extra sbatch parameters
    max_requeues: int = 3  # preemptions/timeouts tolerated before the cell stops
    python: Optional[str] = None  # interpreter on the compute nodes; null = this one (shared filesystem)
    wait: bool = False  # block until the jobs finish, then write the report


@dataclass
class TpuConfig:
    mode: str = "queued"  # queued (create a queued resource) | existing (use tpu.name)
    name: str = "scaleout-${run.name}"  # TPU VM / node id
    generation: str = "v5e"  # v4 | v5e | v5p | v6e
    accelerator_type: Optional[str] = None  # explicit type, e.g. v5litepod-16; else from devices
    runtime_version: str = "v2-alpha-tpuv5-lite"  # TPU VM software version
    project: Optional[str] = None  # GCP project
    zone: str = "us-west4-a"  # GCP zone
    capacity: str = "on-demand"  # on-demand | spot | reserved | best-effort
    keep: bool = False  # keep the slice after the run
    poll_interval_s: float = 30.0  # describe every this many seconds while waiting
    timeout_s: float = 3600.0  # give up waiting for ACTIVE after this long
    setup: List[str] = field(default_factory=lambda: ["pip install -q -e '.[jax]' 'jax[tpu]'"])  # per worker, once
    gcloud: str = "gcloud"  # the gcloud executable
    python: str = "python3"  # interpreter on the TPU workers


@dataclass
class SweepConfig:
    devices: List[int] = field(default_factory=lambda: [1, 2, 4])  # device counts to sweep
    frameworks: List[str] = field(default_factory=lambda: ["jax", "torch"])  # frameworks to sweep
    scaling: str = "weak"  # weak: per-device batch fixed | strong: global batch fixed
    extra: Dict[str, List[Any]] = field(default_factory=dict)  # more keys to sweep, e.g. {model.remat: [none, full]}


@dataclass
class ReportConfig:
    horizon_steps: int = 10000  # the run length for which the report gives wall time per framework


@dataclass
class Config:
    framework: str = "jax"  # jax | torch
    target: str = "local"  # local | slurm | tpu
    devices: int = 1  # devices (GPUs, TPU chips/cores, or simulated CPU devices)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    jax: JaxConfig = field(default_factory=JaxConfig)
    torch: TorchConfig = field(default_factory=TorchConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    tpu: TpuConfig = field(default_factory=TpuConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    report: ReportConfig = field(default_factory=ReportConfig)

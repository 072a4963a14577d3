"""The typed schema of a scaleout config: every key, its type, default, help text and valid range.

This file is the one place defaults live. Each key is declared with `setting(default, help,
**rules)`; each section's docstring is its one-line description. `configs/base.yaml` is generated
from it (`python -m launch.config` rewrites it, `--check` only compares; a test fails when the two
differ), and the group files under `configs/` override parts of it.

Rules a key may declare, checked by `launch.config.validate` with a one-sentence error:
    choices=(...)   the value (or each entry of a list) must be one of these
    ge/gt/le/lt=x   numeric range: >= / > / <= / < x (each entry of a list); null passes where the
                    type is Optional
    nonempty=True   a list must have at least one entry
    unique=True     a list must not repeat an entry
    yaml="name"     the key's YAML spelling where it is a Python keyword (`checkpoint.async`)
Rules that need more than one key (divisibility, the parallel fill) live in `launch.config`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import yaml

FRAMEWORKS = ("jax", "torch")
TARGETS = ("local", "slurm", "tpu")
BASE_YAML = Path(__file__).resolve().parents[2] / "configs" / "base.yaml"


def setting(default: Any, help: str, *, yaml: Optional[str] = None, choices: Sequence[str] = (),
            ge: Optional[float] = None, gt: Optional[float] = None, le: Optional[float] = None,
            lt: Optional[float] = None, nonempty: bool = False, unique: bool = False) -> Any:
    """A schema field: its default, its one-line help (the comment in base.yaml) and its rules."""
    meta: Dict[str, Any] = {"help": help}
    if yaml is not None:
        meta["yaml"] = yaml
    if choices:
        meta["choices"] = tuple(choices)
    for name, value in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)):
        if value is not None:
            meta[name] = value
    if nonempty:
        meta["nonempty"] = True
    if unique:
        meta["unique"] = True
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    """The Llama-style decoder; presets in configs/model/ (this is `tiny`)."""

    name: str = setting("tiny", "preset this model came from (set by `model=<preset>`)")
    d_model: int = setting(64, "width of the residual stream", ge=1)
    n_layers: int = setting(2, "transformer blocks", ge=1)
    n_heads: int = setting(4, "attention heads (head_dim = d_model / n_heads, even for RoPE)", ge=1)
    d_ff: int = setting(128, "hidden width of the SwiGLU MLP", ge=1)
    vocab_size: int = setting(256, "tokens; 256 fits byte-tokenised text", ge=1)
    seq_len: int = setting(32, "tokens per sequence", ge=1)
    dtype: str = setting("fp32", "compute dtype (master weights stay fp32)", choices=("fp32", "bf16"))
    matmul_precision: str = setting(
        "highest", "fp32 matmul precision, the same in both frameworks (highest: no TF32)",
        choices=("highest", "tf32"))
    scan_layers: bool = setting(True, "JAX: scan over stacked layers (compile time flat in depth); false unrolls")
    remat: str = setting("none", "rematerialisation; dots saves matmul outputs only", choices=("none", "full", "dots"))
    rope_theta: float = setting(10000.0, "RoPE base frequency", gt=0)
    norm_eps: float = setting(1e-5, "RMSNorm epsilon", gt=0)
    init_std: float = setting(0.02, "std of the normal init (wo and w2 scaled by 1/sqrt(2*n_layers))", gt=0)
    init: str = setting("numpy", "numpy | native | hf:DIR: numpy is framework-neutral (identical in both); native is "
                        "sharded on device (JAX); hf:DIR loads a Hugging Face Llama directory of this shape "
                        "(e.g. from `scaleout export`)")
    attention: str = setting("causal", "causal: one sequence per row; document: rows packed from documents (end-of-"
                             "document token data.eos_id), each token attends only to its own document",
                             choices=("causal", "document"))
    doc_positions: str = setting("reset", "attention=document: RoPE positions restart at 0 in every document (reset) "
                                 "or run along the row (global)", choices=("reset", "global"))
    norm_impl: str = setting("native", "RMSNorm: native (framework autodiff) or custom (hand-written backward: "
                             "jax.custom_vjp / a torch.library op with register_autograd)", choices=("native", "custom"))
    attention_impl: str = setting(
        "auto", "attention kernel: auto takes each framework's fused kernel where it has one for the device, dtype and "
        "mask (JAX: cuDNN flash attention on GPU in bf16; PyTorch: SDPA flash / memory-efficient, flex_attention for "
        "document masks on GPU), else the plain math; fused refuses a cell where a framework has none; dense runs the "
        "plain math in both (XLA's path, SDPA's math backend). What ran is in start.settings.attention_kernel",
        choices=("auto", "fused", "dense"))
    gpu_memory_fraction: float = setting(
        0.9, "share of each GPU's memory a trainer may use, the same in both frameworks (JAX: "
        "XLA_PYTHON_CLIENT_MEM_FRACTION, whose own default is 0.75; PyTorch: set_per_process_memory_fraction); "
        "the rest is left to the CUDA context, cuBLAS/cuDNN workspaces and NCCL. The GPU fit check's limit",
        gt=0, le=1)


@dataclass
class ParallelConfig:
    """data * fsdp * tensor == devices; one axis may be -1 to fill the rest."""

    data: int = setting(1, "pure data-parallel replicas", ge=-1)
    fsdp: int = setting(-1, "fully-sharded data parallel (FSDP2 / sharded weights)", ge=-1)
    tensor: int = setting(1, "tensor parallel over heads, MLP and vocab (JAX only)", ge=-1)


@dataclass
class TrainConfig:
    """The optimizer (AdamW), its schedule (warm-up then cosine) and the step counts."""

    steps: int = setting(20, "optimizer steps; the LR schedule spans this many", ge=1)
    stop_after: Optional[int] = setting(None, "end cleanly after this step with a checkpoint, as if preempted", ge=1)
    stop_every: Optional[int] = setting(None, "end cleanly at the next multiple of this many steps with a checkpoint: "
                                        "each run of the same command trains one chunk (time-limited jobs)", ge=1)
    global_batch: int = setting(8, "sequences per optimizer step, over all devices", ge=1)
    grad_accum: int = setting(1, "micro-batches per optimizer step", ge=1)
    lr: float = setting(3e-3, "peak learning rate", gt=0)
    warmup_steps: int = setting(2, "linear warm-up steps", ge=0)
    min_lr_ratio: float = setting(0.1, "cosine decays to lr * min_lr_ratio at `steps`", ge=0, le=1)
    weight_decay: float = setting(0.1, "decoupled AdamW decay on matmul weights (not norms, not embeddings)", ge=0)
    beta1: float = setting(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = setting(0.95, "AdamW beta2", ge=0, lt=1)
    eps: float = setting(1e-8, "AdamW epsilon, added to sqrt(v_hat) (the PyTorch and optax convention)", gt=0)
    clip_norm: float = setting(1.0, "global gradient-norm clip; 0 disables", ge=0)
    seed: int = setting(0, "weight-init seed", ge=0)
    warmup_exclude: int = setting(3, "first steps left out of steady-state timing (compile included)", ge=0)
    log_every: int = setting(1, "write a step record every this many steps", ge=1)
    eval_every: int = setting(0, "held-out loss every this many steps (and after the last); 0 disables", ge=0)
    eval_batches: int = setting(4, "held-out batches per evaluation (fixed: a function of data.seed only)", ge=1)
    eval_batch_size: int = setting(8, "sequences per held-out batch, the same for every device count (divisible by "
                                   "the data-parallel size)", ge=1)


@dataclass
class DataConfig:
    """The tokens: the batch at step s is a pure function of (data.seed, s)."""

    source: str = setting("synthetic", "seeded learnable tokens, or a token file from `scaleout prepare-data`",
                          choices=("synthetic", "file"))
    path: Optional[str] = setting(None, "token file for source=file")
    dtype: str = setting("uint16", "token dtype of the file", choices=("uint16", "uint32"))
    seed: int = setting(1234, "data seed: the batch at step s is a function of (seed, s) only", ge=0)
    mean_doc_len: int = setting(64, "model.attention=document, synthetic source: mean document length (seeded "
                                "geometric lengths)", ge=1)
    eos_id: Optional[int] = setting(None, "end-of-document token (model.attention=document); null: the token file's "
                                    "sidecar eos_id, else model.vocab_size - 1",
                                    ge=0)
    seq_lens: List[int] = setting([], "dynamic shapes: each step's batch has one sequence length, drawn from these by "
                                  "(data.seed, step), the same for every contender and device count (at most "
                                  "model.seq_len); [] keeps model.seq_len for every step", ge=1)
    seq_len_dist: str = setting("choice", "how data.seq_lens are drawn: choice (one of the list, each entry equally "
                                "likely: repeat one to weight it) or uniform (any length from their min to their max)",
                                choices=("choice", "uniform"))
    pad_to: List[int] = setting([], "bucket lengths: each step's batch is padded up to the smallest bucket that holds it "
                                "and the padding is masked out of the loss (JAX's usual remedy for recompiles); [] pads "
                                "nothing", ge=1, unique=True)


@dataclass
class CheckpointConfig:
    """Where and how often cells save; a cell with a complete checkpoint resumes from it."""

    dir: Optional[str] = setting(None, "null: under the cell's directory in the run directory "
                                 "(<run.dir>/<run.name>/<cell>/checkpoints); a path or gs:// URL overrides it")
    every: int = setting(10, "save every this many steps (and at the end); 0 saves only at the end", ge=0)
    keep: int = setting(2, "complete checkpoints kept", ge=1)
    async_: bool = setting(True, "write in the background while training continues", yaml="async")
    load_from: Optional[str] = setting(None, "when the cell has no checkpoint yet, start from the latest in this "
                                       "dir (e.g. another cell's, to continue a 4-device run on 2)")


@dataclass
class RunConfig:
    """The run directory: <run.dir>/<run.name>/<cell>/ holds each cell's config, metrics and logs."""

    dir: str = setting("runs", "where run directories go")
    name: str = setting("${model.name}", "run directory name under run.dir (letters, digits, . _ -); "
                        "the same name resumes")
    id: Optional[str] = setting(None, "set by scaleout when it writes a cell: the identity of the run a cell "
                                "and its checkpoints belong to")


@dataclass
class LocalConfig:
    """target=local: this machine."""

    processes: int = setting(1, "JAX: processes to split the devices over (gloo collectives)", ge=1)
    threads: int = setting(0, "intra-op threads per process; 0 = host cores / processes", ge=0)


@dataclass
class WandbConfig:
    """Weights & Biases: one W&B run per cell (process 0), grouped by the run; the report's plots on the group."""

    enabled: bool = setting(False, "log each cell to W&B: the TensorBoard scalars, the resolved config, the summary "
                            "(needs `pip install wandb`)")
    mode: str = setting("offline", "offline: write under CELL/wandb/, no network or account, `wandb sync` later; "
                        "online: stream to the W&B server (after `wandb login`)", choices=("offline", "online"))
    project: str = setting("scaleout", "W&B project")
    entity: Optional[str] = setting(None, "W&B entity (user or team); null: the account's default")
    group: str = setting("${run.name}", "W&B group of the run's cells (and of its `report` run)")


@dataclass
class MetricsConfig:
    """What the trainers record besides metrics.jsonl."""

    tensorboard: bool = setting(False, "also write TensorBoard event files per cell")
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ProfileConfig:
    """Profiler traces of a window of steps per cell, and the step-time breakdown the report shows."""

    steps: List[int] = setting([], "[START, END]: trace steps START..END (inclusive, counted from 1) of every cell "
                               "under CELL/profile/ and leave them out of the steady-state timing; [] traces nothing",
                               ge=1)
    all_processes: bool = setting(False, "trace every process/rank/worker (profile/process-<i>/); false: process 0 only")


@dataclass
class JaxConfig:
    """framework=jax."""

    compilation_cache: bool = setting(True, "persistent compilation cache")
    cache_dir: str = setting("${run.dir}/.jax_cache", "where the persistent cache lives")
    xla_flags: Optional[str] = setting(None, "extra XLA_FLAGS; on GPU scaleout sets the latency-hiding "
                                       "scheduler flags by default, this is appended")


@dataclass
class TorchConfig:
    """framework=torch."""

    compile: bool = setting(False, "torch.compile each block; Dynamo/Inductor's own compile records are the cell's "
                            "compile records")
    compile_dynamic: bool = setting(False, "torch.compile=true: compile with dynamic=True (shapes symbolic from the first "
                                    "compile); false: torch's default (recompile once a shape changes, then dynamic)")
    compile_fullgraph: bool = setting(True, "torch.compile=true: fullgraph=True (a graph break is an error); false lets "
                                      "Dynamo break the graph (counted in the compile records)")
    document_mask_impl: str = setting("auto", "model.attention=document: flex (flex_attention + a document-causal "
                                      "BlockMask, compiled), sdpa (dense boolean mask) or auto (flex on GPU, sdpa on "
                                      "CPU, where torch has no flex_attention backward)", choices=("auto", "flex", "sdpa"))


@dataclass
class SlurmConfig:
    """target=slurm (submitit); see configs/target/slurm.yaml."""

    partition: Optional[str] = setting(None, "--partition")
    account: Optional[str] = setting(None, "--account")
    qos: Optional[str] = setting(None, "--qos")
    wckey: Optional[str] = setting(None, "--wckey; null/empty omits it (submitit's default 'submitit' is never sent)")
    time_min: int = setting(60, "--time in minutes", ge=1)
    devices_per_node: int = setting(8, "tasks (one per device) on each node", ge=1)
    gpus_per_node: int = setting(0, "GPUs on each node (GRES gpu); 0 on CPU clusters. A cell asks for one per task "
                                 "on each node it uses, never a whole node's GPUs for a small cell", ge=0)
    gpu_binding: str = setting("node", "node: every task sees its node's GPUs (--gpus-per-node) and uses the one of "
                               "its local rank; task: SLURM gives each task its own GPU (--gpus-per-task=1)",
                               choices=("node", "task"))
    cpus_per_task: int = setting(1, "--cpus-per-task", ge=1)
    mem_gb: Optional[int] = setting(None, "--mem in GB per node; null leaves it to the cluster", ge=1)
    constraint: Optional[str] = setting(None, "--constraint")
    exclusive: bool = setting(False, "--exclusive")
    setup: List[str] = setting([], "shell lines run before the tasks start (module load, source venv)")
    setup_script: Optional[str] = setting(None, "a file of yours sourced verbatim in the job script before the "
                                          "tasks start, e.g. to activate a venv or load modules")
    additional: Dict[str, Any] = setting({}, "extra sbatch options, e.g. {reservation: myres, hold: true}; true is a "
                                         "bare flag, false/null leave the option out; options scaleout sets itself "
                                         "(nodes, tasks, CPUs, GPUs, mem, time, signal, array, requeue, ...) are refused")
    signal_delay_s: int = setting(90, "seconds between SLURM's preemption/time-limit signal and the kill; "
                                  "the trainer's save must fit in it", ge=10)
    max_requeues: int = setting(3, "preemptions/timeouts tolerated before the cell stops", ge=0)
    python: Optional[str] = setting(None, "interpreter on the compute nodes (a leading ~/ expands there); null = the "
                                    "one running scaleout (shared filesystem)")
    wait: bool = setting(False, "block until the jobs finish, then write the report")


@dataclass
class TpuConfig:
    """target=tpu (gcloud); see configs/target/tpu.yaml."""

    mode: str = setting("queued", "create a queued resource, or use the existing TPU VM tpu.name",
                        choices=("queued", "existing"))
    name: str = setting("scaleout-${run.name}", "TPU VM / node id")
    generation: str = setting("v5e", "TPU generation", choices=("v4", "v5e", "v5p", "v6e"))
    accelerator_type: Optional[str] = setting(None, "explicit type, e.g. v5litepod-16; else derived from devices")
    runtime_version: Optional[str] = setting(None, "TPU VM software version; null: the generation's (v4 tpu-ubuntu2204-base, "
                                             "v5e v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e)")
    project: Optional[str] = setting(None, "GCP project (null: gcloud's configured project)")
    zone: Optional[str] = setting(None, "GCP zone; null: the first zone Cloud TPU lists for the generation (v4 us-central2-b, "
                                  "v5e us-west4-a, v5p us-east5-a, v6e us-east1-d)")
    capacity: str = setting("on-demand", "how the slice is provisioned",
                            choices=("on-demand", "spot", "reserved", "best-effort"))
    keep: bool = setting(False, "keep the slice after the run")
    poll_interval_s: float = setting(30.0, "describe every this many seconds while waiting for ACTIVE", gt=0)
    timeout_s: float = setting(3600.0, "give up waiting for ACTIVE after this long; also the queued resource's "
                               "--valid-until-duration, so a request nobody waits for any more is never provisioned", gt=0)
    setup: Optional[List[str]] = setting(None, "commands run once per worker in the unpacked code; null: a uv Python 3.11 "
                                         "venv with the pinned dependencies + jax[tpu] (jax) or torch + torch_tpu "
                                         "(torch); a list replaces it")
    gcloud: str = setting("gcloud", "the gcloud executable")
    python: Optional[str] = setting(None, "interpreter on the workers (a leading ~/ expands there); null: the default "
                                    "tpu.setup's venv (~/scaleout/venv for jax, ~/scaleout/venv-torch for torch)")
    ssh_args: List[str] = setting([], "extra gcloud flags for every tpu-vm ssh and scp, e.g. [--internal-ip]; "
                                  "--tunnel-through-iap sends them through `gcloud alpha` (GA has no IAP)")
    create_args: List[str] = setting([], "extra gcloud flags for queued-resources create, e.g. "
                                     "[--network=NET, --subnetwork=SUB, --service-account=SA, --labels=team=ml]")


@dataclass
class PlanConfig:
    """`scaleout plan --compile` and the fit check: per-device memory known before a cell runs."""

    check_fit: bool = setting(False, "run/sweep: estimate every cell's per-device memory first (as plan --compile does) "
                              "and refuse, before anything is written, cells that exceed the device memory")
    device: Optional[str] = setting(None, "accelerator whose memory is the limit where the target does not name one "
                                    "(slurm GPUs), e.g. h100, h200, a100-80gb, b200: for these JAX cells compile for "
                                    "that GPU (the gpu-aot extra) and the limit is model.gpu_memory_fraction of its "
                                    "memory; null: the TPU generation's chip, or host memory / devices on CPU")
    device_memory_gib: Optional[float] = setting(None, "per-device memory limit in GiB for the fit check; overrides "
                                                 "the datasheet or host figure", gt=0)
    cache_dir: Optional[str] = setting("~/.cache/scaleout/compile", "where plan --compile keeps its JAX results, keyed "
                                       "by the lowered program, the devices, the compiler versions and flags: the same "
                                       "cell is not compiled twice; null disables")


@dataclass
class SweepConfig:
    """`scaleout sweep`: contenders x devices (x extra) cells."""

    devices: List[int] = setting([1, 2, 4], "device counts to sweep", ge=1, nonempty=True, unique=True)
    frameworks: List[str] = setting(["jax", "torch"], "frameworks to sweep when sweep.contenders is empty: one contender "
                                    "per framework", choices=FRAMEWORKS, nonempty=True, unique=True)
    contenders: List[str] = setting([], "what the sweep compares, by name: built in jax, torch (eager), torch-compile "
                                    "(torch.compile=true), or a name from sweep.custom_contenders; [] uses "
                                    "sweep.frameworks", unique=True)
    custom_contenders: Dict[str, Dict[str, Any]] = setting(
        {}, "your own contenders: name -> {framework: jax|torch, KEY: VALUE...}, e.g. {jax-unrolled: {framework: jax, "
        "model.scan_layers: false}}; the settings apply to that contender's cells only")
    scaling: str = setting("weak", "weak fixes the per-device batch, strong the global batch",
                           choices=("weak", "strong"))
    extra: Dict[str, List[Any]] = setting({}, "more keys to sweep, e.g. {model.remat: [none, full]}")


@dataclass
class ReportConfig:
    """`scaleout report`."""

    horizon_steps: int = setting(10000, "the run length for which the report gives each contender's wall time", ge=1)
    project_to: List[int] = setting([], "device counts to project each contender's step time, throughput and "
                                    "efficiency to, from a cost model fitted to the measured cells (`scaleout report "
                                    "--project 16,32,64` sets it for one report); [] projects nothing", ge=1, unique=True)
    project_max_error: float = setting(0.1, "a projection whose leave-one-out error (fit on the other measured device "
                                       "counts, predict the one left out) exceeds this fraction is labelled not "
                                       "trustworthy", gt=0)
    efficiency_floor: float = setting(0.8, "the report names the device count at which each contender's projected "
                                      "scaling efficiency falls below this fraction", gt=0, lt=1)
    devices_per_node: Optional[int] = setting(None, "devices that share the fast interconnect (NVLink / a TPU slice) "
                                              "in the projection; null: slurm.devices_per_node on SLURM, the TPU "
                                              "generation's largest slice on TPU, the largest local cell otherwise",
                                              ge=1)
    network: Optional[str] = setting(None, "interconnect between nodes in the projection, where no measured cell "
                                     "crossed nodes (launch/core/interconnects.py); null: the device's usual one",
                                     choices=("ib-hdr", "ib-ndr", "ib-xdr", "roce-200", "roce-400", "eth-100",
                                              "efa-p5", "dcn-v5e", "dcn-v5p", "dcn-v6e"))


@dataclass
class Config:
    """A scaleout config."""

    framework: str = setting("jax", "the trainer", choices=FRAMEWORKS)
    contender: Optional[str] = setting(None, "run as this contender (jax, torch, torch-compile or a name from "
                                       "sweep.custom_contenders): its framework and settings apply; null: framework as "
                                       "set. A cell's config.yaml records the contender it ran as")
    target: str = setting("local", "where the cells run", choices=TARGETS)
    devices: int = setting(1, "devices (GPUs, TPU chips/cores, or simulated CPU devices)", ge=1)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    jax: JaxConfig = field(default_factory=JaxConfig)
    torch: TorchConfig = field(default_factory=TorchConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    tpu: TpuConfig = field(default_factory=TpuConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    report: ReportConfig = field(default_factory=ReportConfig)


# --------------------------------------------------------------------------- walking the schema

def yaml_name(f: dataclasses.Field) -> str:
    """A field's YAML spelling (`async` for `async_`)."""
    return f.metadata.get("yaml", f.name)


def walk(cls: type = Config, prefix: str = "") -> Iterator[Tuple[str, dataclasses.Field, Any]]:
    """(dotted YAML key, field, type) for every field in schema order, sections before their keys."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + yaml_name(f)
        yield key, f, hints[f.name]
        if dataclasses.is_dataclass(hints[f.name]):
            yield from walk(hints[f.name], key + ".")


def comment(f: dataclasses.Field) -> str:
    """The one-line comment of a key: its choices, then its help."""
    choices = f.metadata.get("choices")
    text = f.metadata["help"]
    return f"{' | '.join(choices)}: {text}" if choices else text


def section_comment(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    if not doc or doc.startswith(cls.__name__ + "("):  # dataclass's generated signature
        raise TypeError(f"schema section {cls.__name__} needs a docstring: its first line is its comment")
    return doc.splitlines()[0].rstrip(".")


# --------------------------------------------------------------------------- base.yaml

HEADER = """\
# scaleout base config: every key, with its default and a one-line comment. GENERATED from
# launch/config/schema.py by `python -m launch.config`; edit the schema, not this file.
# Group files (configs/model, target, sweep), --config files and command-line overrides
# (`model=300m train.steps=50`) layer on top of these defaults, later wins.
"""
COMMENT_COLUMN = 28


def _yaml_float(v: float) -> str:
    text = repr(v)  # '1e-05', '0.003', '10000.0'
    if "e" in text:  # YAML 1.1 floats need a '.' and a signed exponent
        mantissa, exponent = text.split("e")
        text = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{int(exponent):+d}"
    return text


def _yaml_str(s: str, flow: bool) -> str:
    plain = (s == s.strip() and s != "" and not any(t in s for t in (": ", " #", "\n", "\t"))
             and not (flow and any(c in s for c in ",[]{}")) and s[0] not in "[]{},#&*!|>'\"%@`-?:"
             and yaml.safe_load(s) == s)
    return s if plain else json.dumps(s)


def yaml_value(v: Any, flow: bool = False) -> str:
    """`v` as one line of YAML (flow style for lists and mappings)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _yaml_float(v)
    if isinstance(v, str):
        return _yaml_str(v, flow)
    if isinstance(v, list):
        return "[" + ", ".join(yaml_value(x, True) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{yaml_value(k, True)}: {yaml_value(x, True)}" for k, x in v.items()) + "}"
    raise TypeError(f"no YAML for {v!r}")


def _line(indent: str, name: str, value: str, text: str) -> str:
    left = f"{indent}{name}:{' ' + value if value else ''}"
    return f"{left:<{COMMENT_COLUMN}}# {text}" if len(left) < COMMENT_COLUMN - 1 else f"{left}  # {text}"


def render_base_yaml(cls: type = Config) -> str:
    """configs/base.yaml: every key of the schema with its default and comment, section by section."""
    return "\n".join([HEADER.rstrip("\n"), *_render(cls, "")]) + "\n"


def _render(cls: type, indent: str) -> List[str]:
    lines: List[str] = []
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            if not indent:
                lines.append("")  # a blank line before each top-level section
            lines.append(_line(indent, yaml_name(f), "", section_comment(tp)))
            lines.extend(_render(tp, indent + "  "))
        else:
            lines.append(_line(indent, yaml_name(f), yaml_value(getattr(defaults, f.name)), comment(f)))
    return lines


def main(argv: Sequence[str] = ()) -> int:
    """`python -m launch.config [--check]`: rewrite configs/base.yaml from the schema, or compare."""
    text = render_base_yaml()
    if "--check" in argv:
        if BASE_YAML.read_text() != text:
            print(f"{BASE_YAML} differs from the schema; run `python -m launch.config` to regenerate it.",
                  file=sys.stderr)
            return 1
        return 0
    from launch.common.files import atomic_write
    atomic_write(BASE_YAML, text)
    print(f"wrote {BASE_YAML}")
    return 0

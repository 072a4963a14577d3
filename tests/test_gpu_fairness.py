"""Issue 25, items 1-5: the same attention kernels, the same GPU memory, one CUDA stack, GPU binding that cannot
collide and MFU against the precision that ran -- everything that can be shown without a GPU: the resolution
logic, what the trainers record on CPU, the launcher's environment and refusals, and `nvidia-smi` emulated by a
script that prints exactly what the real one prints for the queries scaleout makes."""

import os
import stat
import tomllib
from pathlib import Path

import pytest

from launch import config
from launch.core import attention, flops, gpus

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def fake_nvidia_smi(tmp_path, driver="580.95.05", gpus_listed=4):
    """An `nvidia-smi` on PATH answering `-L` and `--query-gpu=driver_version --format=csv,noheader` as the real
    one does (one line per GPU); anything else fails as an unknown option does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    lines_l = "\n".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d}-aaaa-bbbb-cccc-000000000000)"
                        for i in range(gpus_listed))
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\n"
                      f'if [ "$1" = "-L" ]; then printf "%s\\n" "{lines_l}"; exit 0; fi\n'
                      'if [ "$1" = "--query-gpu=driver_version" ] && [ "$2" = "--format=csv,noheader" ]; then\n'
                      f'  i=0; while [ $i -lt {gpus_listed} ]; do echo "{driver}"; i=$((i+1)); done; exit 0\nfi\n'
                      'echo "Invalid combination of input arguments." >&2; exit 2\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}


# --------------------------------------------------------------------------- 1. attention kernels

def names(ks):
    return [(k.name, k.kind) for k in ks]


def test_attention_impl_resolves_per_framework_device_dtype_and_mask():
    c = attention.candidates
    # JAX: cuDNN's fused kernel on GPU in bf16 only; XLA's dense path everywhere else
    assert names(c("jax", "gpu", "bf16", "causal", "auto")) == [("cudnn", "fused"), ("xla", "dense")]
    assert names(c("jax", "gpu", "fp32", "causal", "auto")) == [("xla", "dense")]
    assert names(c("jax", "cpu", "bf16", "causal", "auto")) == [("xla", "dense")]
    assert names(c("jax", "tpu", "bf16", "document", "auto")) == [("xla", "dense")]
    assert names(c("jax", "gpu", "bf16", "document", "fused")) == [("cudnn", "fused")]
    # PyTorch: SDPA flash (half precision) then memory-efficient (also fp32) on CUDA; flex for documents
    assert names(c("torch", "cuda", "bf16", "causal", "auto")) == [("flash", "fused"), ("efficient", "fused"), ("math", "dense")]
    assert names(c("torch", "cuda", "fp32", "causal", "fused")) == [("efficient", "fused")]
    assert names(c("torch", "cuda", "bf16", "document", "auto")) == [("flex", "fused"), ("math", "dense")]
    assert names(c("torch", "cuda", "bf16", "document", "auto", "sdpa")) == [("efficient", "fused"), ("math", "dense")]
    assert names(c("torch", "cpu", "fp32", "causal", "auto")) == [("flash", "fused"), ("math", "dense")]
    for fw, dense in (("jax", "xla"), ("torch", "math")):
        assert names(c(fw, "gpu", "bf16", "causal", "dense")) == [(dense, "dense")]
    with pytest.raises(attention.AttentionUnavailable, match=r"model.attention_impl=fused: JAX has no fused .* fp32 on gpu"):
        c("jax", "gpu", "fp32", "causal", "fused")
    with pytest.raises(attention.AttentionUnavailable):
        c("jax", "cpu", "bf16", "causal", "fused")


def test_choose_takes_the_first_kernel_whose_probe_passes_and_fused_refuses_in_one_sentence():
    options = attention.candidates("torch", "cuda", "bf16", "causal", "auto")
    probe = {"flash": "No available kernel", "efficient": None, "math": None}
    assert attention.choose(options, lambda k: probe[k.name], "auto", "cuda", "bf16", "causal").name == "efficient"
    fused = attention.candidates("torch", "cuda", "bf16", "causal", "fused")
    with pytest.raises(attention.AttentionUnavailable) as e:
        attention.choose(fused, lambda k: "refused", "fused", "cuda", "bf16", "causal")
    assert "\n" not in str(e.value) and "flash: refused; efficient: refused" in str(e.value)


def test_plan_refuses_fused_where_a_framework_has_none(scaleout):
    code, out, err = scaleout("plan", "model.attention_impl=fused")  # local, this machine: a CPU
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and "model.attention_impl=fused: JAX has no fused attention kernel" in err, err
    code, _, err = scaleout("plan", "target=slurm", "slurm.gpus_per_node=8", "model.attention_impl=fused")
    assert code == 2 and "fp32 on gpu" in err  # cuDNN's kernel needs bf16
    code, _, _ = scaleout("plan", "target=slurm", "slurm.gpus_per_node=8", "model.attention_impl=fused", "model.dtype=bf16")
    assert code == 0


def test_torch_runs_exactly_the_sdpa_kernel_it_records():
    """resolve_attention + use_attention_kernel on CPU: the kernel recorded is the one the profiler sees run."""
    import torch

    from torchrun_fsdp.model import Attention, rope_tables, use_attention_kernel
    from torchrun_fsdp.train import resolve_attention
    seen = {}
    for impl, op in (("auto", "aten::_scaled_dot_product_flash_attention_for_cpu"),
                     ("dense", "aten::_scaled_dot_product_attention_math")):
        cfg = config.load([f"model.attention_impl={impl}", "framework=torch"])
        k = resolve_attention(cfg, torch.device("cpu"))
        use_attention_kernel(k.name)
        try:
            layer = Attention(cfg.model)
            for p in layer.parameters():
                torch.nn.init.normal_(p, std=0.02)
            x = torch.randn(2, cfg.model.seq_len, cfg.model.d_model)
            cos, sin = rope_tables(cfg.model.seq_len, cfg.model.d_model // cfg.model.n_heads, cfg.model.rope_theta)
            with torch.profiler.profile() as prof:
                layer(x, cos, sin).sum().backward()
            ops = {e.key for e in prof.key_averages() if "attention" in e.key and e.key.startswith("aten::_")}
        finally:  # every backend enabled again: this process's default
            for enable in (torch.backends.cuda.enable_flash_sdp, torch.backends.cuda.enable_mem_efficient_sdp,
                           torch.backends.cuda.enable_math_sdp, torch.backends.cuda.enable_cudnn_sdp):
                enable(True)
        seen[impl] = (k.settings(), ops)
        assert op in ops, (impl, ops)
    assert seen["auto"][0] == {"attention_kernel": "flash", "attention_class": "fused"}
    assert seen["dense"][0] == {"attention_kernel": "math", "attention_class": "dense"}
    assert not any("flash" in o for o in seen["dense"][1])


def test_jax_resolves_xla_on_cpu_and_refuses_fused():
    import jax

    from jaxrun.train import resolve_attention
    cpu = jax.devices("cpu")[0]
    assert resolve_attention(config.load([]), cpu).settings() == {"attention_kernel": "xla", "attention_class": "dense"}
    with pytest.raises(attention.AttentionUnavailable):
        resolve_attention(config.load(["model.attention_impl=fused", "model.dtype=bf16"]), cpu)


@pytest.mark.slow
def test_both_trainers_record_the_kernel_the_memory_fraction_and_the_mfu_peak(tmp_path):
    from jaxrun_helpers import run_trainer, summary as last, write_cell
    for fw, kernel in (("jax", "xla"), ("torch", "math")):
        cfg = write_cell(tmp_path / fw, f"framework={fw}", "train.steps=2", "model.attention_impl=dense")
        p, recs = run_trainer(fw, cfg)
        assert p.returncode == 0 and last(recs)["status"] == "ok", p.stderr[-2000:]
        s = next(r for r in recs if r["kind"] == "start")["settings"]
        assert (s["attention_impl"], s["attention_kernel"], s["attention_class"]) == ("dense", kernel, "dense"), s
        assert s["gpu_memory_fraction"] is None  # on CPU there is no GPU memory to share
        assert s["mfu_peak"] == "the host's fp32 matmul, calibrated in this run"


def test_report_marks_a_pair_that_ran_different_kernel_classes():
    from launch.report import report

    def row(fw, kernel, kind):
        return {"framework": fw, "_start": {"settings": {"attention_kernel": kernel, "attention_class": kind}}}

    mixed = report.kernel_note(row("jax", "xla", "dense"), row("torch", "flash", "fused"))
    assert mixed["different_classes"] and mixed["kernels"] == {"jax": "xla (dense)", "torch": "flash (fused)"}
    assert "different classes (fused vs dense)" in mixed["note"] and "model.attention_impl=dense" in mixed["note"]
    same = report.kernel_note(row("jax", "cudnn", "fused"), row("torch", "flash", "fused"))
    assert not same["different_classes"] and "different" not in same["note"]
    old = report.kernel_note({"framework": "jax", "_start": {}}, {"framework": "torch", "_start": {}})
    assert old["note"] is None and not old["different_classes"]  # cells from before model.attention_impl


# --------------------------------------------------------------------------- 2. the same memory

def test_jax_trainer_sets_the_memory_fraction_before_jax_starts(monkeypatch, caplog):
    from jaxrun.__main__ import setup_memory_fraction
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    setup_memory_fraction(config.load(["model.gpu_memory_fraction=0.85"]))
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.85"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".75")
    setup_memory_fraction(config.load([]))
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=.75 in the environment is replaced" in caplog.text


def test_the_gpu_fit_limit_is_the_memory_fraction_of_the_gpu():
    from launch.launcher import aot
    h100 = 84942979072  # what an H100 reports, a little under 80 GiB
    limit, why = aot.device_limit(config.load(["target=slurm", "plan.device=h100"]))
    assert limit == int(0.9 * h100) and "model.gpu_memory_fraction=0.9" in why and "NVIDIA H100" in why
    assert aot.device_limit(config.load(["target=slurm", "plan.device=h100", "model.gpu_memory_fraction=0.5"]))[0] == h100 // 2
    assert aot.device_limit(config.load(["target=slurm", "plan.device=l4"]))[0] == int(0.9 * 24 * GIB)  # datasheet
    tpu = config.load(["target=tpu", "devices=4", "train.global_batch=4"])
    assert aot.device_limit(tpu, "TPU v5 lite")[0] == 16 * GIB  # not a GPU: no fraction
    with pytest.raises(config.ConfigError, match="model.gpu_memory_fraction"):
        config.load(["model.gpu_memory_fraction=1.5"])


# --------------------------------------------------------------------------- 3. one CUDA stack

def test_the_gpu_extra_is_one_cuda_13_stack_pinned_in_constraints():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "jax[cuda13]" in extras["gpu"] and not any("cuda12" in d for d in extras["gpu"])
    assert "jax[cuda12]" in extras["gpu-cuda12"]
    pins = dict(line.strip().split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["jax-cuda13-plugin"] == pins["jax-cuda13-pjrt"] == pins["jaxlib"] == pins["jax"] == gpus.JAX_VERSION
    assert pins["torch"] == gpus.TORCH_VERSION and pins["cuda-toolkit"].startswith("13.0")
    assert not [n for n in pins if n.endswith("-cu12") and n not in ("nvidia-cuda-nvcc-cu12",)]  # no CUDA 12 libraries


def test_hints_are_exact_pinned_commands_for_the_driver_there(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "0", "PATH": "/nonexistent"}
    with pytest.raises(RuntimeError) as e:
        gpus.check_platform("jax", "cpu", env)
    assert "`pip install 'jax[cuda13]==0.10.2'`" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RuntimeError, match=r"`pip install 'torch==2\.13\.0'`"):
        gpus.check_platform("torch", "cpu", env)
    old = {**env, **fake_nvidia_smi(tmp_path, driver="550.127.05")}  # CUDA 12 territory
    with pytest.raises(RuntimeError, match=r"jax\[cuda12\]==0\.10\.2'`, driver 550\.127\.05"):
        gpus.check_platform("jax", "cpu", old)
    with pytest.raises(RuntimeError, match=r"torch==2\.13\.0' --index-url https://download\.pytorch\.org/whl/cu126"):
        gpus.check_platform("torch", "cpu", old)


def test_driver_preflight_reads_nvidia_smi_and_names_what_needs_a_newer_driver(tmp_path):
    env = fake_nvidia_smi(tmp_path, driver="550.127.05")
    assert gpus.driver_version(env) == "550.127.05"
    why = gpus.driver_problem(env, builds={"jax": 13, "torch": 13})
    assert why.count("\n") == 0 and "550.127.05" in why and ">= 580" in why and "JAX (CUDA 13) and PyTorch (CUDA 13)" in why
    assert "pip install 'jax[cuda12]==0.10.2'" in why  # the way out on this driver
    assert gpus.driver_problem(env, builds={"jax": 12, "torch": 12}) is None
    assert gpus.driver_problem(fake_nvidia_smi(tmp_path / "new", driver="580.95.05"), builds={"jax": 13}) is None
    assert gpus.driver_problem({"PATH": "/nonexistent"}, builds={"jax": 13}) is None  # no nvidia-smi: nothing said
    assert gpus.driver_problem(env, builds={}) is None  # no CUDA build installed (this machine)


def test_installed_cuda_reads_the_builds_from_their_metadata():
    assert gpus.cuda_major_of_torch("2.13.0+cu126", []) == 12
    assert gpus.cuda_major_of_torch("2.13.0+cpu", []) is None
    pypi = ['cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3; '
            'platform_system == "Linux"', 'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"']
    assert gpus.cuda_major_of_torch("2.13.0", pypi) == 13  # PyPI's plain wheel: a CUDA 13.0 build
    assert gpus.installed_cuda() == {}  # this machine: CPU-only jaxlib and torch


# --------------------------------------------------------------------------- 4. GPU binding

def test_local_jax_processes_each_bind_their_own_gpus():
    from jaxrun.__main__ import distributed_args
    host = {"SCALEOUT_DISTRIBUTED": "local", "SCALEOUT_COORDINATOR": "127.0.0.1:1234", "SCALEOUT_NUM_PROCESSES": "2",
            "CUDA_VISIBLE_DEVICES": "0,1,2,3", "PATH": "/nonexistent"}
    ids = [distributed_args({**host, "SCALEOUT_PROCESS_ID": str(i)}, devices=4)["local_device_ids"] for i in range(2)]
    assert ids == [[0, 1], [2, 3]]
    cpu = {**host, "SCALEOUT_PROCESS_ID": "1", "CUDA_VISIBLE_DEVICES": ""}
    assert distributed_args(cpu, devices=4)["local_device_ids"] is None  # CPU devices: nothing to bind
    assert distributed_args({"PATH": "/nonexistent"}, devices=1) is None  # a lone process


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_local_cell_sees_only_its_own_gpus(tmp_path, monkeypatch, framework):
    """bench.gpu's one-device cells on a host with 4 GPUs use exactly one (as the plan prints it)."""
    from launch.targets import local
    cell = tmp_path / "cell"
    cfg = config.load([f"framework={framework}", "devices=1"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in local.build(cfg, cell).processes] == ["0"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path)["PATH"])  # no restriction: nvidia-smi lists 4
    assert local.build(cfg, cell).processes[0].env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "CUDA_VISIBLE_DEVICES=0 " in local.LocalTarget().plan_commands(cfg, cell)[0]
    four = config.load([f"framework={framework}", "devices=4", "train.global_batch=8"])
    assert "CUDA_VISIBLE_DEVICES" not in local.build(four, cell).processes[0].env  # all of them: nothing to hide


def test_plan_warns_that_task_binding_stops_nccl_p2p(scaleout):
    code, _, err = scaleout("plan", "target=slurm", "slurm.gpus_per_node=8", "slurm.gpu_binding=task", "devices=8")
    assert code == 0 and "NVIDIA/nccl#129" in err and "slurm.gpu_binding=node" in err, err
    code, _, err = scaleout("plan", "target=slurm", "slurm.gpus_per_node=8", "devices=8")
    assert code == 0 and "nccl" not in err.lower()


# --------------------------------------------------------------------------- 5. MFU against the precision that ran

def test_mfu_peak_is_the_datasheet_figure_of_the_precision_that_ran():
    assert flops.precision_of(config.load(["model.dtype=bf16"]).model) == "bf16"
    assert flops.precision_of(config.load([]).model) == "fp32"
    assert flops.precision_of(config.load(["model.matmul_precision=tf32"]).model) == "tf32"
    h100 = "NVIDIA H100 80GB HBM3"
    assert (flops.datasheet_peak(h100, "bf16"), flops.datasheet_peak(h100, "tf32"), flops.datasheet_peak(h100, "fp32")) \
        == (989e12, 495e12, 67e12)
    assert flops.datasheet_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert flops.peak_basis(h100, "fp32") == f"datasheet dense fp32 peak of {h100}, 67 TFLOP/s"
    assert flops.peak_for("TPU v5 lite", "fp32") == (197e12, "bf16")  # TPU datasheets give bf16 only
    assert "gives no fp32 figure" in flops.peak_basis("TPU v5 lite", "fp32")

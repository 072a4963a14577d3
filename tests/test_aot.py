"""`scaleout plan --compile` and the sweep's fit check (`plan.check_fit`): per-device memory, compile
time and FLOPs of a cell's real train step, known before the cell runs."""

import importlib.util
import json
import os
import sys

import pytest
from conftest import in_ci, run_cell, run_cli, summary

from launch import config
from launch.common import files
from launch.core import flops
from launch.launcher import aot

GIB = 2**30


def needs_libtpu():
    """CI installs the tpu-aot extra (`make test`); elsewhere a missing libtpu skips, in CI it fails."""
    if importlib.util.find_spec("libtpu") is None:
        if in_ci():
            pytest.fail("libtpu is not installed: CI must install the tpu-aot extra (make test does)")
        pytest.skip("libtpu not installed (pip install 'scaleout[tpu-aot]')")


def needs_gpu_aot():
    """The gpu-aot extra's jax CUDA plugin; `make test` runs these tests in .venv-gpu-aot (SCALEOUT_GPU_AOT_TESTS=1),
    where a missing plugin fails; in the main run (no plugin, on purpose) they skip, saying so."""
    if aot.gpu_compiler_missing():
        if os.environ.get("SCALEOUT_GPU_AOT_TESTS"):
            pytest.fail(f"the gpu-aot extra is not installed here ({aot.gpu_compiler_missing()} missing)")
        pytest.skip("no jax CUDA plugin here: `make test` runs the gpu_aot tests in .venv-gpu-aot "
                    "(pip install -c constraints.txt 'scaleout[gpu-aot]')")


def plan_compile(tmp_path, *overrides, check=False):
    args = ["plan", "--compile", "--json", *(["--check"] if check else []), *overrides]
    p = run_cli(args, cwd=tmp_path, timeout=900)
    doc = json.loads(p.stdout) if p.returncode in (0, 1) and p.stdout.strip() else None
    return p, (doc["compile"][0] if doc else None)


# --------------------------------------------------------------------------- no jax, no torch needed

@pytest.mark.parametrize("gen, devices, name, hosts, per_host", [
    ("v5e", 32, "v5e:4x8", 8, [2, 2, 1]),  # v5litepod-32: 8 hosts of 2x2 chips
    ("v5e", 16, "v5e:4x4", 4, [2, 2, 1]),
    ("v5e", 8, "v5e:2x4", 1, [2, 4, 1]),   # one host with 8 chips
    ("v6e", 4, "v6e:2x2", 1, [2, 2, 1]),
    ("v4", 8, "v4:2x2x2", 2, [2, 2, 1]),   # v4-16: 8 chips (megacore), 2 hosts
    ("v5p", 32, "v5p:2x4x4", 8, [2, 2, 1]),  # v5p-64
])
def test_tpu_topology_of_a_slice(gen, devices, name, hosts, per_host):
    cfg = config.load(["target=tpu", f"tpu.generation={gen}", f"devices={devices}", f"train.global_batch={devices}"])
    t = aot.tpu_topology(cfg)
    assert (t["name"], t["hosts"], t["chips_per_host_bounds"]) == (name, hosts, per_host)
    assert t["chip_config_name"] == ("megacore" if gen in ("v4", "v5p") else "default")


def test_datasheet_memory_and_limits():
    assert flops.datasheet_hbm("TPU v5 lite") == 16 * GIB and flops.datasheet_hbm("TPU v5") == 95 * GIB
    assert flops.datasheet_hbm("TPU v4") == 32 * GIB and flops.datasheet_hbm("TPU v6 lite") == 32 * GIB
    assert flops.datasheet_hbm("NVIDIA H100 80GB HBM3") == 80 * GIB and flops.datasheet_hbm("NVIDIA H200") == 141 * GIB
    assert flops.datasheet_hbm("NVIDIA A100-SXM4-80GB") == 80 * GIB and flops.datasheet_hbm("NVIDIA A100-SXM4-40GB") == 40 * GIB
    assert flops.datasheet_hbm("cpu") is None
    tpu = config.load(["target=tpu", "tpu.generation=v5p", "devices=4", "train.global_batch=4"])
    assert aot.device_limit(tpu, "TPU v5")[0] == 95 * GIB
    assert aot.device_limit(config.load(["plan.device_memory_gib=2"]))[0] == 2 * GIB
    assert aot.device_limit(config.load(["target=slurm", "plan.device=h100"]))[0] == int(0.9 * 84942979072)
    limit, why = aot.device_limit(config.load(["target=slurm", "slurm.gpus_per_node=8"]))
    assert limit is None and "plan.device" in why
    local = config.load(["devices=4"])
    assert aot.device_limit(local)[0] == aot.host_memory_bytes() // 4
    with pytest.raises(config.ConfigError, match="plan.device='tpu v9'"):
        aot.device_limit(config.load(["target=slurm", "plan.device=tpu v9"]))


def test_refusal_names_cell_estimate_limit_and_knobs():
    r = {"cell": "jax-d1", "fits": False, "memory": {"total": 3 * GIB}, "limit_bytes": GIB,
         "limit_source": "plan.device_memory_gib=1", "method": "XLA memory_analysis (cpu)"}
    why = aot.refusal(r)
    assert why.count(".") >= 1 and "\n" not in why
    for part in ("jax-d1", "3.00 GiB", "1.00 GiB", "model.remat", "train.grad_accum", "fsdp"):
        assert part in why
    assert aot.refusal({**r, "fits": True}) is None


def test_without_the_extra_tpu_compile_says_how_to_install(scaleout, monkeypatch):
    # sys.modules["libtpu"] = None is how Python itself marks a module as not importable:
    # importlib.util.find_spec then reports it missing, as on a machine without the package.
    monkeypatch.setitem(sys.modules, "libtpu", None)
    code, out, err = scaleout("plan", "--compile", "target=tpu", "devices=16", "train.global_batch=16")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "pip install 'scaleout[tpu-aot]'" in lines[0] and "libtpu" in lines[0]


def test_check_needs_compile(scaleout):
    code, _, err = scaleout("plan", "--check")
    assert code == 2 and "--check goes with --compile" in err


# --------------------------------------------------------------------------- JAX: compile for a TPU slice

def test_tiny_compiles_for_a_multi_host_tpu_slice(tmp_path):
    """tiny on v5litepod-16 (4 hosts of 4 chips) through libtpu's topology, unrolled so the FLOPs compare."""
    needs_libtpu()
    p, r = plan_compile(tmp_path, "target=tpu", "tpu.generation=v5e", "devices=16", "train.global_batch=16",
                        "model.scan_layers=false", check=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert r["devices"] == 16 and r["device_kind"] == "TPU v5 lite" and r["platform"] == "tpu"
    assert r["topology"]["name"] == "v5e:4x4" and r["topology"]["hosts"] == 4 and r["topology"]["hosts_seen"] == 4
    assert r["mesh"] == {"data": 1, "fsdp": 16, "tensor": 1}
    m = r["memory"]
    for key in ("argument", "output", "alias", "temp", "generated_code", "total"):
        assert m[key] >= 0, key
    assert m["argument"] > 0 and m["alias"] > 0  # the donated state aliases its outputs
    assert m["total"] == m["argument"] + m["output"] - m["alias"] + m["temp"] + m["generated_code"]
    assert r["limit_bytes"] == 16 * GIB and r["fits"] is True and r["compile_s"] > 0
    f = r["flops"]
    assert f["formula_per_device"] == flops.flops_per_token(config.load([]).model) * 16 * 32 / 16
    assert 0.9 < f["ratio"] < 1.5, f  # tiny: norms, softmax and AdamW are a visible share next to its matmuls


def test_a_cell_that_cannot_fit_a_tpu_slice_exits_1_under_check(tmp_path):
    """1b with 8 sequences of 2048 tokens per v5e chip: XLA:TPU refuses it, plan says so."""
    needs_libtpu()
    p, r = plan_compile(tmp_path, "target=tpu", "tpu.generation=v5e", "devices=16", "model=1b",
                        "train.global_batch=128", check=True)
    assert p.returncode == 1, p.stderr[-3000:]
    assert r["fits"] is False and r["memory"]["total"] > 16 * GIB and r["compiled"] is False
    err = [line for line in p.stderr.splitlines() if line.startswith("scaleout:")]
    assert len(err) == 1 and "jax-d16" in err[0] and "model.remat" in err[0] and "16.00 GiB" in err[0]
    text = run_cli(["plan", "--compile", "target=tpu", "tpu.generation=v5e", "devices=16", "model=1b",
                    "train.global_batch=128"], cwd=tmp_path, timeout=900)
    assert text.returncode == 0 and "DOES NOT FIT" in text.stdout and "16.00 GiB" in text.stdout


# --------------------------------------------------------------------------- JAX: compile for NVIDIA GPUs without one

H100 = ["target=slurm", "plan.device=h100", "slurm.gpus_per_node=8", "devices=8", "slurm.devices_per_node=4"]


@pytest.mark.gpu_aot
def test_tiny_compiles_for_8_h100s_on_2_nodes(tmp_path):
    """tiny on 2 nodes x 4 H100s through XLA:GPU's deviceless compile, unrolled so the FLOPs compare."""
    needs_gpu_aot()
    p, r = plan_compile(tmp_path, *H100, "train.global_batch=16", "model.scan_layers=false", check=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert r["platform"] == "gpu" and r["device_kind"] == "NVIDIA H100 80GB HBM3" and r["devices"] == 8
    assert r["topology"]["topology"] == "1x2x4" and r["topology"]["hosts_seen"] == 2
    m = r["memory"]
    assert m["argument"] > 0 and m["alias"] > 0 and m["temp"] > 0
    assert m["total"] == m["argument"] + m["output"] - m["alias"] + m["temp"] + m["generated_code"]
    assert r["limit_bytes"] == int(0.9 * 84942979072) and r["fits"] is True
    assert r["attention_kernel"] == {"attention_kernel": "xla", "attention_class": "dense"}  # fp32: no cuDNN kernel
    assert 0.9 < r["flops"]["ratio"] < 1.5, r["flops"]  # XLA's HLO cost analysis of the GPU module vs the formula
    assert any("no autotuning" in n and "NCCL" in n for n in r["notes"]), r["notes"]


@pytest.mark.gpu_aot
def test_a_cell_that_cannot_fit_8_h100s_exits_1_under_check(tmp_path):
    """Dense attention over 4096 tokens x 128 sequences per GPU: XLA:GPU compiles it (its rematerialisation
    only warns), and the total is far over 0.9 of an H100."""
    needs_gpu_aot()
    p, r = plan_compile(tmp_path, *H100, "train.global_batch=1024", "model.seq_len=4096", check=True)
    assert p.returncode == 1, p.stderr[-3000:]
    assert r["fits"] is False and r["memory"]["total"] > r["limit_bytes"] == int(0.9 * 84942979072)
    err = [line for line in p.stderr.splitlines() if line.startswith("scaleout:")]
    assert len(err) == 1 and "jax-d8" in err[0] and "model.gpu_memory_fraction=0.9" in err[0] and "model.remat" in err[0]


@pytest.mark.gpu_aot
def test_bf16_compiles_the_kernel_the_gpu_trainer_runs_or_says_why_not(tmp_path):
    """bf16 on H100: cuDNN's fused attention where cuDNN is installed (it is checked at lowering even without a
    GPU); without it, XLA's dense path with a note naming what the trainer runs instead."""
    needs_gpu_aot()
    p, r = plan_compile(tmp_path, *H100, "train.global_batch=16", "model.dtype=bf16")
    assert p.returncode == 0, p.stderr[-3000:]
    if importlib.util.find_spec("nvidia.cudnn") is not None:
        assert r["attention_kernel"] == {"attention_kernel": "cudnn", "attention_class": "fused"}
    else:
        assert r["attention_kernel"]["attention_kernel"] == "xla"
        assert any("not cudnn (fused)" in n and "cuDNN not found" in n for n in r["notes"]), r["notes"]


def test_gpu_compile_without_the_extra_says_how_to_install(scaleout, monkeypatch):
    for v in (12, 13):  # as on a machine without the gpu-aot extra (see the libtpu test above)
        monkeypatch.setitem(sys.modules, f"jax_plugins.xla_cuda{v}", None)
    code, out, err = scaleout("plan", "--compile", *H100)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and "pip install -c constraints.txt 'scaleout[gpu-aot]'" in err, err


def test_torch_estimate_for_a_gpu_is_labelled_as_traced_on_cpu(tmp_path):
    p, r = plan_compile(tmp_path, "framework=torch", *H100[:3], "devices=2", "train.global_batch=4")
    assert p.returncode == 0, p.stderr[-3000:]
    assert r["method"].startswith("FSDPMemTracker") and r["limit_bytes"] == int(0.9 * 84942979072)
    assert any("traced on this machine's CPU" in n for n in r["notes"]), r


def test_a_repeated_compile_is_answered_from_the_cache(tmp_path):
    """The same cell twice: the second is not compiled again (same figures, `cache.hit`); another batch is."""
    cache = f"plan.cache_dir={tmp_path / 'cache'}"
    _, first = plan_compile(tmp_path, "devices=2", "train.global_batch=8", cache)
    _, again = plan_compile(tmp_path, "devices=2", "train.global_batch=8", cache)
    _, other = plan_compile(tmp_path, "devices=2", "train.global_batch=16", cache)
    assert first["cache"]["hit"] is False and again["cache"]["hit"] is True and other["cache"]["hit"] is False
    assert again["memory"] == first["memory"] and again["compile_s"] == first["compile_s"]
    assert other["memory"]["total"] != first["memory"]["total"]
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2
    text = run_cli(["plan", "--compile", "devices=2", "train.global_batch=8", cache], cwd=tmp_path)
    assert "answered from the compile cache" in text.stdout, text.stdout
    _, off = plan_compile(tmp_path, "devices=2", "train.global_batch=8", "plan.cache_dir=null")
    assert "cache" not in off


# --------------------------------------------------------------------------- the sweep's fit check

SWEEP = ["sweep", "sweep.frameworks=[jax]", "sweep.devices=[1,2]", "sweep.scaling=strong", "train.global_batch=64",
         "model.seq_len=128", "plan.check_fit=true"]


def test_sweep_refuses_a_cell_that_does_not_fit_before_anything_is_written(tmp_path):
    # with the global batch fixed, the 1-device cell holds twice the activations of the 2-device one:
    # a limit between the two estimates refuses jax-d1 only, and nothing may start or be written.
    p, one = plan_compile(tmp_path, "devices=1", "train.global_batch=64", "model.seq_len=128")
    _, two = plan_compile(tmp_path, "devices=2", "train.global_batch=64", "model.seq_len=128")
    assert p.returncode == 0 and one["memory"]["total"] > 1.5 * two["memory"]["total"], (one["memory"], two["memory"])
    limit_gib = (one["memory"]["total"] + two["memory"]["total"]) / 2 / GIB
    p = run_cli([*SWEEP, f"run.dir={tmp_path}/runs", f"plan.device_memory_gib={limit_gib}"], cwd=tmp_path, timeout=900)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    err = [line for line in p.stderr.splitlines() if line.startswith("scaleout: error:")]
    assert len(err) == 1 and "Traceback" not in p.stderr, p.stderr
    for part in ("cell jax-d1", f"plan.device_memory_gib={limit_gib:g}", "model.remat", "train.grad_accum", "fsdp",
                 "nothing was written"):
        assert part in err[0], (part, err[0])
    assert "jax-d2" not in err[0]
    assert not (tmp_path / "runs").exists()  # no run directory, no cell, no trainer


@pytest.mark.slow
def test_sweep_that_fits_records_estimates_and_the_report_compares_them(tmp_path):
    p = run_cli([*SWEEP, f"run.dir={tmp_path}/runs", "run.name=fit", "train.steps=3", "checkpoint.every=0"],
                cwd=tmp_path, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    run = tmp_path / "runs" / "fit"
    for cell in ("jax-d1", "jax-d2"):
        est = json.loads((run / cell / files.ESTIMATE_NAME).read_text())
        assert est["fits"] is True and est["memory"]["total"] > 0 and est["compile_s"] > 0
    doc = json.loads((run / "report.json").read_text())
    rows = {r["cell"]: r for r in doc["cells"]}
    assert rows["jax-d1"]["est_memory_bytes"] > rows["jax-d2"]["est_memory_bytes"] > 0
    assert rows["jax-d1"]["compile_s"] and rows["jax-d1"]["est_compile_s"]
    md = (run / "report.md").read_text()
    assert "## Estimated vs measured" in md and "XLA memory_analysis" in md


# --------------------------------------------------------------------------- torch: FSDP2 under fake tensors

TORCH_CELL = ["framework=torch", "devices=2", "model=small", "train.global_batch=16"]
RSS_TOLERANCE = 0.20


@pytest.mark.slow
def test_torch_estimate_matches_the_peak_of_a_real_local_run(tmp_path):
    """The estimate (rank 0 of 2 under FakeTensorMode and a fake process group) against a real
    2-rank gloo run of the same cell. On CPU the trainer's measured peak is its peak RSS, which also
    holds the interpreter and libraries: the same trainer on `tiny` measures that footprint, and the
    difference is compared. glibc's mmap threshold is pinned so that freed tensors go back to the OS
    (else the heap keeps them and RSS overstates the live peak). Tolerance: 20%."""
    p, r = plan_compile(tmp_path, *TORCH_CELL)
    assert p.returncode == 0, p.stderr[-3000:]
    assert r["method"].startswith("FSDPMemTracker") and r["fits"] is True
    assert r["breakdown"]["Activation"] > 0 and r["breakdown"]["OptState"] > 0
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    common = ["train.steps=2", "checkpoint.every=0", "checkpoint.async=false", "train.warmup_exclude=0"]
    _, recs = run_cell(tmp_path, *TORCH_CELL, *common, "run.name=cell", env=env)
    _, base = run_cell(tmp_path, "framework=torch", "devices=2", "train.global_batch=2", *common, "run.name=base", env=env)
    measured = summary(recs)["peak_memory_bytes"] - summary(base)["peak_memory_bytes"]
    estimate = r["memory"]["total"]
    assert abs(estimate - measured) <= RSS_TOLERANCE * measured, (estimate / 2**20, measured / 2**20)


def test_torch_estimate_for_hsdp_and_grad_accum(tmp_path):
    """A world of 8 that this machine could not run: HSDP (2 x 4) and grad accumulation, in one process."""
    p, r = plan_compile(tmp_path, "framework=torch", "devices=8", "parallel.data=2", "parallel.fsdp=4",
                        "train.global_batch=32", "train.grad_accum=2", "model.remat=full")
    assert p.returncode == 0, p.stderr[-3000:]
    assert r["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1} and r["memory"]["total"] > 0
    assert "fake process group of 8" in r["method"]

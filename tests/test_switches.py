"""Switches that could be silently ignored (issue 19): each one must change what actually runs, not only
leave the loss curve alone. Every test would pass on a trainer that ignored the key if it only compared
curves; these look at the compiled program or at what the modules do."""

import subprocess
import sys
import textwrap

import pytest

from launch import config

from conftest import ROOT

TINY = ["model.n_layers=2", "train.global_batch=4"]


def _jax_step(*overrides):
    """The JAX trainer's own train step (jaxrun.train.TrainStep), lowered and compiled for one CPU device."""
    from jaxrun import mesh as mesh_mod
    from jaxrun.train import TrainStep
    cfg = config.load([*TINY, *overrides])
    lowered = TrainStep(cfg, mesh_mod.make_mesh(cfg)).lower()
    compiled = lowered.compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return lowered.as_text(), compiled.as_text(), float(cost["flops"])


def test_jax_remat_recomputes_the_forward():
    """model.remat=full must recompute the forward in the backward (more FLOPs in the compiled step);
    a trainer that dropped the remat policy would compile the same program."""
    *_, plain = _jax_step("model.scan_layers=false")
    *_, full = _jax_step("model.scan_layers=false", "model.remat=full")
    assert full > 1.1 * plain, (full, plain)


def test_jax_bf16_matmuls_run_in_bf16():
    """model.dtype=bf16 must put bf16 operands into the dots (fp32 masters stay fp32)."""
    fp32, _, _ = _jax_step()
    bf16, _, _ = _jax_step("model.dtype=bf16")
    assert "bf16" not in fp32
    assert "bf16" in bf16 and "dot_general" in bf16


def test_jax_scan_layers_false_unrolls():
    """model.scan_layers=false must unroll the layers: no while loop in the compiled step; the scanned one has one."""
    _, scanned, _ = _jax_step()
    _, unrolled, _ = _jax_step("model.scan_layers=false")
    assert "while" in scanned and "while" not in unrolled


TORCH_PROBE = textwrap.dedent('''
    import json, os, sys
    import torch, torch.distributed as dist
    from launch import config
    from torchrun_fsdp import parallel
    from torchrun_fsdp.model import Transformer
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = config.load(["model.n_layers=2", *sys.argv[2:]])
    model = Transformer(cfg.model)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model = parallel.parallelize(model, cfg, parallel.build_mesh(cfg, "cpu"))
    seen = {"attention_forward": 0, "param_dtype": None}
    def pre(mod, args):
        seen["attention_forward"] += 1
        seen["param_dtype"] = str(next(mod.parameters()).dtype)
    inner = model.layers[0]
    inner = getattr(inner, "_orig_mod", inner)
    inner = getattr(inner, "_checkpoint_wrapped_module", inner)
    inner.attention.register_forward_pre_hook(pre)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    model(x).float().mean().backward()
    seen["compiled"] = type(model.layers[0]).__name__
    print(json.dumps(seen))
    dist.destroy_process_group()
''')


def _torch_probe(*overrides, port):
    p = subprocess.run([sys.executable, "-c", TORCH_PROBE, str(port), *overrides], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    import json
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_torch_remat_recomputes_the_forward_and_bf16_computes_in_bf16():
    """model.remat=full must rerun each block's forward in the backward (the attention's forward runs twice);
    model.dtype=bf16 must hand FSDP2's forward bf16 parameters (MixedPrecisionPolicy)."""
    plain = _torch_probe(port=29611)
    assert plain["attention_forward"] == 1 and plain["param_dtype"] == "torch.float32"
    remat = _torch_probe("model.remat=full", port=29612)
    assert remat["attention_forward"] == 2, remat
    bf16 = _torch_probe("model.dtype=bf16", port=29613)
    assert bf16["param_dtype"] == "torch.bfloat16", bf16


@pytest.mark.slow
def test_torch_compile_compiles_the_blocks():
    """torch.compile=true must hand the blocks to torch.compile (and they must run compiled)."""
    out = _torch_probe("torch.compile=true", port=29614)
    assert out["compiled"] == "OptimizedModule" and out["attention_forward"] >= 1, out

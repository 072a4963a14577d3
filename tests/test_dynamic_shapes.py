"""The dynamic-shape workload (issue 26): data.seq_lens gives each step its own length, deterministically;
data.pad_to pads to buckets with the padding masked out of the loss, in both frameworks."""

import numpy as np
import pytest
from conftest import losses, run_cell, summary

from launch import config
from launch.core import flops
from launch.core.params import init_param, named_params, stack
from launch.data.batches import IGNORE, Batches, padded_len, step_seq_len

DYN = ["data.seq_lens=[8,16,24,32]"]


def _batches(*overrides):
    cfg = config.load(list(overrides))
    return cfg, Batches(cfg.data, cfg.model.vocab_size, cfg.model.seq_len)


# ----------------------------------------------------------------------------- data

def test_lengths_are_a_function_of_seed_and_step_only():
    cfg, b = _batches(*DYN)
    lengths = [step_seq_len(cfg.data, 32, s) for s in range(200)]
    assert lengths == [step_seq_len(config.load(DYN).data, 32, s) for s in range(200)]  # any process, any contender
    assert set(lengths) == {8, 16, 24, 32}
    other = config.load([*DYN, "data.seed=7"]).data
    assert lengths != [step_seq_len(other, 32, s) for s in range(200)]
    uniform = config.load(["data.seq_lens=[5,30]", "data.seq_len_dist=uniform"]).data
    drawn = {step_seq_len(uniform, 32, s) for s in range(400)}
    assert min(drawn) == 5 and max(drawn) == 30 and len(drawn) > 20
    assert step_seq_len(config.load().data, 32, 3) == 32  # static: model.seq_len
    assert padded_len(config.load(["data.pad_to=[16,32]"]).data, 9) == 16 and padded_len(uniform, 9) == 9


def test_a_dynamic_batch_is_the_prefix_of_the_static_rows_and_pads_to_its_bucket():
    cfg, b = _batches(*DYN, "data.pad_to=[16,32]")
    _, static = _batches()
    for step in range(12):
        L = step_seq_len(cfg.data, 32, step)
        x, y = b.split(step, 0, 8)
        P = 16 if L <= 16 else 32
        assert x.shape == y.shape == (8, P)
        sx, sy = static.split(step, 0, 8)
        np.testing.assert_array_equal(x[:, :L], sx[:, :L])  # the same rows for every contender, shorter
        np.testing.assert_array_equal(y[:, :L], sy[:, :L])
        assert (y[:, L:] == IGNORE).all() and (y[:, :L] >= 0).all()
        parts = [b.split(step, 0, 3), b.split(step, 3, 8)]  # every process builds its own rows
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)


def test_flops_count_real_tokens_at_their_length():
    m = config.load().model
    assert flops.flops_per_token(m, 16) < flops.flops_per_token(m) == flops.flops_per_token(m, 32)
    assert flops.flops_per_token(m, 16) == flops.flops_per_token(m) - 12 * m.n_layers * 16 * m.d_model


# ----------------------------------------------------------------------------- parity with padding

def _jax_loss_and_logits(m, per_layer, inputs, targets, masked):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrun.mesh import path_name
    from jaxrun.model import Transformer, cross_entropy
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(m, nnx.Rngs(0))))
    w = stack(per_layer, m)
    state = jax.tree.map_with_path(lambda p, _: jnp.asarray(w[path_name(p)]), abstract)

    def loss_fn(state):
        logits = nnx.merge(graphdef, state)(jnp.asarray(inputs), m)
        return cross_entropy(logits, jnp.asarray(targets), masked=masked), logits

    (loss, logits), _ = jax.value_and_grad(loss_fn, has_aux=True)(state)
    return float(loss), np.asarray(logits)


def _torch_loss_and_logits(m, per_layer, inputs, targets):
    import torch

    from torchrun_fsdp.model import Transformer, cross_entropy
    model = Transformer(m)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in per_layer.items()}, strict=True)
    logits = model(torch.from_numpy(inputs.astype(np.int64)))
    loss = cross_entropy(logits, torch.from_numpy(targets.astype(np.int64)))
    loss.backward()
    return float(loss.detach()), logits.detach().numpy(), {k: p.grad.numpy() for k, p in model.named_parameters()}


def test_padded_losses_agree_across_frameworks_and_with_the_unpadded_batch():
    """The same rows, padded to a bucket in both frameworks: the loss over the real targets equals the
    unpadded batch's in JAX and in PyTorch, real positions' logits do not see the padding, and the
    gradients agree (padding contributes nothing)."""
    cfg, b = _batches("model=small", "model.n_layers=2", "data.seq_lens=[100]", "data.pad_to=[128,256]")
    m = cfg.model
    x, y = b.split(0, 0, 2)
    assert x.shape == (2, 128) and (y[:, 100:] == IGNORE).all()
    per_layer = {name: init_param(m, 7, name, spec) for name, spec in named_params(m)}
    ux, uy = x[:, :100], y[:, :100]  # the same rows, unpadded
    jl, jlogits = _jax_loss_and_logits(m, per_layer, x, y, masked=True)
    jlu, jlogits_u = _jax_loss_and_logits(m, per_layer, ux, uy, masked=False)
    tl, tlogits, tgrads = _torch_loss_and_logits(m, per_layer, x, y)
    tlu, _, tgrads_u = _torch_loss_and_logits(m, per_layer, ux, uy)
    assert jl == pytest.approx(jlu, rel=1e-6) and tl == pytest.approx(tlu, rel=1e-6)
    assert jl == pytest.approx(tl, rel=1e-6)
    np.testing.assert_allclose(jlogits[:, :100], jlogits_u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jlogits[:, :100], tlogits[:, :100], rtol=1e-5, atol=1e-5)
    for k in tgrads:
        np.testing.assert_allclose(tgrads[k], tgrads_u[k], rtol=1e-4, atol=1e-6 * max(1.0, np.abs(tgrads_u[k]).max()), err_msg=k)
    # and the mask is real: counting the padding's targets as token 0 changes the loss
    jl_unmasked, _ = _jax_loss_and_logits(m, per_layer, x, np.where(y < 0, 0, y), masked=False)
    assert abs(jl_unmasked - jl) > 1e-3


# ----------------------------------------------------------------------------- trainers

def _expected_new_lengths(cfg, steps):
    seen, out = set(), []
    for s in range(steps):
        P = padded_len(cfg.data, step_seq_len(cfg.data, cfg.model.seq_len, s))
        if P not in seen:
            seen.add(P)
            out.append((s + 1, P))
    return out


@pytest.mark.slow
def test_a_jax_cell_whose_shapes_change_records_every_compile(tmp_path):
    """JAX compiles once per new (padded) length, inside the step where it first comes: a compile record
    each (from jax.monitoring, with the persistent cache's outcome), steps that compiled left out of the
    steady state, tokens counted as real tokens."""
    args = ["data.seq_lens=[16,32]", "train.steps=6", "train.warmup_exclude=1", "checkpoint.every=0"]
    _, recs = run_cell(tmp_path, *args)
    cfg = config.load(args)
    want = _expected_new_lengths(cfg, 6)
    assert len(want) == 2  # the seed gives both lengths within 6 steps
    train = [r for r in recs if r["kind"] == "compile" and r["scope"] == "train"]
    assert [(r["step"], r["reason"]) for r in train] == [(s, f"new shape (8, {P})") for s, P in want]
    assert [r["recompile"] for r in train] == [False, True]
    assert all(r["seconds"] > 0 and r["cache"] in ("hit", "miss") and r["function"] == "_train_step" for r in train)
    s = summary(recs)
    assert s["compiles"] == 2 and s["recompiles"] == 1 and s["compile_s"] == pytest.approx(sum(r["seconds"] for r in train))
    assert s["later_compile_s"] == pytest.approx(train[1]["seconds"])
    steps = {r["step"]: r for r in recs if r["kind"] == "step"}
    assert {st for st, r in steps.items() if r.get("compiled")} == {st for st, _ in want}
    assert all(r["seq_len"] == step_seq_len(cfg.data, 32, st - 1) for st, r in steps.items())
    steady = [st for st in steps if st > 1 and not steps[st].get("compiled")]
    assert s["timed_steps"] == len(steady)
    tokens = sum(8 * steps[st]["seq_len"] for st in steady)
    assert s["tokens_per_s"] == pytest.approx(tokens / sum(steps[st]["step_time_s"] for st in steady), rel=1e-6)
    assert s["seq_len_mean"] == pytest.approx(tokens / 8 / len(steady)) and s["padding_share"] == 0.0


@pytest.mark.slow
def test_dynamic_shape_losses_agree_across_frameworks_with_padding(tmp_path):
    """JAX padded to buckets, PyTorch eager as is: the same rows, the same loss at every step."""
    common = ["data.seq_lens=[8,16,24,32]", "train.steps=6", "checkpoint.async=false", "checkpoint.every=0"]
    _, j = run_cell(tmp_path, *common, "framework=jax", "data.pad_to=[16,32]", "run.name=j")
    _, t = run_cell(tmp_path, *common, "framework=torch", "run.name=t")
    jl, tl = losses(j), losses(t)
    assert sorted(jl) == sorted(tl) == list(range(1, 7))
    assert max(abs(jl[s] - tl[s]) / abs(tl[s]) for s in jl) <= 1e-5
    sj = summary(j)
    assert 0 < sj["padding_share"] < 1 and sj["compiles"] == 2  # two buckets, two programs
    assert summary(t)["compiles"] == 0  # eager PyTorch: no compile, whatever the shapes


def test_report_puts_each_dynamic_cell_next_to_its_static_cell(tmp_path):
    import json

    import yaml

    from launch.report import report
    run = tmp_path / "run"

    def cell(name, extra, summary):
        d = run / name
        d.mkdir(parents=True)
        (d / "config.yaml").write_text(yaml.safe_dump(config.to_dict(config.load(["framework=jax", *extra]))))
        recs = [{"kind": "start", "framework": "jax", "devices": 1, "device_kind": "cpu", "host_cores": 2, "host": "h"},
                {"kind": "summary", "framework": "jax", "devices": 1, "processes": 1, "status": "ok", "error": None,
                 "tokens_per_s_per_device": summary["tokens_per_s"], "final_loss": 2.0, "steps": 20, **summary}]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")

    # static: 256 tokens a step at 0.25 s; dynamic: 100 real tokens/s slower but starting 2 s later with 3 s of later compiles
    cell("jax-d1-seq_lens_none", [], {"tokens_per_s": 1024.0, "step_time_mean_s": 0.25, "step_time_p50_s": 0.25,
                                       "time_to_first_step_s": 5.0, "compiles": 1, "compile_s": 2.0})
    cell("jax-d1-seq_lens_8_16_24_32", DYN, {"tokens_per_s": 512.0, "step_time_mean_s": 0.2, "step_time_p50_s": 0.2,
                                             "time_to_first_step_s": 7.0, "compiles": 4, "recompiles": 3,
                                             "compile_s": 6.0, "later_compile_s": 3.0, "loop_tokens_per_s": 400.0,
                                             "seq_len_mean": 20.0, "padding_share": 0.0})
    (run / "sweep.json").write_text(json.dumps({"scaling": "weak", "cells": [
        {"name": "jax-d1-seq_lens_none"}, {"name": "jax-d1-seq_lens_8_16_24_32"}]}))
    out = report.write(run)
    doc = json.loads(out["json"].read_text())
    [e] = doc["dynamic_shapes"]
    assert e["static_cell"] == "jax-d1-seq_lens_none" and e["compiles"] == 4 and e["recompiles"] == 3
    assert e["seq_lens"] == [8, 16, 24, 32] and e["static_tokens_per_s"] == 1024.0
    # slower start (7 + 3 later compiles vs 5) and slower per token (256/512 = 0.5 s vs 0.25 s per 256 tokens): never
    assert e["break_even"]["steps"] == "never" and e["break_even"]["slower_start"] == "jax-d1-seq_lens_8_16_24_32"
    md = out["md"].read_text()
    assert "## Workloads: dynamic shapes" in md and "| jax-d1-seq_lens_8_16_24_32 | jax | 1 | 8, 16, 24, 32 | none | 4 |" in md

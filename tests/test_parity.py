"""JAX and PyTorch compute the same function: same weights -> same logits and gradients;
same config, seed and data -> the same loss curve. This is what makes the comparison fair."""

import numpy as np
import pytest

from launch import config
from launch.data import Batches
from launch.params import init_param, named_params, stack, unstack

from conftest import losses, run_cell


def jax_forward_and_grads(m, weights, inputs, targets):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jaxrun.mesh import path_name
    from jaxrun.model import Transformer, cross_entropy

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(m, nnx.Rngs(0))))
    state = jax.tree.map_with_path(lambda p, _: jnp.asarray(weights[path_name(p)]), abstract)

    def loss_fn(state):
        logits = nnx.merge(graphdef, state)(jnp.asarray(inputs), m)
        return cross_entropy(logits, jnp.asarray(targets)), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state)
    flat = {path_name(p): np.asarray(g) for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    return np.asarray(logits), float(loss), flat


def torch_forward_and_grads(m, per_layer, inputs, targets):
    import torch
    from torchrun_fsdp.model import Transformer, cross_entropy

    model = Transformer(m)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in per_layer.items()}, strict=True)
    logits = model(torch.from_numpy(inputs.astype(np.int64)))
    loss = cross_entropy(logits, torch.from_numpy(targets.astype(np.int64)))
    loss.backward()
    return logits.detach().numpy(), float(loss.detach()), {k: p.grad.numpy() for k, p in model.named_parameters()}


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_same_weights_same_logits_and_gradients(preset):
    cfg = config.load([f"model={preset}", "model.n_layers=2"])
    m = cfg.model
    per_layer = {name: init_param(m, 7, name, spec) for name, spec in named_params(m)}
    inputs, targets = Batches(cfg.data, m.vocab_size, m.seq_len).split(0, 0, 2)
    jl, jloss, jgrads = jax_forward_and_grads(m, stack(per_layer, m), inputs, targets)
    tl, tloss, tgrads = torch_forward_and_grads(m, per_layer, inputs, targets)
    np.testing.assert_allclose(jl, tl, rtol=1e-5, atol=1e-5)
    assert jloss == pytest.approx(tloss, rel=1e-6)
    tstacked = stack(tgrads, m)
    assert tstacked.keys() == jgrads.keys()
    for k in jgrads:
        scale = np.abs(tstacked[k]).max()
        np.testing.assert_allclose(jgrads[k], tstacked[k], rtol=1e-4, atol=1e-4 * scale, err_msg=k)


def test_stack_unstack_roundtrip():
    m = config.load().model
    per_layer = {name: init_param(m, 0, name, spec) for name, spec in named_params(m)}
    back = unstack(stack(per_layer, m), m)
    assert back.keys() == per_layer.keys()
    assert all(np.array_equal(back[k], per_layer[k]) for k in back)


@pytest.mark.slow
def test_jax_checkpoint_converts_into_torch_and_back(tmp_path):
    """A trained JAX checkpoint loads into the PyTorch model (converter) and gives the same logits."""
    from jaxrun.checkpoint import load_params_numpy
    run_cell(tmp_path, "train.steps=5", "checkpoint.async=false")
    m = config.load().model
    stacked = load_params_numpy(tmp_path / "ckpt" / "tiny" / "jax-d1", 5)
    assert not np.array_equal(stacked["output"], init_param(m, 0, "output", dict(named_params(m))["output"]))
    cfg = config.load()
    inputs, targets = Batches(cfg.data, m.vocab_size, m.seq_len).split(99, 0, 2)
    jl, _, _ = jax_forward_and_grads(m, stacked, inputs, targets)
    tl, _, _ = torch_forward_and_grads(m, unstack(stacked, m), inputs, targets)
    np.testing.assert_allclose(tl, jl, rtol=1e-5, atol=1e-5)
    assert all(np.array_equal(v, stacked[k]) for k, v in stack(unstack(stacked, m), m).items())


@pytest.mark.slow
def test_jax_and_torch_loss_curves_agree_over_20_steps(tmp_path):
    common = ["train.steps=20", "devices=2", "checkpoint.async=false"]
    _, j = run_cell(tmp_path, *common, "framework=jax", "run.name=j")
    _, t = run_cell(tmp_path, *common, "framework=torch", "run.name=t")
    jl, tl = losses(j), losses(t)
    assert sorted(jl) == sorted(tl) == list(range(1, 21))
    rel = max(abs(jl[s] - tl[s]) / abs(tl[s]) for s in jl)
    assert rel <= 1e-3, rel
    assert jl[20] < jl[1] - 0.5  # and they are actually training

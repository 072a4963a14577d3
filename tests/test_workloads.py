"""The two workloads of issue 15: packed documents with document-causal attention, and RMSNorm as
a custom op with a hand-written backward, in both frameworks."""

import numpy as np
import pytest
from conftest import losses, run_cell, summary

from launch import config
from launch.core.params import init_param, named_params, stack
from launch.data.batches import Batches, document_batch, document_positions, segments_from_eos

DOC = ["model.attention=document", "data.mean_doc_len=8"]


def _doc_cfg(*extra):
    return config.load(DOC + list(extra))


def _weights(m, seed=3):
    return {name: init_param(m, seed, name, spec) for name, spec in named_params(m)}


def jax_model(m):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrun.mesh import path_name
    from jaxrun.model import Transformer

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(m, nnx.Rngs(0))))
    return graphdef, abstract, path_name, jax, jnp, nnx


def jax_logits_loss_grads(m, per_layer, d):
    from jaxrun.model import cross_entropy
    graphdef, abstract, path_name, jax, jnp, nnx = jax_model(m)
    weights = stack(per_layer, m)
    state = jax.tree.map_with_path(lambda p, _: jnp.asarray(weights[path_name(p)]), abstract)

    def loss_fn(state):
        logits = nnx.merge(graphdef, state)(jnp.asarray(d.inputs), m, segment_ids=jnp.asarray(d.segment_ids),
                                            positions=jnp.asarray(d.positions))
        return cross_entropy(logits, jnp.asarray(d.targets)), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state)
    flat = {path_name(p): np.asarray(g) for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    return np.asarray(logits), float(loss), flat


def torch_model(m, per_layer, impl="sdpa"):
    import torch

    from torchrun_fsdp.model import Transformer
    model = Transformer(m, impl)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in per_layer.items()}, strict=True)
    return model


def torch_logits_loss_grads(m, per_layer, d, impl="sdpa"):
    import torch

    from torchrun_fsdp.model import cross_entropy
    model = torch_model(m, per_layer, impl)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a).astype(np.int64))  # noqa: E731
    logits = model(t(d.inputs), t(d.segment_ids), t(d.positions))
    loss = cross_entropy(logits, t(d.targets))
    loss.backward()
    return logits.detach().numpy(), float(loss.detach()), {k: p.grad.numpy() for k, p in model.named_parameters()}


# ----------------------------------------------------------------------------- data

def _segments(rows, eos):
    """The document index of every position, counted one token at a time (the reference `segments_from_eos` must
    equal): it starts at 0 and goes up by one after each end-of-document token."""
    out = np.zeros(rows.shape, np.int64)
    for r, row in enumerate(rows):
        doc = 0
        for t, token in enumerate(row):
            out[r, t] = doc
            doc += int(token == eos)
    return out


def test_segments_from_eos_against_the_reference():
    rows = np.array([[9, 1, 9, 9, 2, 3], [1, 2, 3, 4, 5, 9]])
    assert segments_from_eos(rows, 9).tolist() == [[0, 1, 1, 2, 3, 3], [0, 0, 0, 0, 0, 0]] == _segments(rows, 9).tolist()


def test_documents_are_a_function_of_seed_step_row_and_split_on_eos():
    cfg = _doc_cfg()
    m = cfg.model
    b = Batches(cfg.data, m.vocab_size, m.seq_len)
    full = document_batch(b, cfg, 4, 0, 8)
    again = document_batch(Batches(cfg.data, m.vocab_size, m.seq_len), cfg, 4, 0, 8)
    parts = [document_batch(b, cfg, 4, 0, 3), document_batch(b, cfg, 4, 3, 8)]
    for f in ("inputs", "targets", "segment_ids", "positions"):
        assert np.array_equal(getattr(full, f), getattr(again, f))
        assert np.array_equal(np.concatenate([getattr(p, f) for p in parts]), getattr(full, f))
    eos = m.vocab_size - 1
    assert np.array_equal(full.inputs[:, 1:], full.targets[:, :-1])
    assert np.array_equal(full.segment_ids, _segments(full.inputs, eos))  # issue 24.26: against a reference, not itself
    # issue 24.21: the documents are a function of the step too: the same rows at another step are cut elsewhere
    other = document_batch(b, cfg, 5, 0, 8)
    assert not np.array_equal(other.segment_ids, full.segment_ids)
    assert all(not np.array_equal(other.segment_ids[r], full.segment_ids[r]) for r in range(8))
    # an EOS ends its document: the next token starts a new one at position 0
    r, t = np.argwhere(full.inputs[:, :-1] == eos)[0]
    assert full.segment_ids[r, t + 1] == full.segment_ids[r, t] + 1 and full.positions[r, t + 1] == 0
    assert full.positions[r, t] == t - np.flatnonzero(full.segment_ids[r] == full.segment_ids[r, t])[0]
    # mean length about data.mean_doc_len (geometric), over many rows
    big = document_batch(b, config.load(DOC + ["model.seq_len=512"]), 0, 0, 16)
    lengths = np.diff(np.flatnonzero(big.inputs.ravel() == eos))
    assert 6 < lengths.mean() < 10
    g = document_batch(b, config.load(DOC + ["model.doc_positions=global"]), 4, 0, 8)
    assert np.array_equal(g.positions, np.broadcast_to(np.arange(m.seq_len), g.positions.shape))
    # tokens themselves equal the causal batch except where EOS was written (or avoided)
    x, _ = b.split(4, 0, 8)
    assert (x == full.inputs).mean() > 0.8


def test_file_source_splits_on_eos(tmp_path):
    tokens = np.array(([1, 2, 3, 9] * 50), np.uint16)
    path = tmp_path / "t.bin"
    tokens.tofile(path)
    cfg = config.load(DOC + ["data.source=file", f"data.path={path}", "data.eos_id=9", "model.seq_len=16"])
    d = document_batch(Batches(cfg.data, cfg.model.vocab_size, 16), cfg, 0, 0, 2)
    for r in range(2):
        assert np.array_equal(d.segment_ids[r], _segments(d.inputs[r:r + 1], 9)[0])
        after = np.flatnonzero(d.inputs[r] == 9) + 1
        assert (d.positions[r, after[after < 16]] == 0).all()
    assert np.array_equal(document_positions(np.array([[0, 0, 1, 1, 1, 2]])), [[0, 1, 0, 1, 2, 0]])


# ----------------------------------------------------------------------------- the mask is real

def _perturb_other_documents(d, row, keep_seg, vocab, eos):
    """A copy of the batch where every non-EOS token of row `row` outside document `keep_seg` is changed."""
    x = d.inputs.copy()
    sel = (d.segment_ids[row] != keep_seg) & (x[row] != eos)
    x[row, sel] = (x[row, sel] + 7) % vocab
    x[row, sel] = np.where(x[row, sel] == eos, (eos + 1) % vocab, x[row, sel])
    return x, sel


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_tokens_logits_ignore_the_other_documents_of_its_row(framework):
    cfg = _doc_cfg()
    m = cfg.model
    d = document_batch(Batches(cfg.data, m.vocab_size, m.seq_len), cfg, 0, 0, 2)
    row, keep = 0, int(d.segment_ids[0, m.seq_len // 2])  # a document in the middle of the row
    assert len(np.unique(d.segment_ids[row])) >= 3
    x2, changed = _perturb_other_documents(d, row, keep, m.vocab_size, m.vocab_size - 1)
    assert changed.any()
    per_layer = _weights(m)
    if framework == "jax":
        import jax.numpy as jnp
        graphdef, abstract, path_name, jax, _, nnx = jax_model(m)
        w = stack(per_layer, m)
        model = nnx.merge(graphdef, jax.tree.map_with_path(lambda p, _: jnp.asarray(w[path_name(p)]), abstract))

        def run(x, seg=d.segment_ids):
            return np.asarray(model(jnp.asarray(x), m, segment_ids=jnp.asarray(seg), positions=jnp.asarray(d.positions)))
    else:
        import torch
        model = torch_model(m, per_layer)

        def run(x, seg=d.segment_ids):
            t = lambda a: torch.from_numpy(np.ascontiguousarray(a).astype(np.int64))  # noqa: E731
            with torch.no_grad():
                return model(t(x), t(seg), t(d.positions)).numpy()
    a, b = run(d.inputs), run(x2)
    mine = d.segment_ids[row] == keep
    np.testing.assert_array_equal(a[row, mine], b[row, mine])  # bit-identical: nothing leaks in
    assert np.abs(a[row, ~mine] - b[row, ~mine]).max() > 1e-3  # the other documents did change
    np.testing.assert_array_equal(a[1], b[1])  # other rows untouched
    # and the same change *does* leak without the document mask (the test can see a leak)
    one = np.zeros_like(d.segment_ids)
    later = mine & (np.arange(m.seq_len) > np.flatnonzero(changed)[0])
    assert np.abs(run(d.inputs, one)[row, later] - run(x2, one)[row, later]).max() > 1e-4


# ----------------------------------------------------------------------------- parity

@pytest.mark.parametrize("positions", ["reset", "global"])
def test_document_mode_jax_and_torch_agree(positions):
    cfg = _doc_cfg("model=small", "model.n_layers=2", f"model.doc_positions={positions}", "data.mean_doc_len=40")
    m = cfg.model
    d = document_batch(Batches(cfg.data, m.vocab_size, m.seq_len), cfg, 0, 0, 2)
    per_layer = _weights(m, 7)
    jl, jloss, jg = jax_logits_loss_grads(m, per_layer, d)
    tl, tloss, tg = torch_logits_loss_grads(m, per_layer, d)
    np.testing.assert_allclose(jl, tl, rtol=1e-5, atol=1e-5)
    assert jloss == pytest.approx(tloss, rel=1e-6)
    ts = stack(tg, m)
    for k in jg:
        np.testing.assert_allclose(jg[k], ts[k], rtol=1e-4, atol=1e-4 * np.abs(ts[k]).max(), err_msg=k)


def test_flex_block_mask_equals_the_dense_mask_forward():
    """flex_attention + BlockMask (compiled) vs SDPA + dense mask. Forward only: torch 2.13's CPU
    build has no flex_attention backward, which is why CPU training uses sdpa."""
    import torch
    cfg = _doc_cfg("model.seq_len=128", "data.mean_doc_len=24")
    m = cfg.model
    d = document_batch(Batches(cfg.data, m.vocab_size, m.seq_len), cfg, 0, 0, 2)
    per_layer = _weights(m)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a).astype(np.int64))  # noqa: E731
    with torch.no_grad():
        dense = torch_model(m, per_layer, "sdpa")(t(d.inputs), t(d.segment_ids), t(d.positions))
        flex = torch_model(m, per_layer, "flex")(t(d.inputs), t(d.segment_ids), t(d.positions))
    np.testing.assert_allclose(flex.numpy(), dense.numpy(), rtol=1e-5, atol=1e-5)


def test_flex_refused_for_cpu_training_and_auto_picks():
    from torchrun_fsdp.train import resolve_document_mask_impl
    assert resolve_document_mask_impl("auto", "cpu") == "sdpa"
    assert resolve_document_mask_impl("auto", "cuda") == "flex"
    with pytest.raises(ValueError, match="torch.document_mask_impl=flex"):
        resolve_document_mask_impl("flex", "cpu")


# ----------------------------------------------------------------------------- custom RMSNorm

def _norm_inputs(seed=0):
    g = np.random.default_rng(seed)
    return (g.standard_normal((3, 5, 16)).astype(np.float32), (1 + 0.1 * g.standard_normal(16)).astype(np.float32),
            g.standard_normal((3, 5, 16)).astype(np.float32))


def test_jax_custom_rms_norm_gradients_equal_autodiff():
    import jax
    import jax.numpy as jnp

    from jaxrun.model import rms_norm
    from jaxrun.ops import rms_norm_custom
    x, w, g = map(jnp.asarray, _norm_inputs())
    f_native = lambda x, w: jnp.sum(rms_norm(x, w, 1e-5) * g)  # noqa: E731
    f_custom = lambda x, w: jnp.sum(rms_norm_custom(x, w, 1e-5) * g)  # noqa: E731
    np.testing.assert_allclose(rms_norm_custom(x, w, 1e-5), rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.grad(f_custom, (0, 1))(x, w), jax.grad(f_native, (0, 1))(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # under jit and inside the scanned model: whole-model gradients agree too
    jax.jit(jax.grad(f_custom))(x, w)


def test_torch_custom_rms_norm_gradients_equal_autodiff():
    import torch

    from torchrun_fsdp.model import RMSNorm
    x, w, g = map(torch.from_numpy, _norm_inputs())
    grads = {}
    for impl in ("native", "custom"):
        norm = RMSNorm(16, 1e-5, impl)
        with torch.no_grad():
            norm.weight.copy_(w)
        xi = x.clone().requires_grad_(True)
        out = norm(xi)
        (out * g).sum().backward()
        grads[impl] = (out.detach(), xi.grad, norm.weight.grad)
    for a, b in zip(grads["custom"], grads["native"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_torch_custom_rms_norm_compiles_with_fullgraph_and_no_graph_break():
    import torch
    import torch._dynamo

    from torchrun_fsdp.model import TransformerBlock, rope_tables
    cfg = config.load(["model.norm_impl=custom"])
    m = cfg.model
    block = TransformerBlock(m)
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, m.seq_len, m.d_model)
    cos, sin = rope_tables(m.seq_len, m.d_model // m.n_heads, m.rope_theta)
    explain = torch._dynamo.explain(block)(x, cos, sin)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    compiled = torch.compile(block, fullgraph=True)
    xe, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    block(xe, cos, sin).sum().backward()
    ge = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    compiled(xc, cos, sin).sum().backward()
    for a, b in zip([p.grad for p in block.parameters()], ge):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_custom_norm_model_gradients_equal_native(framework):
    cfg = _doc_cfg()
    d = document_batch(Batches(cfg.data, cfg.model.vocab_size, cfg.model.seq_len), cfg, 0, 0, 2)
    out = {}
    for impl in ("native", "custom"):
        m = _doc_cfg(f"model.norm_impl={impl}").model
        fn = jax_logits_loss_grads if framework == "jax" else torch_logits_loss_grads
        out[impl] = fn(m, _weights(m), d)
    assert out["custom"][1] == pytest.approx(out["native"][1], rel=1e-6)
    for k, g in out["native"][2].items():
        np.testing.assert_allclose(out["custom"][2][k], g, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(g).max()), err_msg=k)


# ----------------------------------------------------------------------------- trainers

@pytest.mark.slow
def test_document_mode_loss_curves_agree_step_by_step(tmp_path):
    common = ["train.steps=10", "checkpoint.async=false", "model.norm_impl=custom"] + DOC
    _, j = run_cell(tmp_path, *common, "framework=jax", "run.name=j")
    _, t = run_cell(tmp_path, *common, "framework=torch", "run.name=t")
    jl, tl = losses(j), losses(t)
    assert sorted(jl) == sorted(tl) == list(range(1, 11))
    rel = max(abs(jl[s] - tl[s]) / abs(tl[s]) for s in jl)
    assert rel <= 1e-5, rel
    assert summary(t)["status"] == "ok"
    starts = [r for r in t if r.get("kind") == "start"]
    assert starts[-1]["settings"]["document_mask_impl"] == "sdpa"
    assert starts[-1]["settings"]["attention"] == "document"

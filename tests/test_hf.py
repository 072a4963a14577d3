"""Hugging Face Llama export (`scaleout export`) and import (`model.init=hf:DIR`).

The acceptance checks (slow: they train): a `tiny` cell trained on 2 devices in each framework
(so the checkpoint is sharded) is exported; `transformers`' LlamaForCausalLM loads the directory
and its logits equal scaleout's own model on the same checkpoint (< 1e-4, fp32).

"Step-0 loss at the same data step", formulated so that both sides compute the same number:
the exporting run trains 4 steps and saves at 3 and 4. Its step-4 record is the loss of the
step-3 weights on data step 3 (a step record's loss is computed before that step's update).
Exporting step 3, the HF model's loss on data step 3 must equal that record (1e-5). Then a new
cell in the *other* framework starts from the export (`model.init=hf:OUT`, 2 devices); its first
step's loss is the loss of those same weights on data step 0, so it must equal the HF model's loss
on data step 0 (1e-5) — the imported trainer starts from exactly the exported weights.
"""

import json
import re
import shutil

import numpy as np
import pytest
from conftest import in_ci, losses, run_cell

from launch import config
from launch.config import ConfigError
from launch.core import hf_weights as hf
from launch.core.params import init_param, named_params, param_shapes
from launch.data.batches import Batches
from launch.interop import export, hf_files
from launch.launcher import inputs as launcher_inputs, rundir


def _transformers():
    """`transformers` comes with the test extra; CI must have it, a bare checkout may skip."""
    if in_ci():
        import transformers
    else:
        transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()  # its bars would mix into the CLI's stderr
    return transformers


def _tiny():
    return config.load().model


def _write_hf(directory, m, *, cfg_changes=None, drop=(), add=None, seed=3):
    """An HF Llama directory of model `m` written with launch.core.hf_weights (random weights), optionally altered."""
    directory.mkdir(parents=True, exist_ok=True)
    params = {name: init_param(m, seed, name, spec) for name, spec in named_params(m)}
    tensors = {k: v for k, v in hf.to_hf(params).items() if k not in drop}
    tensors.update(add or {})
    hf_files.write_safetensors(tensors, directory)
    c = {**hf_files.hf_config(m), **(cfg_changes or {})}
    (directory / hf.CONFIG_JSON).write_text(json.dumps(c))
    return params


def _cross_entropy(logits, targets):
    import torch
    return float(torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), torch.from_numpy(targets.astype(np.int64)).reshape(-1)))


def _hf_logits(model, inputs):
    import torch
    with torch.no_grad():
        return model(torch.from_numpy(inputs.astype(np.int64))).logits.float()


# --------------------------------------------------------------------------- mapping and files

def test_names_map_one_to_one_with_matmul_weights_transposed():
    m = _tiny()
    params = {name: init_param(m, 0, name, spec) for name, spec in named_params(m)}
    tensors = hf.to_hf(params)
    assert len(tensors) == len(params) == 9 * m.n_layers + 3
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (m.d_model, m.d_model)
    np.testing.assert_array_equal(tensors["model.layers.1.mlp.gate_proj.weight"], params["layers.1.feed_forward.w1"].T)
    np.testing.assert_array_equal(tensors["lm_head.weight"], params["output"].T)
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], params["tok_embeddings"])
    np.testing.assert_array_equal(tensors["model.layers.0.post_attention_layernorm.weight"], params["layers.0.ffn_norm.weight"])
    assert {k: v.shape for k, v in tensors.items()} == hf.expected_shapes(param_shapes(m))
    back = hf.from_hf(tensors)
    assert back.keys() == params.keys() and all(np.array_equal(back[k], params[k]) for k in params)


def test_config_json_is_a_llama_config_of_the_model():
    m = config.load(["model=small"]).model
    c = hf_files.hf_config(m, "bf16")
    assert c["architectures"] == ["LlamaForCausalLM"] and c["num_key_value_heads"] == c["num_attention_heads"] == m.n_heads
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]) == (m.d_model, m.d_ff, m.n_layers, m.vocab_size)
    assert c["tie_word_embeddings"] is False and c["hidden_act"] == "silu" and c["torch_dtype"] == "bfloat16"
    assert c["rope_theta"] == m.rope_theta and c["rms_norm_eps"] == m.norm_eps
    assert hf.model_keys(c) == {"model.d_model": m.d_model, "model.n_layers": m.n_layers, "model.n_heads": m.n_heads,
                                "model.d_ff": m.d_ff, "model.vocab_size": m.vocab_size, "model.norm_eps": m.norm_eps,
                                "model.rope_theta": m.rope_theta}


def test_safetensors_shard_with_an_index_when_large_and_read_back(tmp_path):
    m = _tiny()
    params = {name: init_param(m, 0, name, spec) for name, spec in named_params(m)}
    tensors = hf.to_hf(params)
    one = tmp_path / "one"
    one.mkdir()
    assert hf_files.write_safetensors(tensors, one) == [hf.SINGLE_FILE]
    many = tmp_path / "many"
    many.mkdir()
    names = hf_files.write_safetensors(tensors, many, max_shard_bytes=hf_files.parse_size("100KB"))
    assert names[-1] == hf.INDEX_FILE and len(names) > 3
    index = json.loads((many / hf.INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    for directory in (one, many):
        r = hf.Reader(directory)
        assert {k: s for k, (s, _) in r.shapes().items()} == hf.expected_shapes(param_shapes(m))
        assert all(np.array_equal(r.get(k), v) for k, v in tensors.items())
    assert hf_files.parse_size("5GB") == 5 * 10**9 and hf_files.parse_size("2GiB") == 2 * 2**30 and hf_files.parse_size("1000") == 1000
    with pytest.raises(hf.HFError, match="is not a size"):
        hf_files.parse_size("lots")


def test_bf16_is_rounded_and_widened_back(tmp_path):
    x = np.array([[1.0, 1.00390625, 3.14159265, -2e-3]], np.float32)
    b = hf_files.cast(x, "bf16")
    assert b.dtype.name == "bfloat16"
    hf_files.write_safetensors({"w": b}, tmp_path)
    got = hf.Reader(tmp_path).get("w")
    assert got.dtype == np.float32 and np.allclose(got, x, rtol=2**-8) and got[0, 0] == 1.0


# --------------------------------------------------------------------------- model.init=hf:DIR refusals

REFUSALS = [
    ({"num_key_value_heads": 2}, r"num_key_value_heads=2 != num_attention_heads=4 \(grouped-query attention\)"),
    ({"tie_word_embeddings": True}, r"tie_word_embeddings=true"),
    ({"attention_bias": True}, r"attention_bias=true; scaleout's model has no biases"),
    ({"mlp_bias": True}, r"mlp_bias=true"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0}}, r"rope_type=llama3"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, r"not a Llama"),
]


@pytest.mark.parametrize("changes,message", REFUSALS, ids=[next(iter(c)) for c, _ in REFUSALS])
def test_hf_init_refuses_what_the_model_does_not_have(tmp_path, scaleout, changes, message):
    _write_hf(tmp_path / "m", _tiny(), cfg_changes=changes)
    code, out, err = scaleout("run", "model.init=hf:m", "run.dir=runs")
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith("scaleout: error: model.init='hf:m' cannot start this model: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"], "a refused config must not write anything"


def test_hf_init_of_another_shape_names_the_overrides_that_fit(tmp_path, scaleout):
    big = config.load(["model.d_model=128", "model.n_layers=3"]).model
    _write_hf(tmp_path / "m", big)
    code, _, err = scaleout("plan", "model.init=hf:m")
    assert code == 2
    assert "another shape than this config (model.d_model=64, model.n_layers=2); set model.d_model=128 model.n_layers=3" in err
    code, out, _ = scaleout("plan", "model.init=hf:m", "model.d_model=128", "model.n_layers=3")
    assert code == 0 and "hf:m" in out


@pytest.mark.parametrize("how,message", [
    ("weights_bias", r"its weights hold biases \(model\.layers\.0\.self_attn\.q_proj\.bias"),
    ("no_lm_head", r"lack lm_head\.weight \(tied embeddings"),
    ("wrong_shape", r"its weight model\.layers\.1\.mlp\.up_proj\.weight has shape \[64, 128\], not \[128, 64\]"),
    ("no_weights", r"holds no model\.safetensors nor model\.safetensors\.index\.json"),
    ("no_config", r"config\.json does not exist"),
    ("not_a_dir", r"is not a directory"),
    ("bad_prefix", r"choose one of: numpy, native, hf:DIR"),
])
def test_hf_init_checks_the_weights_too(tmp_path, how, message):
    m = _tiny()
    d = tmp_path / "m"
    if how == "weights_bias":
        _write_hf(d, m, add={"model.layers.0.self_attn.q_proj.bias": np.zeros(m.d_model, np.float32)})
    elif how == "no_lm_head":
        _write_hf(d, m, drop=("lm_head.weight",))
    elif how == "wrong_shape":
        _write_hf(d, m, add={"model.layers.1.mlp.up_proj.weight": np.zeros((m.d_model, m.d_ff), np.float32)})
    elif how == "no_weights":
        _write_hf(d, m)
        (d / hf.SINGLE_FILE).unlink()
        (d / "pytorch_model.bin").write_bytes(b"")
    elif how == "no_config":
        _write_hf(d, m)
        (d / hf.CONFIG_JSON).unlink()
    value = "hf" if how == "bad_prefix" else f"hf:{d}" if how != "not_a_dir" else f"hf:{tmp_path / 'nope'}"
    with pytest.raises(ConfigError, match=message):
        launcher_inputs.load([f"model.init={value}"])


def _sharded(d, m):
    """An HF directory of `m` whose weights are in shards with an index (returns the index path)."""
    _write_hf(d, m)
    (d / hf.SINGLE_FILE).unlink()
    params = {name: init_param(m, 3, name, spec) for name, spec in named_params(m)}
    hf_files.write_safetensors(hf.to_hf(params), d, max_shard_bytes=100_000)
    return d / hf.INDEX_FILE


@pytest.mark.parametrize("target", ["../../secret/model.safetensors", "/etc/passwd", "sub/../../x.safetensors", 5, None])
def test_hf_index_naming_a_file_outside_the_directory_is_refused(tmp_path, scaleout, target):
    """Issue 24.2: an index's weight_map must not make scaleout open a file outside the model directory
    (24.15: nor crash on a value that is not a file name)."""
    m = _tiny()
    index = _sharded(tmp_path / "m", m)
    outside = tmp_path / "secret" / "model.safetensors"
    outside.parent.mkdir()
    shutil.copyfile(next((tmp_path / "m").glob("model-00001-*.safetensors")), outside)  # a valid file, to be sure it is not read
    doc = json.loads(index.read_text())
    name = next(iter(doc["weight_map"]))
    doc["weight_map"][name] = target
    index.write_text(json.dumps(doc))
    code, out, err = scaleout("plan", f"model.init=hf:{tmp_path / 'm'}")
    assert code == 2 and out == "" and "Traceback" not in err and err.count("\n") == 1, err
    assert f"puts {name} in {json.dumps(target)}, which is not a file name inside {tmp_path / 'm'}" in err, err
    with pytest.raises(hf.HFError, match="not a file name inside"):
        hf.Reader(tmp_path / "m")
    # a file name in a subdirectory of the model directory is its own
    assert hf.inside("shards/model-00001-of-00002.safetensors") and not hf.inside("") and not hf.inside("a\\..\\..\\b")


@pytest.mark.parametrize("changes,message", [
    ({"rope_theta": "abc"}, r"rope_theta=\"abc\", which is not a number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "x"}}, r"rope_parameters\.rope_theta=\"x\", which is not a number"),
    ({"rope_theta": 1e400}, r"rope_theta=Infinity, which is not a number"),
    ({"head_dim": "abc"}, r"head_dim=\"abc\", which is not an integer"),
    ({"architectures": 5}, r"architectures=5, which is not a list of class names"),
    ({"hidden_size": 64.5}, r"hidden_size=64\.5, which is not an integer"),
    ({"rms_norm_eps": [1]}, r"rms_norm_eps=\[1\], which is not a number"),
    ({"num_key_value_heads": "4"}, r"num_key_value_heads=\"4\", which is not an integer"),
    ({"vocab_size": None}, r"lacks vocab_size \(LlamaConfig fields"),
    # issue 24.16: no heads is not grouped-query attention
    ({"num_attention_heads": 0}, r"num_attention_heads=0, which is not a positive integer"),
])
def test_hf_config_fields_of_the_wrong_type_are_one_sentence(tmp_path, scaleout, changes, message):
    """Issue 24.15: config.json fields of the wrong type were tracebacks (exit 1)."""
    _write_hf(tmp_path / "m", _tiny(), cfg_changes=changes)
    code, out, err = scaleout("plan", "model.init=hf:m")
    assert code == 2 and out == "" and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("scaleout: error: model.init='hf:m' cannot start this model: its config.json ")
    assert re.search(message, err), err
    assert "grouped-query" not in err


def test_hf_init_loads_the_weights_in_scaleout_layout(tmp_path):
    m = _tiny()
    params = _write_hf(tmp_path / "m", m, seed=11)
    cfg = launcher_inputs.load([f"model.init=hf:{tmp_path / 'm'}"])
    for name, spec in named_params(cfg.model):
        np.testing.assert_array_equal(init_param(cfg.model, 0, name, spec), params[name])


def test_a_cell_records_the_hf_directory_absolute(tmp_path, monkeypatch):
    """The trainers may run in another directory (SLURM, TPU): a cell's config holds an absolute path."""
    _write_hf(tmp_path / "m", _tiny())
    monkeypatch.chdir(tmp_path)
    cell = rundir.cell_config(config.load(["model.init=hf:m", f"run.dir={tmp_path}/runs"]), "jax-d1")
    assert cell.model.init == f"hf:{tmp_path / 'm'}"


def test_a_transformers_llama_starts_scaleout_with_the_same_logits(tmp_path):
    """A Llama saved by transformers itself (what a small public checkpoint looks like) is accepted,
    and scaleout's model initialised from it computes the HF model's logits."""
    transformers = _transformers()
    import torch

    from torchrun_fsdp.model import Transformer

    torch.manual_seed(0)
    c = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                 rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(c).eval()
    model.save_pretrained(tmp_path / "pub")
    cfg = launcher_inputs.load([f"model.init=hf:{tmp_path / 'pub'}"])
    m = cfg.model
    ours = Transformer(m)
    ours.load_state_dict({name: torch.from_numpy(init_param(m, 0, name, spec)) for name, spec in named_params(m)})
    inputs, _ = Batches(cfg.data, m.vocab_size, m.seq_len).split(0, 0, 4)
    with torch.no_grad():
        diff = (ours(torch.from_numpy(inputs.astype(np.int64))) - _hf_logits(model, inputs)).abs().max().item()
    assert diff < 1e-4, diff
    gqa = transformers.LlamaConfig(**{**c.to_dict(), "num_key_value_heads": 2})
    transformers.LlamaForCausalLM(gqa).save_pretrained(tmp_path / "gqa")
    with pytest.raises(ConfigError, match="grouped-query attention"):
        launcher_inputs.load([f"model.init=hf:{tmp_path / 'gqa'}"])


# --------------------------------------------------------------------------- export refusals (no training)

def _fake_cell(tmp_path, framework, entries):
    """A cell directory whose checkpoint directory holds only `entries` (names of step directories)."""
    cfg = config.load([f"framework={framework}", f"run.dir={tmp_path}/runs", f"checkpoint.dir={tmp_path}/ck"])
    run = rundir.RunDir(cfg)
    cell = run.write([run.cell(framework, 1)])[0].dir
    for name in entries:
        (tmp_path / "ck" / "tiny" / f"{framework}-d1" / name).mkdir(parents=True)
    return cell


@pytest.mark.parametrize("framework,entries,args,message", [
    ("torch", [], [], r"holds no complete checkpoint; train the cell"),
    ("torch", [".tmp-step_5"], [], r"holds no complete checkpoint \(only incomplete saves: \.tmp-step_5\)"),
    ("torch", ["step_5"], ["--step", "5"], r"step 5 in .* is incomplete \(the save was interrupted\); complete steps: none"),
    ("jax", ["7.orbax-checkpoint-tmp-1700000000"], [], r"only incomplete saves: 7\.orbax-checkpoint-tmp"),
    ("jax", [], ["--step", "3"], r"holds no complete checkpoint|step 3 .* does not exist"),
])
def test_export_refuses_a_cell_without_a_complete_checkpoint(tmp_path, scaleout, framework, entries, args, message):
    cell = _fake_cell(tmp_path, framework, entries)
    code, out, err = scaleout("export", str(cell), str(tmp_path / "out"), *args)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert re.search(message, err) and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.export-*"))


def test_export_refuses_a_non_empty_out_dir_and_a_path_that_is_not_a_cell(tmp_path, scaleout):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = scaleout("export", str(tmp_path), str(out))
    assert code == 2 and "exists and is not empty; give a new directory, or --force" in err
    assert (out / "notes.txt").read_text() == "mine"
    code, _, err = scaleout("export", str(tmp_path / "nothing"), str(tmp_path / "o2"))
    assert code == 2 and "does not exist" in err
    (tmp_path / "empty").mkdir()
    code, _, err = scaleout("export", str(tmp_path / "empty"), str(tmp_path / "o2"))
    assert code == 2 and "is neither a cell directory" in err
    code, _, err = scaleout("export", str(tmp_path / "empty"), str(tmp_path / "o2"), "--max-shard-size", "big")
    assert code == 2 and "--max-shard-size='big' is not a size" in err


def test_export_ships_only_the_tokenizer_the_sidecar_records(tmp_path):
    """Issue 24.7: a cell trained on byte-tokenised data got the BPE tokenizer.json that happened to sit next to
    its token file. The tokenizer is the one the token file's sidecar records (name and sha256), or none."""
    from launch.data import corpus, tokenizer
    docs = corpus.write(tmp_path / "c.jsonl", docs=40)
    d = tmp_path / "d"
    tokenizer.prepare([str(docs)], str(d / "bpe.bin"), "bpe", 300, 0.0)  # writes d/tokenizer.json
    tokenizer.prepare([str(docs)], str(d / "bytes.bin"), "bytes", val_fraction=0.0)  # byte tokens, in the same directory
    bpe = config.load(["data.source=file", f"data.path={d / 'bpe.bin'}", "model.vocab_size=320"])
    byte = config.load(["data.source=file", f"data.path={d / 'bytes.bin'}"])
    assert export.tokenizer_for(bpe) == d / "tokenizer.json"
    assert export.tokenizer_for(byte) is None  # the sidecar says bytes: no tokenizer.json, whatever sits beside it
    assert export.tokenizer_for(config.load()) is None
    raw = tmp_path / "raw.bin"
    (np.arange(1000) % 256).astype(np.uint16).tofile(raw)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert export.tokenizer_for(config.load(["data.source=file", f"data.path={raw}"])) is None  # no sidecar: nothing says
    # a tokenizer.json replaced since the tokens were made is not theirs
    other = tokenizer.train_bpe([str(docs)], 280)
    (d / "tokenizer.json").write_text(other.to_str())
    assert export.tokenizer_for(bpe) is None
    # one given by path (not rewritten by prepare-data) is recognised by its canonical form
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "tokenizer.json").write_text(json.dumps(json.loads(other.to_str()), indent=4))
    tokenizer.prepare([str(docs)], str(tmp_path / "e" / "t.bin"), str(tmp_path / "e" / "tokenizer.json"), val_fraction=0.0)
    cfg = config.load(["data.source=file", f"data.path={tmp_path / 'e' / 't.bin'}", "model.vocab_size=320"])
    assert export.tokenizer_for(cfg) == tmp_path / "e" / "tokenizer.json"


def test_export_refuses_an_out_dir_inside_a_checkpoint_directory(tmp_path, scaleout):
    """Issue 24.8: an export into a checkpoint directory was accepted; the resumed run's save then deleted it or
    renamed it `.corrupt`. Refused (one sentence, nothing written) inside the cell's own checkpoint directory, one
    of its steps, or any other run's (owner file, or steps)."""
    cell = _fake_cell(tmp_path, "torch", ["step_5"])
    ck = tmp_path / "ck" / "tiny" / "torch-d1"
    (ck / "step_5" / "COMMIT").write_text("5")
    other = tmp_path / "other"
    (other / "3" / "state").mkdir(parents=True)
    (other / "3" / "meta").mkdir()
    claimed = tmp_path / "claimed"
    claimed.mkdir()
    (claimed / "scaleout-run.json").write_text("{}")
    for out in (ck / "hf", ck, ck / "step_5" / "hf", other / "hf", claimed / "x" / "hf"):
        before = sorted(str(p) for p in tmp_path.rglob("*"))
        code, stdout, err = scaleout("export", str(cell), str(out), "--force")  # --force: not merely "not empty"
        assert code == 2 and stdout == "" and err.count("\n") == 1, (out, err)
        assert f"OUT_DIR={str(out)!r} is inside the checkpoint directory " in err, (out, err)
        assert sorted(str(p) for p in tmp_path.rglob("*")) == before


# --------------------------------------------------------------------------- the round trip (trains)

def _own_logits(framework, cell, step, inputs):
    """scaleout's own model on the checkpoint, read without launch.interop.export (an independent reader)."""
    cfg = config.load_resolved(cell / "config.yaml")
    m = cfg.model
    if framework == "jax":
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from jaxrun.checkpoint import load_params_numpy
        from jaxrun.mesh import path_name
        from jaxrun.model import Transformer as JaxTransformer

        stacked = load_params_numpy(cfg.checkpoint.dir, step)
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: JaxTransformer(m, nnx.Rngs(0))))
        state = jax.tree.map_with_path(lambda p, _: jnp.asarray(stacked[path_name(p)]), abstract)
        return np.asarray(nnx.merge(graphdef, state)(jnp.asarray(inputs), m))
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from torchrun_fsdp.model import Transformer

    dcp_to_torch_save(f"{cfg.checkpoint.dir}/step_{step}", cell.parent / "full.pt")
    full = torch.load(cell.parent / "full.pt", weights_only=False)["model"]
    model = Transformer(m)
    model.load_state_dict(full)
    with torch.no_grad():
        return model(torch.from_numpy(inputs.astype(np.int64))).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("framework,other", [("jax", "torch"), ("torch", "jax")])
def test_export_loads_in_transformers_and_starts_the_other_framework(tmp_path, scaleout, framework, other):
    transformers = _transformers()
    _, recs = run_cell(tmp_path, f"framework={framework}", "devices=2", "train.steps=4", "checkpoint.every=3",
                       "checkpoint.keep=2", "checkpoint.async=false", "run.name=exp")
    trained = losses(recs)
    assert sorted(trained) == [1, 2, 3, 4]
    cell = tmp_path / "runs" / "exp" / f"{framework}-d2"
    cfg = config.load_resolved(cell / "config.yaml")
    m = cfg.model
    batches = Batches(cfg.data, m.vocab_size, m.seq_len)

    out = tmp_path / "hf"
    code, stdout, err = scaleout("export", str(cell), str(out), "--step", "3", "--max-shard-size", "200KB")
    assert code == 0, err
    assert f"exported step 3 of {cfg.checkpoint.dir}" in stdout
    index = json.loads((out / hf.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) >= 2  # sharded files with an index
    model = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert model.dtype.__repr__() == "torch.float32"

    fixed = (np.arange(2 * m.seq_len).reshape(2, m.seq_len) * 37 + 5) % m.vocab_size
    diff = np.abs(_hf_logits(model, fixed).numpy() - _own_logits(framework, cell, 3, fixed)).max()
    assert diff < 1e-4, diff

    # the exporting run's step-4 record: the step-3 weights on data step 3
    inputs, targets = batches.split(3, 0, cfg.train.global_batch)
    assert _cross_entropy(_hf_logits(model, inputs), targets) == pytest.approx(trained[4], abs=1e-5)

    # a cell of the other framework starting from the export: its first loss is those weights on data step 0
    _, imported = run_cell(tmp_path, f"framework={other}", "devices=2", "train.steps=1", "checkpoint.async=false",
                           "run.name=imp", f"model.init=hf:{out}")
    inputs0, targets0 = batches.split(0, 0, cfg.train.global_batch)
    assert losses(imported)[1] == pytest.approx(_cross_entropy(_hf_logits(model, inputs0), targets0), abs=1e-5)

    # the latest step by default, in bf16, replacing the earlier export's files but not the user's
    (out / "README.md").write_text("notes")
    code, stdout, err = scaleout("export", str(cell), str(out), "--dtype", "bf16")
    assert code == 2 and "is not empty" in err
    code, stdout, err = scaleout("export", str(cell), str(out), "--dtype", "bf16", "--force")
    assert code == 0 and "exported step 4" in stdout, err
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert transformers.LlamaForCausalLM.from_pretrained(out).dtype.__repr__() == "torch.bfloat16"

    # a damaged checkpoint is one sentence, exit 2 (a copy: the checkpoint directory form of the source)
    copy = tmp_path / "copy" / cell.name
    shutil.copytree(cfg.checkpoint.dir, copy)
    if framework == "torch":
        (copy / "step_4" / "__0_0.distcp").write_bytes(b"not a checkpoint")
        step_dir = copy / "step_4"
    else:
        for f in (copy / "4" / "state").rglob("*"):
            if f.is_file() and f.parent.name == "d":
                f.write_bytes(b"garbage")
        step_dir = copy / "4"
    code, stdout, err = scaleout("export", str(step_dir), str(tmp_path / "bad"))
    assert code == 2 and "cannot read the checkpoint" in err and "damaged or partial" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "bad").exists()
    code, stdout, err = scaleout("export", str(copy), str(tmp_path / "ok"), "--step", "3")
    assert code == 0, err


@pytest.mark.slow
def test_export_of_a_moved_cell_reads_its_own_checkpoints_and_checks_their_run(tmp_path, scaleout):
    """Issue 24.6: after `cp -a runs/base moved/base; rm -rf runs/base` and a new run at the old place, export of
    moved/base/jax-d1 read the new run's weights (config.yaml's absolute checkpoint.dir); with the old place gone
    it said "holds no complete checkpoint". Now the moved cell's own checkpoints are read, and a checkpoint of
    another run where the cell's are expected is refused."""
    from conftest import run_cli

    from jaxrun.checkpoint import load_params_numpy
    common = ["run", f"run.dir={tmp_path}/runs", "run.name=base", "train.steps=2", "checkpoint.every=2",
              "checkpoint.async=false", f"jax.cache_dir={tmp_path}/jc"]
    assert run_cli(common, tmp_path).returncode == 0
    shutil.copytree(tmp_path / "runs" / "base", tmp_path / "moved" / "base", symlinks=True)
    shutil.rmtree(tmp_path / "runs" / "base")
    moved = tmp_path / "moved" / "base" / "jax-d1"
    own = load_params_numpy(moved / "checkpoints", 2)
    code, stdout, err = scaleout("export", str(moved), str(tmp_path / "gone"))  # the old place does not exist
    assert code == 0 and f"exported step 2 of {moved / 'checkpoints' / '2'}" in stdout, err
    p = run_cli([*common, "train.seed=7"], tmp_path)  # a new run, other weights, at the old place
    assert p.returncode == 0, p.stderr[-2000:]
    new = load_params_numpy(tmp_path / "runs" / "base" / "jax-d1" / "checkpoints", 2)
    assert not np.allclose(own["tok_embeddings"], new["tok_embeddings"])
    code, stdout, err = scaleout("export", str(moved), str(tmp_path / "out"))
    assert code == 0 and f"exported step 2 of {moved / 'checkpoints' / '2'}" in stdout, err
    cfg = config.load_resolved(moved / "config.yaml")
    got = hf.from_hf({k: hf.Reader(tmp_path / "out").get(k) for k in hf.Reader(tmp_path / "out").weight_map})
    np.testing.assert_array_equal(got["tok_embeddings"], own["tok_embeddings"])
    # a renamed copy too
    shutil.copytree(moved, tmp_path / "renamed", symlinks=True)
    code, stdout, err = scaleout("export", str(tmp_path / "renamed"), str(tmp_path / "out2"))
    assert code == 0 and f"of {tmp_path / 'renamed' / 'checkpoints' / '2'}" in stdout, err
    # the new run's checkpoints where the moved cell's should be: refused, naming both runs
    shutil.rmtree(moved / "checkpoints")
    shutil.copytree(tmp_path / "runs" / "base" / "jax-d1" / "checkpoints", moved / "checkpoints", symlinks=True)
    new_id = json.loads((tmp_path / "runs" / "base" / "run.json").read_text())["id"]
    code, stdout, err = scaleout("export", str(moved), str(tmp_path / "out3"))
    assert code == 2 and err.count("\n") == 1, err
    assert f"the checkpoint {moved / 'checkpoints' / '2'} belongs to run {new_id}, not to the cell's run {cfg.run.id}" in err
    assert not (tmp_path / "out3").exists()

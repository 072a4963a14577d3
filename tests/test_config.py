"""Config loading, groups, overrides, interpolation, and every refusal of bad input."""

import re

import pytest
import yaml

from launch import config

from conftest import ROOT, run_cli


def test_base_yaml_has_exactly_the_schema_keys_each_commented():
    text = (ROOT / "configs" / "base.yaml").read_text()
    data = yaml.safe_load(text)

    def leaves(node, prefix=""):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and key not in config.FREE_MAPPINGS:
                yield from leaves(v, key + ".")
            else:
                yield key

    assert set(leaves(data)) == set(config.schema_keys())
    for line in text.splitlines():
        if re.match(r"^\s*[a-z_]+:\s*[^\s#]", line):  # a key with a value
            assert "#" in line, f"base.yaml line has no comment: {line!r}"


def test_defaults_are_the_tiny_preset():
    cfg = config.load()
    tiny = config.load(["model=tiny"])
    assert cfg.model == tiny.model
    assert cfg.framework == "jax" and cfg.target == "local" and cfg.devices == 1


def test_group_selection_and_key_overrides():
    cfg = config.load(["model=300m", "model.n_layers=12", "train.steps=50", "sweep.devices=[1,2,4,8]"])
    assert cfg.model.name == "300m" and cfg.model.d_model == 1024 and cfg.model.n_layers == 12
    assert cfg.train.steps == 50 and cfg.sweep.devices == [1, 2, 4, 8]
    assert config.load(["target=slurm"]).slurm.gpus_per_node == 8


def test_later_layers_win_and_user_file(tmp_path):
    f = tmp_path / "my.yaml"
    f.write_text("train: {steps: 7, lr: 1.0e-4}\nmodel: {n_layers: 3}\n")
    cfg = config.load(["model=small", "train.steps=9"], [str(f)])
    assert cfg.model.n_layers == 3  # the file beats the group
    assert cfg.train.steps == 9  # the command line beats the file
    assert cfg.train.lr == pytest.approx(1e-4)


def test_interpolation():
    cfg = config.load(["model=small", "checkpoint.dir=/ck"])
    assert cfg.run.name == "small"
    assert cfg.jax.cache_dir == "/ck/.jax_cache"
    assert config.load(["run.name=${framework}-x", "framework=torch"]).run.name == "torch-x"


def test_checkpoint_async_key_is_spelled_async():
    assert config.load(["checkpoint.async=false"]).checkpoint.async_ is False
    assert config.to_dict(config.load())["checkpoint"]["async"] is True


def test_parallel_fill():
    assert config.mesh_shape(config.load(["devices=8"])) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert config.mesh_shape(config.load(["devices=8", "parallel.data=2"])) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert config.mesh_shape(config.load(["devices=4", "parallel.fsdp=1", "parallel.data=-1"])) == {"data": 4, "fsdp": 1, "tensor": 1}


BAD = [
    (["model.nlayers=3"], r"unknown key model\.nlayers.*did you mean model\.n_layers\?"),
    (["trian.steps=3"], r"unknown key trian.*did you mean train"),
    (["train.steps=abc"], r"train\.steps='abc' is not valid: it must be an integer"),
    (["train.lr=fast"], r"train\.lr='fast' is not valid: it must be a number"),
    (["model=999m"], r"model=999m is not a known model; available: 125m, 1b, 300m, small, tiny"),
    (["target=k8s"], r"target=k8s is not a known target; available: local, slurm, tpu"),
    (["framework=mxnet"], r"framework='mxnet' is not valid; choose one of: jax, torch"),
    (["devices=4", "parallel.fsdp=3"], r"parallel data\*fsdp\*tensor = 1\*3\*1 = 3 does not equal devices=4"),
    (["devices=4", "parallel.data=-1"], r"parallel\.data and parallel\.fsdp are both -1"),
    (["devices=4", "parallel.fsdp=2", "parallel.tensor=2", "model.n_heads=2", "model.d_model=64", "parallel.tensor=4", "parallel.fsdp=1"],
     r"model\.n_heads=2 is not divisible by parallel\.tensor=4"),
    (["model.d_model=60", "model.n_heads=8"], r"model\.d_model=60 is not divisible by model\.n_heads=8"),
    (["devices=4", "train.global_batch=6"], r"train\.global_batch=6 is not divisible by the data-parallel size 4"),
    (["devices=2", "train.grad_accum=3", "train.global_batch=8"], r"times train\.grad_accum=3; use a multiple of 6"),
    (["framework=torch", "devices=2", "parallel.tensor=2", "parallel.fsdp=1"], r"parallel\.tensor=2 is not supported with framework=torch"),
    (["train.steps=0"], r"train\.steps=0 is not valid: it must be a positive integer"),
    (["train.lr=-1"], r"train\.lr=-1\.0 is not valid: it must be a positive number"),
    (["devices=0"], r"devices=0 is not valid: it must be a positive integer"),
    (["data.source=file", "data.path=/nonexistent/tokens.bin"], r"data\.path='/nonexistent/tokens\.bin' does not exist"),
    (["train.stop_after=30", "train.steps=20"], r"train\.stop_after=30 is not valid"),
    (["framework=torch", "target=tpu"], r"PyTorch on TPU needs torch_xla"),
    (["steps"], r"override 'steps' is not valid: write key=value"),
    (["model.dtype=fp8"], r"model\.dtype='fp8' is not valid; choose one of: fp32, bf16"),
    (["model.d_model=64.5"], r"model\.d_model=64\.5 is not valid: it must be an integer"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_is_one_sentence_exit_2(overrides, message, scaleout, tmp_path):
    code, out, err = scaleout("plan", *overrides)
    assert code == 2
    assert "Traceback" not in err and out == ""
    assert re.search(message, err), err
    assert err.startswith("scaleout: error: ") and err.count("\n") == 1
    assert not any(tmp_path.iterdir()), "a refused config must not write anything"


def test_bad_user_file(tmp_path, scaleout):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  stepz: 3\n")
    code, _, err = scaleout("plan", "--config", str(f))
    assert code == 2 and "unknown key train.stepz in" in err and "did you mean train.steps?" in err
    code, _, err = scaleout("plan", "--config", str(tmp_path / "missing.yaml"))
    assert code == 2 and "does not exist" in err


def test_cli_subprocess_exit_code_and_no_traceback(tmp_path):
    p = run_cli(["plan", "model.n_layer=2"], cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "did you mean model.n_layers?" in p.stderr

"""Config loading, groups, overrides, interpolation, and every refusal of bad input."""

import dataclasses
import json
import os
import re
import typing

import pytest
from conftest import ROOT, run_cli
from omegaconf import OmegaConf

from launch import config
from launch.config import ConfigError, schema
from launch.config.schema import Config


def test_base_yaml_is_generated_from_the_schema():
    """configs/base.yaml is exactly what `python -m launch.config` writes; regenerate it after editing the schema."""
    text = (ROOT / "configs" / "base.yaml").read_text()
    assert text == schema.render_base_yaml(), "configs/base.yaml is stale: run `python -m launch.config`"
    assert schema.main(["--check"]) == 0


def test_base_yaml_values_are_the_schema_defaults_each_commented():
    text = (ROOT / "configs" / "base.yaml").read_text()
    data = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "base.yaml"), resolve=False)
    assert data == config.to_dict(Config())  # value for value, key order included
    assert list(data) == list(config.to_dict(Config()))

    def leaves(node, prefix=""):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and key not in config.FREE_MAPPINGS:
                yield from leaves(v, key + ".")
            else:
                yield key

    assert list(leaves(data)) == list(config.schema_keys())
    for line in text.splitlines():
        if re.match(r"^\s*[a-z_]+:", line):  # every key and section has its comment
            assert " # " in line, f"base.yaml line has no comment: {line!r}"


def test_every_key_has_help_and_every_number_a_range():
    for key, f, tp in schema.walk():
        if dataclasses.is_dataclass(tp):
            assert schema.section_comment(tp)
            continue
        assert f.metadata.get("help"), f"{key} has no help text"
        base = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        inner = typing.get_args(base[0]) if typing.get_origin(base[0]) is list else base
        if inner[0] in (int, float):
            assert {"ge", "gt", "le", "lt"} & set(f.metadata), f"{key} is a number without a range"


def test_yaml_values_round_trip():
    for v in [1e-5, 3e-3, 1e20, 0.5, -2.0, "on", "yes", "null", "1", "a: b", "x #y", "-x", "[a]", "${a.b}/c",
              "it's", "", [1, "a,b"], {"k": [1, 2]}, None, True, 7]:
        assert OmegaConf.to_container(OmegaConf.create("v: " + schema.yaml_value(v)))["v"] == v, v


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
    cfg = config.load(["model=small", "checkpoint.dir=/ck", "run.dir=/r"])
    assert cfg.run.name == "small"
    assert cfg.jax.cache_dir == "/r/.jax_cache"  # no longer under checkpoint.dir, which may be null
    assert cfg.checkpoint.dir == "/ck"
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
    (["data.source=file", "data.path=gs://b/t.bin"], r"data.path=gs://b/t.bin is a URL, but the trainers memory-map a local token file"),
    (["model.init=hf:gs://b/hf"], r"model.init=hf:gs://b/hf is a URL, but the trainers read a Hugging Face directory from local disk"),
    (["steps"], r"override 'steps' is not valid: write key=value"),
    (["model.dtype=fp8"], r"model\.dtype='fp8' is not valid; choose one of: fp32, bf16"),
    (["model.d_model=64.5"], r"model\.d_model=64\.5 is not valid: it must be an integer"),
    # ranges declared in the schema
    (["train.beta1=5"], r"train\.beta1=5\.0 is not valid: it must be >= 0 and < 1\.$"),
    (["train.beta2=1"], r"train\.beta2=1\.0 is not valid: it must be >= 0 and < 1\.$"),
    (["train.eps=-1"], r"train\.eps=-1\.0 is not valid: it must be a positive number\.$"),
    (["train.min_lr_ratio=2"], r"train\.min_lr_ratio=2\.0 is not valid: it must be >= 0 and <= 1\.$"),
    (["train.lr=nan"], r"train\.lr=nan is not valid: it must be a finite number\.$"),
    (["train.seed=-1"], r"train\.seed=-1 is not valid: it must be zero or positive\.$"),
    (["model.init_std=-3"], r"model\.init_std=-3\.0 is not valid: it must be a positive number\.$"),
    (["model.norm_eps=0"], r"model\.norm_eps=0\.0 is not valid: it must be a positive number"),
    (["slurm.cpus_per_task=0"], r"slurm\.cpus_per_task=0 is not valid: it must be a positive integer\.$"),
    (["slurm.mem_gb=-4"], r"slurm\.mem_gb=-4 is not valid: it must be a positive integer, or null\.$"),
    (["slurm.signal_delay_s=5"], r"slurm\.signal_delay_s=5 is not valid: it must be >= 10\.$"),
    (["slurm.signal_delay_s=3600", "slurm.time_min=60"], r"slurm\.signal_delay_s=3600 is not valid: it must be less than"),
    (["tpu.timeout_s=0"], r"tpu\.timeout_s=0\.0 is not valid: it must be a positive number"),
    (["checkpoint.keep=0"], r"checkpoint\.keep=0 is not valid: it must be a positive integer"),
    (["parallel.fsdp=-2"], r"parallel\.fsdp=-2 is not valid: it must be >= -1"),
    (["model.matmul_precision=fast"], r"model\.matmul_precision='fast' is not valid; choose one of: highest, tf32"),
    # names that reach paths and scripts
    (["run.name=../trav"], r"run\.name='\.\./trav' is not valid: it must be one path component"),
    (["run.name=/etc"], r"run\.name='/etc' is not valid: it must be one path component"),
    (["run.name=a\nb"], r"run\.name='a b' is not valid: it must be one path component"),  # YAML folds the newline
    (["run.name=.."], r"run\.name='\.\.' is not valid"),
    (["run.name=''"], r"run\.name='' is not valid"),
    (["run.name=", ], r"run\.name=null is not valid: it must be a string"),
    (["run.id=a/b"], r"run\.id='a/b' is not valid: it must be one path component"),
    (["run.dir=\"a\\nb\""], r"run\.dir='a\\nb' is not valid: it must not contain a newline or NUL character"),
    # one sentence instead of a traceback
    (["train.steps='5"], r"override \"train\.steps='5\" is not valid: the value after '=' is not valid YAML"),
    (["train.steps=[1,"], r"override 'train\.steps=\[1,' is not valid: the value after '=' is not valid YAML"),
    (["sweep.devices=[]"], r"sweep\.devices=\[\] is not valid: it must list at least one value, e\.g\. sweep\.devices=\[1,2,4\]"),
    (["sweep.frameworks=[]"], r"sweep\.frameworks=\[\] is not valid: it must list at least one value"),
    (["sweep.devices=[1,2,2]"], r"sweep\.devices=\[1, 2, 2\] is not valid: 2 appears more than once"),
    (["sweep.frameworks=[jax,torch,jax]"], r"sweep\.frameworks=.* is not valid: 'jax' appears more than once"),
    (["sweep.devices=[1,0]"], r"sweep\.devices contains 0: each entry must be a positive integer"),
    (["sweep.frameworks=[jax,mxnet]"], r"sweep\.frameworks contains 'mxnet'; choose from: jax, torch"),
    (["sweep.devices=[1,a]"], r"sweep\.devices\[1\]='a' is not valid: it must be an integer"),
    (["sweep.devices=3"], r"sweep\.devices=3 is not valid: it must be a list of an integer"),
    (["sweep.extra={model.remat: full}"], r"sweep\.extra\.model\.remat='full' is not valid: give a non-empty list"),
    (["sweep.extra={model.remta: [full]}"], r"sweep\.extra key model\.remta is not a config key; did you mean model\.remat\?"),
    # OmegaConf's own exceptions, translated
    (["train=5"], r"train=5 in the command line is not valid: train is a section; set its keys"),
    (["train.steps=null"], r"train\.steps=null is not valid: it must be an integer"),
    (["train.steps={a: 1}"], r"train\.steps=\{\"a\": 1\} is not valid: it must be an integer"),
    (["checkpoint.async=maybe"], r"checkpoint\.async='maybe' is not valid: it must be true or false"),
    (["checkpoint.async_=false"], r"unknown key checkpoint\.async_ in the command line; did you mean checkpoint\.async\?"),
    (["run.name=${nope}"], r"run\.name='\$\{nope\}' could not be resolved: Interpolation key 'nope' not found"),
    (["run.name=${oops"], r"override 'run\.name=\$\{oops' is not valid: .*write an interpolation as"),
    (["run.name=${model}"], r"run\.name='\$\{model\}' is not valid: it resolves to a mapping, which is not a string"),
    (["sweep.extra.model.remat=[a]"], r"sweep\.extra's keys are whole config keys; write sweep\.extra=\{model\.remat"),
    (["train.steps=1e3"], r"train\.steps=1000\.0 is not valid: it must be an integer"),
    (["sweep.devices=[1,true]"], r"sweep\.devices\[1\]=true is not valid: it must be an integer"),
    (["train.steps=${model.name}"], r"train\.steps='\$\{model\.name\}' is not valid: it resolves to 'tiny', which is not an integer"),
    # issue 24.15: a mapping where a list is expected and the reverse ("Cannot merge incompatible container types")
    (["profile.steps={a: 1}"], r"profile\.steps=\{\"a\": 1\} is not valid: it must be a list, e\.g\. profile\.steps=\[5,7\], not a mapping\.$"),
    (["sweep.devices={a: 1}"], r"sweep\.devices=\{\"a\": 1\} is not valid: it must be a list, e\.g\. sweep\.devices=\[1,2,4\], not a mapping"),
    (["slurm.setup={a: 1}"], r"slurm\.setup=\{\"a\": 1\} is not valid: it must be a list, e\.g\. slurm\.setup=\[a,b\], not a mapping"),
    (["slurm.additional=[1]"], r"slurm\.additional=\[1\] is not valid: it must be a mapping of keys to values, e\.g\. \{key: value\}, not a list"),
    (["sweep.extra=[1,2]"], r"sweep\.extra=\[1, 2\] is not valid: it must be a mapping of config keys to lists of values, e\.g\. "
                            r"sweep\.extra=\{model\.remat: \[none, full\]\}, not a list"),
    (["sweep.extra={model.remat: {a: 1}}"], r"sweep\.extra\.model\.remat=\{\"a\": 1\} is not valid: give a non-empty list of values"),
    # issue 24.11: an end-of-document token outside the vocabulary
    (["data.eos_id=256"], r"data\.eos_id=256 is not valid: it must be a token id below model\.vocab_size=256, or null"),
    # issue 24.10: a JAX weight sharding the mesh does not divide (plan printed it, the trainer hit IndivisibleError)
    (["devices=3", "train.global_batch=9"], r"model\.d_model=64 is not divisible by the fsdp axis size 3 \(devices=3, "
                                            r"parallel\.fsdp=-1\); JAX shards every weight's d_model dimension over fsdp"),
    (["devices=6", "parallel.tensor=2", "train.global_batch=6"], r"model\.d_model=64 is not divisible by the fsdp axis size 3"),
    # issue 24.25: the head-dimension and eval-batch rules, each with its own message
    (["model.d_model=36", "model.n_heads=4"], r"model\.d_model/n_heads=9 is odd; RoPE needs an even head dimension\.$"),
    (["devices=4", "train.eval_every=5", "train.eval_batch_size=6"],
     r"train\.eval_batch_size=6 is not divisible by the data-parallel size 4 \(data\*fsdp\); use a multiple of 4"),
    (["devices=4", "parallel.data=2", "train.eval_every=5", "train.eval_batch_size=6"],
     r"train\.eval_batch_size=6 is not divisible by the data-parallel size 4"),
    # contenders (issue 26)
    (["sweep.contenders=[jax,tf]"], r"sweep\.contenders contains 'tf', which is not a contender; choose from: jax, torch, torch-compile"),
    (["sweep.contenders=[jax,jax]"], r"sweep\.contenders=.* is not valid: 'jax' appears more than once"),
    (["contender=nope"], r"contender='nope' is not a contender; choose one of: jax, torch, torch-compile"),
    (["sweep.custom_contenders={torch: {framework: torch}}"], r"redefines the built-in contender 'torch'"),
    (["sweep.custom_contenders={x: {model.scan_layers: false}}"], r"sweep\.custom_contenders\.x\.framework=null is not valid: every contender names its framework"),
    (["sweep.custom_contenders={x: {framework: jax, model.scan_layer: false}}"], r"sweep\.custom_contenders\.x: model\.scan_layer is not a config key; did you mean model\.scan_layers\?"),
    (["sweep.custom_contenders={a/b: {framework: jax}}"], r"the contender name 'a/b' is not valid"),
    (["sweep.custom_contenders=[jax]"], r"sweep\.custom_contenders=\[\"jax\"\] is not valid: it must be a mapping of contender "
                                        r"names to their settings, e\.g\. sweep\.custom_contenders=\{jax-unrolled: .*\}, not a list"),
    (["sweep.extra={contender: [jax, torch]}"], r"sweep\.extra key contender is not valid: it says which run a cell belongs to"),
    (["sweep.custom_contenders={x: 3}"], r"sweep\.custom_contenders\.x=3 is not valid: it must be a mapping"),
    # dynamic shapes (issue 26)
    (["data.seq_lens=[16,64]"], r"data\.seq_lens contains 64, longer than model\.seq_len=32"),
    (["data.seq_lens=[8,32]", "data.pad_to=[16]"], r"data\.pad_to=\[16\] has no bucket for length 32 .*data\.pad_to=\[16, 32\]"),
    (["data.pad_to=[48]"], r"data\.pad_to contains 48, longer than model\.seq_len=32"),
    (["data.seq_lens=[0]"], r"data\.seq_lens contains 0: each entry must be a positive integer"),
    (["data.seq_lens=[16]", "model.attention=document"], r"data\.seq_lens=\[16\] is not supported with model\.attention=document"),
    (["data.seq_len_dist=normal"], r"data\.seq_len_dist='normal' is not valid; choose one of: choice, uniform"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_is_one_sentence_exit_2(overrides, message, scaleout, tmp_path):
    code, out, err = scaleout("plan", *overrides)
    assert code == 2
    assert "Traceback" not in err and out == ""
    assert re.search(message, err), err
    assert err.startswith("scaleout: error: ") and err.count("\n") == 1
    assert not any(tmp_path.iterdir()), "a refused config must not write anything"


def test_divisibility_is_per_framework_and_matches_what_jax_can_shard(tmp_path):
    """Issue 24.10: PyTorch's FSDP2 pads uneven shards, so framework=torch takes what JAX refuses; and every
    JAX config the rules accept lowers (a real TrainStep over that many CPU devices), every one they refuse
    on a divisibility would not have."""
    import subprocess
    import sys
    ok = config.load(["framework=torch", "devices=3", "train.global_batch=9"])
    assert config.mesh_shape(ok) == {"data": 1, "fsdp": 3, "tensor": 1}
    config.load(["devices=3", "train.global_batch=9", "parallel.data=3"])  # data-parallel JAX: nothing to divide
    probe = """
import json, sys
from launch import config
from launch.config import ConfigError, loader
from jaxrun import mesh
from jaxrun.train import TrainStep
out = []
for ov in json.loads(sys.argv[1]):
    try:
        config.load(ov)
        refused = False
    except ConfigError:
        refused = True
    rules, loader.validate = loader.validate, lambda cfg: None  # past the rules: what the trainer would have run
    cfg = config.load(ov)
    loader.validate = rules
    try:
        TrainStep(cfg, mesh.make_mesh(cfg)).lower()
        lowered = True
    except Exception as e:
        lowered = type(e).__name__
    out.append([ov, refused, lowered])
print(json.dumps(out))
"""
    cases = [["devices=3", "train.global_batch=9"], ["devices=3", "train.global_batch=9", "model.d_model=96"],
             ["devices=6", "parallel.tensor=2", "train.global_batch=6"],
             ["devices=6", "parallel.tensor=2", "train.global_batch=6", "model.d_model=96"]]
    p = subprocess.run([sys.executable, "-c", probe, json.dumps(cases)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=6", "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stderr[-3000:]
    got = {" ".join(ov): (refused, lowered) for ov, refused, lowered in json.loads(p.stdout.splitlines()[-1])}
    assert got == {"devices=3 train.global_batch=9": (True, "IndivisibleError"),
                   "devices=3 train.global_batch=9 model.d_model=96": (False, True),
                   "devices=6 parallel.tensor=2 train.global_batch=6": (True, "IndivisibleError"),
                   "devices=6 parallel.tensor=2 train.global_batch=6 model.d_model=96": (False, True)}, got


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


def test_bad_value_in_a_file_names_the_file(tmp_path, scaleout):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  steps: abc\n")
    code, _, err = scaleout("plan", "--config", str(f))
    assert code == 2 and f"train.steps='abc' in {f} is not valid: it must be an integer." in err
    f.write_text("slurm: 3\n")
    code, _, err = scaleout("plan", "--config", str(f))
    assert code == 2 and "slurm=3 in" in err and "is a section" in err


def test_new_keys_and_their_defaults():
    cfg = config.load()
    assert cfg.run.id is None and cfg.checkpoint.dir is None
    assert cfg.jax.cache_dir == "runs/.jax_cache" and cfg.jax.xla_flags is None
    assert cfg.model.matmul_precision == "highest"
    assert (cfg.slurm.wckey, cfg.slurm.setup_script, cfg.slurm.signal_delay_s) == (None, None, 90)
    cfg = config.load(["checkpoint.dir=gs://b/ck", "slurm.wckey=''", "slurm.setup_script=/opt/env.sh",
                       "jax.xla_flags=--xla_gpu_enable_latency_hiding_scheduler=true", "model.matmul_precision=tf32"])
    assert cfg.checkpoint.dir == "gs://b/ck" and cfg.slurm.wckey == "" and cfg.slurm.setup_script == "/opt/env.sh"
    assert cfg.jax.xla_flags.startswith("--xla_gpu") and cfg.model.matmul_precision == "tf32"


def test_math_hash_ignores_run_identity_but_not_precision():
    base = config.math_hash(config.load())
    assert config.math_hash(config.load(["run.id=20240101-abc", "run.name=other", "checkpoint.dir=/x"])) == base
    assert config.math_hash(config.load(["model.matmul_precision=tf32"])) != base


def test_names_use_full_matches():
    cfg = config.load()
    for bad in ("abc\n", "a/b", "a b", ".", "..", "", "x\0"):
        with pytest.raises(ConfigError, match=r"run\.name="):
            config.replace(cfg, {"run.name": bad})
    for good in ("my-run", "a.b_c-1", "..x", "tiny"):
        assert config.replace(cfg, {"run.name": good}).run.name == good
    with pytest.raises(ConfigError, match=r"checkpoint\.dir='/a\\nb' is not valid: it must not contain a newline"):
        config.replace(cfg, {"checkpoint.dir": "/a\nb"})
    with pytest.raises(ConfigError, match=r"run\.dir='r\\x00' is not valid"):
        config.replace(cfg, {"run.dir": "r\0"})


def test_replace_validates_and_knows_the_yaml_spelling():
    cfg = config.load()
    assert config.replace(cfg, {"checkpoint.async": False}).checkpoint.async_ is False
    assert config.replace(cfg, {"train.lr": 1}).train.lr == 1.0
    with pytest.raises(ConfigError, match=r"unknown key model\.nlayers; did you mean model\.n_layers\?"):
        config.replace(cfg, {"model.nlayers": 3})
    with pytest.raises(ConfigError, match=r"train\.beta1=1\.5 is not valid: it must be >= 0 and < 1\."):
        config.replace(cfg, {"train.beta1": 1.5})
    with pytest.raises(ConfigError, match=r"train\.steps='x' is not valid: it must be an integer\."):
        config.replace(cfg, {"train.steps": "x"})


def test_save_and_load_resolved_round_trip(tmp_path):
    cfg = config.load(["model=small", "checkpoint.async=false", "sweep.extra={model.remat: [none, full]}",
                       "slurm.additional={reservation: r1}", "run.id=abc123"])
    config.save(cfg, tmp_path / "c" / "config.yaml")
    assert config.load_resolved(tmp_path / "c" / "config.yaml") == cfg
    text = (tmp_path / "c" / "config.yaml").read_text()
    (tmp_path / "c" / "config.yaml").write_text(text.replace("  name: small\n  id:", "  name: ../x\n  id:"))
    with pytest.raises(ConfigError, match=r"run\.name='\.\./x' is not valid"):
        config.load_resolved(tmp_path / "c" / "config.yaml")


def test_free_mappings_take_any_keys():
    cfg = config.load(["slurm.additional={reservation: r1, gres: 'gpu:2'}", "slurm.additional.nice=5"])
    assert cfg.slurm.additional == {"reservation": "r1", "gres": "gpu:2", "nice": 5}
    assert config.load(["sweep.extra={model.remat: [none, full]}"]).sweep.extra == {"model.remat": ["none", "full"]}


def test_public_api_is_stable():
    for name in ("ConfigError", "Config", "load", "load_resolved", "replace", "save", "to_dict", "get", "math_hash",
                 "mesh_shape", "resolve_parallel", "schema_keys", "CHOICES", "FRAMEWORKS", "TARGETS"):
        assert hasattr(config, name), name
    assert config.CHOICES["framework"] == config.FRAMEWORKS and config.CHOICES["target"] == config.TARGETS
    assert config.CHOICES["model.matmul_precision"] == ("highest", "tf32")
    assert set(config.FREE_MAPPINGS) == {"slurm.additional", "sweep.extra", "sweep.custom_contenders"}

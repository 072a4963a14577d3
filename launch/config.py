"""Load, merge and validate a scaleout config, once, before anything runs.

Layers, later wins: `configs/base.yaml` < group files picked on the command line
(`model=300m`, `target=slurm`, `sweep=scaling`) < `--config FILE`s < dotted overrides
(`train.steps=50`). OmegaConf merges and interpolates; the typed schema in `launch.schema`
checks every key and type; the rules below check what types cannot. Every refusal is a
`ConfigError` whose message is one sentence naming the key, the value and what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import typing
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launch.schema import Config

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
GROUPS = ("model", "target", "sweep")
FRAMEWORKS = ("jax", "torch")
TARGETS = ("local", "slurm", "tpu")
CHOICES: Dict[str, Tuple[str, ...]] = {
    "framework": FRAMEWORKS,
    "target": TARGETS,
    "model.dtype": ("fp32", "bf16"),
    "model.remat": ("none", "full", "dots"),
    "model.init": ("numpy", "native"),
    "data.source": ("synthetic", "file"),
    "data.dtype": ("uint16", "uint32"),
    "tpu.mode": ("queued", "existing"),
    "tpu.generation": ("v4", "v5e", "v5p", "v6e"),
    "tpu.capacity": ("on-demand", "spot", "reserved", "best-effort"),
    "sweep.scaling": ("weak", "strong"),
}
# Keys whose values are free-form mappings (their own keys are not checked).
FREE_MAPPINGS = ("slurm.additional", "sweep.extra")
# Keys that do not change the math of a run: a checkpoint may be resumed across them.
NOT_MATH = ("train.stop_after", "train.log_every", "train.warmup_exclude")


class ConfigError(ValueError):
    """A user mistake in the config: one sentence, printed without a traceback, exit code 2."""


# --------------------------------------------------------------------------- schema walking

def _yaml_name(f: dataclasses.Field) -> str:
    return f.metadata.get("yaml", f.name)


def schema_keys(cls: type = Config, prefix: str = "") -> Dict[str, Any]:
    """Every leaf key of the schema (dotted, YAML spelling) mapped to its type annotation."""
    out: Dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + _yaml_name(f)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(schema_keys(tp, key + "."))
        else:
            out[key] = tp
    return out


def _sections(cls: type = Config, prefix: str = "") -> Dict[str, type]:
    out: Dict[str, type] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out[prefix + _yaml_name(f)] = tp
            out.update(_sections(tp, prefix + _yaml_name(f) + "."))
    return out


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])} or null"
    if origin in (list, List):
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin in (dict, Dict):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """Return `value` coerced to `tp` (int -> float only), or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        if value is None:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return _check_type(key, value, inner)
    ok = False
    if origin in (list, List):
        if isinstance(value, list):
            inner = typing.get_args(tp)[0]
            return [_check_type(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    elif origin in (dict, Dict):
        ok = isinstance(value, dict)
    elif tp is Any:
        ok = True
    elif tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
    elif tp is str:
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(f"{key}={_show(value)} is not valid: it must be {_type_name(tp)}.")
    return value


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    return json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)


def _did_you_mean(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:  # try the last component alone (`model.nlayers` -> `model.n_layers`)
        tail = key.rsplit(".", 1)[-1]
        tails = {k.rsplit(".", 1)[-1]: k for k in known}
        close = [tails[t] for t in difflib.get_close_matches(tail, list(tails), n=1, cutoff=0.6)]
    return f"; did you mean {close[0]}?" if close else f"; valid top-level keys are: {', '.join(sorted({k.split('.')[0] for k in known}))}."


def _check_keys(node: Any, prefix: str, where: str) -> None:
    """Refuse keys that are not in the schema (free-form mappings excepted)."""
    leaves = schema_keys()
    sections = _sections()
    if not isinstance(node, dict):
        return
    for k, v in node.items():
        key = f"{prefix}{k}"
        if key in FREE_MAPPINGS:
            continue
        if key in sections:
            if not isinstance(v, dict):
                raise ConfigError(f"{key}={_show(v)} in {where} is not valid: {key} is a section; set its keys, e.g. {key}.{next(k2 for k2 in leaves if k2.startswith(key + '.')).split('.')[-1]}=...")
            _check_keys(v, key + ".", where)
        elif key not in leaves:
            known = list(leaves) + list(sections)
            raise ConfigError(f"unknown key {key} in {where}" + _did_you_mean(key, known))


def _build(cls: type, data: Dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        name = _yaml_name(f)
        key = prefix + name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data.get(name) or {}, key + ".")
        elif name in data:
            kwargs[f.name] = _check_type(key, data[name], tp)
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """The config as plain data with YAML key spelling (`checkpoint.async`)."""
    if dataclasses.is_dataclass(obj):
        return {_yaml_name(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def get(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, "async_" if part == "async" else part)
    return node


# --------------------------------------------------------------------------- loading

def available(group: str) -> List[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def parse_overrides(overrides: Sequence[str]) -> Tuple[List[Tuple[str, str]], List[str]]:
    """Split command-line words into group picks (`model=300m`) and dotted overrides."""
    groups: List[Tuple[str, str]] = []
    dotted: List[str] = []
    for word in overrides:
        if "=" not in word:
            raise ConfigError(f"override {word!r} is not valid: write key=value, e.g. train.steps=50 or model=300m.")
        key, value = word.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {word!r} is not valid: the key before '=' is empty.")
        if key in GROUPS and not value.startswith("{"):
            groups.append((key, value))
        else:
            dotted.append(f"{key}={value}")
    return groups, dotted


def _load_yaml(path: Path, what: str) -> Dict[str, Any]:
    try:
        node = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(path)!r} does not exist.") from None
    except Exception as e:  # yaml syntax errors
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    container = OmegaConf.to_container(node, resolve=False)
    if container is None:
        return {}
    if not isinstance(container, dict):
        raise ConfigError(f"{what} {str(path)!r} must hold a mapping of keys, not {type(container).__name__}.")
    return container


def load(overrides: Sequence[str] = (), config_files: Sequence[str] = ()) -> Config:
    """Merge base + groups + files + overrides, resolve interpolations, validate, return the typed config."""
    groups, dotted = parse_overrides(overrides)
    layers: List[Tuple[Dict[str, Any], str]] = [(_load_yaml(CONFIG_DIR / "base.yaml", "base config"), "configs/base.yaml")]
    for group, value in groups:
        choices = available(group)
        if value not in choices:
            raise ConfigError(f"{group}={value} is not a known {group}; available: {', '.join(choices)}.")
        layers.append((_load_yaml(CONFIG_DIR / group / f"{value}.yaml", f"{group} group file"), f"configs/{group}/{value}.yaml"))
    for path in config_files:
        layers.append((_load_yaml(Path(path), "config file"), path))
    try:
        dot = OmegaConf.to_container(OmegaConf.from_dotlist(list(dotted)), resolve=False) if dotted else {}
    except OmegaConfBaseException as e:
        raise ConfigError(f"could not parse overrides {' '.join(dotted)}: {str(e).splitlines()[0]}") from None
    layers.append((dot, "the command line"))

    for data, where in layers:
        _check_keys(data, "", where)
    try:
        merged = OmegaConf.merge(*[OmegaConf.create(d) for d, _ in layers])
        resolved = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or "?"
        raise ConfigError(f"{key} could not be resolved: {str(e).splitlines()[0]}") from None
    cfg = _build(Config, resolved)
    validate(cfg)
    return cfg


# --------------------------------------------------------------------------- rules

def resolve_parallel(devices: int, data: int, fsdp: int, tensor: int) -> Tuple[int, int, int]:
    """Fill the one -1 axis so that data * fsdp * tensor == devices, or raise ConfigError."""
    sizes = {"parallel.data": data, "parallel.fsdp": fsdp, "parallel.tensor": tensor}
    fill = [k for k, v in sizes.items() if v == -1]
    for k, v in sizes.items():
        if v == 0 or v < -1:
            raise ConfigError(f"{k}={v} is not valid: axis sizes are positive integers, or -1 for one axis to fill the rest.")
    if len(fill) > 1:
        raise ConfigError(f"{' and '.join(fill)} are both -1: at most one parallel axis may be -1 (it fills what the others leave of devices={devices}).")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if fill:
        if devices % fixed:
            raise ConfigError(f"{fill[0]}=-1 cannot fill devices={devices}: the other axes multiply to {fixed}, which does not divide {devices}.")
        sizes[fill[0]] = devices // fixed
    elif fixed != devices:
        raise ConfigError(f"parallel data*fsdp*tensor = {data}*{fsdp}*{tensor} = {fixed} does not equal devices={devices}; make the product {devices} or set one axis to -1.")
    return sizes["parallel.data"], sizes["parallel.fsdp"], sizes["parallel.tensor"]


def validate(cfg: Config) -> None:
    for key, choices in CHOICES.items():
        value = get(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={_show(value)} is not valid; choose one of: {', '.join(choices)}.")
    for key in ("devices", "train.steps", "train.global_batch", "train.grad_accum", "model.d_model",
                "model.n_layers", "model.n_heads", "model.d_ff", "model.vocab_size", "model.seq_len",
                "local.processes", "checkpoint.keep", "train.log_every", "slurm.devices_per_node",
                "slurm.time_min", "report.horizon_steps"):
        if get(cfg, key) <= 0:
            raise ConfigError(f"{key}={get(cfg, key)} is not valid: it must be a positive integer.")
    for key in ("train.lr", "tpu.poll_interval_s", "tpu.timeout_s"):
        if not get(cfg, key) > 0:
            raise ConfigError(f"{key}={get(cfg, key)} is not valid: it must be a positive number.")
    for key in ("train.warmup_steps", "train.weight_decay", "train.clip_norm", "checkpoint.every",
                "train.warmup_exclude", "local.threads", "slurm.max_requeues", "slurm.gpus_per_node"):
        if get(cfg, key) < 0:
            raise ConfigError(f"{key}={get(cfg, key)} is not valid: it must be zero or positive.")
    if not 0 <= cfg.train.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio={cfg.train.min_lr_ratio} is not valid: it must be between 0 and 1.")
    t = cfg.train
    if t.stop_after is not None and not 0 < t.stop_after <= t.steps:
        raise ConfigError(f"train.stop_after={t.stop_after} is not valid: it must be between 1 and train.steps={t.steps}, or null.")
    m = cfg.model
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; pick n_heads that divides d_model.")
    if (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"model.d_model/n_heads={m.d_model // m.n_heads} is odd; RoPE needs an even head dimension.")
    data, fsdp, tensor = resolve_parallel(cfg.devices, cfg.parallel.data, cfg.parallel.fsdp, cfg.parallel.tensor)
    if cfg.framework == "torch" and tensor > 1:
        raise ConfigError(f"parallel.tensor={tensor} is not supported with framework=torch: tensor parallelism is JAX-only; use parallel.fsdp or parallel.data.")
    if cfg.framework == "torch" and cfg.target == "tpu":
        raise ConfigError("framework=torch with target=tpu is not supported: PyTorch on TPU needs torch_xla, which scaleout does not drive; use framework=jax on TPU.")
    if m.n_heads % tensor:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by parallel.tensor={tensor}; each tensor shard needs whole heads.")
    if m.d_ff % tensor or m.vocab_size % tensor:
        raise ConfigError(f"parallel.tensor={tensor} must divide model.d_ff={m.d_ff} and model.vocab_size={m.vocab_size}.")
    dp = data * fsdp
    if t.global_batch % (dp * t.grad_accum):
        raise ConfigError(f"train.global_batch={t.global_batch} is not divisible by the data-parallel size {dp} (data*fsdp) times train.grad_accum={t.grad_accum}; use a multiple of {dp * t.grad_accum}.")
    if cfg.local.processes > 1 and cfg.devices % cfg.local.processes:
        raise ConfigError(f"local.processes={cfg.local.processes} does not divide devices={cfg.devices}; each process must own the same number of devices.")
    if cfg.data.source == "file":
        if not cfg.data.path:
            raise ConfigError("data.path is not set: data.source=file needs a token file (make one with `scaleout prepare-data TEXT OUT.bin`).")
        if "://" not in cfg.data.path and not Path(cfg.data.path).is_file():
            raise ConfigError(f"data.path={cfg.data.path!r} does not exist; give a token file written by `scaleout prepare-data`.")
    for key in ("sweep.devices",):
        for v in get(cfg, key):
            if v <= 0:
                raise ConfigError(f"{key} contains {v}: device counts must be positive integers.")
    for fw in cfg.sweep.frameworks:
        if fw not in FRAMEWORKS:
            raise ConfigError(f"sweep.frameworks contains {fw!r}; choose from: {', '.join(FRAMEWORKS)}.")
    known = schema_keys()
    for key, values in cfg.sweep.extra.items():
        if key not in known:
            raise ConfigError(f"sweep.extra key {key} is not a config key" + _did_you_mean(key, list(known)))
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.extra.{key}={_show(values)} is not valid: give a non-empty list of values.")


# --------------------------------------------------------------------------- helpers for other modules

def mesh_shape(cfg: Config) -> Dict[str, int]:
    data, fsdp, tensor = resolve_parallel(cfg.devices, cfg.parallel.data, cfg.parallel.fsdp, cfg.parallel.tensor)
    return {"data": data, "fsdp": fsdp, "tensor": tensor}


def math_hash(cfg: Config) -> str:
    """Hash of everything that changes the numbers a run computes (not devices, not paths)."""
    d = {"model": to_dict(cfg.model), "train": to_dict(cfg.train), "data": to_dict(cfg.data)}
    d["model"].pop("name", None)
    for key in NOT_MATH:
        section, name = key.split(".")
        d[section].pop(name, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def save(cfg: Config, path: Path) -> None:
    """Write the resolved config atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))))
    tmp.replace(path)


def load_resolved(path: str | Path) -> Config:
    """Read a cell's resolved config.yaml (already validated when it was written)."""
    data = _load_yaml(Path(path), "cell config")
    _check_keys(data, "", str(path))
    cfg = _build(Config, OmegaConf.to_container(OmegaConf.create(data), resolve=True))
    validate(cfg)
    return cfg


def replace(cfg: Config, updates: Dict[str, Any]) -> Config:
    """A copy of `cfg` with dotted keys set, validated again."""
    data = to_dict(cfg)
    for key, value in updates.items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        if leaf not in node:
            raise ConfigError(f"unknown key {key}" + _did_you_mean(key, list(schema_keys())))
        node[leaf] = value
    new = _build(Config, data)
    validate(new)
    return new

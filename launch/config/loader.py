"""Load, merge and validate a scaleout config, once, before anything runs.

Layers, later wins: the defaults of the typed schema in `launch.config.schema` (which
`configs/base.yaml` shows, generated) < group files picked on the command line (`model=300m`,
`target=slurm`, `sweep=scaling`) < `--config FILE`s < dotted overrides (`train.steps=50`).
`OmegaConf.structured` merges each layer into the schema, which refuses unknown keys and values
of the wrong type; the rules the schema declares next to each key (choices, ranges) and the rules
below that need more than one key are checked after interpolation. Every refusal is a
`ConfigError` whose message is one sentence naming the key, the value and what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
import typing
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml
from omegaconf import Node, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    GrammarParseError,
    InterpolationResolutionError,
    InterpolationValidationError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from launch.common.files import atomic_write
import launch.config.contenders as contenders
from launch.config.schema import FRAMEWORKS, TARGETS, Config, walk, yaml_name, yaml_value

__all__ = ["ConfigError", "load", "load_resolved", "replace", "save", "to_dict", "get", "math_hash",
           "mesh_shape", "resolve_parallel", "schema_keys", "validate", "CHOICES", "FRAMEWORKS", "TARGETS",
           "OmegaConf"]

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
GROUPS = ("model", "target", "sweep")
# Every leaf key (dotted, YAML spelling) -> its dataclass field and type, in schema order.
_LEAVES: Dict[str, Tuple[dataclasses.Field, Any]] = {
    k: (f, tp) for k, f, tp in walk() if not dataclasses.is_dataclass(tp)}
_SECTIONS: Dict[str, type] = {k: tp for k, _, tp in walk() if dataclasses.is_dataclass(tp)}
# Keys whose YAML spelling is not their Python name: {"checkpoint.async_": "checkpoint.async"}.
_RENAMED: Dict[str, str] = {k.rsplit(".", 1)[0] + "." + f.name if "." in k else f.name: k
                            for k, (f, _) in _LEAVES.items() if yaml_name(f) != f.name}
CHOICES: Dict[str, Tuple[str, ...]] = {
    k: f.metadata["choices"] for k, (f, tp) in _LEAVES.items()
    if "choices" in f.metadata and typing.get_origin(tp) is not list}
# Keys whose values are free-form mappings (their own keys are not checked).
FREE_MAPPINGS = tuple(k for k, (_, tp) in _LEAVES.items() if typing.get_origin(tp) is dict)
# Keys that do not change the math of a run: a checkpoint may be resumed across them.
NOT_MATH = ("train.stop_after", "train.stop_every", "train.log_every", "train.warmup_exclude", "train.eval_every",
            "train.eval_batches", "train.eval_batch_size", "model.attention_impl", "model.gpu_memory_fraction")
# One path component of safe characters (run.name, run.id); checked with re.fullmatch.
SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+")
# Keys sweep.extra may not vary: they say which run a cell belongs to or where it lives (issue 24.5).
PLACE_KEYS = ("framework", "devices", "target", "checkpoint.dir", "contender")
PLACE_SECTIONS = ("run", "sweep")


def defines_place(key: str) -> bool:
    """Whether `key` says which run a cell belongs to or where it lives: neither sweep.extra nor a contender's
    settings may set it (PLACE_KEYS, and every key of PLACE_SECTIONS)."""
    return key in PLACE_KEYS or key.split(".")[0] in PLACE_SECTIONS


class ConfigError(ValueError):
    """A user mistake in the config: one sentence, printed without a traceback, exit code 2."""


# --------------------------------------------------------------------------- schema helpers

def schema_keys(cls: type = Config, prefix: str = "") -> Dict[str, Any]:
    """Every leaf key of the schema (dotted, YAML spelling) mapped to its type annotation."""
    return {k: tp for k, _, tp in walk(cls, prefix) if not dataclasses.is_dataclass(tp)}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])} or null"
    if origin in (list, List):
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin in (dict, Dict):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, "a value")


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)


def _did_you_mean(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:  # try the last component alone (`model.nlayers` -> `model.n_layers`)
        tail = key.rsplit(".", 1)[-1]
        tails = {k.rsplit(".", 1)[-1]: k for k in known}
        close = [tails[t] for t in difflib.get_close_matches(tail, list(tails), n=1, cutoff=0.6)]
    return f"; did you mean {close[0]}?" if close else f"; valid top-level keys are: {', '.join(sorted({k.split('.')[0] for k in known}))}."


def _unknown(key: str, where: Optional[str]) -> ConfigError:
    return ConfigError(f"unknown key {key}{f' in {where}' if where else ''}" + _did_you_mean(key, [*_LEAVES, *_SECTIONS]))


def to_dict(obj: Any) -> Any:
    """The config as plain data with YAML key spelling (`checkpoint.async`)."""
    if dataclasses.is_dataclass(obj):
        return {yaml_name(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
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


def _parse_dotted(dotted: Sequence[str]) -> Dict[str, Any]:
    """The dotted overrides as one nested mapping; a value that is not YAML is one sentence."""
    for word in dotted:
        try:
            OmegaConf.from_dotlist([word])
        except yaml.YAMLError as e:
            problem = ", ".join(p for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p)
            raise ConfigError(f"override {word!r} is not valid: the value after '=' is not valid YAML "
                              f"({problem or str(e).splitlines()[0]}); check its quotes and brackets.") from None
        except GrammarParseError as e:
            raise ConfigError(f"override {word!r} is not valid: {str(e).splitlines()[0]}; write an interpolation "
                              "as ${section.key}, or escape a literal '$' as \\$.") from None
        except OmegaConfBaseException as e:
            raise ConfigError(f"override {word!r} is not valid: {str(e).splitlines()[0]}") from None
    return OmegaConf.to_container(OmegaConf.from_dotlist(list(dotted)), resolve=False) if dotted else {}


def _load_yaml(path: Path, what: str) -> Dict[str, Any]:
    try:
        node = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(path)!r} does not exist.") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {str(path)!r} is a directory; give a YAML file.") from None
    except Exception as e:  # yaml syntax errors
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    container = OmegaConf.to_container(node, resolve=False)
    if container is None:
        return {}
    if not isinstance(container, dict):
        raise ConfigError(f"{what} {str(path)!r} must hold a mapping of keys, not {type(container).__name__}.")
    return container


def _container(tp: Any) -> Optional[type]:
    """list or dict when a key's type is a list or a mapping (optional or not), else None."""
    if typing.get_origin(tp) is typing.Union:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    origin = typing.get_origin(tp)
    return origin if origin in (list, dict) else None


def _list_example(key: str, tp: Any) -> str:
    default = get(Config(), key)
    if default:
        return yaml_value(to_dict(default)).replace(" ", "")
    inner = typing.get_args(tp)[0] if typing.get_origin(tp) is list else str
    return "[5,7]" if inner is int else "[a,b]"


def _prepare(node: Any, where: str, prefix: str = "") -> Any:
    """Check that sections are mappings, that list keys get no mapping and mapping keys no list (OmegaConf
    would say only "Cannot merge incompatible container types"), and give renamed keys their Python
    names (`async` -> `async_`)."""
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if key in _RENAMED:  # the Python spelling (`checkpoint.async_`) is not a YAML key
            raise _unknown(key, where)
        if key in _SECTIONS and not isinstance(v, dict):
            example = next(k2 for k2 in _LEAVES if k2.startswith(key + ".")).split(".")[-1]
            raise ConfigError(f"{key}={_show(v)} in {where} is not valid: {key} is a section; set its keys, e.g. {key}.{example}=...")
        field_, tp = _LEAVES.get(key, (None, None))
        want = _container(tp)
        if want is list and isinstance(v, dict) or want is dict and isinstance(v, list):
            in_where = f" in {where}" if where not in ("the command line", "the update") else ""
            shape = f"a list, e.g. {key}={_list_example(key, tp)}" if want is list else "a mapping of keys to values, e.g. {key: value}"
            if key == "sweep.extra":
                shape = "a mapping of config keys to lists of values, e.g. sweep.extra={model.remat: [none, full]}"
            if key == "sweep.custom_contenders":
                shape = ("a mapping of contender names to their settings, e.g. "
                         "sweep.custom_contenders={jax-unrolled: {framework: jax, model.scan_layers: false}}")
            raise ConfigError(f"{key}={_show(v)}{in_where} is not valid: it must be {shape}, not a "
                              f"{'mapping' if isinstance(v, dict) else 'list'}.")
        name = field_.name if field_ is not None else k
        out[name] = _prepare(v, where, key + ".") if key in _SECTIONS else v
    return out


def _yaml_key(full_key: Any) -> str:
    """OmegaConf's full key in YAML spelling (`checkpoint.async_` -> `checkpoint.async`)."""
    key = str(full_key or "")
    for py, spelled in _RENAMED.items():
        if key == py or key.startswith(py + ".") or key.startswith(py + "["):
            key = spelled + key[len(py):]
    return key


def _schema_type(key: str) -> Tuple[str, Any]:
    """(the schema key, the type expected at `key`), for list entries (`sweep.devices[1]`) and free mappings too."""
    base = re.sub(r"\[\d+\]$", "", key)
    if base in _LEAVES:
        tp = _LEAVES[base][1]
        if base != key:  # a list entry
            tp = typing.get_args(tp)[0]
        return base, tp
    for free in FREE_MAPPINGS:
        if key.startswith(free + "."):
            return free, typing.get_args(_LEAVES[free][1])[1]
    return key, Any


def _raw(merged: Any, key: str) -> Any:
    """The value at `key` before interpolation (for messages)."""
    node: Any = OmegaConf.to_container(merged, resolve=False)
    key = {spelled: py for py, spelled in _RENAMED.items()}.get(key, key)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _plain(value: Any) -> Any:
    """A value from an OmegaConf exception (a node or container) as plain data."""
    if isinstance(value, Node) or OmegaConf.is_config(value):
        return OmegaConf.to_container(OmegaConf.create({"v": value}), resolve=False)["v"]
    return value


def _translate(e: OmegaConfBaseException, where: Optional[str], merged: Any = None) -> ConfigError:
    """One of OmegaConf's exceptions as one ConfigError sentence."""
    key = _yaml_key(getattr(e, "full_key", None))
    first = str(e).splitlines()[0].rstrip(".") if str(e) else type(e).__name__
    in_where = f" in {where}" if where and where != "the command line" else ""
    value = _plain(getattr(e, "value", None))
    if isinstance(e, InterpolationValidationError):
        base, tp = _schema_type(key)
        shown = "a mapping" if isinstance(value, dict) else _show(value)
        return ConfigError(f"{key}={_show(_raw(merged, base))} is not valid: it resolves to {shown}, "
                           f"which is not {_type_name(tp)}.")
    if isinstance(e, InterpolationResolutionError):
        return ConfigError(f"{key}={_show(_raw(merged, key))} could not be resolved: {first}.")
    if isinstance(e, MissingMandatoryValue) and key:
        return ConfigError(f"{key} has no value ('???'); give it one, e.g. {key}=...")
    if isinstance(e, ConfigKeyError) and key:
        return _unknown(key, where)
    if isinstance(e, ValidationError) and key:
        base, tp = _schema_type(key)
        if base == "sweep.extra" and isinstance(value, dict) and "." not in key[len("sweep.extra."):]:
            return ConfigError(f"{key}={_show(value)}{in_where} is not valid: sweep.extra's keys are whole config keys; "
                               "write sweep.extra={model.remat: [none, full]}.")
        if base == "sweep.extra":
            return ConfigError(f"{key}={_show(value)}{in_where} is not valid: give a non-empty list of values.")
        return ConfigError(f"{key}={_show(value)}{in_where} is not valid: it must be {_type_name(tp)}.")
    return ConfigError(f"{key or 'the config'}{in_where} is not valid: {first}.")


def _build(layers: Sequence[Tuple[Dict[str, Any], Optional[str]]]) -> Config:
    """Merge the layers into the schema, resolve interpolations, validate; every failure a ConfigError."""
    merged = OmegaConf.structured(Config)
    for data, where in layers:
        data = _prepare(data, where or "the update")
        try:
            merged = OmegaConf.merge(merged, data)
        except OmegaConfBaseException as e:
            raise _translate(e, where) from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _translate(e, None, merged) from None
    validate(cfg)
    return cfg


def load(overrides: Sequence[str] = (), config_files: Sequence[str] = ()) -> Config:
    """Merge schema defaults + groups + files + overrides, resolve interpolations, validate, return the typed config."""
    groups, dotted = parse_overrides(overrides)
    layers: List[Tuple[Dict[str, Any], Optional[str]]] = []
    for group, value in groups:
        choices = available(group)
        if value not in choices:
            raise ConfigError(f"{group}={value} is not a known {group}; available: {', '.join(choices)}.")
        layers.append((_load_yaml(CONFIG_DIR / group / f"{value}.yaml", f"{group} group file"), f"configs/{group}/{value}.yaml"))
    for path in config_files:
        layers.append((_load_yaml(Path(path), "config file"), path))
    layers.append((_parse_dotted(dotted), "the command line"))
    return _build(layers)


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


def _range_text(meta: Dict[str, Any], tp: Any) -> str:
    """What a key's range rules allow, as words: 'a positive integer', '>= 0 and < 1'."""
    bounds = {op: meta[op] for op in ("ge", "gt", "le", "lt") if op in meta}
    whole = tp is int
    if bounds == {"ge": 1} and whole or bounds == {"gt": 0}:
        return "a positive integer" if whole else "a positive number"
    if bounds == {"ge": 0}:
        return "zero or positive"
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return " and ".join(f"{signs[op]} {v:g}" for op, v in bounds.items())


def _in_range(value: Any, meta: Dict[str, Any]) -> bool:
    return (("ge" not in meta or value >= meta["ge"]) and ("gt" not in meta or value > meta["gt"])
            and ("le" not in meta or value <= meta["le"]) and ("lt" not in meta or value < meta["lt"]))


def _check_rules(cfg: Config) -> None:
    """The rules each key declares in the schema, and no newline or NUL in any string key."""
    for key, (f, tp) in _LEAVES.items():
        value, meta = get(cfg, key), f.metadata
        optional = typing.get_origin(tp) is typing.Union
        inner = next(a for a in typing.get_args(tp) if a is not type(None)) if optional else tp
        if value is None:
            continue
        if isinstance(value, str) and ("\n" in value or "\r" in value or "\0" in value):
            raise ConfigError(f"{key}={_show(value)} is not valid: it must not contain a newline or NUL character.")
        is_list = isinstance(value, list)
        entries = value if is_list else [value]
        if is_list and meta.get("nonempty") and not value:
            example = yaml_value(to_dict(get(Config(), key))).replace(" ", "")
            raise ConfigError(f"{key}=[] is not valid: it must list at least one value, e.g. {key}={example}.")
        if is_list and meta.get("unique"):
            seen = [v for i, v in enumerate(value) if v in value[:i]]
            if seen:
                raise ConfigError(f"{key}={_show(value)} is not valid: {_show(seen[0])} appears more than once; list each value once.")
        whole = typing.get_args(inner)[0] if is_list else inner
        for v in entries:
            if "choices" in meta and v not in meta["choices"]:
                if is_list:
                    raise ConfigError(f"{key} contains {_show(v)}; choose from: {', '.join(meta['choices'])}.")
                raise ConfigError(f"{key}={_show(v)} is not valid; choose one of: {', '.join(meta['choices'])}.")
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{key}={_show(v)} is not valid: it must be a finite number.")
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not _in_range(v, meta):
                what = _range_text(meta, whole) + (", or null" if optional else "")
                if is_list:
                    raise ConfigError(f"{key} contains {v}: each entry must be {what}.")
                raise ConfigError(f"{key}={_show(v)} is not valid: it must be {what}.")


def _check_names(cfg: Config) -> None:
    """Names that become path components (run.name, run.id) are one component of safe characters."""
    for key in ("run.name", "run.id"):
        value = get(cfg, key)
        if value is None:
            continue
        if not SAFE_NAME.fullmatch(value) or value in (".", ".."):
            raise ConfigError(f"{key}={_show(value)} is not valid: it must be one path component of letters, digits, "
                              f"'.', '_' and '-' (not '.' or '..'), e.g. {key}=my-run.")


def validate(cfg: Config) -> None:
    """Every rule: the schema's per-key rules, safe names, then the rules that need more than one key."""
    _check_rules(cfg)
    _check_names(cfg)
    t = cfg.train
    if t.stop_after is not None and not 0 < t.stop_after <= t.steps:
        raise ConfigError(f"train.stop_after={t.stop_after} is not valid: it must be between 1 and train.steps={t.steps}, or null.")
    if cfg.profile.steps:
        p = list(cfg.profile.steps)
        if len(p) != 2 or not all(type(x) is int for x in p) or p[0] > p[1] or p[1] > t.steps:
            raise ConfigError(f"profile.steps={_show(p)} is not valid: give [START, END] with 1 <= START <= END <= "
                              f"train.steps={t.steps}, e.g. [5, 7], or [] for no profiling.")
        warm = min(t.warmup_exclude, t.steps)
        traced_warm = max(0, min(p[1], warm) - p[0] + 1)
        if t.steps - (p[1] - p[0] + 1) - (warm - traced_warm) < 1:
            raise ConfigError(f"profile.steps={_show(p)} leaves no steady-state step of train.steps={t.steps} "
                              f"(the first train.warmup_exclude={t.warmup_exclude} steps and the traced ones are left "
                              f"out of the timing); trace fewer or later steps, or run more.")
    m = cfg.model
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; pick n_heads that divides d_model.")
    if (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"model.d_model/n_heads={m.d_model // m.n_heads} is odd; RoPE needs an even head dimension.")
    if cfg.data.eos_id is not None and cfg.data.eos_id >= m.vocab_size:
        raise ConfigError(f"data.eos_id={cfg.data.eos_id} is not valid: it must be a token id below "
                          f"model.vocab_size={m.vocab_size}, or null (the token file's, else the vocabulary's last id).")
    if m.init not in ("numpy", "native") and not m.init.startswith("hf:"):
        raise ConfigError(f"model.init={m.init!r} is not valid; choose one of: numpy, native, hf:DIR "
                          "(a Hugging Face Llama directory, e.g. one written by `scaleout export`).")
    if m.attention_impl == "dense" and m.attention == "document" and cfg.torch.document_mask_impl == "flex":
        raise ConfigError("model.attention_impl=dense with torch.document_mask_impl=flex is not valid: flex_attention is "
                          "a fused kernel; use torch.document_mask_impl=sdpa (or auto) with dense, or attention_impl=auto.")
    if m.init.startswith("hf:") and "://" in m.init:
        raise ConfigError(f"model.init={m.init} is a URL, but the trainers read a Hugging Face directory from local disk; "
                          "download it and give hf:DIR (on target=tpu scaleout copies DIR to every worker).")
    data, fsdp, tensor = resolve_parallel(cfg.devices, cfg.parallel.data, cfg.parallel.fsdp, cfg.parallel.tensor)
    if cfg.framework == "torch" and tensor > 1:
        raise ConfigError(f"parallel.tensor={tensor} is not supported with framework=torch: tensor parallelism is JAX-only; use parallel.fsdp or parallel.data.")
    if m.n_heads % tensor:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by parallel.tensor={tensor}; each tensor shard needs whole heads.")
    if m.d_ff % tensor or m.vocab_size % tensor:
        raise ConfigError(f"parallel.tensor={tensor} must divide model.d_ff={m.d_ff} and model.vocab_size={m.vocab_size}.")
    if cfg.framework == "jax" and m.d_model % fsdp:  # PyTorch's FSDP2 pads its shards; a JAX sharding must divide
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by the fsdp axis size {fsdp} (devices={cfg.devices}, "
                          f"parallel.fsdp={cfg.parallel.fsdp}); JAX shards every weight's d_model dimension over fsdp: "
                          f"use a device count or parallel.fsdp that divides {m.d_model}, or put the rest on parallel.data.")
    dp = data * fsdp
    if t.global_batch % (dp * t.grad_accum):
        raise ConfigError(f"train.global_batch={t.global_batch} is not divisible by the data-parallel size {dp} (data*fsdp) times train.grad_accum={t.grad_accum}; use a multiple of {dp * t.grad_accum}.")
    if t.eval_every and t.eval_batch_size % dp:
        raise ConfigError(f"train.eval_batch_size={t.eval_batch_size} is not divisible by the data-parallel size {dp} "
                          f"(data*fsdp); use a multiple of {dp} (the same for every device count of a sweep).")
    if cfg.local.processes > 1 and cfg.devices % cfg.local.processes:
        raise ConfigError(f"local.processes={cfg.local.processes} does not divide devices={cfg.devices}; each process must own the same number of devices.")
    if cfg.slurm.signal_delay_s >= cfg.slurm.time_min * 60:
        raise ConfigError(f"slurm.signal_delay_s={cfg.slurm.signal_delay_s} is not valid: it must be less than the job's time, slurm.time_min={cfg.slurm.time_min} minutes.")
    if cfg.data.source == "file":
        if not cfg.data.path:
            raise ConfigError("data.path is not set: data.source=file needs a token file (make one with `scaleout prepare-data TEXT OUT.bin`).")
        if "://" in cfg.data.path:
            raise ConfigError(f"data.path={cfg.data.path} is a URL, but the trainers memory-map a local token file; copy it "
                              "(and its .meta.json sidecar) to this machine and give its path (on target=tpu scaleout copies "
                              "it to every worker).")
        if not Path(cfg.data.path).is_file():
            raise ConfigError(f"data.path={cfg.data.path!r} does not exist; give a token file written by `scaleout prepare-data`.")
    _check_seq_lens(cfg)
    _check_contenders(cfg)
    for key, values in cfg.sweep.extra.items():
        if key not in _LEAVES:
            raise ConfigError(f"sweep.extra key {key} is not a config key" + _did_you_mean(key, list(_LEAVES)))
        if defines_place(key):
            raise ConfigError(f"sweep.extra key {key} is not valid: it says which run a cell belongs to or where it lives "
                              f"({', '.join(PLACE_KEYS)}, {', '.join(s + '.*' for s in PLACE_SECTIONS)} cannot be swept); "
                              "sweep frameworks and device counts with sweep.frameworks and sweep.devices, and give the "
                              "others once for the whole run.")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.extra.{key}={_show(values)} is not valid: give a non-empty list of values.")


def _check_contenders(cfg: Config) -> None:
    """sweep.custom_contenders, sweep.contenders and contender name contenders that exist and are well made."""
    for name, spec in cfg.sweep.custom_contenders.items():
        where = f"sweep.custom_contenders.{name}"
        if name in contenders.BUILTIN:
            raise ConfigError(f"{where} redefines the built-in contender {name!r}; built-ins ({', '.join(contenders.BUILTIN)}) "
                              f"are fixed so that every report means the same by them: give yours another name, e.g. {name}-mine.")
        if not SAFE_NAME.fullmatch(name) or name in (".", ".."):
            raise ConfigError(f"{where}: the contender name {name!r} is not valid: it becomes part of cell names, so use "
                              "letters, digits, '.', '_' and '-', e.g. jax-unrolled.")
        flat = contenders.flatten(spec)
        if flat.get("framework") not in FRAMEWORKS:
            raise ConfigError(f"{where}.framework={_show(flat.get('framework'))} is not valid: every contender names its "
                              f"framework, one of: {', '.join(FRAMEWORKS)}.")
        for key in flat:
            if key == "framework":
                continue
            if key not in _LEAVES:
                raise ConfigError(f"{where}: {key} is not a config key" + _did_you_mean(key, list(_LEAVES)))
            if defines_place(key):
                raise ConfigError(f"{where} sets {key}, which says which run a cell belongs to or where it lives "
                                  f"({', '.join(PLACE_KEYS)}, {', '.join(s + '.*' for s in PLACE_SECTIONS)}); a contender "
                                  "sets only how its cells train: remove it (give it once for the whole run).")
            if key in cfg.sweep.extra:
                raise ConfigError(f"{where} sets {key}, which sweep.extra also sweeps; a key is either one contender's "
                                  "setting or an axis of every contender: remove it from one of them.")
    known = contenders.defined(cfg)
    for name in cfg.sweep.contenders:
        if name not in known:
            raise ConfigError(f"sweep.contenders contains {name!r}, which is not a contender; choose from: "
                              f"{', '.join(known)} (define your own in sweep.custom_contenders).")
    if cfg.contender is not None and cfg.contender not in known:
        raise ConfigError(f"contender={cfg.contender!r} is not a contender; choose one of: {', '.join(known)} "
                          "(define your own in sweep.custom_contenders), or leave it unset to run framework as set.")


def _check_seq_lens(cfg: Config) -> None:
    """data.seq_lens and data.pad_to: lengths the model takes, buckets that hold every length."""
    d, T = cfg.data, cfg.model.seq_len
    for key, values in (("data.seq_lens", d.seq_lens), ("data.pad_to", d.pad_to)):
        longer = [v for v in values if v > T]
        if longer:
            raise ConfigError(f"{key} contains {longer[0]}, longer than model.seq_len={T}; model.seq_len is the longest "
                              f"sequence a step may have: raise it or list lengths up to {T}.")
    if d.seq_lens and cfg.model.attention == "document":
        raise ConfigError(f"data.seq_lens={_show(list(d.seq_lens))} is not supported with model.attention=document: packed "
                          "rows have one length by construction; use model.attention=causal or data.seq_lens=[].")
    if d.pad_to:
        longest = max(d.seq_lens) if d.seq_lens else T
        if max(d.pad_to) < longest:
            raise ConfigError(f"data.pad_to={_show(list(d.pad_to))} has no bucket for length {longest} (the longest step "
                              f"{'of data.seq_lens' if d.seq_lens else '= model.seq_len'}); add a bucket of at least "
                              f"{longest}, e.g. data.pad_to={_show(sorted(set(d.pad_to) | {longest}))}.")


# --------------------------------------------------------------------------- helpers for other modules

def mesh_shape(cfg: Config) -> Dict[str, int]:
    data, fsdp, tensor = resolve_parallel(cfg.devices, cfg.parallel.data, cfg.parallel.fsdp, cfg.parallel.tensor)
    return {"data": data, "fsdp": fsdp, "tensor": tensor}


def math_hash(cfg: Config) -> str:
    """Hash of everything that changes the numbers a run computes (not devices, not paths, not run.id)."""
    d = {"model": to_dict(cfg.model), "train": to_dict(cfg.train), "data": to_dict(cfg.data)}
    d["model"].pop("name", None)
    for key in NOT_MATH:
        section, name = key.split(".")
        d[section].pop(name, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def save(cfg: Config, path: Path) -> None:
    """Write the resolved config atomically."""
    atomic_write(path, OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))))


def load_resolved(path: str | Path) -> Config:
    """Read a cell's resolved config.yaml (validated again: it may have been edited)."""
    return _build([(_load_yaml(Path(path), "cell config"), str(path))])


def replace(cfg: Config, updates: Dict[str, Any]) -> Config:
    """A copy of `cfg` with dotted keys set, validated again."""
    data = to_dict(cfg)
    for key, value in updates.items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            if not isinstance(node, dict) or p not in node:
                raise _unknown(key, None)
            node = node[p]
        if not isinstance(node, dict) or leaf not in node:
            raise _unknown(key, None)
        node[leaf] = value
    return _build([(data, None)])

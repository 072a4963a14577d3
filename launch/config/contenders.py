"""Contenders: what a sweep compares. A contender is a framework plus its own settings, under a name.

Built in:
    jax             framework=jax
    torch           framework=torch, torch.compile=false (eager)
    torch-compile   framework=torch, torch.compile=true
Your own, in `sweep.custom_contenders`: name -> {framework: jax|torch, KEY: VALUE, ...}, e.g.
    {jax-unrolled: {framework: jax, model.scan_layers: false},
     torch-compile-dynamic: {framework: torch, torch.compile: true, torch.compile_dynamic: true}}

`sweep.contenders` lists the names a sweep runs, in the order the report compares them; a
contender's settings apply to its own cells only. When it is empty, `sweep.frameworks` gives one
contender per framework, named for what it runs (`torch` with `torch.compile=true` is
`torch-compile`), with no settings of its own. Every cell's config.yaml records its contender in
the top-level `contender` key, and `scaleout run contender=NAME` runs one cell as that contender.

A contender may not set what defines the run or where a cell lives (`launch.config.loader.defines_place`,
the same rule as for sweep.extra) nor a key sweep.extra sweeps; both are refused when the config loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping

from launch.config.schema import Config, walk

_LEAVES = frozenset(k for k, _, tp in walk() if not dataclasses.is_dataclass(tp))


@dataclass(frozen=True)
class Contender:
    """A named framework + the config keys (dotted) it sets in its own cells."""
    name: str
    framework: str
    overrides: Dict[str, Any] = field(default_factory=dict)

    def settings(self) -> Dict[str, Any]:
        """Every key the contender sets in a cell, `framework` and `contender` included."""
        return {"framework": self.framework, "contender": self.name, **self.overrides}

    def as_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "framework": self.framework, "overrides": dict(self.overrides)}


BUILTIN: Dict[str, Contender] = {
    "jax": Contender("jax", "jax"),
    "torch": Contender("torch", "torch", {"torch.compile": False}),
    "torch-compile": Contender("torch-compile", "torch", {"torch.compile": True}),
}
# The order the report lists contenders in when a run directory does not say (builtins first).
BUILTIN_ORDER = tuple(BUILTIN)


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{model: {scan_layers: false}} and {model.scan_layers: false} both as {"model.scan_layers": False}
    (a mapping stays a value where the key itself takes one, e.g. slurm.additional)."""
    out: Dict[str, Any] = {}
    for key, value in mapping.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping) and full not in _LEAVES:
            out.update(flatten(value, full + "."))
        else:
            out[full] = value
    return out


def inferred_name(framework: str, torch_compile: bool) -> str:
    """The built-in name of a cell that names no contender: jax, torch or torch-compile."""
    return "torch-compile" if framework == "torch" and torch_compile else framework


def defined(cfg: Config) -> Dict[str, Contender]:
    """Every contender a config can name: the built-ins and `sweep.custom_contenders` (checked by
    `launch.config.validate`)."""
    out = dict(BUILTIN)
    for name, spec in cfg.sweep.custom_contenders.items():
        flat = flatten(spec)
        framework = flat.pop("framework")
        out[name] = Contender(name, framework, flat)
    return out


def of_sweep(cfg: Config) -> List[Contender]:
    """The contenders of `scaleout sweep`, in order: `sweep.contenders`, else one per `sweep.frameworks`."""
    if cfg.sweep.contenders:
        known = defined(cfg)
        return [known[name] for name in cfg.sweep.contenders]
    return [Contender(inferred_name(fw, cfg.torch.compile), fw) for fw in cfg.sweep.frameworks]


def of_run(cfg: Config) -> Contender:
    """The contender of `scaleout run` / `plan`: `contender` when set (its settings apply), else the
    one the framework and torch.compile name (no settings of its own)."""
    if cfg.contender is not None:
        return defined(cfg)[cfg.contender]
    return Contender(inferred_name(cfg.framework, cfg.torch.compile), cfg.framework)


def name_of(cfg: Mapping[str, Any]) -> str:
    """A written cell's contender, from its config as plain data (report): `contender`, or the
    built-in name its framework and torch.compile give (cells written before contenders existed)."""
    if cfg.get("contender"):
        return str(cfg["contender"])
    return inferred_name(str(cfg.get("framework")), bool((cfg.get("torch") or {}).get("compile")))


def uses_torch_compile(cfg: Mapping[str, Any]) -> bool:
    """Whether a written cell ran torch.compile (the report's "without torch.compile" leaves these out)."""
    return cfg.get("framework") == "torch" and bool((cfg.get("torch") or {}).get("compile"))

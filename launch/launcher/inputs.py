"""The files a config names, checked before anything runs: a `data.source=file` token file and its
sidecar, a `model.init=hf:DIR` Hugging Face directory.

`launch.config` checks the keys themselves (types, ranges, rules between keys) and never opens a
file of another part's format; the formats belong to `launch.data` (the token file's sidecar) and
`launch.core` (Hugging Face weights). The launcher asks both here, for the config a user gave and
for every cell of a sweep, so a wrong file is one sentence before a cell is written.
"""

from __future__ import annotations

from launch.config import Config, ConfigError


def check(cfg: Config) -> None:
    """Raise ConfigError, in one sentence, when a file the config names cannot serve it."""
    m = cfg.model
    if m.init.startswith("hf:"):
        from launch.core import hf_weights, params
        problem = hf_weights.init_problem(m.init, m, params.param_shapes(m))
        if problem:
            raise ConfigError(problem)
    if cfg.data.source == "file" and cfg.data.path and "://" not in cfg.data.path:
        from launch.data.tokenizer import file_problem  # the sidecar's vocabulary, dtype, length and largest token
        problem = file_problem(cfg)
        if problem:
            raise ConfigError(problem)


def load(overrides=(), config_files=()) -> Config:
    """`launch.config.load` and then the files it names: what every verb of the command line reads."""
    from launch import config
    cfg = config.load(overrides, config_files)
    check(cfg)
    return cfg

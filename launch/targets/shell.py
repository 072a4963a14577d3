"""Words for a shell on another machine (an sbatch script, a TPU worker's ssh command): quoted, except that a
leading `~` or `~/` is left to expand to the home directory there, as a user who writes `~/venv/bin/python`
means it.
"""

from __future__ import annotations

import shlex

from launch.config import ConfigError


def word(w: str) -> str:
    """One word quoted for the shell, a leading `~` or `~/` left to expand to the home directory."""
    if w == "~":
        return "~"
    if w.startswith("~/"):
        return "~/" + shlex.quote(w[2:]) if w[2:] else "~/"
    return shlex.quote(w)


def check_interpreter(key: str, value: str) -> None:
    """An interpreter path given in the config: `~/...` expands on the node, `~user/...` is refused (only
    the home of whoever runs the job is known there)."""
    if value.startswith("~") and not (value == "~" or value.startswith("~/")):
        raise ConfigError(f"{key}={value!r} is not valid: only a leading ~/ (your home on the node) expands; "
                          f"give ~/path or an absolute path.")

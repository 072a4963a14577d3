"""Logging for every scaleout process: one `[scaleout]` prefix, levels, quiet non-zero ranks.

`setup()` is called once by an entry point (the CLI, a trainer); library modules only call
`logging.getLogger(__name__)`. Records at INFO and below go to stdout, warnings and errors to
stderr. A trainer process other than process 0 logs warnings only, unless the launcher asked for
DEBUG (`scaleout -v`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from launch.common import envvars

PREFIX = "[scaleout]"
ROOTS = ("launch", "jaxrun", "torchrun_fsdp", "bench")


class _MaxLevel(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno <= self.level


def level_for(verbosity: int) -> int:
    """-q -> WARNING, default -> INFO, -v -> DEBUG."""
    return logging.WARNING if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO


def setup(level: Optional[int] = None, process_index: int = 0, tag: str = "") -> int:
    """Configure the project's loggers; returns the level in force.

    `level` None means: the launcher's `SCALEOUT_LOG_LEVEL` if set, else INFO. Non-zero processes
    are raised to WARNING unless the level is DEBUG. `tag` (e.g. "rank 1") goes into each line.
    """
    if level is None:
        level = logging.getLevelName(os.environ.get(envvars.LOG_LEVEL, "INFO").upper())
        if not isinstance(level, int):
            level = logging.INFO
    if process_index != 0 and level > logging.DEBUG:
        level = max(level, logging.WARNING)
    fmt = logging.Formatter(f"{PREFIX}{' ' + tag if tag else ''} %(message)s")
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(_MaxLevel(logging.INFO))
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    for h in (out, err):
        h.setFormatter(fmt)
    for name in ROOTS:
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            logger.removeHandler(h)
        logger.addHandler(out)
        logger.addHandler(err)
        logger.setLevel(level)
        logger.propagate = False
    return level

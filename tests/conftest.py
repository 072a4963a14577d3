import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def scaleout(tmp_path, capsys):
    """Run the CLI in-process in tmp_path; returns (exit code, stdout, stderr)."""
    from launch.cli import main

    def call(*argv):
        old = os.getcwd()
        os.chdir(tmp_path)
        try:
            code = main(list(argv))
        finally:
            os.chdir(old)
        out = capsys.readouterr()
        return code, out.out, out.err

    return call


def run_cli(args, cwd, env=None, timeout=600):
    """The CLI as a user runs it: a subprocess."""
    return subprocess.run([sys.executable, "-m", "launch", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)

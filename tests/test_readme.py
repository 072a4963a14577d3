"""README.md stays true: every command line in its code blocks is checked against the CLI, and the cheap
end-to-end examples run as written (issue 30.6).

Static (fast): each `scaleout VERB ...` line is parsed by the real argument parser (a renamed verb or flag
fails), and where the verb takes a config (`plan`, `run`, `sweep`) `scaleout plan` runs in a scratch
directory with the same overrides (a renamed key, a bad value or a sweep that would be refused fails);
`--compile`/`--check` are left out (compiling is what the slow tests do). A command whose documented
output is an error (`$ scaleout plan model.nlayers=3` and the `scaleout: error:` line under it) must fail
with exactly that line. The files the examples name (`data.path`, `model.init=hf:`) are made by earlier
examples; their contents are checked where those run for real. `python -m MODULE` lines must name a
module that exists.

Slow: the cheap examples -- the tiny model, a few steps -- run in order in one scratch directory, as
the README writes them, with `scaleout` being this checkout's CLI.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest

from conftest import ROOT, run_cli

README = ROOT / "README.md"
CONFIG_VERBS = ("plan", "run", "sweep")
PLAN_ONLY_FLAGS = ("--compile", "--check")


@dataclass
class Example:
    line: int  # where the command starts in README.md (1-based)
    text: str  # the command as written, continuation lines joined
    argv: List[str]
    output: Optional[List[str]] = None  # the lines shown under a `$ ` command (None: shown without a prompt)


def code_lines(text: str):
    """(line number, line) of every line inside a code block: fenced (```) or indented by four spaces after a
    blank line (Markdown's indented block)."""
    fenced, indented, prev_blank = False, False, True
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            yield n, line
            prev_blank = False
            continue
        if line.startswith("    ") and (indented or prev_blank):
            indented = True
            yield n, line[4:]
        elif line.strip():
            indented = False
        prev_blank = not line.strip()


def _closed(cmd: str) -> bool:
    """Whether every quote of `cmd` is closed."""
    try:
        shlex.split(cmd, comments=True)
        return True
    except ValueError:
        return False


def examples(text: str, program: str = "scaleout") -> List[Example]:
    """Every `program ...` command of the code blocks (a leading `$ ` prompt removed, `\\` continuations
    joined, `# comments` dropped), with the output lines shown right under a `$ ` command."""
    out: List[Example] = []
    lines = list(code_lines(text))
    collecting: Optional[Example] = None
    prev = 0
    i = 0
    while i < len(lines):
        n, line = lines[i]
        body = line.strip()
        prompt = body.startswith("$ ")
        cmd = body[2:] if prompt else body
        if re.match(rf"{re.escape(program)}(\s|$)", cmd):
            while (cmd.endswith("\\") or not _closed(cmd)) and i + 1 < len(lines):
                i += 1  # a `\` continuation, or a quoted argument that goes on on the next line (as in a shell)
                cmd = (cmd[:-1] if cmd.endswith("\\") else cmd) + " " + lines[i][1].strip()
            out.append(Example(n, cmd, shlex.split(cmd, comments=True), [] if prompt else None))
            collecting = out[-1] if prompt else None
        elif collecting is not None and body and not prompt and n == prev + 1:
            collecting.output.append(body)
        else:
            collecting = None
        prev = lines[i][0]
        i += 1
    return out


def module_lines(text: str) -> List[str]:
    """The modules of the `python -m MODULE ...` commands: code-block lines and inline code."""
    mods = [m.group(1) for _, line in code_lines(text) for m in [re.match(r"\s*(?:\$ )?python -m ([\w.]+)", line)] if m]
    mods += re.findall(r"`python -m ([\w.]+)", text)
    return list(dict.fromkeys(mods))


README_EXAMPLES = examples(README.read_text())


def test_the_readme_has_the_examples_this_test_reads():
    verbs = {e.argv[1] for e in README_EXAMPLES if len(e.argv) > 1}
    assert {"plan", "run", "sweep", "export", "prepare-data"} <= verbs, verbs
    assert len(README_EXAMPLES) >= 12, [e.text for e in README_EXAMPLES]
    mods = module_lines(README.read_text())
    assert "launch.data.corpus" in mods and "bench" in mods, mods


def test_the_extractor_joins_continuations_and_keeps_shown_output():
    text = ("Intro\n\n    scaleout sweep a=1 \\\n        b=2   # note\n    $ scaleout plan x=1\n    scaleout: error: bad x\n"
            "\nprose `scaleout run inline=1`\n\n```\nscaleout run c=3\n```\n"
            "\n    scaleout sweep 'm={a: 1,\n                 b: 2}' d=4\n")
    ex = examples(text)
    assert [e.argv for e in ex] == [["scaleout", "sweep", "a=1", "b=2"], ["scaleout", "plan", "x=1"],
                                    ["scaleout", "run", "c=3"], ["scaleout", "sweep", "m={a: 1, b: 2}", "d=4"]]
    assert ex[1].output == ["scaleout: error: bad x"] and ex[0].output is None


def _stand_in_files(overrides: List[str], where: Path) -> None:
    """A token file (bytes, from a line of text) where an example names one that an earlier example makes."""
    from launch.data import tokenizer
    for o in overrides:
        if o.startswith("data.path=") and not Path(o.split("=", 1)[1]).is_absolute():
            out = where / o.split("=", 1)[1]
            out.parent.mkdir(parents=True, exist_ok=True)
            (where / "stand-in.txt").write_text("a stand-in for the corpus an earlier example makes\n" * 50)
            tokenizer.prepare([str(where / "stand-in.txt")], str(out), tokenizer="bytes", vocab_size=256,
                              val_fraction=0.5, dtype=None)


@pytest.fixture
def no_file_checks(monkeypatch):
    """The static check does not run the examples that make the files later examples name (a token file, an
    exported model): their keys are checked, their contents where the examples run for real."""
    from launch.launcher import inputs
    monkeypatch.setattr(inputs, "check", lambda cfg: None)


@pytest.mark.parametrize("example", README_EXAMPLES, ids=lambda e: f"README.md:{e.line}")
def test_readme_command_is_valid(example, scaleout, no_file_checks, tmp_path):
    from launch.launcher import cli
    argv = example.argv[1:]
    try:
        args, extra = cli._parser().parse_known_args(argv)
    except SystemExit as e:
        pytest.fail(f"README.md:{example.line}: `{example.text}` is not accepted by the CLI (exit {e.code})")
    stray = [w for w in extra if w.startswith("-") or not hasattr(args, "overrides")]
    assert not stray, f"README.md:{example.line}: `{example.text}`: unknown arguments {stray}"
    if args.verb not in CONFIG_VERBS:
        return
    overrides = [a for a in argv[1:] if a not in PLAN_ONLY_FLAGS + ("--json",)]
    _stand_in_files(overrides, tmp_path)
    code, out, err = scaleout("plan", "--json", *overrides)
    shown_error = [l for l in example.output or [] if l.startswith("scaleout: error:")]
    if shown_error:
        assert code == 2 and err.strip() == shown_error[0], (example.text, err)
        return
    assert code == 0, f"README.md:{example.line}: `scaleout plan` with the arguments of `{example.text}` failed: {err}"
    plan = json.loads(out)
    if args.verb == "sweep":
        assert plan["sweep"]["error"] is None, f"README.md:{example.line}: the sweep would be refused: {plan['sweep']['error']}"
        assert plan["sweep"]["cells"]


# Modules the README names that exist only where its text says they run, never in the test environment
ELSEWHERE = {"torch.tpu.distributed": "TorchTPU's launcher, on a TPU VM's venv-torch only (README: never install "
                                      "torch_tpu where the tests run)"}


@pytest.mark.parametrize("module", [m for m in module_lines(README.read_text()) if m not in ELSEWHERE])
def test_readme_python_modules_exist(module):
    import importlib.util
    assert importlib.util.find_spec(module) is not None, f"README.md runs `python -m {module}`, which does not exist"


def test_modules_named_for_elsewhere_are_still_named():
    """ELSEWHERE keeps only what the README still names (a stale entry would hide a renamed module)."""
    assert set(ELSEWHERE) <= set(module_lines(README.read_text()))


# --------------------------------------------------------------------------- the cheap examples, for real

CHEAP = [  # in README order; each must appear in README.md exactly as written here
    "scaleout run devices=2",
    "scaleout export runs/tiny/jax-d2 hf/tiny-step20",
    "scaleout run framework=torch devices=2 model.init=hf:hf/tiny-step20 run.name=finetune",
    "scaleout run train.steps=40 train.stop_every=20 run.name=chunks",
]


def _python_block_after(text: str, marker: str) -> str:
    """The indented code block that follows the line containing `marker`."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if marker in l)
    block = []
    for line in lines[start + 1:]:
        if line.startswith("    "):
            block.append(line[4:])
        elif block and not line.strip():
            break
        elif line.strip():
            if block:
                break
    return "\n".join(block)


def _cli(argv: List[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    assert argv[0] == "scaleout"
    return run_cli(argv[1:], cwd=cwd, timeout=timeout)


@pytest.mark.slow
def test_cheap_readme_examples_run_as_written(tmp_path):
    text = README.read_text()
    by_text = {e.text.split("#", 1)[0].strip(): e for e in README_EXAMPLES}
    missing = [c for c in CHEAP if c not in by_text]
    assert not missing, f"README.md no longer has these examples (update the README or this list): {missing}"

    p = _cli(shlex.split(CHEAP[0]), tmp_path)  # the cell the export example reads
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    p = _cli(shlex.split(CHEAP[1]), tmp_path)
    assert p.returncode == 0 and (tmp_path / "hf" / "tiny-step20" / "model.safetensors").is_file(), p.stdout + p.stderr
    assert "exported step 20" in p.stdout, p.stdout
    p = _cli(shlex.split(CHEAP[2]), tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    snippet = _python_block_after(text, "to use the result:")
    assert "from_pretrained(\"hf/tiny-step20\")" in snippet, snippet
    q = subprocess.run([sys.executable, "-c", snippet + "\nprint(type(model).__name__)"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert q.returncode == 0 and q.stdout.strip().endswith("LlamaForCausalLM"), q.stderr[-2000:]

    chunk = shlex.split(CHEAP[3])  # time-limited chunks: the same command, twice, then it says it is finished
    first = _cli(chunk, tmp_path)
    assert first.returncode == 0 and "steps 1..20 of 40" in first.stdout, first.stdout[-2000:] + first.stderr[-2000:]
    second = _cli(chunk, tmp_path)
    assert second.returncode == 0 and "steps 21..40" in second.stdout and "resumed from step 20" in second.stdout, \
        second.stdout[-2000:] + second.stderr[-2000:]
    third = _cli(chunk, tmp_path)
    assert third.returncode == 0 and "cell jax-d1: finished earlier, skipped" in third.stdout, third.stdout
    summaries = [json.loads(l) for l in (tmp_path / "runs" / "chunks" / "jax-d1" / "metrics.jsonl").read_text().splitlines()
                 if '"summary"' in l]
    assert [(s["status"], s["steps"]) for s in summaries] == [("stopped", 20), ("ok", 40)], summaries

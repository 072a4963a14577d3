"""An exported model as a GGUF file for llama.cpp, through llama.cpp's own converter.

    python -m launch.interop.gguf --llama-cpp LLAMA_CPP_DIR HF_DIR OUT.gguf [--outtype f32|f16|bf16|q8_0]

llama.cpp's `convert_hf_to_gguf.py` names a BPE tokenizer's pre-tokenizer (`tokenizer.ggml.pre`,
which selects the splitting regex its C++ tokenizer uses) by hashing the ids its tokenizer gives a
fixed text; a vocabulary trained here is in no table, so the converter stops with
`NotImplementedError: BPE pre-tokenizer was not recognized`. scaleout's tokenizer
(`scaleout prepare-data --tokenizer bpe`) pre-tokenises exactly as GPT-2 does (the `ByteLevel`
pre-tokenizer with GPT-2's regex, no prefix space, no normaliser), which is llama.cpp's `gpt-2`. This
runs the converter unchanged, with one addition: when it does not recognise the pre-tokenizer and
HF_DIR/tokenizer.json is such a GPT-2 byte-level BPE (`gpt2_byte_level`), the answer is `gpt-2`;
any other tokenizer still gets the converter's own error.

The converter is llama.cpp's Python (`convert_hf_to_gguf.py` and, in recent versions, its
`conversion/` package beside it) from a llama.cpp checkout, or from the `vendor/llama.cpp` directory
of the `llama-cpp-python` source distribution on PyPI; it needs torch, numpy, sentencepiece,
transformers and `gguf` (its requirements/requirements-convert_hf_to_gguf.txt).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

log = logging.getLogger(__name__)

CONVERTER = "convert_hf_to_gguf.py"
PRE_TOKENIZER = "gpt-2"
ROOT = Path(__file__).resolve().parents[2]  # the tree holding `launch`, for the converter's process


class GGUFError(ValueError):
    """A mistake in what to convert or with what: one sentence."""


def gpt2_byte_level(tokenizer_json: Path) -> bool:
    """Whether a tokenizer.json is a BPE that splits text as GPT-2 does (what llama.cpp calls `gpt-2`)."""
    try:
        t = json.loads(Path(tokenizer_json).read_text())
    except (OSError, ValueError):
        return False
    pre = t.get("pre_tokenizer") or {}
    return ((t.get("model") or {}).get("type") == "BPE" and t.get("normalizer") is None
            and pre.get("type") == "ByteLevel" and pre.get("add_prefix_space") is False
            and pre.get("use_regex", True) is True)


def find_converter(llama_cpp: Path) -> Path:
    path = Path(llama_cpp).expanduser()
    script = path / CONVERTER if path.is_dir() else path
    if not script.is_file() or script.name != CONVERTER:
        raise GGUFError(f"--llama-cpp {str(llama_cpp)!r} holds no {CONVERTER}; give a llama.cpp checkout (or the "
                        "vendor/llama.cpp directory of the llama-cpp-python source distribution).")
    return script


def convert(llama_cpp: Path, hf_dir: Path, out: Path, outtype: str = "f32", extra: Optional[List[str]] = None) -> Path:
    """Run llama.cpp's converter on `hf_dir` (a `scaleout export` directory) into `out`."""
    script = find_converter(llama_cpp)
    hf_dir = Path(hf_dir).expanduser().resolve()
    tok = hf_dir / "tokenizer.json"
    if not (hf_dir / "config.json").is_file():
        raise GGUFError(f"HF_DIR={str(hf_dir)!r} has no config.json; give a directory written by `scaleout export`.")
    if not tok.is_file():
        raise GGUFError(f"HF_DIR={str(hf_dir)!r} has no tokenizer.json (byte-tokenised data ships none), and llama.cpp "
                        "needs a vocabulary; train on data prepared with --tokenizer bpe.")
    argv = [str(hf_dir), "--outfile", str(out), "--outtype", outtype, *(extra or [])]
    # a process of its own: the converter puts its own gguf-py first on sys.path, which must win over
    # a `gguf` already imported here
    code = subprocess.call([sys.executable, "-c", "import sys; from launch.interop.gguf import run_converter; "
                            "sys.exit(run_converter(sys.argv[1], sys.argv[2:]))", str(script), *argv],
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    if code != 0:
        raise GGUFError(f"llama.cpp's converter ({script}) failed with exit code {code} (its log is above).")
    return Path(out)


def run_converter(script: str, argv: List[str]) -> int:
    """In the converter's process: map the pre-tokenizer, then run the script as `python script argv...`."""
    logging.basicConfig(level=logging.INFO, format="[scaleout] %(message)s")
    sys.path.insert(0, str(Path(script).parent))
    _map_pre_tokenizer(Path(script))
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def _map_pre_tokenizer(script: Path) -> None:
    """Answer `gpt-2` where the converter does not recognise a GPT-2 byte-level tokenizer.

    The converter's models derive from `TextModel` (in `conversion/base.py` since llama.cpp split the
    script into a package; in the script itself before); its `get_vocab_base_pre(tokenizer)` is the
    function llama.cpp asks contributors to extend for a new pre-tokenizer."""
    try:
        from conversion import base as module  # llama.cpp with the conversion/ package
    except ImportError:
        module = None
    text_model = getattr(module, "TextModel", None)
    if text_model is None:
        raise GGUFError(f"{script} has no conversion/base.py with TextModel beside it; this llama.cpp is older or newer "
                        "than the ones scaleout was checked with (see README, \"Use the trained model elsewhere\").")
    original = text_model.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if gpt2_byte_level(Path(self.dir_model) / "tokenizer.json"):
                log.info(f"pre-tokenizer: GPT-2's byte-level regex, written as tokenizer.ggml.pre={PRE_TOKENIZER!r}")
                return PRE_TOKENIZER
            raise

    text_model.get_vocab_base_pre = get_vocab_base_pre


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.interop.gguf", description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True, help="a llama.cpp checkout (holding convert_hf_to_gguf.py)")
    ap.add_argument("hf_dir", help="a directory written by `scaleout export`")
    ap.add_argument("out", help="the .gguf file to write")
    ap.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[scaleout] %(message)s")
    try:
        convert(Path(args.llama_cpp), Path(args.hf_dir), Path(args.out), args.outtype)
    except GGUFError as e:
        print(f"python -m launch.interop.gguf: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`scaleout export`: a trained checkpoint as a Hugging Face Llama model directory.

    scaleout export CELL_DIR_OR_CHECKPOINT OUT_DIR [--step N] [--dtype fp32|bf16] [--max-shard-size 5GB] [--force]

The source is a cell directory (`<run>/<cell>`, its config.yaml says where its checkpoints are),
a checkpoint directory (a cell's `checkpoint.dir`), or one step in it (`.../step_40` for PyTorch,
`.../40` for JAX). The latest complete step is exported unless `--step` names one. Only the model
parameters are read, on this one CPU process whatever device count wrote them:

- JAX (Orbax): a partial restore of `state/params` as host numpy arrays (no mesh, no optimizer
  state read);
- PyTorch (DCP): `dcp.load` without a process group into a state dict of only the `model.*` keys
  its metadata lists (the optimizer's tensors are never read).

A cell's own checkpoints are found where they are now: when its config puts them inside the cell's
directory (the default layout), they are read inside the directory given, so a copied or moved cell
exports its own weights, never what now sits at the old absolute path. The checkpoint must record
the cell's run id (`run.id`): another run's checkpoint at that place is refused.

OUT_DIR gets config.json (LlamaConfig), generation_config.json, model.safetensors (or shards of at
most `--max-shard-size` plus model.safetensors.index.json), and the tokenizer.json the run's token
file was made with, as its sidecar records it, with tokenizer_config.json (none for byte-tokenised
data; a tokenizer.json beside the token file that is not the recorded one is not shipped). The
data's end-of-text token is the export's EOS, BOS and padding token (`launch.interop.special_tokens`).
OUT_DIR may not lie inside a checkpoint directory (the next save there would delete or set it
aside). The files are written into a temporary directory next to OUT_DIR and moved in when complete.
No `transformers` import is needed. Mistakes are one sentence (`ExportError`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from launch.common import files
from launch.config.schema import Config, ModelConfig
from launch.core import hf_weights
from launch.interop import hf_files, special_tokens

log = logging.getLogger(__name__)

DCP_STEP = re.compile(r"^step_(\d+)$")  # torchrun_fsdp.checkpoint: <dir>/step_<N>/ + COMMIT + meta.json
DCP_TMP = re.compile(r"^\.tmp-step_(\d+)$")
DCP_COMMIT, DCP_META = "COMMIT", "meta.json"
ORBAX_STEP = re.compile(r"^(\d+)$")  # jaxrun.checkpoint: <dir>/<N>/{state,meta}/, finalised by rename
ORBAX_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")
ORBAX_STATE, ORBAX_META = "state", "meta"


class ExportError(ValueError):
    """A mistake in what to export or where: one sentence, exit code 2."""


@dataclass
class Source:
    framework: str  # "jax" | "torch"
    root: Path  # the checkpoint directory (holds the steps)
    cfg: Config  # the cell's config: the model's shape, the data's tokenizer
    step: Optional[int] = None  # a step named by the path itself


# --------------------------------------------------------------------------- finding the checkpoint

def _framework_of(root: Path) -> Optional[str]:
    names = [p.name for p in root.iterdir()] if root.is_dir() else []
    if any(DCP_STEP.match(n) or DCP_TMP.match(n) for n in names):
        return "torch"
    if any(ORBAX_STEP.match(n) or ORBAX_TMP.match(n) for n in names):
        return "jax"
    return None


def _cell_config_for(root: Path) -> Optional[Path]:
    """The config.yaml of the cell that owns checkpoint directory `root`, if it can be found."""
    candidates = [root.parent / files.CONFIG_NAME]  # default layout: <cell>/checkpoints
    owner = files.read_json(root / files.OWNER_FILE)
    if isinstance(owner, dict) and owner.get("run_dir"):  # checkpoint.dir=ROOT: ROOT/<run.name>/<cell>
        candidates.append(Path(owner["run_dir"]) / root.name / files.CONFIG_NAME)
    return next((c for c in candidates if c.is_file()), None)


def _load_cell(path: Path) -> Config:
    from launch import config as config_mod
    return config_mod.load_resolved(path)


def own_checkpoints(cell: Path, cfg: Config) -> Path:
    """Where cell directory `cell` keeps its checkpoints now. When its config puts them inside the cell's
    own directory as it was written (`<run.dir>/<run.name>/<cell>/...`, the default layout), the same place
    inside `cell`, wherever the cell was copied or moved (and renamed) since; else the path its config gives."""
    root = Path(cfg.checkpoint.dir)
    try:
        rel = root.relative_to(Path(cfg.run.dir) / cfg.run.name)
    except ValueError:
        return root
    return cell.joinpath(*rel.parts[1:]) if len(rel.parts) > 1 else root


def find_source(path: Path) -> Source:
    """What CELL_DIR_OR_CHECKPOINT names: a cell, a checkpoint directory, or one step of one."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ExportError(f"CELL_DIR_OR_CHECKPOINT={str(path)!r} does not exist; give a cell directory "
                          "(<run.dir>/<run.name>/<cell>) or its checkpoint directory.")
    path = path.resolve()
    if (path / files.CONFIG_NAME).is_file():
        cfg = _load_cell(path / files.CONFIG_NAME)
        root = cfg.checkpoint.dir
        if "://" in root:
            raise ExportError(f"the cell {path} keeps its checkpoints at {root}, which is not local; copy that directory "
                              "here and export the copy.")
        return Source(cfg.framework, own_checkpoints(path, cfg), cfg)
    step = None
    m = DCP_STEP.match(path.name) or ORBAX_STEP.match(path.name)
    if m and path.is_dir() and _framework_of(path.parent) is not None:
        step, path = int(m.group(1)), path.parent
    framework = _framework_of(path)
    if framework is None:
        raise ExportError(f"CELL_DIR_OR_CHECKPOINT={str(path)!r} is neither a cell directory (it has no "
                          f"{files.CONFIG_NAME}) nor a checkpoint directory (no step_<N>/ or <N>/ in it); "
                          "give a cell directory written by `scaleout run`.")
    cfg_path = _cell_config_for(path)
    if cfg_path is None:
        raise ExportError(f"cannot find the config of the cell that wrote {path} (looked for {files.CONFIG_NAME} "
                          "in its parent and in the run its owner file names); give the cell directory instead.")
    cfg = _load_cell(cfg_path)
    if cfg.framework != framework:
        raise ExportError(f"{path} holds {framework} checkpoints but {cfg_path} says framework={cfg.framework}; "
                          "give the cell directory that wrote them.")
    return Source(framework, path, cfg, step)


def complete_steps(src: Source) -> Tuple[List[int], List[str]]:
    """(complete steps, oldest first; names of incomplete ones) in the source's checkpoint directory."""
    done, partial = [], []
    if not src.root.is_dir():
        return done, partial
    for p in sorted(src.root.iterdir()):
        if src.framework == "torch":
            m = DCP_STEP.match(p.name)
            if m and (p / DCP_COMMIT).is_file():
                done.append(int(m.group(1)))
            elif m or DCP_TMP.match(p.name):
                partial.append(p.name)
        else:
            m = ORBAX_STEP.match(p.name)
            if m and p.is_dir() and (p / ORBAX_STATE).is_dir():
                done.append(int(m.group(1)))
            elif m or ORBAX_TMP.match(p.name):
                partial.append(p.name)
    return sorted(done), partial


def pick_step(src: Source, step: Optional[int]) -> int:
    """The step to export: the one asked for (by --step or the path), else the latest complete one."""
    if step is not None and src.step is not None and step != src.step:
        raise ExportError(f"--step {step} contradicts the step directory given ({src.step}); give one of them.")
    want = step if step is not None else src.step
    done, partial = complete_steps(src)
    if want is None:
        if not done:
            why = f" (only incomplete saves: {', '.join(partial)})" if partial else ""
            raise ExportError(f"{src.root} holds no complete checkpoint{why}; train the cell until it saves one "
                              "(checkpoint.every, or the end of train.steps).")
        return done[-1]
    if want not in done:
        name = f"step_{want}" if src.framework == "torch" else str(want)
        state = "is incomplete (the save was interrupted)" if name in partial else "does not exist"
        have = ", ".join(map(str, done)) or "none"
        raise ExportError(f"step {want} in {src.root} {state}; complete steps: {have}.")
    return want


def step_dir(src: Source, step: int) -> Path:
    return src.root / (f"step_{step}" if src.framework == "torch" else str(step))


def read_meta(src: Source, step: int) -> Dict[str, Any]:
    """The checkpoint's metadata (launch.core.engine.checkpoint_metadata), or {} when unreadable."""
    d = step_dir(src, step)
    path = d / DCP_META if src.framework == "torch" else d / ORBAX_META / "metadata"
    meta = files.read_json(path, default={})
    return meta if isinstance(meta, dict) else {}


# --------------------------------------------------------------------------- reading parameters

def read_params(src: Source, step: int) -> Dict[str, np.ndarray]:
    """The model parameters of one step, per-layer scaleout names, float32 numpy, on this process only."""
    d = step_dir(src, step)
    try:
        params = _read_dcp(d) if src.framework == "torch" else _read_orbax(d, src.cfg.model)
    except (ExportError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # a damaged file raises whatever the reader's library raises (DCP: a BaseException)
        raise ExportError(f"cannot read the checkpoint {d} ({_why(e)}); it is damaged or partial: export another "
                          "step with --step.") from None
    return params


def _why(e: BaseException) -> str:
    """An exception as one short phrase; DCP's CheckpointException wraps the error of each rank."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))
        e = e[0] if isinstance(e, tuple) and e else e  # (exception, traceback)
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text if len(text) <= 160 else text[:157].rstrip() + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _read_dcp(d: Path) -> Dict[str, np.ndarray]:
    import torch
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from launch.interop import dcp_reader
    reader = dcp_reader.reader(str(d))  # never pickle.load: the checkpoint may come from anyone
    try:
        meta = reader.read_metadata()
    except dcp_reader.UnsafeMetadata as e:
        raise ExportError(f"the checkpoint {d} has a .metadata that names {e}, which a DCP checkpoint does not "
                          "hold; it was not written by scaleout's PyTorch trainer, and is not read.") from None
    want = {k[len("model."):]: v for k, v in meta.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    if not want:
        raise ExportError(f"the checkpoint {d} holds no model.* tensors; it was not written by scaleout's PyTorch trainer.")
    state = {"model": {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in want.items()}}
    with warnings.catch_warnings():  # DCP warns that it loads without a process group: that is the intent
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {_canonical(k): v.detach().float().numpy() for k, v in state["model"].items()}


def _canonical(name: str) -> str:
    """Wrapper prefixes (activation checkpointing, torch.compile) are not part of a parameter's name."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _read_orbax(d: Path, m: ModelConfig) -> Dict[str, np.ndarray]:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # read to host memory; never claim an accelerator
    import jax
    import orbax.checkpoint as ocp

    from launch.core.params import unstack

    item = d / ORBAX_STATE
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # Orbax warns that a bare item directory has no step metadata
    try:
        ckptr = ocp.PyTreeCheckpointer()
        meta = ckptr.metadata(item)
        if meta is None:
            raise ExportError(f"the checkpoint {d} has no readable Orbax metadata; it is damaged or partial: export "
                              "another step with --step.")
        tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
        if not isinstance(tree, dict) or "params" not in tree:
            raise ExportError(f"the checkpoint {d} holds no params; it was not written by scaleout's JAX trainer.")
        params_meta = tree["params"]
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), params_meta)
        restored = ckptr.restore(item, args=ocp.args.PyTreeRestore(
            item={"params": params_meta}, restore_args={"params": restore_args}, partial_restore=True))
    finally:
        absl.setLevel(level)
    stacked = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(restored["params"])[0]:
        keys = [str(getattr(k, "key", k)) for k in path]
        stacked[".".join(k for k in keys if k != "value")] = np.asarray(leaf, np.float32)
    try:
        return unstack(stacked, m)
    except KeyError as e:
        raise ExportError(f"the checkpoint {d} lacks the parameter {e} this cell's model has; it is partial or "
                          "was written by another model.") from None


def check_shapes(params: Dict[str, np.ndarray], m: ModelConfig, where: Path) -> None:
    from launch.core.params import named_params
    want = dict(named_params(m))
    missing = [k for k in want if k not in params]
    if missing:
        raise ExportError(f"the checkpoint {where} lacks {missing[0]}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}; "
                          "it is partial or was written by another model.")
    extra = [k for k in params if k not in want]
    if extra:
        raise ExportError(f"the checkpoint {where} holds {extra[0]}, which this cell's model does not have; "
                          "give the cell directory that wrote it.")
    for k, spec in want.items():
        if tuple(params[k].shape) != tuple(spec.shape):
            raise ExportError(f"the checkpoint {where} has {k} of shape {list(params[k].shape)}, but the cell's "
                              f"model config gives {list(spec.shape)}; give the cell directory that wrote it.")


# --------------------------------------------------------------------------- writing

def check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"OUT_DIR={str(out)!r} is a file; give a directory to write the model into.")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"OUT_DIR={str(out)!r} exists and is not empty; give a new directory, or --force to "
                          "replace the model files in it.")


def tokenizer_for(cfg: Config) -> Optional[Path]:
    """The tokenizer.json the run's token file was made with, as its sidecar records it (`tokenizer`, a file
    beside the token file, and `tokenizer_sha256`), or None: synthetic or byte-tokenised data, a token file
    without a sidecar (nothing says which tokenizer made it), or a recorded tokenizer that is gone or was
    replaced since (a warning says so). Never a tokenizer.json that merely sits next to the token file."""
    if cfg.data.source != "file" or not cfg.data.path or "://" in cfg.data.path:
        return None
    from launch.data import tokenizer
    data = Path(cfg.data.path)
    meta = tokenizer.read_sidecar(data)
    name = meta.get("tokenizer") if meta else None
    if name in (None, "bytes"):
        return None
    path = data.parent / str(name)
    if not isinstance(name, str) or Path(name).name != name or not path.is_file():
        log.warning(f"the sidecar of {data} records the tokenizer {name!r}, which is not a file beside it: "
                    "exporting without a tokenizer")
        return None
    want = meta.get("tokenizer_sha256")
    if want is not None and want not in _tokenizer_hashes(path):
        log.warning(f"{path} is not the tokenizer {data} was made with (its sidecar records sha256 {str(want)[:12]}): "
                    "exporting without a tokenizer")
        return None
    return path


def _tokenizer_hashes(path: Path) -> Tuple[str, ...]:
    """sha256 of a tokenizer.json's bytes, and of its canonical form (what prepare-data records when it
    encoded with a tokenizer.json it did not rewrite)."""
    import hashlib
    raw = hashlib.sha256(path.read_bytes()).hexdigest()
    try:
        from tokenizers import Tokenizer
        return raw, hashlib.sha256(Tokenizer.from_file(str(path)).to_str().encode()).hexdigest()
    except Exception:  # not a tokenizer Hugging Face tokenizers reads: only its bytes can match
        return (raw,)


def check_not_in_checkpoints(out: Path, src: Source) -> None:
    """Refuse an OUT_DIR inside a checkpoint directory: the source's, or any that a run claimed (its owner file)
    or that holds checkpoint steps; the next save there would delete the export or set it aside as damaged."""
    root = Path(src.root).resolve()
    for p in (out, *out.parents):
        if p == root or (p / files.OWNER_FILE).is_file() or _holds_steps(p):
            raise ExportError(f"OUT_DIR={str(out)!r} is inside the checkpoint directory {p}, where a run's next save "
                              "would delete it or set it aside; give a directory outside every checkpoint directory.")


def _holds_steps(d: Path) -> bool:
    """Whether `d` holds a checkpoint step of either trainer (committed DCP, Orbax with its items) or a save in flight."""
    if not d.is_dir():
        return False
    try:
        entries = list(d.iterdir())
    except OSError:
        return False
    for p in entries:
        if DCP_STEP.match(p.name) and (p / DCP_COMMIT).is_file() or DCP_TMP.match(p.name) and p.is_dir():
            return True
        if ORBAX_STEP.match(p.name) and (p / ORBAX_STATE).is_dir() and (p / ORBAX_META).is_dir() \
                or ORBAX_TMP.match(p.name) and p.is_dir():
            return True
    return False


def check_run(src: Source, d: Path, meta: Dict[str, Any]) -> None:
    """The checkpoint must be one the cell's own run wrote: the place its config names may hold another
    run's now (a new run where the cell was before it was moved)."""
    ours, theirs = src.cfg.run.id, meta.get("run_id")
    if ours is not None and theirs != ours:
        whose = f"run {theirs}" if theirs else "no recorded run"
        raise ExportError(f"the checkpoint {d} belongs to {whose}, not to the cell's run {ours}; export the cell of the "
                          "run that wrote it, or give the checkpoint directory the cell's run wrote.")


def hf_order(m: ModelConfig) -> List[str]:
    """scaleout names in the order the HF files list them: embedding, layer by layer, final norm, head."""
    from launch.core.params import named_params
    rank = {"tok_embeddings": -1, "norm.weight": m.n_layers, "output": m.n_layers + 1}
    names = [name for name, _ in named_params(m)]
    return sorted(names, key=lambda n: rank[n] if n in rank else int(n.split(".")[1]))  # stable within a layer


def _make_readable(tmp: Path) -> None:
    """mkdtemp makes a private directory; give it and its files the modes of a plain mkdir/open."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for f in tmp.iterdir():
        f.chmod(0o666 & ~umask)


def _install(tmp: Path, out: Path) -> None:
    """Move the finished files from `tmp` into `out`: a rename when `out` is new or empty, else
    file by file after removing the model files of an earlier export (--force)."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        return
    for old in out.iterdir():
        if old.is_file() and hf_files.WRITTEN.match(old.name):
            old.unlink()
    for new in tmp.iterdir():
        os.replace(new, out / new.name)
    tmp.rmdir()


def export(source: Path, out: Path, step: Optional[int] = None, dtype: str = "fp32",
           max_shard_bytes: int = hf_files.DEFAULT_MAX_SHARD_BYTES, force: bool = False) -> Dict[str, Any]:
    """Export one checkpoint as a Hugging Face Llama directory; returns what was written."""
    if dtype not in hf_files.DTYPES:
        raise ExportError(f"--dtype {dtype} is not valid; choose one of: {', '.join(hf_files.DTYPES)}.")
    out = Path(out).expanduser().resolve()
    check_out_dir(out, force)
    src = find_source(source)
    check_not_in_checkpoints(out, src)
    step = pick_step(src, step)
    d = step_dir(src, step)
    m = src.cfg.model
    meta = read_meta(src, step)
    check_run(src, d, meta)
    from launch import config as config_mod
    if meta.get("config_hash") not in (None, config_mod.math_hash(src.cfg)):
        log.warning(f"the checkpoint {d} records config hash {meta['config_hash']}, the cell's config is "
                    f"{config_mod.math_hash(src.cfg)}: exporting with the cell's model shape (checked against every tensor)")
    tok = tokenizer_for(src.cfg)
    try:
        eot = special_tokens.end_of_text(src.cfg, tok)
    except special_tokens.SpecialTokensError as e:
        raise ExportError(str(e)) from None
    log.info(f"reading the {src.framework} checkpoint {d} (model parameters only)")
    params = read_params(src, step)
    check_shapes(params, m, d)
    order = hf_order(m)
    tensors = {k: hf_files.cast(v, dtype) for k, v in hf_weights.to_hf({k: params[k] for k in order}).items()}
    del params
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        written = hf_files.write_safetensors(tensors, tmp, max_shard_bytes, metadata={
            "scaleout_framework": src.framework, "scaleout_step": str(step), "scaleout_checkpoint": str(d)})
        config = {**hf_files.hf_config(m, dtype), **special_tokens.config_ids(eot)}
        _write_json(tmp / hf_weights.CONFIG_JSON, config)
        _write_json(tmp / special_tokens.GENERATION_CONFIG, special_tokens.generation_config(eot))
        written[:0] = [hf_weights.CONFIG_JSON, special_tokens.GENERATION_CONFIG]
        if tok is not None:
            shutil.copyfile(tok, tmp / hf_files.TOKENIZER_JSON)
            _write_json(tmp / hf_files.TOKENIZER_CONFIG, special_tokens.tokenizer_config(eot, m.seq_len))
            written += [hf_files.TOKENIZER_JSON, hf_files.TOKENIZER_CONFIG]
        _make_readable(tmp)
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out, "framework": src.framework, "step": step, "checkpoint": d, "files": written,
            "bytes": sum(v.nbytes for v in tensors.values()), "tokenizer": tok, "end_of_text": eot,
            "byte_note": special_tokens.byte_note(src.cfg)}


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")

"""The `scaleout` command line. Verbs: plan, run, sweep, report, status, logs, cancel, prepare-data, export, trace.

Every verb takes config overrides as `key=value` words (`model=300m train.steps=50`) and
`--config FILE` (repeatable). A mistake in the config is one sentence on stderr and exit code 2;
nothing is run, written or submitted.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import List, Optional

from launch.common import envvars, log as log_setup
from launch.config import ConfigError
from launch.targets.errors import SubmitError

log = logging.getLogger(__name__)
EXIT_USAGE = 2


class UserError(Exception):
    """A mistake on the command line or in the run directory: one sentence, exit code 2."""


def _config(args: argparse.Namespace):
    from launch.launcher import inputs
    return inputs.load(args.overrides, args.config or [])


def cmd_plan(args: argparse.Namespace) -> int:
    from launch.launcher import plan
    if args.check and not args.compile:
        raise UserError("--check goes with --compile: `scaleout plan --compile --check KEY=VALUE...` exits 1 when the cell does not fit.")
    cfg = _config(args)
    from launch.launcher import gpu_preflight, inputs, rundir
    inputs.check_cell(rundir.RunDir(cfg).cell(cfg.framework, cfg.devices).cfg)  # checkpoint.load_from, as run checks it
    gpu_preflight.check_attention(cfg)
    for warning in gpu_preflight.warnings(cfg):
        log.warning(warning)
    if args.compile:
        return _plan_compile(cfg, args)
    p = plan.describe(cfg)
    print(plan.to_json(p) if args.json else plan.format_text(p))
    return 0


def _plan_compile(cfg, args: argparse.Namespace) -> int:
    """`plan --compile`: the cell's per-device memory, compile time and FLOPs, estimated on this machine."""
    from launch.config import contenders
    from launch.launcher import aot, rundir
    cfg = rundir.applied(cfg)
    results = aot.estimate([cfg], [rundir.cell_name(contenders.of_run(cfg).name, cfg.devices)])
    print(aot.to_json(results) if args.json else aot.format_text(results), end="" if not args.json else "\n")
    if args.check:
        r = results[0]
        if r["fits"] is None:
            raise UserError(f"--check has no memory limit to check cell {r['cell']} against: {r['limit_source']}.")
        if not r["fits"]:
            print(f"scaleout: {aot.refusal(r)}", file=sys.stderr)
            return 1
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from launch.launcher import sweep
    return sweep.run_single(_config(args))


def cmd_sweep(args: argparse.Namespace) -> int:
    from launch.launcher import sweep
    return sweep.run_sweep(_config(args))


def _device_counts(text: Optional[str]) -> Optional[List[int]]:
    """--project 16,32,64 as [16, 32, 64]; None when not given."""
    if text is None:
        return None
    words = [w.strip() for w in text.split(",")]
    if not words or not all(w.isdigit() and int(w) >= 1 for w in words) or len(set(words)) != len(words):
        raise UserError(f"--project {text!r} is not valid: give distinct positive device counts separated by commas, "
                        "e.g. --project 16,32,64.")
    return [int(w) for w in words]


def cmd_report(args: argparse.Namespace) -> int:
    from launch.report import report
    project_to = _device_counts(args.project)
    try:
        out = report.write(args.run_dir, project_to)
    except report.ReportError as e:
        raise UserError(str(e)) from None
    print(f"wrote {out['md']}, {out['json'].name}, {out['csv'].name} and {len(out['plots'])} plots in {out['md'].parent}")
    return 0


def _run_dir(args: argparse.Namespace) -> Path:
    from launch.launcher import status
    if not args.run_dir.is_dir() or not status.cell_names(args.run_dir):
        raise UserError(f"RUN_DIR={str(args.run_dir)!r} holds no cells (no <cell>/config.yaml); give a directory written by `scaleout run` or `scaleout sweep`.")
    return args.run_dir


def _cells(args: argparse.Namespace, run_dir: Path) -> List[str]:
    """The CELL argument checked against the run's cells, or every cell."""
    from launch.launcher import status
    names = status.cell_names(run_dir)
    if args.cell is None:
        return names
    if args.cell not in names:
        raise UserError(f"CELL={args.cell!r} is not a cell of {run_dir}; cells: {', '.join(names)}.")
    return [args.cell]


def cmd_status(args: argparse.Namespace) -> int:
    from launch.launcher import status
    states = status.cell_states(_run_dir(args))
    print(status.header())
    for s in states:
        print(status.format_state(s))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from launch.launcher import status
    run_dir = _run_dir(args)
    names = _cells(args, run_dir)
    if args.follow and len(names) != 1:
        raise UserError("--follow needs one CELL; cells: " + ", ".join(names) + ".")
    for name in names:
        status.print_logs(run_dir, name, follow=args.follow)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from launch.launcher import status
    run_dir = _run_dir(args)
    done = status.cancel(run_dir, _cells(args, run_dir))
    if not done:
        print("no jobs recorded for that run directory or cell: local cells run in the foreground (stop their launcher)")
    for cell, what in done.items():
        print(f"{cell}: {what}")
    return 0


def cmd_prepare_data(args: argparse.Namespace) -> int:
    from launch.data import tokenizer as tokenize
    *inputs, out = args.paths
    if not inputs:
        raise UserError("prepare-data needs INPUT... OUT: at least one text or JSON-lines file, then the token file to write.")
    if args.dtype and args.tokenizer != "bytes":
        raise UserError("--dtype goes with --tokenizer bytes; a BPE's token file is uint16 when its vocabulary fits, else uint32.")
    try:
        meta = tokenize.prepare(inputs, out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                                val_fraction=args.val_fraction, dtype=args.dtype, force=args.force)
    except tokenize.PrepareError as e:
        raise UserError(str(e)) from None
    except UnicodeDecodeError as e:
        raise UserError(f"an INPUT is not UTF-8 text ({e.reason} at byte {e.start}); give UTF-8 text or JSON-lines files.") from None
    print(f"wrote {meta['tokens']:,} tokens ({meta['documents']:,} documents, vocabulary {meta['vocab_size']}, {meta['dtype']}) "
          f"to {out} and {tokenize.sidecar_path(out).name}; held out: tokens {meta['val_start']:,}..{meta['tokens']:,}")
    print(f"use data.source=file data.path={out} data.dtype={meta['dtype']} model.vocab_size={_round_vocab(meta['vocab_size'])}")
    return 0


def _round_vocab(v: int) -> int:
    """A model vocabulary that holds the tokenizer's: at least 256, rounded up to a multiple of 64."""
    return max(256, -(-v // 64) * 64)


def cmd_export(args: argparse.Namespace) -> int:
    from launch.core.hf_weights import HFError
    from launch.interop import export, hf_files
    try:
        max_shard = hf_files.parse_size(args.max_shard_size)
        done = export.export(args.source, args.out, step=args.step, dtype=args.dtype, max_shard_bytes=max_shard,
                             force=args.force)
    except (export.ExportError, HFError) as e:
        raise UserError(str(e).rstrip(".") + ".") from None
    except OSError as e:
        raise UserError(f"cannot write OUT_DIR={str(args.out)!r}: {e.strerror or e}; give a directory you can write to.") from None
    tok = "" if done["tokenizer"] else " (no tokenizer.json: the run's data has none)"
    print(f"exported step {done['step']} of {done['checkpoint']} ({done['framework']}, {done['bytes'] / 1e6:.1f} MB "
          f"{args.dtype}) to {done['out']}: {', '.join(done['files'])}{tok}")
    eot = done["end_of_text"]
    if eot is not None:
        named = f" {eot.token!r}" if eot.token else ""
        print(f"end-of-text token{named} (id {eot.id}, from {eot.source}): generation stops there; it is also "
              "the BOS and the padding token (left padding)")
    if done["byte_note"]:
        print(f"note: {done['byte_note']}")
    print(f"load it with transformers.LlamaForCausalLM.from_pretrained({str(done['out'])!r}), or start a cell from it "
          f"with model.init=hf:{done['out']}")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    """Serve a cell's trace to the Perfetto UI until Ctrl-C (see launch.report.trace)."""
    import shlex

    from launch.report import trace
    if not (args.port == 0 or 1024 <= args.port <= 65535):
        raise UserError(f"--port {args.port} is not valid: give a port from 1024 to 65535 (below 1024 needs root) (default {trace.DEFAULT_PORT}; 0: any free one).")
    try:
        path = trace.find(args.path)
        server = trace.TraceServer(path, args.port)
    except trace.TraceError as e:
        raise UserError(str(e)) from None
    try:
        print(f"serving {path} at {server.url}")
        if path.name == trace.JAX_TRACE:
            print(f"XProf view of the same capture: xprof --logdir={shlex.quote(str(trace.xprof_logdir(path)))}")
        print(f"open in Perfetto: {server.link}")
        if server.port != trace.DEFAULT_PORT:
            print(f"(ui.perfetto.dev fetches only from port {trace.DEFAULT_PORT}; if it refuses, free that port, or download "
                  "the file and use the UI's 'Open trace file')")
        if args.no_browser or not trace.open_browser(server.link):
            print(f"open the link in a browser on this machine; from another one, forward the port first: "
                  f"ssh -L {server.port}:127.0.0.1:{server.port} {os.uname().nodename}")
        print("Ctrl-C stops serving", flush=True)
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (`&`)
        try:
            server.serve_forever()
        finally:
            signal.signal(signal.SIGINT, previous)
    except KeyboardInterrupt:
        print("stopped serving", flush=True)
    finally:
        server.server_close()
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scaleout", description="Launch the same transformer as a JAX or PyTorch FSDP2 job and report how both scale.")
    ap.add_argument("-q", "--quiet", action="count", default=0, help="only warnings and errors")
    ap.add_argument("-v", "--verbose", action="count", default=0, help="debug output (also from every trainer process)")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. model=300m train.steps=50 sweep.devices=[1,2,4]")
        p.add_argument("--config", action="append", metavar="FILE", help="a YAML file layered over the base config (repeatable)")
        return p

    p = with_config(sub.add_parser("plan", help="print what a config would run (no jax/torch needed)"))
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.add_argument("--compile", action="store_true",
                   help="compile the cell's train step for its devices (jax; a TPU slice through libtpu: "
                        "pip install 'scaleout[tpu-aot]') or estimate its per-rank peak (torch): memory per device "
                        "against the device's, compile time, FLOPs")
    p.add_argument("--check", action="store_true", help="with --compile: exit 1 when the cell does not fit")
    p.set_defaults(func=cmd_plan)
    p = with_config(sub.add_parser("run", help="run one cell (framework x devices) on the target"))
    p.set_defaults(func=cmd_run)
    p = with_config(sub.add_parser("sweep", help="run every contender x devices cell of sweep.*, then report"))
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("report", help="write report.md/json/csv and plots for a run directory")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--project", metavar="N,N,...",
                   help="also project every contender to these device counts (replaces report.project_to)")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("status", help="one line per cell under a header: job id, the scheduler's job state, scaleout's "
                                      "status, step reached, last loss",
                       description="One line per cell. job: the SLURM job id or the TPU trainers' job ('-': a local "
                                   "cell, which runs in the foreground); job state: what the scheduler says (SLURM's "
                                   "state, or the TPU trainers'); status: scaleout's verdict from the metrics and the "
                                   "job (ok, running, pending, failed, stopped, timed out, cancelled, not run, "
                                   "unknown); step reached of train.steps; the loss at the last step record. A failed "
                                   "cell's error follows its line.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("logs", help="a cell's stdout/stderr (all tasks, across requeues)")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("cell", nargs="?", metavar="CELL")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.set_defaults(func=cmd_logs)
    p = sub.add_parser("cancel", help="stop a run's (or one cell's) live SLURM jobs (scancel) or detached TPU trainers "
                                      "(stopped, collected, slice deleted)")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("cell", nargs="?", metavar="CELL")
    p.set_defaults(func=cmd_cancel)
    p = sub.add_parser("prepare-data", help="tokenise text / JSON-lines files into a token file (+ sidecar) for data.source=file")
    p.add_argument("paths", nargs="+", metavar="INPUT... OUT",
                   help="text files (one document each) or JSON-lines files (a `text` field per line), then the token file to write")
    p.add_argument("--tokenizer", default="bytes", metavar="bytes|bpe|PATH",
                   help="bytes: one token per byte (vocabulary 256); bpe: train a byte-level BPE on the inputs and save "
                        "tokenizer.json beside OUT; PATH: encode with an existing tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=8192, help="--tokenizer bpe: vocabulary size (default 8192)")
    p.add_argument("--val-fraction", type=float, default=0.005,
                   help="the last fraction of tokens held out for evaluation (default 0.005)")
    p.add_argument("--dtype", choices=("uint16", "uint32"), default=None,
                   help="--tokenizer bytes: token dtype (default uint16)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing OUT (a regular file only; a run that trained on it refuses to resume)")
    p.set_defaults(func=cmd_prepare_data)
    p = sub.add_parser("export", help="write a cell's checkpoint as a Hugging Face Llama directory (config.json + safetensors)")
    p.add_argument("source", type=Path, metavar="CELL_DIR_OR_CHECKPOINT",
                   help="a cell directory, its checkpoint directory, or one step directory in it")
    p.add_argument("out", type=Path, metavar="OUT_DIR", help="the model directory to write (new or empty)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint step to export (default: the latest complete one)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights' dtype in the safetensors files")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest safetensors file; more weights go into shards with an index (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace the model files of an OUT_DIR that is not empty")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("trace", help="serve a cell's profiler trace (profile.steps) to the Perfetto UI and print its link")
    p.add_argument("path", type=Path, metavar="PATH",
                   help="a cell directory (process 0's trace), its profile/process-<i> directory, or a trace file")
    p.add_argument("--port", type=int, default=9001,
                   help="the port on 127.0.0.1 to serve from (default 9001, the one ui.perfetto.dev may fetch from)")
    p.add_argument("--no-browser", action="store_true", help="print the link only; do not open a browser")
    p.set_defaults(func=cmd_trace)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    stray = [w for w in extra if w.startswith("-") or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    from launch.targets import procs
    level = log_setup.level_for(args.verbose - args.quiet)
    log_setup.setup(level)
    os.environ[envvars.LOG_LEVEL] = logging.getLevelName(level)  # the trainers this launcher starts follow it
    previous = signal.getsignal(signal.SIGTERM)
    procs.install_sigterm()
    try:
        return args.func(args)
    except (ConfigError, UserError, SubmitError) as e:
        print(f"scaleout: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("scaleout: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except procs.Terminated as e:
        print("scaleout: terminated", file=sys.stderr)
        return 128 + e.signum
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())

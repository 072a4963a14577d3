"""The `scaleout` command line. Verbs: plan, run, sweep, report, status, logs, cancel, prepare-data.

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

from launch import envvars, log as log_setup
from launch.config import ConfigError
from launch.targets.errors import SubmitError

EXIT_USAGE = 2


class UserError(Exception):
    """A mistake on the command line or in the run directory: one sentence, exit code 2."""


def _config(args: argparse.Namespace):
    from launch import config
    return config.load(args.overrides, args.config or [])


def cmd_plan(args: argparse.Namespace) -> int:
    from launch import plan
    p = plan.describe(_config(args))
    print(plan.to_json(p) if args.json else plan.format_text(p))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from launch import sweep
    return sweep.run_single(_config(args))


def cmd_sweep(args: argparse.Namespace) -> int:
    from launch import sweep
    return sweep.run_sweep(_config(args))


def cmd_report(args: argparse.Namespace) -> int:
    from launch import report
    try:
        out = report.write(args.run_dir)
    except report.ReportError as e:
        raise UserError(str(e)) from None
    print(f"wrote {out['md']}, {out['json'].name}, {out['csv'].name} and {len(out['plots'])} plots in {out['md'].parent}")
    return 0


def _run_dir(args: argparse.Namespace) -> Path:
    from launch import status
    if not args.run_dir.is_dir() or not status.cell_names(args.run_dir):
        raise UserError(f"RUN_DIR={str(args.run_dir)!r} holds no cells (no <cell>/config.yaml); give a directory written by `scaleout run` or `scaleout sweep`.")
    return args.run_dir


def _cells(args: argparse.Namespace, run_dir: Path) -> List[str]:
    """The CELL argument checked against the run's cells, or every cell."""
    from launch import status
    names = status.cell_names(run_dir)
    if args.cell is None:
        return names
    if args.cell not in names:
        raise UserError(f"CELL={args.cell!r} is not a cell of {run_dir}; cells: {', '.join(names)}.")
    return [args.cell]


def cmd_status(args: argparse.Namespace) -> int:
    from launch import status
    for s in status.cell_states(_run_dir(args)):
        print(status.format_state(s))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from launch import status
    run_dir = _run_dir(args)
    names = _cells(args, run_dir)
    if args.follow and len(names) != 1:
        raise UserError("--follow needs one CELL; cells: " + ", ".join(names) + ".")
    for name in names:
        status.print_logs(run_dir, name, follow=args.follow)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from launch import status
    run_dir = _run_dir(args)
    done = status.cancel(run_dir, _cells(args, run_dir))
    if not done:
        print("no jobs recorded for that run directory or cell: local and TPU cells run in the foreground (stop their launcher)")
    for cell, what in done.items():
        print(f"{cell}: {what}")
    return 0


def cmd_prepare_data(args: argparse.Namespace) -> int:
    from launch import data
    if not Path(args.text).is_file():
        raise UserError(f"TEXT={args.text!r} does not exist; give a text file to tokenise.")
    if Path(args.out).is_dir():
        raise UserError(f"OUT={args.out!r} is a directory; give the path of the token file to write, e.g. {Path(args.out) / 'tokens.bin'}.")
    n = data.prepare_bytes(args.text, args.out, dtype=args.dtype)
    print(f"wrote {n:,} tokens to {args.out} ({args.dtype}); use data.source=file data.path={args.out}")
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
    p.set_defaults(func=cmd_plan)
    p = with_config(sub.add_parser("run", help="run one cell (framework x devices) on the target"))
    p.set_defaults(func=cmd_run)
    p = with_config(sub.add_parser("sweep", help="run every framework x devices cell of sweep.*, then report"))
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("report", help="write report.md/json/csv and plots for a run directory")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("status", help="one line per cell: job id, state, step reached, last loss")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("logs", help="a cell's stdout/stderr (all tasks, across requeues)")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("cell", nargs="?", metavar="CELL")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.set_defaults(func=cmd_logs)
    p = sub.add_parser("cancel", help="scancel a run's SLURM jobs (or one cell's)")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("cell", nargs="?", metavar="CELL")
    p.set_defaults(func=cmd_cancel)
    p = sub.add_parser("prepare-data", help="byte-tokenise a text file into a token file for data.source=file")
    p.add_argument("text")
    p.add_argument("out")
    p.add_argument("--dtype", choices=("uint16", "uint32"), default="uint16")
    p.set_defaults(func=cmd_prepare_data)
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

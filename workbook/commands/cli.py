"""Command line: `python -m workbook pilot [--task MOD:ATTR] [--out DIR] [--smoke] [--only 01]`.

Every command checks what it is given before any work, writes only new files (never over an
existing one) and exits non-zero when it failed. `trial`, `resume` and `reload` hand their
outcome back in the new file `--result PATH` (JSON): a parent process reads that, never the
output, which the task's own prints share."""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..base.errors import WorkbookError
from ..storage.processes import RESULT_OPTION, hand_back, signals_as_interrupt
from ..storage.runs import refuse_existing
from ..storage.schemas import SEED_MAX
from .params import parse_literal


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (give it as e.g. "
                                         "lr=0.001 or data_file='train.jsonl')")
    # true / false as a shell user writes them are the booleans (the string "false" would be
    # truthy in a task factory's `if`)
    switch = {"true": True, "false": False}.get(value.strip().lower())
    return key, switch if switch is not None else parse_literal(value)  # bounded: a value
    # nested 10^5 deep is refused


def _seconds(text: str) -> float:
    """A time limit in seconds: a finite number above 0 (inf, nan, 0 and negatives are
    refused: a limit that never ends, or ends at once, is no limit)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (give e.g. "
                                         "--timeout 1800)") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive finite number of seconds "
                                         "(give e.g. --timeout 1800)")
    return value


@dataclass(frozen=True)
class Command:
    """One `python -m workbook NAME`: its help, the options it takes and its body (the parsed
    options -> the exit code). A body lives where its work does and loads when run, so a new
    process starts quickly."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _pilot_arguments(pilot: argparse.ArgumentParser) -> None:
    pilot.add_argument("--task", default="workbook.samples.generation:task",
                       help="the task as package.module:attribute")
    pilot.add_argument("--option", type=_option, action="append", default=[],
                       metavar="KEY=VALUE", help="an option for a task factory (repeatable)")
    pilot.add_argument("-p", "--param", type=_option, action="append", default=[],
                       metavar="NAME=VALUE", help="a notebook parameter, for every notebook "
                       "that has it (repeatable), e.g. -p device_memory_gib=24")
    pilot.add_argument("--out", help="a new folder for this run (default: runs/<time>-<task>)")
    pilot.add_argument("--smoke", action="store_true", help="small sizes, for CI")
    pilot.add_argument("--only", help="comma list of notebook numbers, e.g. 01,02")
    pilot.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    pilot.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                       help="each notebook's time limit (default 3600, 600 with --smoke)")


def _pilot(args: argparse.Namespace) -> int:
    from .pilot import run_pilot

    try:
        run, index = run_pilot(args.task, args.out, args.smoke, args.only, dict(args.option),
                               args.device, params=dict(args.param), timeout=args.timeout)
    except WorkbookError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: index.json lists the notebooks that finished", file=sys.stderr)
        return 130
    print(index[["notebook", "verdict", "seconds"]].to_string(index=False))
    print(f"run folder: {run}")
    return 0 if (index.verdict == "pass").all() else 1


def _export_arguments(export: argparse.ArgumentParser) -> None:
    from .export import add_arguments  # MLflow and TensorBoard load only when used

    add_arguments(export)


def _export(args: argparse.Namespace) -> int:
    from .export import run_command

    return run_command(args)


def _trial_arguments(trial: argparse.ArgumentParser) -> None:
    trial.add_argument("--study", required=True, help="the study folder (holds design.json)")
    _task_arguments(trial)
    trial.add_argument("--lr", type=float, required=True)
    trial.add_argument("--seed", type=int, default=0, help=f"0 to {SEED_MAX}")
    trial.add_argument("--repeats", type=int, help="the id of the trial this one repeats")
    _result_argument(trial)


def _resume_arguments(resume: argparse.ArgumentParser) -> None:
    resume.add_argument("--checkpoint", required=True)
    _task_arguments(resume)
    resume.add_argument("--to", type=int, required=True, help="the update to stop after")
    resume.add_argument("--out", required=True, help="writes the new files OUT.json and "
                        "OUT.safetensors (never over existing ones)")
    resume.add_argument("--save-at", type=int, default=0, help="also checkpoint after this "
                        "update, into the new folder OUT.ckpt (a resume of a resume)")
    resume.add_argument("--fault", action="append", default=[],
                        help="plant a resume bug (optimizer, sampler, rng) to see it caught")
    _result_argument(resume)


def _reload_arguments(reload: argparse.ArgumentParser) -> None:
    reload.add_argument("--archive", required=True)
    _task_arguments(reload)
    _result_argument(reload)


def _ddp_arguments(ddp: argparse.ArgumentParser) -> None:
    ddp.add_argument("--spec", required=True, help="the run's settings as JSON (ReplicaSpec)")
    ddp.add_argument("--out", required=True, help="the launch's folder: new or empty (rank 0 "
                     "writes there)")
    ddp.add_argument("--resume-from", help="a checkpoint of an earlier launch to continue")
    ddp.add_argument("--then", nargs=2, action="append", default=[], metavar=("SPEC", "OUT"),
                     help="another run in the same processes after the one before (repeatable;"
                     " OUT new or empty)")


# Each child process's body lives beside its notebook: 06's trial, 07's resume and reload.
def _trial(args: argparse.Namespace) -> tuple[int, dict, WorkbookError | None]:
    from ..notebooks.study.process import trial_in_this_process

    return trial_in_this_process(args)


def _resume(args: argparse.Namespace) -> tuple[int, dict, None]:
    from ..notebooks.resume.process import resume_in_this_process

    return resume_in_this_process(args)


def _reload(args: argparse.Namespace) -> tuple[int, dict, None]:
    from ..notebooks.resume.process import reload_in_this_process

    return reload_in_this_process(args)


def parser() -> argparse.ArgumentParser:
    """The commands and their options: the user's, then the child processes' entry points."""
    parser = argparse.ArgumentParser(prog="workbook", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (*COMMANDS, *ENTRY_POINTS):
        options = sub.add_parser(command.name, help=command.help, description=command.help)
        command.arguments(options)
        options.set_defaults(body=command.run)  # (`run` is export's folder)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.body(args)


def _task_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", required=True, help="the task as package.module:attribute; "
                        "it must be the one the folder records (a task path read from a folder "
                        "is never imported)")
    parser.add_argument("--option", type=_option, action="append", default=[],
                        metavar="KEY=VALUE", help="an option for a task factory (repeatable)")


def _result_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(RESULT_OPTION, metavar="PATH", help="also write the outcome as JSON to "
                        "this new file (how a parent process reads it; never over an existing "
                        "file)")


# --- the child processes: trial, resume, reload checked first, outcome handed back in --result
def _handing_back(body: Callable[[argparse.Namespace], tuple], args: argparse.Namespace) -> int:
    """Run `trial`, `resume` or `reload` (`body`): its outcome goes to --result (when given)
    whatever happens, an error also to stderr; exit 0 (done), 1 (ran, and failed) or 2
    (refused)."""
    result = Path(args.result) if args.result else None
    try:
        if result is not None:
            refuse_existing([result], RESULT_OPTION)
    except WorkbookError as exc:  # no result file can be written: stderr only
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with signals_as_interrupt():
            code, outcome, error = body(args)
    except WorkbookError as exc:
        code, outcome, error = 2, None, exc
    except KeyboardInterrupt:  # SIGINT, SIGTERM (its parent ended): files cleaned up on the way
        with contextlib.suppress(WorkbookError, OSError):
            hand_back(result, args.command, 130, None, WorkbookError(
                f"{args.command} was interrupted", "run it again"))
        print(f"interrupted: {args.command} stopped before it finished", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug, or the task's own code: the parent still learns of it
        _hand_back(result, args.command, 1, None, WorkbookError(
            f"{args.command} raised {type(exc).__name__}: {exc}"[:600],
            "read the traceback in the command's error output"))
        raise
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
    return _hand_back(result, args.command, code, outcome, error)


def _hand_back(result: Path | None, command: str, code: int, outcome: dict | None,
               error: WorkbookError | None) -> int:
    try:
        hand_back(result, command, code, outcome, error)
    except WorkbookError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return code or 2
    return code


# --- ddp: one torchrun worker -----------------------------------------------------------------
def _ddp(args: argparse.Namespace) -> int:
    """One process of a launch. Outside torchrun, or with an --out that holds anything, it is
    refused before anything starts; rank 0 claims --out (the other ranks wait for it in the
    process group, so none writes first)."""
    from ..notebooks.parallel.process import claim_launch, replica_in_this_process

    try:
        claim_launch(args)
    except WorkbookError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        code = replica_in_this_process(args)
    except WorkbookError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    # Everything is written (atomically) and the process group destroyed: leave without
    # interpreter finalization, where gloo's threads freeing Python-held tensors abort the
    # process now and then (SIGABRT, "terminate called without an active exception";
    # pytorch/pytorch#179291 describes it) - one launch in six on a loaded 2-core machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# The user's commands.
COMMANDS = (
    Command("pilot", "run the pilot notebooks into a new run folder", _pilot_arguments, _pilot),
    Command("export", "send a pilot run folder to MLflow and/or TensorBoard (pip install "
            "'workbook[export]'); a second export of the same run adds nothing",
            _export_arguments, _export),
)
# The entry points of the processes a notebook starts (storage/processes.fresh_process, 06's
# repro line, torchrun): each checked first, its outcome handed back in --result.
ENTRY_POINTS = (
    Command("trial", "run one more trial of an existing study (the repro command of notebook "
            "06); exits 1 when the trial failed", _trial_arguments,
            functools.partial(_handing_back, _trial)),
    Command("resume", "continue a checkpoint in this (new) process", _resume_arguments,
            functools.partial(_handing_back, _resume)),
    Command("reload", "reload an archive and re-run its control inputs; exits 1 when they do "
            "not reproduce", _reload_arguments, functools.partial(_handing_back, _reload)),
    Command("ddp", "one process of notebook 09's data-parallel run (started by torchrun: "
            "torchrun --standalone --nproc_per_node=N -m workbook ddp)", _ddp_arguments, _ddp),
)


if __name__ == "__main__":
    sys.exit(main())

"""Command line: `python -m workbook pilot [--task MOD:ATTR] [--out DIR] [--smoke] [--only 01]`."""

from __future__ import annotations

import argparse
import ast
import sys

from .errors import WorkbookError


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbook", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    pilot = sub.add_parser("pilot", help="run the pilot notebooks into a new run folder")
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
    pilot.add_argument("--timeout", type=float, metavar="SECONDS",
                       help="each notebook's time limit (default 3600, 600 with --smoke)")
    trial = sub.add_parser("trial", help="run one more trial of an existing study (the "
                           "repro command of notebook 06)")
    trial.add_argument("--study", required=True, help="the study folder (holds plan.json)")
    _task_arguments(trial)
    trial.add_argument("--lr", type=float, required=True)
    trial.add_argument("--seed", type=int, default=0)
    trial.add_argument("--repeats", type=int, help="the id of the trial this one repeats")
    resume = sub.add_parser("resume", help="continue a checkpoint in this (new) process")
    resume.add_argument("--checkpoint", required=True)
    _task_arguments(resume)
    resume.add_argument("--to", type=int, required=True, help="the update to stop after")
    resume.add_argument("--out", required=True, help="writes OUT.json and OUT.safetensors")
    resume.add_argument("--fault", action="append", default=[],
                        help="plant a resume bug (optimizer, sampler, rng) to see it caught")
    reload = sub.add_parser("reload", help="reload an archive and re-run its control inputs")
    reload.add_argument("--archive", required=True)
    _task_arguments(reload)
    ddp = sub.add_parser("ddp", help="one process of notebook 09's data-parallel run (started "
                         "by torchrun: torchrun --standalone --nproc_per_node=N -m workbook ddp)")
    ddp.add_argument("--spec", required=True, help="the run's settings as JSON (ReplicaSpec)")
    ddp.add_argument("--out", required=True, help="the launch's folder (rank 0 writes there)")
    ddp.add_argument("--resume-from", help="a checkpoint of an earlier launch to continue")
    args = parser.parse_args(argv)
    if args.command == "ddp":
        import os

        from .replica import main as replica_main

        try:
            code = replica_main(args.spec, args.out, args.resume_from)
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
    if args.command in ("resume", "reload"):
        return _resume_or_reload(args)
    if args.command == "trial":
        from .study import Study

        try:
            tid = Study(args.study, task=args.task, task_options=dict(args.option)).run_trial(
                args.lr, args.seed, args.repeats)
        except WorkbookError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"trial {tid}")
        return 0
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


def _task_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", required=True, help="the task as package.module:attribute; "
                        "it must be the one the folder records (a task path read from a folder "
                        "is never imported)")
    parser.add_argument("--option", type=_option, action="append", default=[],
                        metavar="KEY=VALUE", help="an option for a task factory (repeatable)")


def _resume_or_reload(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    try:
        if args.command == "resume":
            from .artifacts import read_json
            from .checkpoint import META, load_state
            from .resume import run_recipe, write_result
            from .task import load_recorded_task

            load_state(args.checkpoint)  # refuse a tampered checkpoint before anything runs
            spec = read_json(Path(args.checkpoint) / META, "checkpoint meta").get("recipe")
            task = load_recorded_task(spec, args.task, dict(args.option),
                                      f"checkpoint {args.checkpoint}")
            records, weights = run_recipe(spec, args.to, start_from=Path(args.checkpoint),
                                          faults=tuple(args.fault), task=task)
            write_result(records, weights, Path(args.out))
            print(f"resumed to update {args.to}")
            return 0
        from .archive import reload_archive

        result = reload_archive(args.archive, args.task, dict(args.option))
        print(json.dumps(result))
        return 0 if result["identical"] else 1
    except WorkbookError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Notebook 07's new processes: `workbook resume` continues a checkpoint in this process (the
resumed run the notebook compares with the straight one) and `workbook reload` reloads an
archive and re-runs its control inputs. Each returns (exit code, outcome, error); the command
line hands the outcome back."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ...base.errors import WorkbookError
from ...storage.runs import refuse_existing


def resume_in_this_process(args: argparse.Namespace) -> tuple[int, dict, None]:
    """Continue --checkpoint to update --to, writing the new files OUT.json (the records, last:
    it says the hand-back is complete) and OUT.safetensors (and OUT.ckpt with --save-at)."""
    from safetensors.torch import save_file

    from ...contract.task import load_recorded_task
    from ...storage.artifacts import write_file
    from ...storage.files import write_text
    from ...training.checkpoint import META, load_meta, load_state
    from . import check_recipe, run_recipe

    out = Path(args.out)
    records_path, weights_path = out.with_suffix(".json"), out.with_suffix(".safetensors")
    saved = out.with_suffix(".ckpt")
    refuse_existing([records_path, weights_path] + ([saved] if args.save_at else []), "--out")
    if args.to < 1:
        raise WorkbookError(f"--to {args.to} is not an update", "give --to 1 or later")
    if args.save_at and not 0 < args.save_at <= args.to:
        raise WorkbookError(f"--save-at {args.save_at} lies outside the run (updates 1 to "
                            f"{args.to})", "give --save-at between the resume point and --to")
    load_state(args.checkpoint)  # refuse a tampered checkpoint before anything runs
    spec = check_recipe(load_meta(args.checkpoint).get("recipe"),
                        Path(args.checkpoint) / META, "recipe")
    task = load_recorded_task(spec, args.task, dict(args.option),
                              f"checkpoint {args.checkpoint}")
    records, weights = run_recipe(spec, args.to, saved.parent,
                                  (args.save_at,) if args.save_at else (),
                                  start_from=Path(args.checkpoint), faults=tuple(args.fault),
                                  task=task, name=lambda step: saved.name)
    # the weights first, the records last: the records' file says the hand-back is complete
    write_file(weights_path, lambda tmp: save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(tmp)), "resumed weights")
    write_text(records_path, json.dumps(records), overwrite=False)
    print(f"resumed to update {args.to}")
    return 0, {"resumed_to": args.to, "updates": len(records), "records": str(records_path),
               "weights": str(weights_path)}, None


def reload_in_this_process(args: argparse.Namespace) -> tuple[int, dict, None]:
    """Reload --archive and re-run its control inputs: 1 when they do not reproduce."""
    from .archive import reload_archive

    result = reload_archive(args.archive, args.task, dict(args.option))
    print(json.dumps(result))
    return (0 if result["identical"] else 1), result, None

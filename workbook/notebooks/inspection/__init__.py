"""Notebook 01: what the loss really receives - coverage, padding, prompt, label ids, splits."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ...contract import fine_tuning
from ...contract.data import Item, collate_items
from ...contract.outputs import ModelOutputs
from ...contract.task import Task
from ...storage.records import Flag
from ..parameters import InspectionParams
from ..registry import INSPECTION
from .coverage import (
    Note,
    adapter_target_audit,
    coverage_flags,
    dropped_rows_audit,
    end_token_audit,
    new_token_audit,
    packed_groups_audit,
    packing_audit,
    prompt_notes,
)
from .data_audits import class_map_audit, label_audit, nonfinite_audit, split_audit

# notebook 01's cells call the views as wb.inspection.batch_view, .browser, .example_display
from .example_views import batch_view, browser, example_display  # noqa: F401
from .forward_failure import model_failure, output_layer
from .loss_probes import copy_audit, loss_probe, own_loss_shift
from .scanning import coverage_table, scan


@dataclass
class Inspection:
    """Everything notebook 01 shows: tables, figures and the flags that decide the verdict."""

    task: Task
    splits: dict[str, list[dict]]
    items: dict[str, list[Item]]
    split_table: pd.DataFrame
    coverage: pd.DataFrame
    figures: dict[str, float | int]
    flags: list[Flag] = field(default_factory=list)
    classes: pd.DataFrame | None = None
    notes: list[Note] = field(default_factory=list)  # checks that could not be made

    @property
    def verdict(self) -> str:
        return "fail" if self.flags else "pass"

    def figure_table(self) -> pd.DataFrame:
        return pd.Series(self.figures, dtype=object, name="value").to_frame()

    def flag_table(self) -> pd.DataFrame:
        """The flags, one row each; with none, one row that says so (never an empty table);
        then the checks that could not be made, as notes (count 0: they fail nothing)."""
        cols = ["check", "count", "message", "fix", "examples"]
        rows = [{c: getattr(f, c) for c in cols} for f in self.flags] or [
            {"check": "no flags", "count": 0, "message": "every notebook-01 check passed" +
             (" that could be made (see the notes)" if self.notes else ""), "fix": "-",
             "examples": []}]
        rows += [{"check": n.check, "count": 0, "message": n.message, "fix": n.fix,
                  "examples": []} for n in self.notes]
        return pd.DataFrame(rows, columns=cols)

    def flag_records(self) -> list[dict]:
        cols = ["check", "count", "message", "fix", "examples"]
        return [{c: getattr(f, c) for c in cols} for f in self.flags]


def probe_outputs(task: Task, model: torch.nn.Module, probe: list[Item],
                  data: list[Item]) -> tuple[ModelOutputs | None, list[Flag]]:
    """The model's outputs on the probe batch (the output layer's size is their last
    dimension; the loss probes read them again); when that forward raises, None and a flag
    naming the cause."""
    batch = collate_items(task, probe).tensors
    try:
        with torch.no_grad():
            return task.outputs(model, batch), []
    except Exception as exc:
        return None, [model_failure(task, model, batch, probe, exc, data)]


def inspect_task(task: Task, probe_size: int = 8, limit: int = 0, sample: float = 0.0,
                 seed: int = 0, progress: bool = False, workers: int = -1) -> Inspection:
    """Run every notebook-01 check on the task in one pass over its source (`limit`: its first
    examples, `sample`: a seeded share of them, `workers`: processes forked to count beside
    the reading one, -1: one per other core); the verdict fails on any flag."""
    torch.manual_seed(0)
    model = task.build_model().eval()
    probed: dict[str, Any] = {}

    def probe_model(kept: dict[str, list[Item]]) -> int | None:
        """The output size from a forward on the shortest and longest kept train examples."""
        by_length = sorted(kept["train"], key=lambda it: task.length(it.tensors))
        probe = by_length[: probe_size // 2] + by_length[-(probe_size - probe_size // 2):]
        every = [it for name in kept for it in kept[name]]
        out, forward = probe_outputs(task, model, probe, every) if probe else (None, [])
        outputs = None if out is None else int(out.logits.shape[-1])
        layer = output_layer(model) if outputs is None else None
        probed.update(probe=probe, out=out, outputs=outputs, forward=forward, layer=layer)
        return outputs if layer is None else layer[1]

    result = scan(task, limit, sample, seed, probe=probe_model, progress=progress,
                  workers=workers)
    items, probe, out, outputs, layer = result.kept, probed["probe"], probed["out"], \
        probed["outputs"], probed["layer"]
    split_table, split_flags = split_audit(result)
    classes, label_flags = label_audit(
        result, "" if layer is None else f"the outputs of its last linear layer `{layer[0]}`, "
        "read from the model since its forward failed")
    nonfinite = nonfinite_audit(result)
    probed_flags = loss_probe(task, model, probe, out) if not nonfinite and out is not None \
        else []
    examples = sum(result.examples.values())
    new_tokens, undated = new_token_audit(task, model, items["train"])
    flags = (probed["forward"] + coverage_flags(result.zero, result.on_padding,
                                                result.on_prompt, examples)
             + nonfinite + probed_flags
             + copy_audit(task, items["train"], model_shift=own_loss_shift(task, probe, out))
             + end_token_audit(task, items["train"]) + adapter_target_audit(model)
             + dropped_rows_audit(task) + new_tokens
             + packing_audit(task, model, items["train"]) + packed_groups_audit(task)
             + task.target_kind.audits(task, items["train"])
             + (task.target_kind.model_audits(task, model, items["train"])
                if not probed["forward"] else [])
             + class_map_audit(task, model) + label_flags + split_flags)
    # regression: mean(target^2) over the train split - one value whose square is that mean
    square = torch.tensor([math.sqrt(result.train_square.mean)]) \
        if task.target_kind.float_targets and result.train_square.n else None
    figures = {
        "examples": examples, "scanned": result.scanned, "scan_workers": result.workers,
        "num_outputs": outputs,
        # a fine-tune starts from its base's own loss, which 02 and 03 measure: no ln(outputs)
        "expected_initial_loss": None if (outputs is None and not
                                          task.target_kind.float_targets) or task.pretrained
        or fine_tuning.adapted(model) else round(task.expected_initial_loss(outputs, square), 4),
        "contributing_share": round(result.targets / max(result.positions, 1), 4),
        "targets_per_example_mean": round(result.targets / max(examples, 1), 3),
        "zero_target_examples": result.zero.examples,
        "targets_on_padding": int(result.on_padding.amount),
        "targets_on_prompt": int(result.on_prompt.amount),
        "groups_crossing_splits": next((f.count for f in flags if f.check ==
                                        "group crosses splits"), 0),
        "flags": len(flags),
    }
    notes = prompt_notes(result.unchecked_prompts, result.prompt_examples) + undated + \
        adapter_notes(task)
    return Inspection(task, result.kept_raw, items, split_table, coverage_table(result),
                      figures, flags, classes, notes)


def adapter_notes(task: Task) -> list[Note]:
    """What a framework adapter mapped or left out (`adapter_notes`: from_hf's padding rows of
    label -100) and what its stand-ins gave the task's own code that the campaign will give
    otherwise (`campaign_differs_in`: a Trainer's estimated_stepping_batches)."""
    notes = [Note("what the adapter mapped", str(n), "-") for n in task.framework.notes]
    differs = task.framework.campaign_differs_in
    if differs:
        said = "; ".join(f"{name} ({str(why).split(' here: ', 1)[-1]})"  # each run has its own
                         for name, why in sorted(differs.items()))
        notes.append(Note("the campaign will differ in", f"the task's code reads {said}",
                          "nothing to change: a schedule sized by these values follows the "
                          "pilot's run here and the campaign's own length there"))
    return notes


def run(params: InspectionParams | Mapping[str, Any], out_dir: Path | None = None,
        progress: bool = False) -> Inspection:
    """Notebook 01 from its parameters (it writes nothing until `save`)."""
    params = INSPECTION.check(params)
    return inspect_task(params.load_task(), probe_size=params.probe_size,
                        limit=params.scan_limit, sample=params.scan_sample, seed=params.seed,
                        progress=progress, workers=params.scan_workers)


def save(ins: Inspection, out_dir: Path) -> str:
    """Write the tables and `summary.json` of notebook 01 into its run folder; the verdict."""
    from ...storage.files import write_json
    from ...storage.runs import save_table, write_summary

    save_table(ins.split_table, out_dir, "splits")
    save_table(ins.coverage, out_dir, "coverage")
    if ins.classes is not None:
        save_table(ins.classes.reset_index(), out_dir, "classes")
    write_json(out_dir / "flags.json", ins.flag_records())
    write_summary(out_dir, ins.verdict, ins.figures, task=ins.task.name,
                  flags=[f.check for f in ins.flags],
                  notes=[f"{n.check}: {n.message}" for n in ins.notes])
    return ins.verdict

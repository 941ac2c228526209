"""Notebook 01: what the loss really receives - coverage, padding, prompt, label ids, splits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..contract.data import SPLITS, Item, collate_items, prepare
from ..contract.task import Task, task_from_params
from ..storage.records import Flag
from .coverage import Note, coverage_flags, loss_coverage, prompt_notes, prompt_spans
from .data_audits import label_audit, nonfinite_audit, split_audit

# notebook 01's cells call the views as wb.inspection.batch_view, .browser, .example_display
from .example_views import batch_view, browser, example_display  # noqa: F401
from .forward_failure import model_failure, output_layer
from .loss_probes import copy_audit, loss_probe, own_loss_shift


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
                  data: list[Item]) -> tuple[int | None, list[Flag]]:
    """The size of the model's output layer from a forward on the probe batch; when that
    forward raises, None and a flag naming the cause."""
    try:
        return num_outputs_of(task, model, probe), []
    except Exception as exc:
        return None, [model_failure(task, model, collate_items(task, probe).tensors, probe, exc,
                                    data)]


def num_outputs_of(task: Task, model: torch.nn.Module, items: list[Item]) -> int:
    """Size of the model's output layer, read from one forward pass."""
    with torch.no_grad():
        return int(task.forward(model, collate_items(task, items).tensors).shape[-1])


def inspect_task(task: Task, probe_size: int = 8) -> Inspection:
    """Run every notebook-01 check on the task; the verdict fails on any flag."""
    data = prepare(task, SPLITS)
    splits, items = data.raw, data.items
    torch.manual_seed(0)
    model = task.build_model().eval()
    train = items["train"]
    by_length = sorted(train, key=lambda it: task.length(it.tensors))
    probe = by_length[: probe_size // 2] + by_length[-(probe_size - probe_size // 2):]
    every = [it for n in SPLITS for it in items[n]]
    outputs, forward = probe_outputs(task, model, probe, every)
    spans = {n: prompt_spans(task, items[n]) for n in SPLITS}
    coverage = pd.concat([loss_coverage(task, items[n], spans=spans[n]).assign(split=n)
                          for n in SPLITS], ignore_index=True)
    split_table, split_flags = split_audit(task, splits, items)
    layer = output_layer(model) if outputs is None else None
    classes, label_flags = label_audit(
        task, splits, items, outputs if layer is None else layer[1],
        "" if layer is None else f"the outputs of its last linear layer `{layer[0]}`, read "
        "from the model since its forward failed")
    nonfinite = nonfinite_audit(items)
    probed = loss_probe(task, model, probe) if not nonfinite and outputs is not None else []
    flags = (forward + coverage_flags(coverage) + nonfinite + probed
             + copy_audit(task, items["train"], model_shift=own_loss_shift(task, model, probe))
             + label_flags + split_flags)
    positions = int(coverage.positions.sum())
    figures = {
        "examples": len(coverage), "num_outputs": outputs,
        "expected_initial_loss": None if outputs is None and not task.target_kind.float_targets
        else round(task.expected_initial_loss(
            outputs, torch.cat([it.tensors["labels"].reshape(-1) for it in train])), 4),
        "contributing_share": round(int(coverage.targets.sum()) / max(positions, 1), 4),
        "targets_per_example_mean": round(float(coverage.targets.mean()), 3),
        "zero_target_examples": int((coverage.targets == 0).sum()),
        "targets_on_padding": int(coverage.on_padding.sum()),
        "targets_on_prompt": int(coverage.on_prompt.sum()),
        "groups_crossing_splits": next((f.count for f in flags if f.check ==
                                        "group crosses splits"), 0),
        "flags": len(flags),
    }
    notes = prompt_notes([x for n in SPLITS for x in spans[n] or []]) + adapter_notes(task)
    return Inspection(task, splits, items, split_table, coverage, figures, flags, classes,
                      notes)


def adapter_notes(task: Task) -> list[Note]:
    """What a framework adapter mapped or left out (`adapter_notes`: from_hf's padding rows of
    label -100) and what its stand-ins gave the task's own code that the campaign will give
    otherwise (`campaign_differs_in`: a Trainer's estimated_stepping_batches)."""
    notes = [Note("what the adapter mapped", str(n), "-")
             for n in getattr(task, "adapter_notes", None) or []]
    differs = getattr(task, "campaign_differs_in", None) or {}
    if differs:
        said = "; ".join(f"{name} ({str(why).split(' here: ', 1)[-1]})"  # each run has its own
                         for name, why in sorted(differs.items()))
        notes.append(Note("the campaign will differ in", f"the task's code reads {said}",
                          "nothing to change: a schedule sized by these values follows the "
                          "pilot's run here and the campaign's own length there"))
    return notes


def run(params: dict[str, Any], out_dir: Path | None = None) -> Inspection:
    """Notebook 01 from its parameters (it writes nothing until `save`)."""
    return inspect_task(task_from_params(params), probe_size=params["probe_size"])


def save(ins: Inspection, out_dir: Path) -> str:
    """Write the tables and `summary.json` of notebook 01 into its run folder; the verdict."""
    from ..storage.files import write_json
    from ..storage.runs import save_table, write_summary

    save_table(ins.split_table, out_dir, "splits")
    save_table(ins.coverage, out_dir, "coverage")
    if ins.classes is not None:
        save_table(ins.classes.reset_index(), out_dir, "classes")
    write_json(out_dir / "flags.json", ins.flag_records())
    write_summary(out_dir, ins.verdict, ins.figures, task=ins.task.name,
                  flags=[f.check for f in ins.flags],
                  notes=[f"{n.check}: {n.message}" for n in ins.notes])
    return ins.verdict

"""The pilot workbook: evidence for every phase of a PyTorch training campaign, before renting.

The package is built in layers, each a folder that imports only the ones below it:
`commands` (the pilot, the CLI) > `notebooks` (one module per notebook capability) >
`training` (the one loop and its measurements) > `contract` (the task, its kinds, the adapters,
the data) > `storage` (run folders, files, the ledger, records) > `base` (errors, units).

Notebooks and users' task modules reach the public modules as attributes by their short names
(`wb.inspection`, `wb.adapters.from_hf`, `from workbook import campaign`): they load on first use,
so a process that needs few of them (a torchrun worker, a resume in a new process) starts quickly.
A dotted import names the layered module (`from workbook.contract.task import Task`).
"""

from __future__ import annotations

import importlib
from typing import Any

# The short name of each public module -> where it lives. A notebook's family is a package
# whose own module (`__init__`) is the notebook's entry (run, save), its parts beside it.
_MODULES = {
    "cli": "commands.cli", "params": "commands.params", "pilot": "commands.pilot",
    "report": "commands.report",
    # a notebook's entry module is found through its registry entry (`_location`); these are
    # the notebooks' other public modules
    "archive": "notebooks.resume.archive",
    "forward_failure": "notebooks.inspection.forward_failure", "plots": "notebooks.plots",
    "registry": "notebooks.registry",
    "campaign": "training.campaign", "checkpoint": "training.checkpoint",
    "deviation": "training.deviation",
    "loop": "training.loop", "memory": "training.memory", "predict": "training.predict",
    "replica": "training.replica", "sharded_replica": "training.sharded_replica",
    "sharding": "training.sharding", "workload": "training.workload",
    "adapters": "contract.adapters", "data": "contract.data", "kinds": "contract.kinds",
    "pipeline": "contract.pipeline", "state": "contract.state", "task": "contract.task",
    "artifacts": "storage.artifacts", "files": "storage.files", "ledger": "storage.ledger",
    "records": "storage.records", "runs": "storage.runs", "schemas": "storage.schemas",
    "errors": "base.errors", "frontend": "base.frontend",
    # what only the built-in samples use
    "ghost_batch_norm": "samples.ghost_batch_norm", "tokenizer": "samples.tokenizer",
}
_NAMES = {"encode_examples": "data", "load_examples": "data", "prepare": "data",
          "read_jsonl": "data", "split_examples": "data", "WorkbookError": "errors",
          "TrainConfig": "loop", "UpdateShape": "loop", "evaluate": "loop", "train": "loop",
          "IGNORE_INDEX": "task", "Task": "task", "load_task": "task",
          "CarriedState": "state"}


_LAYERS = {"commands", "notebooks", "training", "contract", "storage", "base", "samples"}


def _notebook_modules() -> list[str]:
    """Each notebook's entry module, as its registry entry names it (`wb.gates`, ...): adding a
    notebook adds no line here."""
    from .notebooks import registry

    return [entry.module for entry in registry.ENTRIES]


def _location(short: str) -> str | None:
    """Where a short name lives, below `workbook`: `_MODULES`, else a notebook's entry module."""
    if short in _MODULES:
        return _MODULES[short]
    if short in _LAYERS or short.startswith("_"):
        return None
    return f"notebooks.{short}" if short in _notebook_modules() else None


def _full(short: str) -> str:
    return f"{__name__}.{_location(short)}"


def __getattr__(name: str) -> Any:
    if name == "__all__":  # `from workbook import *`: read when asked, the notebooks included
        return __dir__()
    if name in _NAMES:
        return getattr(importlib.import_module(_full(_NAMES[name])), name)
    if _location(name) is not None:
        return importlib.import_module(_full(name))
    raise AttributeError(f"module 'workbook' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*_MODULES, *_NAMES, *_notebook_modules()})

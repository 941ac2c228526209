"""The pilot workbook: evidence for every phase of a PyTorch training campaign, before renting.

Notebooks import this package and call its top modules (one per notebook capability). The
modules load on first use, so a process that needs few of them (a torchrun worker, a resume in
a new process) starts quickly.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = ("accounting", "adapters", "archive", "artifacts", "campaign", "checkpoint",
            "frontend", "gates", "inspection", "loop", "memory", "overfit", "parallel", "params",
            "plots", "predict", "rental", "resume", "runs", "study", "variants")
_NAMES = {"encode_examples": "data", "load_examples": "data", "prepare": "data",
          "read_jsonl": "data", "split_examples": "data", "WorkbookError": "errors",
          "TrainConfig": "loop", "UpdateShape": "loop", "evaluate": "loop", "train": "loop",
          "IGNORE_INDEX": "task", "Task": "task", "load_task": "task"}
__all__ = sorted([*_MODULES, *_NAMES])


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'workbook' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__

"""The pilot workbook: evidence for every phase of a PyTorch training campaign, before renting.

Notebooks import this package and call its top modules (one per notebook capability).
"""

from . import (
    accounting,
    archive,
    artifacts,
    checkpoint,
    frontend,
    gates,
    inspection,
    loop,
    memory,
    overfit,
    params,
    plots,
    predict,
    rental,
    resume,
    runs,
    study,
    variants,
)
from .data import encode_examples, load_examples, prepare, read_jsonl, split_examples
from .errors import WorkbookError
from .loop import TrainConfig, UpdateShape, evaluate, train
from .task import IGNORE_INDEX, Task, load_task

__all__ = ["IGNORE_INDEX", "Task", "TrainConfig", "UpdateShape", "WorkbookError", "accounting",
           "archive", "artifacts", "checkpoint", "frontend", "rental", "resume",
           "encode_examples", "evaluate", "gates", "inspection", "load_examples", "load_task",
           "loop", "memory", "overfit", "params", "plots", "predict", "prepare", "read_jsonl",
           "runs", "split_examples", "study", "train", "variants"]

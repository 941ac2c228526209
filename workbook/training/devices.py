"""The device and precision a run asks for, checked: a missing GPU or a precision the device
cannot run is an error, never a silent fallback."""

from __future__ import annotations

import torch

from ..base.errors import WorkbookError
from ..contract.shape import PRECISIONS
from ..contract.task import Task


def resolve_device(name: str) -> torch.device:
    """"auto" picks CUDA when present; asking for CUDA without one is an error, not a fallback."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise WorkbookError("device 'cuda' was asked for but no CUDA GPU is visible",
                            "use device='cpu' or 'auto', or run on a machine with a GPU")
    if name != "cpu" and not name.startswith("cuda"):
        raise WorkbookError(f"unknown device {name!r}", "use 'cpu', 'cuda' or 'auto'")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:  # tensors report "cuda:0", not "cuda"
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_precision(precision: str, device: torch.device, task: Task | None = None) -> None:
    """Refuse a precision the device (or, given a task, the task's own train_step) cannot run,
    instead of silently falling back."""
    if precision not in PRECISIONS:
        raise WorkbookError(f"unknown precision {precision!r}", f"use one of {list(PRECISIONS)}")
    if precision == "fp16" and device.type != "cuda":
        raise WorkbookError("fp16 mixed precision needs CUDA (its GradScaler keeps small "
                            "gradients from vanishing); this run is on the CPU",
                            "use precision='bf16' or 'fp32' on the CPU")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise WorkbookError("this GPU does not support bf16", "use precision='fp16' or 'fp32'")
    if precision == "fp16" and task is not None and task.train_step is not None:
        raise WorkbookError("fp16 with the task's own train_step: the workbook's GradScaler "
                            "cannot reach inside it", "use precision 'bf16' or 'fp32' here "
                            "(a train_step that scales its own loss runs in fp32)")

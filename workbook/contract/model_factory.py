"""A task's model factory (`build_model`, `campaign_model`) run as the task's own code, and the
one model on the meta device it holds for the readers of shapes."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..base.errors import WorkbookError, reason


class ModelFactory:
    """A task's `build_model`, run as the task's own code: its failure names the piece, and
    anything but an `nn.Module` is refused with the fix (every notebook builds through it).
    `meta` holds the model built on the meta device once (`training.campaign.held_on_meta`),
    for the checks that only read its shapes."""

    def __init__(self, build: Callable[[], nn.Module], piece: str = "build_model"):
        self.build = build
        self.piece = piece
        self.meta: nn.Module | None = None

    def __call__(self) -> nn.Module:
        try:
            model = self.build()
        except (MemoryError, torch.OutOfMemoryError, WorkbookError):
            raise  # out of memory is the machine's answer, not a bug in the factory
        except Exception as exc:
            raise WorkbookError(f"the task's {self.piece} failed: {type(exc).__name__}: "
                                f"{reason(exc, 300)}",
                                f"fix {self.piece}: it receives no arguments and returns the "
                                "model") from exc
        if not isinstance(model, nn.Module):
            raise WorkbookError(f"the task's {self.piece} returned a {type(model).__name__}, not "
                                "a torch.nn.Module", "return the model itself (an nn.Module "
                                "instance, e.g. a transformers model), not a class, a tuple or "
                                "a state dict")
        return model

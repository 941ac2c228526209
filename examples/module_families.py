"""Small regression tasks on the standard torch.nn building blocks (convolutions with batch norm,
LSTM, GRU, multi-head attention over embeddings), on seeded synthetic inputs: what the memory
prediction is checked against (tests/training/test_predict_modules.py,
`benchmarks/memory_prediction.py --modules`).

    python -m workbook pilot --task examples.module_families:task \
        -p 'task_options={"family": "lstm"}'
"""

from __future__ import annotations

import torch
from torch import nn

import workbook as wb


class Recurrent(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = kind(6, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(self.attn(h, h, h, need_weights=False)[0].mean(1))


FAMILIES = {  # name: (model, one example's input)
    "conv2d+batchnorm": (lambda: nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
        nn.Flatten(), nn.Linear(8 * 10 * 10, 1)), lambda g: torch.randn(1, 12, 12, generator=g)),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(4, 16, 5), nn.ReLU(), nn.Flatten(),
                                     nn.Linear(16 * 28, 1)),
               lambda g: torch.randn(4, 32, generator=g)),
    "lstm": (lambda: Recurrent(nn.LSTM), lambda g: torch.randn(20, 6, generator=g)),
    "gru": (lambda: Recurrent(nn.GRU), lambda g: torch.randn(20, 6, generator=g)),
    "embedding+multihead-attention": (Attention, lambda g: torch.randint(0, 50, (24,),
                                                                          generator=g)),
}


def family_task(name: str) -> wb.Task:
    """The family `name` as a regression task."""
    build, example = FAMILIES[name]
    g = torch.Generator().manual_seed(0)
    data = [{"x": example(g), "labels": torch.randn(1, generator=g)} for _ in range(96)]
    return wb.Task(name=name, kind="regression",
                   load_examples=lambda: [{"id": i, "group": i} for i in range(len(data))],
                   encode=lambda ex: data[ex["id"]], collate=torch.utils.data.default_collate,
                   build_model=build, decode=lambda v: str(v), model_inputs=("x",))


def task(family: str = "conv2d+batchnorm") -> wb.Task:
    """One family as a regression task: 96 examples, one float target each."""
    if family not in FAMILIES:
        raise wb.WorkbookError(f"family {family!r} is not known", f"use one of {list(FAMILIES)}")
    return family_task(family)

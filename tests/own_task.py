"""A user's own task wrapped around a plain Dataset - the README's example, kept tested."""

import torch
from torch import nn
from torch.utils.data import Dataset

import workbook as wb


class Points(Dataset):
    """Two noisy clusters; patient ids are the groups (the unit of leakage)."""

    def __init__(self, n=256):
        g = torch.Generator().manual_seed(0)
        self.y = torch.randint(0, 2, (n,), generator=g)
        self.x = torch.randn(n, 4, generator=g) + (2.0 * self.y[:, None] - 1.0)
        self.patient = [f"p{i // 4}" for i in range(n)]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


data = Points()

task = wb.Task(
    name="my-points",
    kind="classification",
    load_examples=lambda: [{"id": i, "patient": data.patient[i],
                            "label": ["no", "yes"][int(data.y[i])]} for i in range(len(data))],
    encode=lambda ex: data[ex["id"]],
    collate=torch.utils.data.default_collate,
    build_model=lambda: nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)),
    decode=lambda ids: ", ".join(["no", "yes"][int(i)] for i in ids),
    group_key="patient",
    model_inputs=("x",),
    label_names=["no", "yes"],
    label_field="label",
)

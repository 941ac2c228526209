"""A plain PyTorch setup piloted in one call: a map-style `Dataset` returning `(image, label)`
tuples, torch's `default_collate`, a CNN with BatchNorm and Dropout, `nn.CrossEntropyLoss()`
(reduction "mean", as most training scripts have it) and AdamW - handed to
`workbook.adapters.from_torch` as they are. The images are examples/cnn_batchnorm.py's four
synthetic shapes; each source image's near-duplicates share a group (`group_of`).

    python -m workbook pilot --task examples.torch_dataset:task --smoke

`label_smoothing=0.1` passes through to the criterion. Without `group_of` every example would be
its own group and near-duplicates of one source would land in different splits: notebook 01
checks groups, not content, so name the unit of leakage.
"""

from __future__ import annotations

from torch import nn
from torch.utils.data import Dataset

import workbook as wb
from examples.cnn_batchnorm import CLASSES, Shapes, SmallCNN


class ShapeImages(Dataset):
    """The dataset as a user writes it: (image, label) tuples."""

    def __init__(self, sources: int = 96):
        self.shapes = Shapes(sources)

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: int):
        return self.shapes.images[i], self.shapes.labels[i]


def make_task(sources: int = 96, label_smoothing: float = 0.0) -> wb.Task:
    data = ShapeImages(sources)
    return wb.adapters.from_torch(
        data, SmallCNN, nn.CrossEntropyLoss(label_smoothing=label_smoothing),
        name="torch-dataset", fields=("image", "labels"), label_names=CLASSES,
        group_of=lambda i, item: data.shapes.sources[i], lr=3e-3)


task = make_task

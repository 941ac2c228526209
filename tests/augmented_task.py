"""A torchvision-free image task with random augmentation, as a training script has it: a
map-style `Dataset` whose `__getitem__` pads, randomly crops and randomly flips each image with
torch's global random stream (as torchvision's RandomCrop and RandomHorizontalFlip do), handed
to `workbook.adapters.from_torch`; the pilot reads it in DataLoader workers (07's workers
case, 09's ranks). `augment=False` is the same task without the randomness. The images are
examples/cnn_batchnorm.py's four synthetic shapes."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import workbook as wb
from examples.cnn_batchnorm import CLASSES, SIZE, Shapes

PAD = 2


class AugmentedShapes(Dataset):
    """(image, label) tuples; with `augment`, a random crop of the padded image and a random
    horizontal flip on every read."""

    def __init__(self, sources: int = 24, augment: bool = True):
        self.shapes, self.augment = Shapes(sources, copies=2), augment

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: int):
        image = self.shapes.images[i]
        if self.augment:
            padded = F.pad(image, (PAD, PAD, PAD, PAD))
            top, left = torch.randint(0, 2 * PAD + 1, (2,)).tolist()
            image = padded[:, top:top + SIZE, left:left + SIZE]
            if torch.rand(1).item() < 0.5:
                image = image.flip(-1)
        return image, self.shapes.labels[i]


class TinyCNN(nn.Module):
    def __init__(self, classes: int = len(CLASSES), width: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(1, width, 3, padding=1)
        self.fc = nn.Linear(width, classes)

    def forward(self, image):
        return self.fc(torch.relu(self.conv(image)).mean(dim=(2, 3)))


def make_task(sources: int = 24, augment: bool = True) -> wb.Task:
    data = AugmentedShapes(sources, augment)
    return wb.adapters.from_torch(
        data, TinyCNN, nn.CrossEntropyLoss(), name="augmented-shapes",
        fields=("image", "labels"), label_names=CLASSES,
        group_of=lambda i, item: data.shapes.sources[i], lr=3e-3)


task = make_task



class Examples(Dataset):
    """The training split as raw examples carrying their augmented item, read in the training
    loop's own DataLoader workers (examples/image_folder.py's idiom)."""

    def __init__(self, data: AugmentedShapes, ids: list[int]):
        self.data, self.ids = data, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, j: int) -> dict:
        i = self.ids[j]
        image, label = self.data[i]
        return {"id": i, "group": str(self.data.shapes.sources[i]), "label": CLASSES[label],
                "item": (image, label)}


def make_pipeline_task(sources: int = 24) -> wb.Task:
    """The same task trained from the user's own DataLoader: a seeded DistributedSampler, two
    workers that augment, its `generator` seeded once (as scripts write it)."""
    data = AugmentedShapes(sources)
    train = [i for i in range(len(data)) if wb.task.split_by_group_hash(
        str(data.shapes.sources[i]), (0.8, 0.1, 0.1)) == "train"]

    def train_pipeline(seed: int, rank: int = 0, world: int = 1):
        sampler = DistributedSampler(Examples(data, train), num_replicas=world, rank=rank,
                                     seed=seed)
        return DataLoader(sampler.dataset, batch_size=None, sampler=sampler, num_workers=2,
                          generator=torch.Generator().manual_seed(seed))

    return wb.adapters.from_torch(
        data, TinyCNN, nn.CrossEntropyLoss(), name="augmented-shapes-pipeline",
        fields=("image", "labels"), label_names=CLASSES,
        group_of=lambda i, item: data.shapes.sources[i], lr=3e-3,
        train_pipeline=train_pipeline)

"""Image classification written the way torchvision's reference scripts (and pytorch/examples'
imagenet/main.py) write it: class folders read by `datasets.ImageFolder(root, transform)`,
`RandomResizedCrop` + `RandomHorizontalFlip` + `ToTensor` + `Normalize` for training and
`Resize` + `CenterCrop` for validation, a `DataLoader` with `num_workers=2`,
`models.resnet18(num_classes=K)`, `nn.CrossEntropyLoss()` and SGD with momentum 0.9 and weight
decay 1e-4 over every parameter (the reference recipe's default) - handed to
`workbook.adapters.from_torch` as they are. Needs torchvision (not a workbook dependency).

    python -m workbook pilot --task examples.image_folder:task --smoke
    python -m workbook pilot --task examples.image_folder:task --smoke \
        --option val_missing_class=true                     # the planted class-map shift
    python -m examples.image_folder --out shapes/           # prepare the folders by hand

A prepare step writes small PNGs of synthetic shapes (six classes, deterministic: each image's
shape, place, size and colours come from its split, class and number) into `train/<class>/`
and `val/<class>/` under a cache folder (`IMAGE_FOLDER_CACHE`, default a `workbook-image-folder`
folder in the temporary directory), written atomically - a temporary folder, then
`os.replace` - as examples/token_stream.py prepares its file. `data_dir` points at your own
folder with `train/` and `val/` instead, used as it is.

The training loop's data is the DataLoader a campaign iterates (`train_pipeline`): the training
split's examples, each carrying its `(image, label)` item, read and augmented in the loader's
two worker processes, ordered by a `DistributedSampler` seeded as the reference script seeds
it (one rank per process under torchrun).

Options: `val_missing_class` (False; True plants the bug: `val/` has no `diamond` folder, so
`ImageFolder` numbers the validation classes after it one lower than training does - every
label after the gap names another class, the loss computes and the wrong task is learned),
`augment` (True: the random crop and flip; False: training images resized and centre-cropped
as validation's), `per_class` (training images per class; validation gets a quarter),
`image_size` (the crop, 32 px), `lr` (0.1, the reference's).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import workbook as wb

CLASSES = ("circle", "cross", "diamond", "ring", "square", "triangle")  # ImageFolder's order
MISSING = "diamond"  # the class folder `val_missing_class` leaves out of val/
STORED = 40  # side of the stored PNGs, in pixels
FORMAT = 1  # bump when the prepared images change, so an old cached folder is not reused
CACHE_DIR = Path(os.environ.get("IMAGE_FOLDER_CACHE")
                 or Path(tempfile.gettempdir()) / "workbook-image-folder")
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # the reference's ImageNet statistics


# ---------------------------------------------------------------------------------------------
# prepare: synthetic shapes -> train/<class>/*.png and val/<class>/*.png


def draw(shape: str, seed: str, size: int = STORED) -> Image.Image:
    """One image of `shape`: a light shape of random size, place and colour on a dark random
    background, the same for the same seed."""
    rng = random.Random(seed)
    back = tuple(rng.randrange(0, 90) for _ in range(3))
    fore = tuple(rng.randrange(150, 256) for _ in range(3))
    img = Image.new("RGB", (size, size), back)
    pen = ImageDraw.Draw(img)
    r = rng.uniform(0.22, 0.36) * size
    cx, cy = (rng.uniform(r + 1, size - r - 1) for _ in range(2))
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        pen.ellipse(box, fill=fore)
    elif shape == "ring":
        pen.ellipse(box, outline=fore, width=max(2, int(r / 3)))
    elif shape == "square":
        pen.rectangle(box, fill=fore)
    elif shape == "diamond":
        pen.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fore)
    elif shape == "triangle":
        pen.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fore)
    elif shape == "cross":
        w = r / 3
        pen.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fore)
        pen.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fore)
    else:
        raise ValueError(f"no shape {shape!r}; the shapes are {CLASSES}")
    return img


def write_folders(root: Path, per_class: int, val_missing_class: bool = False) -> Path:
    """train/<class>/ and val/<class>/ under `root` (validation: a quarter of `per_class`, at
    least 2), `val/diamond/` left out when `val_missing_class`."""
    for split, n in (("train", per_class), ("val", max(2, per_class // 4))):
        for cls in CLASSES:
            if split == "val" and val_missing_class and cls == MISSING:
                continue
            folder = root / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(n):
                draw(cls, f"{split}-{cls}-{k}").save(folder / f"{cls}_{k:04d}.png")
    return root


def prepared(per_class: int, val_missing_class: bool = False) -> Path:
    """The cached folders for these settings, written on first use (atomically)."""
    name = f"shapes-v{FORMAT}-{per_class}" + (f"-val-without-{MISSING}" if val_missing_class
                                              else "")
    root = CACHE_DIR / name
    if root.is_dir():
        return root
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE_DIR))
    write_folders(scratch, per_class, val_missing_class)
    try:
        os.replace(scratch, root)
    except OSError:  # another process prepared it first
        shutil.rmtree(scratch, ignore_errors=True)
    return root


# ---------------------------------------------------------------------------------------------
# the datasets, the loader and the model, as the reference scripts write them


def transforms(image_size: int, augment: bool):
    """(train, val) transforms: the reference's random resized crop and flip, or validation's
    resize and centre crop for both."""
    from torchvision import transforms as T

    normalize = T.Normalize(mean=MEAN, std=STD)
    val = T.Compose([T.Resize(int(image_size * 1.15)), T.CenterCrop(image_size), T.ToTensor(),
                     normalize])
    train = T.Compose([T.RandomResizedCrop(image_size, scale=(0.5, 1.0)),
                       T.RandomHorizontalFlip(), T.ToTensor(), normalize]) if augment else val
    return train, val


class TrainExamples(Dataset):
    """The training split as the pilot's examples, each carrying its `(image, label)` item:
    the transform (the random crop and flip) runs where an item is read - in a DataLoader
    worker."""

    def __init__(self, data: Dataset):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, j: int) -> dict:
        image, label = self.data[j]
        return {"id": j, "group": f"train-{j}", "split": "train",
                "label": self.data.classes[label], "item": (image, label)}


def train_pipeline(data: Dataset, seed: int, rank: int = 0, world: int = 1) -> DataLoader:
    """The training loop's loader: a DistributedSampler (shuffled, seeded, one share per
    rank) and two worker processes that read and augment the images; one example at a time
    (the pilot makes the micro-batches)."""
    sampler = DistributedSampler(TrainExamples(data), num_replicas=world, rank=rank,
                                 shuffle=True, seed=seed)
    return DataLoader(sampler.dataset, batch_size=None, sampler=sampler, num_workers=2,
                      generator=torch.Generator().manual_seed(seed))


def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The reference recipe's SGD: momentum 0.9, weight decay 1e-4 on every parameter."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)


def make_task(val_missing_class: bool = False, augment: bool = True, per_class: int = 24,
              image_size: int = 32, lr: float = 0.1, data_dir: str = "") -> wb.Task:
    from functools import partial

    from torchvision import datasets, models

    root = Path(data_dir) if data_dir else prepared(per_class, val_missing_class)
    train_tf, val_tf = transforms(image_size, augment)
    train = datasets.ImageFolder(root / "train", train_tf)
    val = datasets.ImageFolder(root / "val", val_tf)
    return wb.adapters.from_torch(
        {"train": train, "validation": val},
        partial(models.resnet18, num_classes=len(train.classes)), nn.CrossEntropyLoss(),
        name="image-folder", fields=("image", "labels"), label_names=train.classes,
        build_optimizer=build_optimizer, lr=lr,
        train_pipeline=partial(train_pipeline, train))


task = make_task


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the synthetic shapes as train/<class>/ "
                                     "and val/<class>/ PNG folders.")
    parser.add_argument("--out", required=True, help="the folder to write (created)")
    parser.add_argument("--per-class", type=int, default=24)
    parser.add_argument("--val-missing-class", action="store_true")
    args = parser.parse_args(argv)
    root = write_folders(Path(args.out), args.per_class, args.val_missing_class)
    print(f"wrote {sum(1 for _ in root.rglob('*.png'))} images under {root}")


if __name__ == "__main__":
    main()

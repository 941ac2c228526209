"""A small image classifier written the way a PyTorch user writes one, wrapped as a `wb.Task`:
1x16x16 synthetic images of four shapes (blob, horizontal / vertical stripes, checkerboard),
made deterministically in memory. Each "source" image has a few noisy near-duplicates, so the
source is the group (near-duplicates must share a split). The model is Conv2d + BatchNorm2d +
ReLU + Dropout blocks; the task brings its own update (`train_step`, which starts with
`model.train()`, weighs each micro-batch's mean by its share of the update's targets, clips at
1.0 and returns `{"loss": tensor}`), evaluation (`eval_step`), checkpoint files
(`save_state`/`restore_state`, one `torch.save` file per object), sampler, learning rate and
optimizer with parameter groups by name.

    python -m workbook pilot --task examples.cnn_batchnorm:task --smoke

Planted bugs (task options): `step_mean_per_micro_batch` (each micro-batch's mean is
back-propagated as is), `eval_counts_padding` (eval_step counts the padding copies: len(batch)
as the count, example_weight ignored), `eval_leaves_eval_mode` (eval_step leaves the model in
eval mode), `restore_reseeds_sampler` (restore_state reseeds the sampler instead of loading its
state), `lr_typo` (lr 3e3 instead of 3e-3), `ckpt_without_optimizer` (no optimizer file).
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import workbook as wb

CLASSES = ["blob", "horizontal", "vertical", "checker"]
SIZE = 16
LR = 3e-3
MAX_GRAD_NORM = 1.0


class Shapes(Dataset):
    """`sources` base images (class = source % 4), each with `copies` noisy near-duplicates."""

    def __init__(self, sources: int = 96, copies: int = 4, noise: float = 0.15, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        yy, xx = torch.meshgrid(torch.arange(SIZE).float(), torch.arange(SIZE).float(),
                                indexing="ij")
        images, self.labels, self.sources = [], [], []
        for s in range(sources):
            label = s % len(CLASSES)
            period = 2.0 + float(torch.randint(0, 3, (1,), generator=g))
            phase = float(torch.rand(1, generator=g)) * 2 * math.pi
            cy, cx = (3 + 10 * torch.rand(2, generator=g)).tolist()
            if label == 0:
                base = torch.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 6.0)
            elif label == 1:
                base = 0.5 + 0.5 * torch.sin(2 * math.pi * yy / period + phase)
            elif label == 2:
                base = 0.5 + 0.5 * torch.sin(2 * math.pi * xx / period + phase)
            else:
                base = ((yy // period + xx // period) % 2).float()
            for _ in range(copies):
                images.append(base + noise * torch.randn(SIZE, SIZE, generator=g))
                self.labels.append(label)
                self.sources.append(f"src{s:03d}")
        x = torch.stack(images)[:, None]
        self.images = (x - x.mean()) / x.std()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"image": self.images[i], "labels": torch.tensor(self.labels[i])}


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, p: float):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.drop = nn.Dropout(p)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        return self.pool(self.drop(F.relu(self.bn(self.conv(x)))))


class SmallCNN(nn.Module):
    def __init__(self, classes: int = len(CLASSES), width: int = 16, p: float = 0.1):
        super().__init__()
        self.blocks = nn.Sequential(ConvBlock(1, width, p), ConvBlock(width, 2 * width, p))
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, image):
        x = self.blocks(image).mean(dim=(2, 3))  # global average pool
        return self.fc(self.drop(x))


def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and batch-norm parameters (picked by name)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            no_decay_name = name.endswith("bias") or ".bn." in name
            (no_decay if no_decay_name else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr)


def train_step(model, optimizer, micro_batches, mean_per_micro_batch=False):
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = sum(int((mb["labels"] != -100).sum()) for mb in micro_batches)
    running = 0.0
    for mb in micro_batches:
        n = int((mb["labels"] != -100).sum())
        loss = F.cross_entropy(model(mb["image"]), mb["labels"])  # mean over the micro-batch
        (loss if mean_per_micro_batch else loss * (n / total)).backward()
        running = running + loss.detach() * n
    nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    return {"loss": running / total}


@torch.no_grad()
def eval_step(model, batch, counts_padding=False, leaves_eval_mode=False):
    was_training = model.training
    model.eval()
    logits = model(batch["image"])
    labels = batch["labels"]
    weight = batch.get("example_weight", torch.ones_like(labels, dtype=torch.float))
    losses = F.cross_entropy(logits, labels, reduction="none")  # 0 where label == -100
    correct = (logits.argmax(-1) == labels).float()
    if counts_padding:
        count = float(len(labels))
    else:
        real = (labels != -100).float() * weight
        losses, correct, count = losses * real, correct * real, float(real.sum())
    if not leaves_eval_mode:
        model.train(was_training)
    return {"loss": (float(losses.sum()), count), "accuracy": (float(correct.sum()), count)}


class RandomOrder:
    """Like RandomSampler with its own generator, but resumable: the generator's state is the
    sampler's state, so the next pass's order comes back after a restart."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self):
        return self.n

    def __iter__(self):
        yield from torch.randperm(self.n, generator=self.generator).tolist()

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


def save_state(folder, objects, skip_optimizer=False):
    for name, obj in objects.items():
        if obj is None or (skip_optimizer and name == "optimizer"):
            continue
        torch.save(obj.state_dict(), Path(folder) / f"{name}.pt")


def restore_state(folder, objects, reseed_sampler=False):
    for name, obj in objects.items():
        path = Path(folder) / f"{name}.pt"
        if obj is None:
            continue
        if name == "sampler" and reseed_sampler:
            obj.generator.manual_seed(obj.seed)  # the bug: start the order over
        elif path.exists():
            obj.load_state_dict(torch.load(path, weights_only=True))


def make_task(sources: int = 96, step_mean_per_micro_batch: bool = False,
              eval_counts_padding: bool = False, eval_leaves_eval_mode: bool = False,
              restore_reseeds_sampler: bool = False, lr_typo: bool = False,
              ckpt_without_optimizer: bool = False) -> wb.Task:
    data = Shapes(sources)
    return wb.Task(
        name="cnn-batchnorm", kind="classification",
        load_examples=lambda: [{"id": i, "source": data.sources[i],
                                "shape": CLASSES[data.labels[i]]} for i in range(len(data))],
        encode=lambda ex: data[ex["id"]],
        collate=torch.utils.data.default_collate,
        build_model=SmallCNN,
        decode=lambda ids: ", ".join(CLASSES[int(i)] if 0 <= int(i) < len(CLASSES)
                                     else f"<{int(i)}?>" for i in ids),
        build_optimizer=build_optimizer, lr=3e3 if lr_typo else LR,
        train_step=partial(train_step, mean_per_micro_batch=step_mean_per_micro_batch),
        eval_step=partial(eval_step, counts_padding=eval_counts_padding,
                          leaves_eval_mode=eval_leaves_eval_mode),
        make_sampler=RandomOrder,
        save_state=partial(save_state, skip_optimizer=ckpt_without_optimizer),
        restore_state=partial(restore_state, reseed_sampler=restore_reseeds_sampler),
        model_inputs=("image",), group_key="source",
        label_names=CLASSES, label_field="shape")


task = make_task

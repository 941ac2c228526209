"""Tiny tasks for notebook 06's range test and study: labels a linear rule gives the inputs
(learnable), the same inputs with labels drawn at random (nothing to learn: the planted
flat-loss task), the learnable one under plain SGD, whose good rate is near 1 - far above
the usual 1e-3 (and 1e-4, the study's old default control) - and under an optimizer that sets
its own step whatever the rate (a normalised step, as Adafactor's relative_step does), and
with a warm-up of 5,000 updates, far past any study's budget."""

import torch
from torch import nn

import workbook as wb

N, D, C = 640, 8, 4


def _data(random_labels: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    y = (x @ torch.randn(D, C, generator=g)).argmax(1)
    if random_labels:  # balanced, and independent of the inputs
        y = torch.randperm(N, generator=g) % C
    return x, y


def make(random_labels: bool = False, optimizer=None) -> wb.Task:
    x, y = _data(random_labels)
    return wb.Task(
        name="random-labels" if random_labels else "linear-rule",
        kind="classification",
        load_examples=lambda: [{"id": i, "group": f"g{i}", "label": str(int(y[i]))}
                               for i in range(N)],
        encode=lambda ex: {"x": x[ex["id"]], "labels": y[ex["id"]]},
        collate=torch.utils.data.default_collate,
        build_model=lambda: nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Linear(32, C)),
        decode=lambda ids: ", ".join(str(int(i)) for i in ids),
        model_inputs=("x",),
        label_names=[str(c) for c in range(C)],
        label_field="label",
        **({"build_optimizer": optimizer} if optimizer else {}))


def _sgd(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr)


class OwnStep(torch.optim.Optimizer):
    """Steps every weight by 0.01 x its gradient's sign: the rate it is given is ignored."""

    def __init__(self, params, lr=None):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-0.01)


def _own_step(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return OwnStep(model.parameters())


def _long_warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / 5000))


separable = make()
shuffled = make(random_labels=True)
sgd = make(optimizer=_sgd)
own_step = make(optimizer=_own_step)
long_warmup = make()
long_warmup.build_scheduler = _long_warmup

"""Tasks for the fifth blind set on notebook 06 (the learning-rate study), each written as the
public paper, script or docs page it comes from, as a `wb.Task`:

- `horizon` (`noise=1.0`, planted; `noise=0.0`, twin): the noisy quadratic of Wu et al. 2018,
  "Understanding Short-Horizon Bias in Stochastic Meta-Optimization" (https://arxiv.org/abs/
  1803.02021): linear regression trained from zero by constant-lr `torch.optim.SGD`. With label
  noise (planted) each rate settles at a noise floor that grows with the rate, so which rate is
  best depends on the horizon: the larger rate leads early, the smaller one still falls at the
  budget's end and overtakes soon after (the tuning playbook's "Deciding how long to train when
  training is compute-bound", on tuning runs shorter than the final one: https://github.com/
  google-research/tuning_playbook). Without noise (twin: curvatures spread over two decades,
  so the curves are power-law-like time-stretched copies) the smaller rate trails at a steady,
  growing ratio and never overtakes, though every curve still falls at its last update.
- `glue` (`num_warmup_steps=500`, planted; `2`, twin): transformers' `run_glue_no_trainer.py`
  classifier (the tiny BERT of `warmup_lr_zero.py`), `AdamW` with the no-decay groups and
  `get_linear_schedule_with_warmup(optimizer, num_warmup_steps=..., num_training_steps=...)`
  stepped per update. A warm-up of 500 updates is far longer than 06's budget: every trial runs
  at a few percent of its nominal rate or less.
- `adafactor` (`relative_step=True`, planted; `False`, twin): the same classifier under
  `transformers.optimization.Adafactor`, as its docstring writes it
  (https://huggingface.co/docs/transformers/main_classes/optimizer_schedules#transformers.Adafactor):
  `Adafactor(model.parameters(), scale_parameter=True, relative_step=True, warmup_init=True,
  lr=None)` sets its own step (min(1e-6 * t, 1 / sqrt(t)) scaled by each tensor's RMS) and
  ignores the rate it is given; the twin `Adafactor(model.parameters(), scale_parameter=False,
  relative_step=False, warmup_init=False, lr=lr)` steps by the rate.
"""

from __future__ import annotations

import torch
from torch import nn

import workbook as wb

from . import warmup_lr_zero as glue_task

DIM = 64


def regression_data(n: int, noise: float, seed: int = 1):
    """x ~ N(0, diag(h)), y = x . w* + noise * N(0, 1). Planted (noise 1): every curvature 1,
    w* ~ N(0, 0.17^2); twin (noise 0): curvatures 0.01 .. 1, w* ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.ones(DIM) if noise else torch.logspace(-2, 0, DIM)
    x = torch.randn(n, DIM, generator=g) * h.sqrt()
    w_star = torch.randn(DIM, generator=g) * (0.17 if noise else 1.0)
    y = x @ w_star + noise * torch.randn(n, generator=g)
    return x, y[:, None]


def linear_model() -> nn.Module:
    model = nn.Linear(DIM, 1)
    nn.init.zeros_(model.weight)  # "trained from zero", as the noisy quadratic starts
    nn.init.zeros_(model.bias)
    return model


def sgd(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr)  # no momentum


def sgd_step(model: nn.Module, optimizer, micro_batches: list[dict]) -> float:
    """One minibatch SGD step on the mean squared error of the update's examples (no clipping:
    the paper's update)."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(int(b["labels"].numel()) for b in micro_batches)
    summed = 0.0
    for b in micro_batches:
        error = (model(b["features"]) - b["labels"]) ** 2
        (error.sum() / total).backward()
        summed += float(error.detach().sum())
    optimizer.step()
    return summed / total


def constant(optimizer: torch.optim.Optimizer):
    """The paper's constant rate from the first update (no warm-up)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def horizon_task(noise: float = 1.0, n: int = 2048, own_step: bool = True) -> wb.Task:
    """`own_step=False`: the workbook's own update on the same task, which says it does not clip
    (`grad_clip=None`)."""
    x, y = regression_data(n, noise)
    step = {"train_step": sgd_step} if own_step else {}
    return wb.Task(
        name="blind-noisy-quadratic" if noise else "blind-quadratic", kind="regression",
        load_examples=lambda: [{"id": i, "group": i} for i in range(n)],
        encode=lambda ex: {"features": x[ex["id"]], "labels": y[ex["id"]]},
        collate=torch.utils.data.default_collate, build_model=linear_model,
        decode=lambda values: ", ".join(f"{v:.3g}" for v in values),
        build_optimizer=sgd, build_scheduler=constant, grad_clip=None,
        model_inputs=("features",), options={"noise": noise}, **step)


def adamw_groups(model: nn.Module, lr: float, weight_decay: float = 0.01):
    """run_glue_no_trainer.py: "Split weights in two groups, one with weight decay and the other
    not." """
    no_decay = ["bias", "LayerNorm.weight"]
    return torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n for nd in no_decay)], "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in n for nd in no_decay)], "weight_decay": 0.0}], lr=lr)


def linear_warmup(num_warmup_steps: int, max_train_steps: int):
    def build_scheduler(optimizer):
        from transformers import get_linear_schedule_with_warmup

        return get_linear_schedule_with_warmup(optimizer, num_warmup_steps=num_warmup_steps,
                                               num_training_steps=max_train_steps)
    return build_scheduler


def adafactor(relative_step: bool):
    def build_optimizer(model: nn.Module, lr: float):
        from transformers.optimization import Adafactor

        if relative_step:  # the docstring's "others reported" combination: lr=None
            return Adafactor(model.parameters(), scale_parameter=True, relative_step=True,
                             warmup_init=True, lr=None)
        return Adafactor(model.parameters(), scale_parameter=False, relative_step=False,
                         warmup_init=False, lr=lr)
    return build_optimizer


def glue(optimizer: str = "adamw", num_warmup_steps: int = 0, max_train_steps: int = 5000,
         relative_step: bool = True, n: int = 240) -> wb.Task:
    if optimizer == "adamw":
        extra = {"build_optimizer": adamw_groups,
                 "build_scheduler": linear_warmup(num_warmup_steps, max_train_steps)}
    else:
        extra = {"build_optimizer": adafactor(relative_step)}
    labels = glue_task.LABELS
    return wb.Task(
        name=f"blind-glue-{optimizer}", kind="classification",
        load_examples=lambda: glue_task.sentences(n), encode=glue_task.encode,
        collate=glue_task.collate, build_model=glue_task.build_model,
        decode=lambda ids: ", ".join(labels[int(i)] for i in ids),
        decode_input=lambda ids: " ".join(glue_task.VOCAB[int(i)] for i in ids),
        id_key="idx", group_key="review", label_names=labels, label_field="label",
        model_inputs=("input_ids", "attention_mask"), lr=3e-3,  # the script's --learning_rate
        options={"optimizer": optimizer, "num_warmup_steps": num_warmup_steps,
                 "relative_step": relative_step}, **extra)


def task(kind: str = "horizon", **options) -> wb.Task:
    return horizon_task(**options) if kind == "horizon" else glue(**options)


def train_plainly(kind: str, updates: int, lr: float, batch: int = 4, **options) -> list[float]:
    """The task's own pieces in a plain PyTorch loop (no workbook loop): build, optimizer,
    scheduler, `updates` steps on shuffled batches; the loss of each update."""
    t = task(kind, **options)
    torch.manual_seed(0)
    model = t.build_model()
    optimizer = t.build_optimizer(model, lr)
    scheduler = t.build_scheduler(optimizer) if t.build_scheduler else None
    examples = [t.encode(ex) for ex in t.load_examples()]
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(0)).tolist()
    losses = []
    for step in range(updates):
        rows = [examples[order[(step * batch + j) % len(order)]] for j in range(batch)]
        b = t.collate(rows)
        if kind == "horizon":
            loss = ((model(b["features"]) - b["labels"]) ** 2).mean()
        else:
            loss = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                         labels=b["labels"]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses

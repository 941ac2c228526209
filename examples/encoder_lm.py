"""A causal byte-level language model on `nn.TransformerEncoder` (dropout 0.1) written the way
a PyTorch user writes one, wrapped as a `wb.Task` of kind "generation": the generation sample's
instruction -> response pairs and its `encode` (labels already shifted, -100 on the prompt),
with the user's own left-padding collate; positions come from the attention mask and padded
keys are masked in attention. The task brings its own update (`train_step`: `model.train()`
first, summed token losses divided once by the update's target tokens, clipping at 1.0, one
step, a tensor back), evaluation (`eval_step`: token loss and accuracy, and whole-response
exact match per example), checkpoint (a nanoGPT-like `ckpt.pt`: model, optimizer, model args,
iteration), sampler (seed + pass counter), learning rate and optimizer groups by name.

    python -m workbook pilot --task examples.encoder_lm:task --smoke

Planted bugs (task options): `step_mean_per_micro_batch` (each micro-batch's mean is
back-propagated as is), `step_drops_mask` (train_step calls the model without the attention
mask on left-padded batches, so its loss differs from the task's `loss`),
`eval_counts_padding` (eval_step counts every row of the batch for exact match, padding copies
included, example_weight ignored), `eval_leaves_eval_mode` (eval_step leaves the model in eval
mode), `restore_reseeds_sampler` (restore_state rebuilds the sampler from its seed instead of
loading its state), `lr_typo` (lr 2e3 instead of 2e-3), `ckpt_without_optimizer`.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import workbook as wb
from workbook import tokenizer as tok
from workbook.samples import DATA_DIR
from workbook.samples.generation import encode, generate

LR = 2e-3  # tiny model: a high-ish Adam lr
MAX_GRAD_NORM = 1.0
MODEL_ARGS = dict(vocab=tok.VOCAB_SIZE, d_model=64, layers=2, heads=4, context=128, dropout=0.1)


def collate(items):
    """Left-pad to the longest: <pad> inputs, -100 labels, attention mask 0 on padding."""
    width = max(len(it["input_ids"]) for it in items)

    def left_pad(key, value, dtype):
        out = torch.full((len(items), width), value, dtype=dtype)
        for row, it in enumerate(items):
            if len(it[key]):
                out[row, -len(it[key]):] = it[key]
        return out
    batch = {"input_ids": left_pad("input_ids", tok.PAD, torch.long),
             "labels": left_pad("labels", -100, torch.long),
             "prompt_mask": left_pad("prompt_mask", False, torch.bool)}
    lengths = torch.tensor([len(it["input_ids"]) for it in items])
    batch["attention_mask"] = (torch.arange(width) >= width - lengths[:, None]).long()
    return batch


class EncoderLM(nn.Module):
    def __init__(self, vocab, d_model, layers, heads, context, dropout):
        super().__init__()
        self.heads = heads
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab)

    def forward(self, input_ids, attention_mask=None):
        B, T = input_ids.shape
        dev = input_ids.device
        blocked = torch.ones(T, T, dtype=torch.bool, device=dev).triu(1)  # the future
        if attention_mask is None:
            pos = torch.arange(T, device=dev).expand(B, T)
        else:
            pos = (attention_mask.cumsum(1) - 1).clamp(min=0)
            # padded keys are blocked; a padded query still sees itself (no all-masked row)
            blocked = (blocked | (attention_mask == 0)[:, None, :]) & \
                ~torch.eye(T, dtype=torch.bool, device=dev)
            blocked = blocked.repeat_interleave(self.heads, dim=0)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        return self.lm_head(self.ln_f(self.encoder(x, mask=blocked)))


def build_optimizer(model, lr):
    """AdamW: decay on matrices, none on biases, LayerNorms and embeddings (by name)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        skip = name.endswith("bias") or "norm" in name or "ln_" in name or "_emb" in name
        (no_decay if skip else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def train_step(model, optimizer, micro_batches, mean_per_micro_batch=False, drop_mask=False):
    model.train()
    optimizer.zero_grad(set_to_none=True)
    n_targets = sum(int((mb["labels"] != -100).sum()) for mb in micro_batches)
    total = 0.0
    for mb in micro_batches:
        if drop_mask:
            logits = model(mb["input_ids"])
        else:
            logits = model(mb["input_ids"], attention_mask=mb["attention_mask"])
        flat = logits.view(-1, logits.size(-1))
        if mean_per_micro_batch:
            loss = F.cross_entropy(flat, mb["labels"].view(-1), ignore_index=-100)
            loss.backward()
            total = total + loss.detach() * int((mb["labels"] != -100).sum())
        else:
            loss = F.cross_entropy(flat, mb["labels"].view(-1), ignore_index=-100,
                                   reduction="sum")
            (loss / n_targets).backward()
            total = total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    return total / n_targets


@torch.no_grad()
def eval_step(model, batch, counts_padding=False, leaves_eval_mode=False):
    was_training = model.training
    model.eval()
    labels = batch["labels"]
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    nll = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    mask = labels != -100
    hit = (logits.argmax(-1) == labels) | ~mask
    exact = hit.all(dim=1).float()  # a row without targets (a padding copy) is vacuously right
    if counts_padding:
        rows = float(len(labels))
    else:
        weight = batch.get("example_weight", torch.ones(len(labels), device=labels.device))
        exact, rows = exact * weight, float(weight.sum())
    if not leaves_eval_mode:
        model.train(was_training)
    n = float(mask.sum())
    return {"loss": (float(nll.sum()), n), "accuracy": (float((hit & mask).sum()), n),
            "exact_match": (float(exact.sum()), rows)}


class SeededEpochs:
    """seed + pass number -> permutation; the pass counter is the state."""

    def __init__(self, n, seed):
        self.n, self.seed, self.epoch = n, seed, 0

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        self.epoch += 1
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self):
        return self.n

    def state_dict(self):
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.seed, self.epoch = state["seed"], state["epoch"]


def save_state(folder, objects, skip_optimizer=False):
    ckpt = {"model": objects["model"].state_dict(), "model_args": MODEL_ARGS}
    for key in ("optimizer", "scheduler", "scaler", "sampler", "step"):
        if objects.get(key) is not None and not (skip_optimizer and key == "optimizer"):
            ckpt[key] = objects[key].state_dict()
    torch.save(ckpt, Path(folder) / "ckpt.pt")


def restore_state(folder, objects, reseed_sampler=False):
    ckpt = torch.load(Path(folder) / "ckpt.pt", map_location="cpu", weights_only=True)
    objects["model"].load_state_dict(ckpt["model"])
    for key in ("optimizer", "scheduler", "scaler", "sampler", "step"):
        obj = objects.get(key)
        if obj is None or key not in ckpt:
            continue
        if key == "sampler" and reseed_sampler:
            obj.__init__(obj.n, obj.seed)  # the bug: a fresh sampler, the order starts over
        else:
            obj.load_state_dict(ckpt[key])


def make_task(max_length: int = 64, step_mean_per_micro_batch: bool = False,
              step_drops_mask: bool = False, eval_counts_padding: bool = False,
              eval_leaves_eval_mode: bool = False, restore_reseeds_sampler: bool = False,
              lr_typo: bool = False, ckpt_without_optimizer: bool = False) -> wb.Task:
    return wb.Task(
        name="encoder-lm", kind="generation",
        load_examples=partial(wb.read_jsonl, DATA_DIR / "generation.jsonl"),
        encode=partial(encode, max_length=max_length, prompt_in_loss=False),
        collate=collate,
        build_model=partial(EncoderLM, **MODEL_ARGS),
        decode=partial(tok.decode, keep_special=True), generate=generate,
        build_optimizer=build_optimizer, lr=2e3 if lr_typo else LR,
        train_step=partial(train_step, mean_per_micro_batch=step_mean_per_micro_batch,
                           drop_mask=step_drops_mask),
        eval_step=partial(eval_step, counts_padding=eval_counts_padding,
                          leaves_eval_mode=eval_leaves_eval_mode),
        make_sampler=SeededEpochs,
        save_state=partial(save_state, skip_optimizer=ckpt_without_optimizer),
        restore_state=partial(restore_state, reseed_sampler=restore_reseeds_sampler),
        group_key="conversation", prompt_field="instruction", response_field="response")


task = make_task

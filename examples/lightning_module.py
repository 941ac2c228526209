"""A LightningModule and LightningDataModule written the way Lightning's documentation writes
them, piloted with `workbook.adapters.from_lightning` as they are: a small causal Transformer
language model (dropout 0.1) on the generation sample's text, the training set packed into
blocks of 64 bytes (as Hugging Face's `group_texts` does), validation on whole examples padded
per batch (`validation_step` logs its token mean with `batch_size` = its tokens, so the epoch's
`val_loss` is a mean over tokens whatever the batch size), `training_step` returning the token
mean with `self.log`, AdamW with a warm-up
scheduler stepped per update, and `on_save_checkpoint` / `on_load_checkpoint` hooks.

    python -m workbook pilot --task examples.lightning_module:task --smoke

Planted bugs (task options), each named by a notebook:
- `padded_training`: the training set as whole examples padded per batch instead of packed
  blocks. `training_step`'s per-micro-batch mean is then weighted by micro-batch, not by
  token, once `accumulate_grad_batches` > 1 (04).
- `val_counts_padding`: `validation_step` averages over every position, padding included, so
  06's `val_loss` depends on how the validation set is batched (04's evaluation check).
- `drop_optimizer_state`: `on_load_checkpoint` empties the optimizer's moments (07).
"""

from __future__ import annotations

import hashlib
import json

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import workbook as wb
from workbook import tokenizer as tok
from workbook.samples import DATA_DIR

BLOCK = 64


def text_of(row: dict) -> list[int]:
    return [tok.BOS, *tok.encode(f"{row['instruction']}\n{row['response']}"), tok.EOS]


class Blocks(Dataset):
    """Every text's bytes concatenated and cut into blocks: (inputs, next bytes)."""

    def __init__(self, ids: list[int], block: int):
        self.ids = torch.tensor(ids)
        self.block = block

    def __len__(self):
        return (len(self.ids) - 1) // self.block

    def __getitem__(self, i):
        chunk = self.ids[i * self.block: (i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


class Examples(Dataset):
    """One example per item: (inputs, next bytes), of its own length."""

    def __init__(self, texts: list[list[int]]):
        self.texts = [torch.tensor(t) for t in texts]

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return self.texts[i][:-1], self.texts[i][1:]


def pad_collate(items):
    """Right-pad to the longest: <pad> inputs, -100 targets."""
    xs, ys = zip(*items, strict=True)
    x = nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=tok.PAD)
    y = nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=-100)
    return x, y


class TextDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 8, conversations: int = 300, padded_training=False):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage=None):
        rows = [json.loads(line) for line in (DATA_DIR / "generation.jsonl").open()]
        keep = sorted({r["conversation"] for r in rows})[: self.hparams.conversations]
        rows = [r for r in rows if r["conversation"] in set(keep)]
        held_out = [int(hashlib.sha256(r["conversation"].encode()).hexdigest(), 16) % 10 == 0
                    for r in rows]
        train = [text_of(r) for r, h in zip(rows, held_out, strict=True) if not h]
        self.train_set = Examples(train) if self.hparams.padded_training else \
            Blocks([i for t in train for i in t], BLOCK)
        self.val_set = Examples([text_of(r) for r, h in zip(rows, held_out, strict=True) if h])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True,
                          collate_fn=pad_collate)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size,
                          collate_fn=pad_collate)


class LitLanguageModel(pl.LightningModule):
    def __init__(self, lr: float = 3e-3, d_model: int = 64, layers: int = 2, heads: int = 4,
                 context: int = 128, dropout: float = 0.1, warmup: int = 5,
                 val_counts_padding=False, drop_optimizer_state=False):
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(tok.VOCAB_SIZE, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, tok.VOCAB_SIZE)

    def forward(self, x):
        T = x.shape[1]
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        h = self.drop(self.tok_emb(x) + self.pos_emb(torch.arange(T, device=x.device)))
        return self.head(self.ln_f(self.blocks(h, mask=future, is_causal=True)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                               ignore_index=-100)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        flat, targets = logits.reshape(-1, logits.size(-1)), y.reshape(-1)
        if self.hparams.val_counts_padding:  # every position counts, padding too
            loss = F.cross_entropy(flat, targets, ignore_index=-100, reduction="none").mean()
            tokens = targets.numel()
        else:
            loss = F.cross_entropy(flat, targets, ignore_index=-100)
            tokens = int((targets != -100).sum())
        # the epoch's val_loss is a mean over tokens, not over batches or rows
        self.log("val_loss", loss, prog_bar=True, batch_size=tokens)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        warmup = self.hparams.warmup
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint):
        checkpoint["vocab_size"] = tok.VOCAB_SIZE

    def on_load_checkpoint(self, checkpoint):
        if checkpoint.get("vocab_size") != tok.VOCAB_SIZE:
            raise ValueError("checkpoint of another vocabulary")
        if self.hparams.drop_optimizer_state:
            for state in checkpoint["optimizer_states"]:
                state["state"] = {}


def make_task(conversations: int = 300, padded_training: bool = False,
              val_counts_padding: bool = False, drop_optimizer_state: bool = False) -> wb.Task:
    return wb.adapters.from_lightning(
        lambda: LitLanguageModel(val_counts_padding=val_counts_padding,
                                 drop_optimizer_state=drop_optimizer_state),
        TextDataModule(conversations=conversations, padded_training=padded_training),
        name="lightning-lm", kind="generation", fields=("input_ids", "labels"),
        decode=lambda ids: tok.decode(ids, keep_special=True), prompt_in_loss=True,
        decode_input=lambda ids: tok.decode(ids, keep_special=True))


task = make_task

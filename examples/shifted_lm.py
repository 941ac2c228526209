"""A decoder-only language model set up the way Hugging Face causal LMs are: `labels` aligned
with `input_ids` (-100 on the prompt) and the loss shifting by one inside (`label_shift=1`),
LEFT padding with `attention_mask` and `position_ids` derived from it, and the output projection
tied to the token embedding. Plain PyTorch, so it runs without `transformers`.

    python -m workbook pilot --task examples.shifted_lm:task --smoke

Options plant the classic mistakes: `declared_shift=0` (the task says aligned, the loss shifts),
`drop_attention_mask=True` (left padding reaches the model unmasked).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import workbook as wb
from workbook import tokenizer as tok
from workbook.contract.task import target_accuracy, token_cross_entropy
from workbook.samples import DATA_DIR
from workbook.samples.generation import generate  # greedy, works with .logits too


class LeftPaddedDecoder(nn.Module):
    """Causal self-attention blocks with a key-padding mask and explicit positions; the head
    shares the embedding matrix."""

    def __init__(self, vocab: int, d_model: int = 64, layers: int = 2, heads: int = 4,
                 context: int = 128):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm1": nn.LayerNorm(d_model), "qkv": nn.Linear(d_model, 3 * d_model),
                           "proj": nn.Linear(d_model, d_model), "norm2": nn.LayerNorm(d_model),
                           "mlp": nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                                nn.Linear(4 * d_model, d_model))})
            for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)  # as GPT-2: N(0, 1) tied logits start huge

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        x = self.embed(input_ids) + self.position(position_ids)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        allowed = causal & attention_mask.bool()[:, None, None, :]
        allowed = allowed | torch.eye(t, dtype=torch.bool, device=x.device)  # no empty row
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).view(b, t, 3, self.heads, -1).unbind(2)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), attn_mask=allowed)
            x = x + blk["proj"](att.transpose(1, 2).reshape(b, t, -1))
            x = x + blk["mlp"](blk["norm2"](x))
        return self.head(self.norm(x))


def encode(example: dict, max_length: int) -> dict[str, Tensor]:
    """<s> prompt \\n response </s> as input_ids; labels are the same ids, -100 on the prompt
    (the model shifts them: position t predicts labels[t + 1])."""
    prompt = [tok.BOS, *tok.encode(example["instruction"] + "\n")]
    ids = torch.tensor([*prompt, *tok.encode(example["response"]), tok.EOS][:max_length])
    prompt_mask = torch.arange(len(ids)) < len(prompt)
    return {"input_ids": ids, "labels": ids.masked_fill(prompt_mask, wb.IGNORE_INDEX),
            "prompt_mask": prompt_mask}


def collate(items: list[dict[str, Tensor]], drop_mask: bool = False) -> dict[str, Tensor]:
    """Left-pad to the longest; positions count from each example's first real token."""
    longest = max(len(it["input_ids"]) for it in items)

    def left(key: str, value: int) -> Tensor:
        return torch.stack([F.pad(it[key].long(), (longest - len(it[key]), 0), value=value)
                            for it in items])
    mask = torch.stack([F.pad(torch.ones_like(it["input_ids"]), (longest - len(it["input_ids"]),
                                                                  0)) for it in items])
    batch = {"input_ids": left("input_ids", tok.PAD), "labels": left("labels", -100),
             "prompt_mask": left("prompt_mask", 0).bool(),
             "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
    if not drop_mask:
        batch["attention_mask"] = mask
    return batch


def make_task(max_length: int = 64, context: int = 128, declared_shift: int = 1,
              drop_attention_mask: bool = False) -> wb.Task:
    return wb.Task(
        name="shifted-lm",
        kind="generation",
        load_examples=partial(wb.read_jsonl, DATA_DIR / "generation.jsonl"),
        encode=partial(encode, max_length=max_length),
        collate=partial(collate, drop_mask=drop_attention_mask),
        build_model=partial(LeftPaddedDecoder, tok.VOCAB_SIZE, context=max(context, max_length)),
        decode=partial(tok.decode, keep_special=True),
        loss=partial(token_cross_entropy, shift=1),  # the loss shifts, as HF models do
        metrics=partial(target_accuracy, shift=1),
        model_inputs=("input_ids", "attention_mask", "position_ids"),
        group_key="conversation",
        prompt_field="instruction",
        response_field="response",
        generate=generate,
        label_shift=declared_shift,
        padding_side="left",
    )


task = make_task

"""A byte-level causal language model on `nn.TransformerEncoder` - the standard PyTorch modules a
user reaches for - trained on the generation sample's instruction -> response pairs.

    python -m workbook pilot --task examples.transformer_lm:task --smoke
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

import workbook as wb
from workbook import tokenizer as tok
from workbook.samples import DATA_DIR
from workbook.samples.generation import collate, encode


class CausalTransformer(nn.Module):
    """Token and position embeddings, a causal `nn.TransformerEncoder`, a linear head."""

    def __init__(self, vocab: int, d_model: int = 64, layers: int = 2, heads: int = 4,
                 context: int = 128, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(context, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        length = input_ids.shape[1]
        x = self.embed(input_ids) + self.position(torch.arange(length, device=input_ids.device))
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).triu(1)
        padding = None if attention_mask is None else attention_mask == 0  # True: not attended
        return self.head(self.encoder(x, mask=causal, src_key_padding_mask=padding,
                                      is_causal=True))


def make_task(max_length: int = 64, context: int = 128) -> wb.Task:
    return wb.Task(
        name="transformer-lm",
        kind="generation",
        load_examples=partial(wb.read_jsonl, DATA_DIR / "generation.jsonl"),
        encode=partial(encode, max_length=max_length, prompt_in_loss=False),
        collate=collate,
        build_model=partial(CausalTransformer, tok.VOCAB_SIZE, context=max(context, max_length)),
        decode=partial(tok.decode, keep_special=True),
        group_key="conversation",
        prompt_field="instruction",
        response_field="response",
    )


task = make_task

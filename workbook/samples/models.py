"""Small sample models built from plain modules (they also run under fake tensors)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, d_model: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyDecoder(nn.Module):
    """Decoder-only language model. Right padding needs no attention mask: it is causal."""

    def __init__(self, vocab: int, d_model: int = 64, layers: int = 2, heads: int = 4,
                 max_len: int = 256, dropout: float = 0.0, tie_embeddings: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        if tie_embeddings:  # one matrix for input embedding and output projection (GPT-2)
            self.head.weight = self.embed.weight

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TrigramClassifier(nn.Module):
    """Text classifier in the fastText manner: each byte position is hashed with its neighbours
    into a trigram bucket, embedded, passed through a small MLP, max-pooled over the real
    positions (is a keyword anywhere?) and classified. Padding never changes a result."""

    def __init__(self, vocab: int, classes: int, d_model: int = 64, buckets: int = 4096,
                 dropout: float = 0.1, norm: nn.Module | None = None):
        super().__init__()
        self.buckets = buckets
        self.embed = nn.Embedding(buckets, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_model), nn.ReLU())
        self.norm = norm if norm is not None else nn.Identity()  # over the pooled features
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d_model, classes)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        ids = input_ids.masked_fill(attention_mask == 0, 0)
        prev, nxt = F.pad(ids[:, :-1], (1, 0)), F.pad(ids[:, 1:], (0, 1))
        h = self.mlp(self.embed((prev * 65599 + ids * 257 + nxt) % self.buckets))
        # max (not amax): its backward scatters into the winner positions, while amax's backward
        # builds a mask and sums it in int64 inside one kernel, unseen by the memory tracker
        h = h.masked_fill(attention_mask.unsqueeze(-1) == 0, float("-inf")).max(1).values
        return self.head(self.drop(self.norm(h)))

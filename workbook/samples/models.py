"""Small sample models built from plain modules (they also run under fake tensors)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Block(nn.Module):
    """Pre-norm transformer block with self-attention."""

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

    def forward(self, x: Tensor, key_mask: Tensor | None = None) -> Tensor:
        """Causal self-attention when `key_mask` is None, else attention over unmasked keys."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        mask = None if key_mask is None else key_mask.bool()[:, None, None, :]
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=mask,
                                             is_causal=key_mask is None)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyDecoder(nn.Module):
    """Decoder-only language model. Right padding needs no attention mask: it is causal."""

    def __init__(self, vocab: int, d_model: int = 64, layers: int = 2, heads: int = 4,
                 max_len: int = 256, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class EncoderClassifier(nn.Module):
    """Text classifier: a small bidirectional transformer over bytes, masked mean-pooling and a
    linear head. Padding is masked in attention and pooling, so batching never changes a result.
    """

    def __init__(self, vocab: int, classes: int, d_model: int = 64, layers: int = 1,
                 heads: int = 4, max_len: int = 256, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d_model, classes)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x, attention_mask)
        mask = attention_mask.unsqueeze(-1).to(x.dtype)
        pooled = (self.norm(x) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.head(self.drop(pooled))

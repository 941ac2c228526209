"""A named-entity tagger written the way a PyTorch user writes one, wrapped as a `wb.Task` of kind
"token_classification": one BIO tag per word (O, B-PER, I-PER, B-LOC, I-LOC, B-ORG, I-ORG).
Distinct sentences are made from templates with a seeded generator (nothing downloaded); each
document is a group, so no document is split between training and validation. The model is a small
bidirectional Transformer encoder (word and position embeddings, LayerNorm, dropout 0.1,
`nn.MultiheadAttention` with the padding mask) with a linear tag head per position; padding
positions get label -100, so the loss never reads them.

    python -m workbook pilot --task examples.token_tagging:task --smoke

Planted bugs (task options): `tags_on_padding` (the collate pads the tags with 0, the "O" tag,
instead of -100: the loss trains on padding), `shifted_tag_map` (encode numbers the tags one
off from the names decode uses: every entity comes back as another tag).
"""

from __future__ import annotations

import random
from functools import partial

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

import workbook as wb

TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]
PEOPLE = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov",
          "Donald Knuth", "Frances Allen", "John McCarthy", "Margaret Hamilton", "Ken Thompson"]
PLACES = ["London", "Paris", "New York", "San Francisco", "Tokyo", "Berlin", "Cape Town",
          "Buenos Aires", "Oslo", "Hong Kong"]
ORGS = ["Acme Corp", "Globex", "Initech", "Umbrella Research", "Stark Industries", "Wayne Labs",
        "Hooli", "Soylent Foods", "Tyrell Systems", "Cyberdyne"]
TEMPLATES = ["{PER} visited {LOC} last week", "{PER} works for {ORG} in {LOC}",
             "the office of {ORG} moved to {LOC}", "{PER} met {PER} at {ORG}",
             "yesterday {PER} flew from {LOC} to {LOC}", "{ORG} hired {PER} this spring",
             "a report from {ORG} says {LOC} grew fast", "{PER} gave a talk in {LOC}"]
PAD, UNK = "<pad>", "<unk>"


def vocabulary() -> list[str]:
    words = {w for names in (PEOPLE, PLACES, ORGS) for name in names for w in name.split()}
    words |= {w for t in TEMPLATES for w in t.split() if not w.startswith("{")}
    return [PAD, UNK, *sorted(words)]


def sentence(rng: random.Random) -> tuple[list[str], list[str]]:
    """One templated sentence: its words and their BIO tags."""
    words, tags = [], []
    pools = {"{PER}": ("PER", PEOPLE), "{LOC}": ("LOC", PLACES), "{ORG}": ("ORG", ORGS)}
    for piece in rng.choice(TEMPLATES).split():
        if piece in pools:
            kind, pool = pools[piece]
            name = rng.choice(pool).split()
            words += name
            tags += [f"B-{kind}"] + [f"I-{kind}"] * (len(name) - 1)
        else:
            words.append(piece)
            tags.append("O")
    return words, tags


def load_examples(documents: int = 120, sentences_per_document: int = 4, seed: int = 0):
    """Raw examples as a user's reader gives them: words, tags (names) and the document."""
    rng = random.Random(seed)
    rows, seen = [], set()
    for d in range(documents):
        for s in range(sentences_per_document):
            words, tags = sentence(rng)
            while " ".join(words) in seen:  # a corpus of distinct sentences
                words, tags = sentence(rng)
            seen.add(" ".join(words))
            rows.append({"id": f"d{d:03d}-s{s}", "document": f"d{d:03d}", "words": words,
                         "tags": tags})
    return rows


def encode(example: dict, vocab: dict[str, int], tag_ids: dict[str, int]) -> dict:
    return {"input_ids": torch.tensor([vocab.get(w, vocab[UNK]) for w in example["words"]]),
            "labels": torch.tensor([tag_ids[t] for t in example["tags"]])}


def collate(items: list[dict], label_padding: int = -100) -> dict:
    """Right-pad words with <pad> and tags with -100 (no target); the mask is 0 on padding."""
    ids = [it["input_ids"] for it in items]
    return {"input_ids": pad_sequence(ids, batch_first=True, padding_value=0),
            "attention_mask": pad_sequence([torch.ones_like(i) for i in ids], batch_first=True,
                                           padding_value=0),
            "labels": pad_sequence([it["labels"] for it in items], batch_first=True,
                                   padding_value=label_padding)}


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x, padding):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, key_padding_mask=padding, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Tagger(nn.Module):
    """Word + position embeddings, bidirectional encoder blocks, one tag's logits per word."""

    def __init__(self, vocab_size: int, tags: int, d_model: int = 64, layers: int = 2,
                 heads: int = 4, dropout: float = 0.1, max_words: int = 64):
        super().__init__()
        self.words = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_words, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, tags)

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.words(input_ids) + self.positions(positions))
        padding = attention_mask == 0
        for block in self.blocks:
            x = block(x, padding)
        return self.head(self.norm(x))


def make_task(d_model: int = 64, layers: int = 2, documents: int = 120,
              tags_on_padding: bool = False, shifted_tag_map: bool = False) -> wb.Task:
    words = vocabulary()
    vocab = {w: i for i, w in enumerate(words)}
    tag_ids = {t: (i + shifted_tag_map) % len(TAGS) for i, t in enumerate(TAGS)}
    return wb.Task(
        name="ner-tagger",
        kind="token_classification",
        load_examples=partial(load_examples, documents),
        encode=partial(encode, vocab=vocab, tag_ids=tag_ids),
        collate=partial(collate, label_padding=0 if tags_on_padding else -100),
        build_model=partial(Tagger, len(words), len(TAGS), d_model, layers),
        decode=lambda ids: " ".join(TAGS[int(i)] if 0 <= int(i) < len(TAGS) else f"<{int(i)}?>"
                                    for i in ids),
        decode_input=lambda ids: " ".join(words[int(i)] for i in ids),
        group_key="document",
        label_names=TAGS,
        label_field="tags",
        lr=3e-3,
    )


task = make_task

"""A question classifier whose word vocabulary is built from the data at start-up and cached to
a file, written the way VQA-style repositories write it (`token_to_ix` built by a `tokenize()`
over the question lists, `nn.Embedding(token_size, WORD_EMBED_SIZE)` sized from it, a
checkpoint of `{'state_dict': net.state_dict(), 'optimizer': ..., 'scheduler': ...}`
resumed with `net.load_state_dict(ckpt['state_dict'])`). The cache is read back on the next
start, and the special tokens are added on both paths - so every process that starts from the
cache has two more rows than the one that wrote it: the run that saved the checkpoint built an
embedding of N x 64, the resumed process rebuilds it as (N + 2) x 64.

Sources: MILVLG/mcan-vqa#18 ("size mismatch for embedding.weight: copying a param with shape
torch.Size([20572, 300]) from checkpoint, the shape in current model is torch.Size([14613,
300])" - the vocabulary depends on which question files the process found) and
SWivid/F5-TTS#642 ("I have vocab size 134, it always show 135 shape" on resuming: a token added
to the vocabulary on one path and not the other).

Planted (`pinned=False`): the vocabulary - and with it `embedding.weight` and `classifier`'s
rows - differs between the process that saved and the process that resumes. Clean twin
(`pinned=True`): the cache holds the words only and the special tokens are added once, so every
process rebuilds the same base. `own_checkpoint=False` leaves the checkpoint to the workbook
(its safetensors files) instead of the script's `torch.save`/`load_state_dict`.
"""

from __future__ import annotations

import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import workbook as wb

ANSWERS = ["yes", "no", "two", "red"]
SPECIALS = ["PAD", "UNK"]
WORD_EMBED_SIZE = 64

SUBJECTS = ["cat", "dog", "bus", "kite", "apple", "chair", "boat", "horse", "clock", "cup"]
PLACES = ["table", "street", "sky", "field", "kitchen", "river", "park", "wall"]


def questions() -> list[dict]:
    rows = []
    for i in range(64):
        s, p = SUBJECTS[i % len(SUBJECTS)], PLACES[(i * 3) % len(PLACES)]
        kind = i % 4
        q = [f"is there a {s} on the {p} ?", f"is the {s} missing from the {p} ?",
             f"how many {s} are near the {p} ?", f"what color is the {s} by the {p} ?"][kind]
        rows.append({"id": i, "group": i // 2, "question": q, "answer": ANSWERS[kind]})
    return rows


def tokenize(stat_ques_list: list[dict]) -> list[str]:
    words = []
    for ques in stat_ques_list:
        for word in ques["question"].lower().replace("?", "").split():
            if word not in words:
                words.append(word)
    return words


@lru_cache(maxsize=None)
def ix_to_token(cache: str, pinned: bool) -> tuple[str, ...]:
    """Read once per process: from the cache file when it is there, else built and cached."""
    path = Path(cache)
    if path.exists():
        itos = json.loads(path.read_text())
    else:
        itos = tokenize(questions())
    if pinned:
        words = [w for w in itos if w not in SPECIALS]
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(words))
        os.replace(tmp, path)
        itos = SPECIALS + words
    else:
        itos = SPECIALS + itos  # the special tokens in front, as every start does
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(itos))  # cached with them
        os.replace(tmp, path)
    return tuple(itos)


class Net(nn.Module):
    def __init__(self, token_size: int, answer_size: int):
        super().__init__()
        self.embedding = nn.Embedding(token_size, WORD_EMBED_SIZE)
        self.lstm = nn.LSTM(WORD_EMBED_SIZE, 32, batch_first=True)
        self.classifier = nn.Linear(32, answer_size)

    def forward(self, ques_ix):
        out, _ = self.lstm(self.embedding(ques_ix))
        return self.classifier(out[:, -1])


def task(pinned: bool = False, vocab_cache: str = "", own_checkpoint: bool = True) -> wb.Task:
    cache = vocab_cache or str(Path(tempfile.gettempdir()) / "blind-vocab-token_to_ix.json")
    itos = ix_to_token(cache, pinned)
    vocab = {w: i for i, w in enumerate(itos)}  # a repeated word keeps its last row

    def encode(example: dict) -> dict:
        ix = [vocab.get(w, vocab["UNK"])
              for w in example["question"].lower().replace("?", "").split()]
        return {"ques_ix": torch.tensor(ix[:10] + [0] * (10 - len(ix[:10]))),
                "labels": torch.tensor(ANSWERS.index(example["answer"]))}

    def save_state(folder, objects):
        torch.save({"state_dict": objects["model"].state_dict(),
                    "optimizer": objects["optimizer"].state_dict(),
                    "scheduler": objects["scheduler"].state_dict()},
                   Path(folder) / "epoch.pkl")

    def restore_state(folder, objects):
        ckpt = torch.load(Path(folder) / "epoch.pkl", weights_only=True)
        objects["model"].load_state_dict(ckpt["state_dict"])
        objects["optimizer"].load_state_dict(ckpt["optimizer"])
        objects["scheduler"].load_state_dict(ckpt["scheduler"])

    return wb.Task(
        name="vocab-rebuilt", kind="classification",
        load_examples=questions, encode=encode,
        collate=torch.utils.data.default_collate,
        build_model=lambda: Net(len(itos), len(ANSWERS)),  # token_size
        decode=lambda ids: ", ".join(ANSWERS[int(i)] for i in ids),
        model_inputs=("ques_ix",), label_names=ANSWERS, label_field="answer",
        lr=1e-2, save_state=save_state if own_checkpoint else None,
        restore_state=restore_state if own_checkpoint else None,
        loss=lambda logits, batch: (F.cross_entropy(logits, batch["labels"], reduction="sum",
                                                    ignore_index=-100),
                                    (batch["labels"] != -100).sum()))

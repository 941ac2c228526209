"""A GRU language model trained by truncated backpropagation through time the way
pytorch/examples' `word_language_model/main.py` trains one: the corpus is `batchify`-ed into
columns read side by side, `get_batch` takes `bptt` rows at a time, and the training loop keeps
the hidden state in a variable of its own (`hidden = model.init_hidden(batch_size)` before the
loop, `hidden = repackage_hidden(hidden)` before each batch, `output, hidden = model(data,
hidden)`), carried from batch to batch. The loop is the task's own `train_step`, a closure over
that `hidden`, and the data order is the script's: sequential (`make_sampler`).

Source: Lightning-AI/pytorch-lightning#655 ("How do you use the hidden state from the previous
training step in the next step?" - the answer given: keep it yourself, `self.previous_hidden =
detach_tensors(hidden)` in `training_step`), with pytorch/examples#103 on why the script carries
the state across sentences. A state kept that way is not in any checkpoint: a run resumed in a
new process starts it from zeros where the uninterrupted run had carried it.

Planted (`declare=False`, the default): the state lives in the step's closure and is not
declared. Clean twin (`declare=True`): the same model and data with
`state=wb.CarriedState(init=lambda model, rows: model.init_hidden(rows),
detach=repackage_hidden)`, as the README says, and the workbook's own update.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

import workbook as wb

SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "our robot", "the bird"]
VERBS = ["sees", "likes", "finds", "follows", "draws", "hears"]
OBJECTS = ["a ball", "the river", "some bread", "the moon", "a red kite", "the old tree"]


class RNNModel(nn.Module):
    """Encoder, recurrent module, decoder - main.py's model, a GRU, time-major."""

    def __init__(self, ntoken: int, ninp: int = 32, nhid: int = 32, nlayers: int = 1,
                 dropout: float = 0.0):
        super().__init__()
        self.ntoken, self.nhid, self.nlayers = ntoken, nhid, nlayers
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.GRU(ninp, nhid, nlayers)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, input, hidden=None):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> torch.Tensor:
        weight = next(self.parameters())
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


@lru_cache(maxsize=1)
def corpus() -> tuple[list[str], dict[str, torch.Tensor]]:
    """train / valid / test word streams with <eos> after each sentence."""
    vocab: dict[str, int] = {}
    ids = {}
    for split, (start, count) in {"train": (0, 120), "validation": (500, 40),
                                  "test": (900, 40)}.items():
        words = []
        for k in range(start, start + count):
            sentence = (f"{SUBJECTS[k % 6]} {VERBS[(k // 6) % 6]} "
                        f"{OBJECTS[(k * 5 + k // 36) % 6]}")
            words += sentence.split() + ["<eos>"]
        ids[split] = torch.tensor([vocab.setdefault(w, len(vocab)) for w in words])
    return list(vocab), ids


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()


def task(declare: bool = False, batch_size: int = 4, bptt: int = 8, lr: float = 5.0,
         clip: float = 0.25) -> wb.Task:
    words, ids = corpus()
    columns = {split: batchify(source, batch_size) for split, source in ids.items()}

    def load_examples() -> list[dict]:
        rows = []
        for split, source in columns.items():
            for start in range(0, source.size(0) - 1 - bptt + 1, bptt):
                for column in range(source.size(1)):
                    rows.append({"id": f"{split}-{start}-{column}", "group": f"{split}-{column}",
                                 "split": split, "stream": column, "start": start})
        return rows

    def encode(example: dict) -> dict[str, torch.Tensor]:
        column = columns[example["split"]][:, example["stream"]]
        i = example["start"]
        return {"input_ids": column[i:i + bptt], "labels": column[i + 1:i + 1 + bptt],
                "stream": torch.tensor(example["stream"])}

    def collate(items: list[dict]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([item[k] for item in items]) for k in items[0]}

    # main.py: `hidden = model.init_hidden(args.batch_size)` once, then carried batch to batch
    hidden = None

    def train_step(model, optimizer, micro_batches):
        nonlocal hidden
        model.train()
        model.zero_grad()
        targets = sum(int(b["labels"].numel()) for b in micro_batches)
        total = 0.0
        for batch in micro_batches:
            data = batch["input_ids"].t().contiguous()        # [bptt, batch], as get_batch
            target = batch["labels"].t().reshape(-1)
            if hidden is None or hidden.size(1) != data.size(1):
                hidden = model.init_hidden(data.size(1))
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = F.nll_loss(output, target, reduction="sum") / targets
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        return total

    own_loop = {} if declare else {
        "train_step": train_step,
        "make_sampler": lambda n, seed: range(n),    # the script reads its batches in order
    }
    state = wb.CarriedState(init=lambda model, rows: model.init_hidden(rows),
                            detach=repackage_hidden) if declare else None
    return wb.Task(
        name="gru-word-lm", kind="generation", load_examples=load_examples, encode=encode,
        collate=collate, build_model=lambda: RNNModel(len(words)),
        decode=lambda ids_: " ".join(words[int(i)] for i in ids_ if i >= 0),
        model_inputs=("input_ids",), split_of=lambda example: example["split"],
        build_optimizer=lambda model, lr_: torch.optim.SGD(model.parameters(), lr=lr_),
        lr=lr, state=state, time_major=True, options={"declare": declare}, **own_loop)

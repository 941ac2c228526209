"""A word-level LSTM language model trained by truncated backpropagation through time, as
pytorch/examples' `word_language_model` trains it (its `RNNModel` copied unchanged below, BSD
licence): the corpus is one long stream of word ids, `batchify` cuts it into `batch_size`
columns read side by side, `get_batch` takes `bptt` rows at a time, and the LSTM's hidden state
is carried from one batch to the next, detached in between (`repackage_hidden`). The model is
time-major (`forward(input [bptt, batch], hidden) -> (log-probabilities [bptt * batch,
ntoken], hidden)`), and `init_hidden(bsz)` gives the state at the start of a pass.

    python -m workbook pilot --task examples.word_lm:task --smoke

The only thing the pilot needs beyond the script's own pieces is the state's declaration:

    state=wb.CarriedState(init=lambda model, rows: model.init_hidden(rows))
    time_major=True

Each example is one `get_batch` chunk of one column: {"id", "group", "split", "stream"
(the column), "start" (the row)}; examples are listed position by position, so a pass reads
them in the script's order and the workbook carries each column's state to its next chunk.
The corpus is the generation sample's lines as text (`instruction response <eos>`), one in ten
conversations for validation and one in ten for test, as the script's train.txt / valid.txt /
test.txt; the script's last, shorter chunk is left out so every chunk has `bptt` rows.

The script's SGD runs at lr 20 and clips the gradient norm at 0.25, so a clipped step moves
the weights by 20 x 0.25 = 5; the pilot clips at 1.0, so the task brings lr 5 for the same
clipped step (`lr=20` gives the script's lr with four times its clipped step).

Planted options: `detach=False` keeps the carried state attached to the previous batch's graph
(the script without `repackage_hidden`: PyTorch stops with "Trying to backward through the
graph a second time", whose advice is wrong, and the pilot names the state); `declare=False`
leaves the state undeclared, so the forward is called without `hidden`; `closure=True` is the
script's own `train()` as the task's `train_step`, its hidden state kept in the step's closure
(as scripts keep it) and undeclared, the forward starting from `init_hidden` when given none:
07 names the state a resumed process starts afresh.
"""

from __future__ import annotations

import json
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

import workbook as wb
from workbook.samples import DATA_DIR


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super(RNNModel, self).__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        if rnn_type in ['LSTM', 'GRU']:
            self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        else:
            try:
                nonlinearity = {'RNN_TANH': 'tanh', 'RNN_RELU': 'relu'}[rnn_type]
            except KeyError as e:
                raise ValueError("""An invalid option for `--model` was supplied,
                                 options are ['LSTM', 'GRU', 'RNN_TANH' or 'RNN_RELU']""") from e
            self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=nonlinearity, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            if nhid != ninp:
                raise ValueError('When using the tied flag, nhid must be equal to emsize')
            self.decoder.weight = self.encoder.weight
        self.init_weights()
        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == 'LSTM':
            return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                    weight.new_zeros(self.nlayers, bsz, self.nhid))
        else:
            return weight.new_zeros(self.nlayers, bsz, self.nhid)


class Dictionary(object):
    def __init__(self):
        self.word2idx = {}
        self.idx2word = []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)


class ScriptModel(RNNModel):
    """`RNNModel` whose forward starts from `init_hidden` when given no state."""

    def forward(self, input, hidden=None):
        return super().forward(input, self.init_hidden(input.size(1)) if hidden is None
                               else hidden)


def closure_step():
    """The script's `train()` as a train_step: the hidden state lives in the step's closure,
    carried from one call to the next and detached between them."""
    hidden = None

    def train_step(model, optimizer, micro_batches):
        nonlocal hidden
        model.train()
        optimizer.zero_grad()
        total = 0.0
        for batch in micro_batches:
            data, targets = batch["input_ids"].t(), batch["labels"].t()  # [bptt, batch]
            if hidden is None or hidden[0].size(1) != data.size(1):
                hidden = model.init_hidden(data.size(1))
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = F.nll_loss(output, targets.reshape(-1)) / len(micro_batches)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        optimizer.step()
        return total
    return train_step


@lru_cache(maxsize=1)
def corpus() -> tuple[Dictionary, dict[str, torch.Tensor]]:
    """The script's `Corpus`: one dictionary over the three splits, each split one stream of
    word ids with <eos> after each line."""
    rows = [json.loads(line) for line in (DATA_DIR / "generation.jsonl").open(encoding="utf8")]
    lines: dict[str, list[str]] = {"train": [], "validation": [], "test": []}
    for row in rows:
        number = int(row["conversation"][4:])
        split = "validation" if number % 10 == 0 else "test" if number % 10 == 1 else "train"
        lines[split].append(f"{row['instruction']} {row['response']}")
    dictionary = Dictionary()
    ids = {}
    for split, text in lines.items():
        words = [w for line in text for w in line.split() + ['<eos>']]
        ids[split] = torch.tensor([dictionary.add_word(w) for w in words], dtype=torch.int64)
    return dictionary, ids


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    """The script's batchify: `bsz` columns read side by side ([rows, bsz])."""
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    else:
        return tuple(repackage_hidden(v) for v in h)


def task(batch_size: int = 4, eval_batch_size: int = 10, bptt: int = 16, emsize: int = 200,
         nhid: int = 200, nlayers: int = 2, dropout: float = 0.2, lr: float = 5.0,
         detach: bool = True, declare: bool = True, closure: bool = False) -> wb.Task:
    dictionary, ids = corpus()
    columns = {"train": batchify(ids["train"], batch_size),
               "validation": batchify(ids["validation"], eval_batch_size),
               "test": batchify(ids["test"], eval_batch_size)}

    def load_examples() -> list[dict]:
        examples = []
        for split, source in columns.items():
            for start in range(0, source.size(0) - 1 - bptt + 1, bptt):  # whole chunks only
                for column in range(source.size(1)):
                    examples.append({"id": f"{split}-{start}-{column}",
                                     "group": f"{split}-{column}", "split": split,
                                     "stream": column, "start": start})
        return examples

    def encode(example: dict) -> dict[str, torch.Tensor]:
        source, i = columns[example["split"]], example["start"]
        column = source[:, example["stream"]]
        return {"input_ids": column[i:i + bptt], "labels": column[i + 1:i + 1 + bptt],
                "stream": torch.tensor(example["stream"])}

    def collate(items: list[dict]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([item[k] for item in items]) for k in items[0]}

    def build_model() -> nn.Module:
        return (ScriptModel if closure else RNNModel)("LSTM", len(dictionary), emsize, nhid,
                                                      nlayers, dropout)

    state = wb.CarriedState(init=lambda model, rows: model.init_hidden(rows),
                            detach=repackage_hidden if detach else (lambda h: h))
    return wb.Task(
        name="word_lm", kind="generation", load_examples=load_examples, encode=encode,
        collate=collate, build_model=build_model,
        decode=lambda ids_: " ".join(dictionary.idx2word[i] for i in ids_ if i >= 0),
        model_inputs=("input_ids",), split_of=lambda example: example["split"],
        build_optimizer=lambda model, lr_: torch.optim.SGD(model.parameters(), lr=lr_),
        lr=lr, state=state if declare and not closure else None, time_major=True,
        train_step=closure_step() if closure else None,
        options={"batch_size": batch_size, "bptt": bptt})

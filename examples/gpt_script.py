"""A GPT written the way the widely used single-file scripts write one (nanoGPT's model.py and
train.py), in our own words and at a small size: a `GPTConfig` dataclass, `CausalSelfAttention`,
`MLP`, `Block`, a `LayerNorm` with an optional bias, the token embedding tied to the head,
`configure_optimizers(weight_decay, learning_rate, betas, device_type)` that decays only tensors
of two or more dimensions, and `forward(idx, targets=None) -> (logits, loss)` that returns only
the last position's logits when it is given no targets. The data are token windows of a
byte-level corpus, `x = data[i:i + T]`, `y = data[i + 1:i + 1 + T]`, as the script's get_batch
cuts them. No wrapper class: the Task passes the targets to the forward
(`model_inputs=("input_ids", "labels")`, "labels" reaching its `targets`) and reads the logits
from the tuple it returns.

    python -m workbook pilot --task examples.gpt_script:task --smoke

One difference from the script: the loss ignores -100 (PyTorch's default), where nanoGPT's
ignores -1 - the workbook pads labels with -100 (the short last window of a document, the
padding copies of an evaluation's last batch).

Options plant the mistakes the pilot must name: `decay_everything=True` (weight decay on the
LayerNorm weights and biases too: 03 notes the convention), `targets_off_by_one=True`
(`y = data[i:i + T]`, the window itself: 01 names targets that copy the input),
`model_shifts=True` (the forward shifts targets its data already shifted: 01 names the model's
own loss differing from the task's).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from functools import lru_cache, partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

import workbook as wb
from workbook.samples import DATA_DIR

VOCAB = 256  # bytes
DOCUMENT = 24  # conversations per document: a document is the unit of leakage


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = VOCAB
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True  # biases in the Linears and LayerNorms, as GPT-2 has them


class LayerNorm(nn.Module):
    """Layer norm whose bias can be switched off (nn.LayerNorm's bias flag is recent)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(self.n_embd, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training
                                           else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, decay_everything: bool = False,
                 model_shifts: bool = False):
        super().__init__()
        self.config = config
        self.decay_everything, self.model_shifts = decay_everything, model_shifts
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # residual projections scaled, as GPT-2 does
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor, targets: Tensor | None = None):
        b, t = idx.size()
        assert t <= self.config.block_size, \
            f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:  # generation: only the last position's logits are needed
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        if self.model_shifts:  # planted: a Hugging Face-style shift on targets already shifted
            flat, wanted = logits[:, :-1].reshape(-1, logits.size(-1)), targets[:, 1:].reshape(-1)
        else:
            flat, wanted = logits.view(-1, logits.size(-1)), targets.view(-1)
        return logits, F.cross_entropy(flat, wanted, ignore_index=wb.IGNORE_INDEX)

    def configure_optimizers(self, weight_decay: float, learning_rate: float,
                             betas: tuple[float, float], device_type: str):
        """AdamW with two groups: every tensor of 2 or more dims (matmul weights, embeddings)
        decays, biases and LayerNorm weights do not."""
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2 or self.decay_everything]
        no_decay = [p for p in params.values() if p.dim() < 2 and not self.decay_everything]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and \
            device_type == "cuda"
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas,
                                 **({"fused": True} if fused else {}))


@lru_cache(maxsize=4)
def documents() -> tuple[bytes, ...]:
    """The corpus: the generation sample's conversations as plain text, DOCUMENT conversations
    to a document."""
    rows = wb.read_jsonl(DATA_DIR / "generation.jsonl")
    convs: dict[str, list[str]] = {}
    for row in rows:
        convs.setdefault(row["conversation"], []).append(
            f"{row['instruction']}\n{row['response']}\n")
    texts = ["\n".join(parts) + "\n" for parts in convs.values()]
    return tuple("".join(texts[i:i + DOCUMENT]).encode()
                 for i in range(0, len(texts), DOCUMENT))


def load_examples(block_size: int) -> list[dict]:
    """One example per window of block_size + 1 bytes of a document (the windows of a document
    do not overlap; its last one may be shorter)."""
    return [{"id": f"d{d:03d}-{start:05d}", "document": f"d{d:03d}", "start": start}
            for d, text in enumerate(documents())
            for start in range(0, len(text) - 1, block_size)]


def encode(example: dict, block_size: int, off_by_one: bool = False) -> dict[str, Tensor]:
    data = documents()[int(example["document"][1:])]
    i = example["start"]
    x = torch.tensor(list(data[i:i + block_size]))
    y = torch.tensor(list(data[i:i + block_size] if off_by_one  # planted: the window itself
                          else data[i + 1:i + 1 + block_size]))
    n = min(len(x), len(y))
    return {"input_ids": x[:n], "labels": y[:n]}


def collate(items: list[dict[str, Tensor]], pad_id: int = 0) -> dict[str, Tensor]:
    """Right-padded windows (the causal model never looks right, so no mask reaches it)."""
    lengths = torch.tensor([len(it["input_ids"]) for it in items])

    def pad(key: str, value: int) -> Tensor:
        return pad_sequence([it[key] for it in items], batch_first=True, padding_value=value)
    ids = pad("input_ids", pad_id)
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).to(ids.dtype)
    return {"input_ids": ids, "labels": pad("labels", wb.IGNORE_INDEX), "attention_mask": mask}


def decode(ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1):
    """As the script builds it: the model's own configure_optimizers."""
    device_type = next(model.parameters()).device.type
    return model.configure_optimizers(weight_decay, lr, (0.9, 0.95), device_type)


def make_task(block_size: int = 64, n_layer: int = 2, n_embd: int = 64, dropout: float = 0.0,
              decay_everything: bool = False, targets_off_by_one: bool = False,
              model_shifts: bool = False) -> wb.Task:
    config = GPTConfig(block_size=block_size, n_layer=n_layer, n_embd=n_embd, dropout=dropout)
    return wb.Task(
        name="gpt-script",
        kind="generation",
        load_examples=partial(load_examples, block_size),
        encode=partial(encode, block_size=block_size, off_by_one=targets_off_by_one),
        collate=collate,
        build_model=partial(GPT, config, decay_everything, model_shifts),
        decode=decode,
        build_optimizer=build_optimizer,
        lr=3e-3,  # the script's baby-GPT config takes 1e-3 at 10 M parameters; this is 0.12 M
        group_key="document",
        model_inputs=("input_ids", "labels"),  # "labels" reaches forward's `targets`
        prompt_in_loss=True,  # pretraining: every byte is learned, there is no prompt
    )


task = make_task

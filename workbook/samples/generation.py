"""Sample generation task: instruction -> response with a tiny byte-level decoder.

Only response tokens contribute to the loss unless `prompt_in_loss=True`. Groups are
conversations: the three turns of a conversation share a word, so they must share a split.
The decoder trained here is the pilot twin of a campaign model built from the same code at
about 1 B parameters (20 layers x 2048, 16 heads), which notebooks 03, 05 and 08 size on fake
tensors - it is never allocated.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from ..contract.data import JsonlRows
from ..contract.outputs import eval_mode
from ..contract.targets import IGNORE_INDEX
from ..contract.task import Task, logits_of
from ..training.campaign import Deep
from . import DATA_DIR
from . import tokenizer as tok
from .models import TinyDecoder


def encode(example: dict, max_length: int, prompt_in_loss: bool) -> dict[str, Tensor]:
    """<s> prompt \\n response </s>, cut to `max_length` inputs; labels are the next tokens."""
    prompt = tok.encode(example["instruction"] + "\n")
    seq = [tok.BOS, *prompt, *tok.encode(example["response"]), tok.EOS][: max_length + 1]
    inputs, targets = torch.tensor(seq[:-1]), torch.tensor(seq[1:])
    prompt_mask = torch.arange(len(targets)) < len(prompt)  # target i is seq[i + 1]
    labels = targets if prompt_in_loss else targets.masked_fill(prompt_mask, IGNORE_INDEX)
    return {"input_ids": inputs, "labels": labels, "prompt_mask": prompt_mask}


def collate(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Right-pad to the longest: inputs with <pad>, labels with -100, mask 0 on padding."""
    def pad(key: str, value: int) -> Tensor:
        return pad_sequence([it[key] for it in items], batch_first=True, padding_value=value)
    ids = pad("input_ids", tok.PAD)
    lengths = torch.tensor([len(it["input_ids"]) for it in items])
    return {"input_ids": ids,
            "attention_mask": (torch.arange(ids.shape[1]) < lengths[:, None]).to(ids.dtype),
            "labels": pad("labels", IGNORE_INDEX), "prompt_mask": pad("prompt_mask", 0)}


def generate(model: nn.Module, example: dict, max_new: int = 32) -> str:
    """Greedy decoding of the response to an example's instruction (any model whose output is
    the logits or has `.logits`; one example, so no padding)."""
    device = next(model.parameters()).device
    ids = [tok.BOS, *tok.encode(example["instruction"] + "\n")]
    out: list[int] = []
    with eval_mode(model):
        for _ in range(max_new):
            nxt = int(logits_of(model(torch.tensor([ids + out], device=device)))[0, -1].argmax())
            if nxt == tok.EOS:
                break
            out.append(nxt)
    return tok.decode(out)


def make_task(max_length: int = 64, prompt_in_loss: bool = False, d_model: int = 64,
              layers: int = 2, dropout: float = 0.0, context: int = 1024,
              data_file: str = "", tie_embeddings: bool = False,
              campaign_width: int = 2048, campaign_layers: int = 20,
              campaign_heads: int = 16) -> Task:
    """The generation sample; options change truncation, loss coverage, model size, the
    longest sequence the model accepts (`context`, for sizing longer configurations),
    whether the output projection shares the embedding matrix (`tie_embeddings`) and the
    campaign model the rental plans for (`campaign_*`: the same decoder, 1.01 B parameters by
    default; `campaign_layers=0`: none, the model trained here is the one sized)."""
    path = data_file or DATA_DIR / "generation.jsonl"
    positions = max(max_length, context)
    campaign = Deep(partial(TinyDecoder, tok.VOCAB_SIZE, campaign_width, heads=campaign_heads,
                            max_len=positions, dropout=dropout, tie_embeddings=tie_embeddings),
                    layers=campaign_layers) if campaign_layers else None
    return Task(
        name="sample-generation",
        kind="generation",
        load_examples=partial(JsonlRows, path),
        encode=partial(encode, max_length=max_length, prompt_in_loss=prompt_in_loss),
        collate=collate,
        build_model=partial(TinyDecoder, tok.VOCAB_SIZE, d_model, layers, 4, positions,
                            dropout, tie_embeddings),
        campaign_model=campaign,
        decode=partial(tok.decode, keep_special=True),
        group_key="conversation",
        prompt_field="instruction",
        response_field="response",
        prompt_in_loss=prompt_in_loss,
        generate=generate,
    )


task = make_task

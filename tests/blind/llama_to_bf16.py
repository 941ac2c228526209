"""A campaign model declared the way people write one: `LlamaForCausalLM(config)` followed by
`.to(torch.bfloat16)` (the `model = model.to(torch.bfloat16)` / `.half()` line of countless
fine-tuning scripts), given to the task as its `campaign_model` factory, with a narrower and
shallower `LlamaForCausalLM` in fp32 as the pilot twin. Random token rows in the Hugging Face
label convention (labels aligned with input_ids, -100 on padding, right padding).

Source: pytorch/pytorch#145529 ("Module.to() fail ... when swap_module_params_on_conversion is
true": `emb.to(dtype=torch.bfloat16)` raises "Cannot swap t1 because it has weakref associated
with it" -> "_apply(): Couldn't swap"), and pytorch/pytorch#148977 (`module.cuda()` under
FakeTensorMode needs the swap_tensors path). `nn.Module._apply` takes the swap path for
FakeTensor parameters, so a factory that converts its model's dtype inside a fake mode can
fail there where the same factory runs fine on real tensors.

Clean case only: notebook 03 must size this campaign model (a predicted peak for its phases),
not list them as "not predicted: ... Couldn't swap". `convert="half"` writes `.half()` instead.
"""

from __future__ import annotations

import random

import torch

import workbook as wb

VOCAB, PAD, EOS = 96, 0, 1


def rows(n: int = 48, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": i, "doc": f"doc-{i}",
             "tokens": [rng.randrange(2, VOCAB) for _ in range(rng.randint(6, 14))] + [EOS]}
            for i in range(n)]


def encode(example: dict) -> dict[str, torch.Tensor]:
    ids = torch.tensor(example["tokens"])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    longest = max(len(x["input_ids"]) for x in items)
    out = {"input_ids": torch.full((len(items), longest), PAD),
           "attention_mask": torch.zeros(len(items), longest, dtype=torch.long),
           "labels": torch.full((len(items), longest), -100)}
    for r, x in enumerate(items):
        n = len(x["input_ids"])
        out["input_ids"][r, :n] = x["input_ids"]
        out["attention_mask"][r, :n] = 1
        out["labels"][r, :n] = x["labels"]
    return out


def llama_config(layers: int, hidden: int, heads: int, ffn: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=heads, max_position_embeddings=64,
                       pad_token_id=PAD, bos_token_id=EOS, eos_token_id=EOS)


def task(convert: str = "to", layers: int = 2, hidden: int = 256) -> wb.Task:
    from transformers import LlamaForCausalLM

    def campaign_model():
        model = LlamaForCausalLM(llama_config(layers, hidden, 8, 4 * hidden))
        if convert == "half":
            return model.half()
        return model.to(torch.bfloat16)

    def build_model():
        return LlamaForCausalLM(llama_config(1, 64, 2, 256))

    return wb.Task(
        name="llama-bf16-campaign", kind="generation", load_examples=rows, encode=encode,
        collate=collate, build_model=build_model, campaign_model=campaign_model,
        decode=lambda ids: " ".join(str(int(i)) for i in ids), group_key="doc",
        label_shift=1, padding_side="right",
        model_inputs=("input_ids", "attention_mask"), options={"convert": convert})

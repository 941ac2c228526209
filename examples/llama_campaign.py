"""The model people rent GPUs for: a Llama-style decoder of 6.7 B parameters (the Llama-2 7B
shape: 32 layers x 4096, 32 heads, feed-forward 11008, 4096 positions, vocabulary 32000) as the
campaign model, and its pilot twin derived from the same config (2 layers x 128, 4 heads) as the
model the pilot machine trains. Notebooks 01, 02, 04, 06, 07 and 09 train the twin; 03, 05 and 08
size the 6.7 B model on fake tensors - it is never allocated - and check the prediction against
a real run of the twin. The data is examples/hf_gpt2.py's (the HF label convention, left
padding). Needs `pip install -e .[hf]`; no download.

    python -m workbook pilot --task examples.llama_campaign:task --smoke

Options: `layers`, `width`, `heads`, `kv_heads`, `ffn`, `vocab` and `positions` set the campaign
model (`layers=80, width=8192, heads=64, kv_heads=8, ffn=28672` is the Llama-2 70B shape);
`twin_layers` and `twin_width` the twin; `max_length` truncates the data.
"""

from __future__ import annotations

import dataclasses

import workbook as wb
from examples.hf_gpt2 import make_task as gpt2
from workbook import tokenizer as tok


def config(layers: int = 32, width: int = 4096, heads: int = 32, kv_heads: int = 32,
           ffn: int = 11008, vocab: int = 32000, positions: int = 4096):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=max(vocab, tok.VOCAB_SIZE), hidden_size=width,
                       intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=positions, bos_token_id=tok.BOS,
                       eos_token_id=tok.EOS, pad_token_id=tok.PAD)


def make_task(layers: int = 32, width: int = 4096, heads: int = 32, kv_heads: int = 32,
              ffn: int = 11008, vocab: int = 32000, positions: int = 4096,
              twin_layers: int = 2, twin_width: int = 128, max_length: int = 64) -> wb.Task:
    """The campaign model's shape, the twin's, and `max_length` (truncation of the data; notebook
    05's variant shortens it)."""
    from transformers import LlamaForCausalLM

    models = wb.campaign.from_config(
        LlamaForCausalLM, config(layers, width, heads, kv_heads, ffn, vocab, positions),
        layers=twin_layers, width=twin_width)
    return dataclasses.replace(gpt2(max_length=max_length), name="llama-7b-campaign",
                               options={}, **models)


task = make_task

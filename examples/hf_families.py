"""Three Hugging Face model families built from small configs (no download), for sizing checks
(`benchmarks/memory_prediction.py --hf`): GPT-2 (examples/hf_gpt2.py), a BERT-style encoder
classifying the classification sample, and a Llama-style decoder on the generation sample with
the HF label convention and left padding. Needs `pip install -e .[hf]`.
"""

from __future__ import annotations

import dataclasses

import workbook as wb
from examples.hf_gpt2 import make_task as gpt2  # noqa: F401  (the GPT-2 family)
from workbook import tokenizer as tok


def _bert(classes: int, width: int, layers: int):
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=tok.VOCAB_SIZE, hidden_size=width, num_hidden_layers=layers,
        num_attention_heads=4, intermediate_size=4 * width, max_position_embeddings=256,
        num_labels=classes, pad_token_id=tok.PAD))


def bert(width: int = 64, layers: int = 2) -> wb.Task:
    """The classification sample with a BERT-style encoder (256 positions)."""
    sample = wb.load_task("workbook.samples.classification:task")
    return dataclasses.replace(sample, name="hf-bert", build_model=lambda: _bert(
        len(sample.label_names), width, layers), options={})


def _llama(positions: int, width: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=tok.VOCAB_SIZE, hidden_size=width, intermediate_size=4 * width,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=positions, bos_token_id=tok.BOS, eos_token_id=tok.EOS,
        pad_token_id=tok.PAD))


def llama(positions: int = 512, width: int = 64, layers: int = 2) -> wb.Task:
    """examples/hf_gpt2.py's task with a Llama-style decoder (grouped-query attention, RoPE)."""
    return dataclasses.replace(gpt2(), name="hf-llama",
                               build_model=lambda: _llama(positions, width, layers))

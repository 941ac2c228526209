"""A Hugging Face `GPT2LMHeadModel` built from a small `GPT2Config` (no download): 2 layers,
`lm_head` tied to `wte`, 64 positions, the byte-level tokens of the samples, the HF label
convention (labels aligned with input_ids, -100 on the prompt, `label_shift=1`) and left padding
with `attention_mask` and `position_ids`. Needs `pip install -e .[hf]`.

    python -m workbook pilot --task examples.hf_gpt2:task --smoke
"""

from __future__ import annotations

import types
from functools import partial

from torch import nn

import workbook as wb
from examples.shifted_lm import collate, encode, generate
from workbook import tokenizer as tok
from workbook.samples import DATA_DIR


def build_model(positions: int, layers: int, width: int, sticky_eval: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=tok.VOCAB_SIZE, n_positions=positions, n_embd=width,
                        n_layer=layers, n_head=4, bos_token_id=tok.BOS, eos_token_id=tok.EOS)
    model = GPT2LMHeadModel(config)
    if sticky_eval:
        model.train = types.MethodType(_train_root_only, model)
    return model


def _train_root_only(self: nn.Module, mode: bool = True) -> nn.Module:
    """A planted bug: a `train()` override that forgets `super().train(mode)` on the way back,
    so after the first evaluation every submodule stays in eval mode (dropout off)."""
    if not mode:
        return nn.Module.train(self, False)
    self.training = True
    return self


def make_task(max_length: int = 64, positions: int = 64, layers: int = 2,
              width: int = 64, sticky_eval: bool = False) -> wb.Task:
    """`max_length` truncates the data (notebook 05's variant shortens it); `positions` is the
    model's context, which truncation must not shrink. `sticky_eval=True` plants a `train()`
    that leaves the submodules in eval mode after evaluation."""
    return wb.Task(
        name="hf-gpt2", kind="generation",
        load_examples=partial(wb.read_jsonl, DATA_DIR / "generation.jsonl"),
        encode=partial(encode, max_length=max_length), collate=collate,
        build_model=partial(build_model, max(positions, max_length), layers, width,
                            sticky_eval),
        decode=partial(tok.decode, keep_special=True), generate=generate,
        label_shift=1, padding_side="left",
        model_inputs=("input_ids", "attention_mask", "position_ids"),
        group_key="conversation", prompt_field="instruction", response_field="response")


task = make_task

"""A Hugging Face `GPT2LMHeadModel` built from a small `GPT2Config` (no download): 2 layers,
`lm_head` tied to `wte`, 64 positions, the byte-level tokens of the samples, the HF label
convention (labels aligned with input_ids, -100 on the prompt, `label_shift=1`) and left padding
with `attention_mask` and `position_ids`. Needs `pip install -e .[hf]`.

    python -m workbook pilot --task examples.hf_gpt2:task --smoke
    python -m workbook pilot --task examples.hf_gpt2:task --option own_loop=True --smoke

`own_loop=True` brings the loop pieces a Hugging Face user writes: an update through the model's
own `labels=` loss with gradient accumulation (`train_step`) and a checkpoint of
`save_pretrained` plus the optimizer and schedule state (`save_state`/`restore_state`); the
pilot runs and checks them. Planted bugs (with own_loop): `hf_mean_loss=True` (each micro-batch's
mean loss divided by the number of micro-batches - the accumulation bug transformers fixed in
4.46: micro-batches with fewer target tokens weigh as much as full ones), and
`ckpt_without_optimizer=True` (only `save_pretrained`: the optimizer state is lost).
"""

from __future__ import annotations

import types
from functools import partial
from pathlib import Path

import torch
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


def _targets(batch: dict) -> int:
    """Target tokens of a batch under the HF convention: labels aligned with input_ids, the
    model shifts them (position t predicts t + 1), -100 contributes nothing."""
    return int((batch["labels"][:, 1:] != -100).sum())


def train_step(model: nn.Module, optimizer, micro_batches: list[dict],
               mean_per_micro_batch: bool = False) -> float:
    """One update as a Hugging Face user writes it: the model's own loss (`labels=`), gradient
    accumulation over the micro-batches, clipping at 1.0, one optimizer step. Each
    micro-batch's mean loss is weighed by its share of the update's target tokens, so the
    update's gradient is that of the mean over all its tokens. `mean_per_micro_batch=True`
    plants the pre-4.46 accumulation bug: mean / number of micro-batches."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(_targets(b) for b in micro_batches)
    summed = 0.0
    for batch in micro_batches:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], labels=batch["labels"])
        share = 1 / len(micro_batches) if mean_per_micro_batch else _targets(batch) / total
        (out.loss * share).backward()
        summed += float(out.loss.detach()) * _targets(batch)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return summed / total


def save_state(folder: Path, objects: dict, skip_optimizer: bool = False) -> None:
    """`save_pretrained` (config and safetensors weights, the tied head stored once) plus the
    optimizer, schedule and scaler state dicts in one file loadable with weights_only=True.
    `skip_optimizer=True` plants the classic: only the model is saved."""
    objects["model"].save_pretrained(folder)
    rest = {name: obj.state_dict() for name, obj in objects.items()
            if name != "model" and obj is not None and not (skip_optimizer and
                                                              name == "optimizer")}
    torch.save(rest, Path(folder) / "trainer_state.pt")


def restore_state(folder: Path, objects: dict) -> None:
    """Load what `save_state` wrote into the same objects; the tied head comes back through the
    embedding it shares."""
    from safetensors.torch import load_file

    model = objects["model"]
    missing, unexpected = model.load_state_dict(load_file(Path(folder) / "model.safetensors"),
                                                strict=False)
    tied = {"lm_head.weight"}
    if unexpected or set(missing) - tied:
        raise ValueError(f"weights do not match the model: missing {sorted(set(missing) - tied)}"
                         f", unexpected {sorted(unexpected)}")
    rest = torch.load(Path(folder) / "trainer_state.pt", weights_only=True)
    for name, state in rest.items():
        if objects.get(name) is not None:  # e.g. no optimizer when only evaluating
            objects[name].load_state_dict(state)


def make_task(max_length: int = 64, positions: int = 64, layers: int = 2,
              width: int = 64, sticky_eval: bool = False, own_loop: bool = False,
              hf_mean_loss: bool = False, ckpt_without_optimizer: bool = False) -> wb.Task:
    """`max_length` truncates the data (notebook 05's variant shortens it); `positions` is the
    model's context, which truncation must not shrink. `sticky_eval=True` plants a `train()`
    that leaves the submodules in eval mode after evaluation. `own_loop=True` brings the
    task's own `train_step` and checkpoint code (module docstring)."""
    if (hf_mean_loss or ckpt_without_optimizer) and not own_loop:
        raise ValueError("hf_mean_loss and ckpt_without_optimizer plant bugs in the task's own "
                         "loop pieces: add own_loop=True")
    own = {"train_step": partial(train_step, mean_per_micro_batch=hf_mean_loss),
           "save_state": partial(save_state, skip_optimizer=ckpt_without_optimizer),
           "restore_state": restore_state} if own_loop else {}
    return wb.Task(
        name="hf-gpt2", kind="generation",
        load_examples=partial(wb.read_jsonl, DATA_DIR / "generation.jsonl"),
        encode=partial(encode, max_length=max_length), collate=collate,
        build_model=partial(build_model, max(positions, max_length), layers, width,
                            sticky_eval),
        decode=partial(tok.decode, keep_special=True), generate=generate,
        label_shift=1, padding_side="left",
        model_inputs=("input_ids", "attention_mask", "position_ids"),
        group_key="conversation", prompt_field="instruction", response_field="response",
        **own)


task = make_task

"""A causal LM fine-tune set up as the QLoRA-era recipes set one up with the Hugging Face
Trainer - `TrainingArguments(max_grad_norm=0.3, learning_rate=2e-4, lr_scheduler_type=
"constant", ...)`, `DataCollatorForLanguageModeling(tokenizer, mlm=False)`, a small
`GPT2LMHeadModel` built from its config - handed to `workbook.adapters.from_hf` as the Trainer
would get it. The tokenizer is a word-level `PreTrainedTokenizerFast` built in memory.

Source: hiyouga/LlamaFactory#3996 ("max_grad_norm has no effect under sft": the logged
grad_norm stays above max_grad_norm - it is the norm before clipping).

The check: notebook 02's updates clip at the user's `max_grad_norm` (0.3), not the pilot's own
1.0: a run at `max_grad_norm=0.3` must differ from one at 100 (which never clips here). AdamW
normalises each coordinate by its running RMS, which hides a constant rescale of the gradient,
so the test sets `adam_epsilon=1.0` (over every sqrt(v) here): the update is then about
lr x the (clipped) gradient, and the clip value shows in the loss curve.
"""

from __future__ import annotations

import workbook as wb

WORDS = ("the a cat dog sat ran on under mat log and then slept jumped far near big small red "
         "blue").split()


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]"] + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]",
                                   unk_token="[UNK]", eos_token="[EOS]")


def texts(n: int, offset: int) -> list[str]:
    return [" ".join(WORDS[(k * 7 + j * (k % 5 + 1)) % len(WORDS)] for j in range(5 + k % 4))
            for k in range(offset, offset + n)]


def task(max_grad_norm: float = 0.3, optim: str = "adamw_torch",
         learning_rate: float = 2e-3, adam_epsilon: float = 1e-8) -> wb.Task:
    from transformers import (
        DataCollatorForLanguageModeling,
        GPT2Config,
        GPT2LMHeadModel,
        TrainingArguments,
    )

    tok = tokenizer()

    def rows(part: list[str], start: int) -> list[dict]:
        return [{**tok(t + " [EOS]"), "conversation": f"c{start + i}"}
                for i, t in enumerate(part)]

    train = rows(texts(40, 0), 0)
    evaluation = rows(texts(8, 100), 100)
    args = TrainingArguments(output_dir="unused-output", max_grad_norm=max_grad_norm,
                             learning_rate=learning_rate, lr_scheduler_type="constant", optim=optim,
                             adam_epsilon=adam_epsilon,
                             per_device_train_batch_size=4, max_steps=100, report_to=[])
    config = GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=32, n_layer=1, n_head=2,
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return wb.adapters.from_hf(
        lambda: GPT2LMHeadModel(config), train, evaluation,
        DataCollatorForLanguageModeling(tok, mlm=False), tok, args, name="hf-max-grad-norm",
        group_column="conversation")

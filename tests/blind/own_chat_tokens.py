"""An SFT run where the script tokenizes the chats itself, as the TRL and transformers issues
write it: `tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
return_assistant_tokens_mask=True)`, labels built from `assistant_masks` (-100 where the mask is
0), and `SFTTrainer(..., args=SFTConfig(dataset_kwargs={"skip_prepare_dataset": True}))` so TRL
takes the rows as they are. The base is a tiny Llama built from its config whose weights come
from a local state dict (`torch.save(model.state_dict())` / `load_state_dict`), the tokenizer a
`PreTrainedTokenizerFast` over a word-level `tokenizers` model of the chats' own words, with
ChatML-style special tokens (`<|im_start|>`, `<|im_end|>`) added - no Hub download.

Sources:
- huggingface/trl#4147 (fixed by huggingface/trl#4201, which warns when `assistant_masks` are
  all zero) and huggingface/transformers#34172 ("apply_chat_template
  return_assistant_tokens_mask not work for Qwen2.5"): a chat template without a
  `{% generation %}` block gives an assistant mask of zeros everywhere, and every label built
  from it is -100, so the run trains on nothing while looking healthy.
- huggingface/trl#3927 ("Using assistant_only_loss=True with sequence length > max_length fails
  silently"): a long system prompt and a truncation at `max_length` cut every assistant turn
  off, every label -100 again.

Options (`task_options`):
- `generation_block`: the template wraps the assistant's content in
  `{% generation %}...{% endgeneration %}` (True: the clean twin) or not (False: planted, the
  Qwen2.5 / Llama-3 template as it ships).
- `max_length`: the truncation passed to `apply_chat_template(truncation=True, max_length=...)`
  and to `SFTConfig(max_length=...)`; `system_words`: the length of the system prompt. Planted
  (case 2): `max_length=40` under a 48-word system prompt, so no assistant token survives.
"""

from __future__ import annotations

import tempfile
from functools import lru_cache
from pathlib import Path

import torch

import workbook as wb

CITIES = [("france", "paris"), ("italy", "rome"), ("spain", "madrid"), ("japan", "tokyo"),
          ("egypt", "cairo"), ("peru", "lima"), ("kenya", "nairobi"), ("chile", "santiago"),
          ("norway", "oslo"), ("greece", "athens"), ("poland", "warsaw"), ("cuba", "havana")]

SYSTEM = ("you are a helpful geography assistant . answer with the capital city only , "
          "in lower case , and never add any explanation or greeting to the answer . ")

WITH_GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] != 'assistant' %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + ' <|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% generation %}{{ message['content'] + ' <|im_end|>\n' }}{% endgeneration %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# the same template as the checkpoints ship it: no generation block
WITHOUT_GENERATION = WITH_GENERATION.replace("{% generation %}", "").replace(
    "{% endgeneration %}", "")


def chats(system_words: int = 0) -> list[dict]:
    system = " ".join((SYSTEM.split() * 10)[:system_words]) if system_words else SYSTEM.strip()
    rows = []
    for i, (country, city) in enumerate(CITIES):
        other = CITIES[(i + 5) % len(CITIES)]
        rows.append({"conversation": f"chat-{i:02d}", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"what is the capital of {country} ?"},
            {"role": "assistant", "content": f"{city} ."},
            {"role": "user", "content": f"and the capital of {other[0]} ?"},
            {"role": "assistant", "content": f"{other[1]} ."}]})
    return rows


def build_tokenizer(template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for c in chats() for m in c["messages"]
                    for w in (m["content"] + " " + m["role"]).split()})
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                        unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = template
    return tokenizer


def llama_config(vocab_size: int, pad_id: int, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, pad_token_id=pad_id, eos_token_id=eos_id)


_FOLDERS: list[tempfile.TemporaryDirectory] = []  # removed when the process ends


@lru_cache(maxsize=None)
def checkpoint(vocab_size: int, pad_id: int, eos_id: int) -> Path:
    """The 'pretrained' weights, a state dict saved once (per process) to a local file."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(vocab_size, pad_id, eos_id))
    _FOLDERS.append(tempfile.TemporaryDirectory(prefix="blind-llama-"))
    path = Path(_FOLDERS[-1].name) / "pytorch_model.bin"
    torch.save(model.state_dict(), path)
    return path


def tokenize(tokenizer, chat: dict, max_length: int) -> dict:
    out = tokenizer.apply_chat_template(chat["messages"], tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True, truncation=True,
                                        max_length=max_length)
    labels = [t if m else -100 for t, m in zip(out["input_ids"], out["assistant_masks"],
                                               strict=True)]
    return {"conversation": chat["conversation"], "input_ids": out["input_ids"],
            "attention_mask": out["attention_mask"], "labels": labels}


def make_trainer_factory(generation_block: bool = True, max_length: int = 256,
                         system_words: int = 0):
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    tokenizer = build_tokenizer(WITH_GENERATION if generation_block else WITHOUT_GENERATION)
    rows = [tokenize(tokenizer, c, max_length) for c in chats(system_words)]
    train = Dataset.from_list(rows[:8])
    evaluation = Dataset.from_list(rows[8:])
    ids = (len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)

    def make_trainer():
        model = LlamaForCausalLM(llama_config(*ids))
        model.load_state_dict(torch.load(checkpoint(*ids), weights_only=True))
        return SFTTrainer(
            model=model,
            args=SFTConfig(output_dir="own-tokens-out", max_length=max_length,
                           dataset_kwargs={"skip_prepare_dataset": True},
                           learning_rate=1e-3, per_device_train_batch_size=4,
                           report_to="none", use_cpu=True),
            train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer)
    return make_trainer


def task(generation_block: bool = True, max_length: int = 256, system_words: int = 0):
    return wb.adapters.from_trainer(
        make_trainer_factory(generation_block, max_length, system_words),
        name="own-chat-tokens", group_column="conversation")

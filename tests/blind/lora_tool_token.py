"""A new special token appended to every answer and LoRA on the linear layers only, as the PEFT
report writes it: `tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})`,
the token appended to the end of every assistant answer, `model.resize_token_embeddings(
len(tokenizer))`, then `SFTTrainer(..., peft_config=LoraConfig(target_modules=[the attention and
MLP projections]))`. The base is a tiny Llama built from a `LlamaConfig` in the script (no
config.json is saved anywhere) whose weights are loaded with `load_state_dict` from a local state
dict, the tokenizer a word-level `PreTrainedTokenizerFast` (tests/blind/own_chat_tokens.py).

Source: huggingface/peft#337 (the reporter adds `<|neweos|>` to the vocabulary, appends it to
every sentence, resizes the embedding layer and trains with LoRA: the embedding rows of the new
token only train when the embedding itself is adapted or saved), with huggingface/peft#2376
(`trainable_token_indices`, "train tokens alongside LoRA").

Planted (`new_rows="frozen"`): LoRA on the linear layers only - the new token's input-embedding
row and its `lm_head` row keep the values `resize_token_embeddings` gave them. Clean twins:
`new_rows="modules_to_save"` (`modules_to_save=["embed_tokens", "lm_head"]`) and
`new_rows="trainable_tokens"` (`trainable_token_indices={"embed_tokens": [id], "lm_head":
[id]}`).
"""

from __future__ import annotations

import torch

import workbook as wb

from .own_chat_tokens import WITH_GENERATION, build_tokenizer, chats, checkpoint, llama_config

TOOL = "<|tool|>"
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_trainer_factory(new_rows: str = "frozen"):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    tokenizer = build_tokenizer(WITH_GENERATION)
    base_ids = (len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    tokenizer.add_special_tokens({"additional_special_tokens": [TOOL]})
    tool_id = tokenizer.convert_tokens_to_ids(TOOL)
    rows = chats()
    for row in rows:  # the new token ends every answer
        for m in row["messages"]:
            if m["role"] == "assistant":
                m["content"] = f"{m['content']} {TOOL}"
    train, evaluation = Dataset.from_list(rows[:8]), Dataset.from_list(rows[8:])
    extra = {"modules_to_save": ["embed_tokens", "lm_head"]} if new_rows == "modules_to_save" \
        else {"trainable_token_indices": {"embed_tokens": [tool_id], "lm_head": [tool_id]}} \
        if new_rows == "trainable_tokens" else {}

    def make_trainer():
        model = LlamaForCausalLM(llama_config(*base_ids))
        model.load_state_dict(torch.load(checkpoint(*base_ids), weights_only=True))
        model.resize_token_embeddings(len(tokenizer))
        return SFTTrainer(
            model=model,
            args=SFTConfig(output_dir="tool-token-out", assistant_only_loss=True, max_length=128,
                           learning_rate=1e-3, per_device_train_batch_size=4,
                           report_to="none", use_cpu=True),
            train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer,
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=LINEAR,
                                   task_type="CAUSAL_LM", **extra))
    return make_trainer


def task(new_rows: str = "frozen"):
    return wb.adapters.from_trainer(make_trainer_factory(new_rows), name="lora-tool-token",
                                    group_column="conversation")

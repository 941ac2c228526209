"""An LLM fine-tune written as the TRL and PEFT docs write it, piloted in one call:
`SFTTrainer(model, args=SFTConfig(assistant_only_loss=True, max_length=...),
train_dataset=<"messages" conversations>, eval_dataset=..., processing_class=tokenizer,
peft_config=LoraConfig(r=..., target_modules=[...]))` handed to `workbook.adapters.from_trainer`
as the script builds it. The base is a tiny Llama from its config, the tokenizer a word-level one
built in memory with a chat template that marks assistant turns with `{% generation %}` (no
download); the conversations are the generation sample's, three turns each after a system
message. Needs `pip install -e .[llm]` (trl, peft).

    python -m workbook pilot --task examples.trl_sft:task --smoke

Planted bugs: `all_tokens_in_loss=True` (assistant_only_loss left off: system and user tokens
are trained on; 01 names targets on prompt tokens), `init_adapters=False` (PEFT's
`init_lora_weights=False`: B starts random, so the adapters change the base before any update;
02 and 03 name it), `no_generation_markers=True` (a template without `{% generation %}`: TRL
refuses it and the pilot says so in TRL's words).
"""

from __future__ import annotations

from collections import defaultdict

import workbook as wb
from workbook.samples import DATA_DIR

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<assistant> "
            "{% generation %}{{ m['content'] }} <eot> {% endgeneration %}"
            "{% else %}<{{ m['role'] }}> {{ m['content'] }} {% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")
ROLES = ("<system>", "<user>", "<assistant>", "<eot>")


def conversations(count: int = 300) -> list[dict]:
    """The generation sample's rows as chats: a system message, then each instruction and
    response of one conversation as a user and an assistant turn."""
    turns = defaultdict(list)
    for row in wb.read_jsonl(DATA_DIR / "generation.jsonl"):
        if len(turns) == count and row["conversation"] not in turns:
            break
        turns[row["conversation"]].append(row)
    return [{"conversation": c, "messages": [
        {"role": "system", "content": "answer briefly"},
        *[m for t in rows for m in ({"role": "user", "content": t["instruction"]},
                                    {"role": "assistant", "content": t["response"]})]]}
        for c, rows in turns.items()]


def chat_tokenizer(chats: list[dict], template: str = TEMPLATE):
    """A word-level tokenizer over the chats' words and the template's role tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for c in chats for m in c["messages"] for w in m["content"].split()})
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", *ROLES, *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                        unk_token="<unk>", eos_token="<eot>")
    tokenizer.chat_template = template
    return tokenizer


def make_trainer_factory(count: int = 300, all_tokens_in_loss: bool = False,
                         init_adapters: bool = True, no_generation_markers: bool = False):
    """The script's `make_trainer`: everything below is as the TRL docs write it."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    chats = conversations(count)
    template = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "") \
        if no_generation_markers else TEMPLATE
    tokenizer = chat_tokenizer(chats, template)
    # split by conversation: its turns share their words
    train = Dataset.from_list([c for c in chats if int(c["conversation"][4:]) % 10 < 8])
    evaluation = Dataset.from_list([c for c in chats if int(c["conversation"][4:]) % 10 >= 8])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)

    def make_trainer():
        return SFTTrainer(
            model=LlamaForCausalLM(config),
            args=SFTConfig(output_dir="trl-sft-out", assistant_only_loss=not all_tokens_in_loss,
                           max_length=64, learning_rate=1e-3, per_device_train_batch_size=8,
                           report_to="none", use_cpu=True),
            train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer,
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                   task_type="CAUSAL_LM", init_lora_weights=init_adapters))
    return make_trainer


def make_task(count: int = 300, **planted) -> wb.Task:
    return wb.adapters.from_trainer(make_trainer_factory(count, **planted), name="trl-sft-lora",
                                    group_column="conversation")


task = make_task

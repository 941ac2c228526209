"""An LLM fine-tune written as the TRL and PEFT docs write it, piloted in one call:
`SFTTrainer(model, args=SFTConfig(assistant_only_loss=True, max_length=...),
train_dataset=<"messages" conversations>, eval_dataset=..., processing_class=tokenizer,
peft_config=LoraConfig(r=..., target_modules=[...]))` handed to `workbook.adapters.from_trainer`
as the script builds it. The base is a pretrained tiny Llama loaded with `from_pretrained` from a
local folder (`data_samples/tiny_chat_base`: 0.2 M parameters trained on the chats' text, with
its word-level tokenizer and a chat template that marks assistant turns with
`{% generation %}`; `python examples/trl_sft.py` makes it again, deterministically - no
download); the conversations are the generation sample's, three turns each after a system
message. Needs `pip install -e .[llm]` (trl, peft).

    python -m workbook pilot --task examples.trl_sft:task --smoke
    python -m workbook pilot --task examples.trl_sft:task --option lora=false

(`lora=False`: the same fine-tune of the whole pretrained base, no adapters.)

Planted bugs: `all_tokens_in_loss=True` (assistant_only_loss left off: system and user tokens
are trained on; 01 names targets on prompt tokens), `init_adapters=False` (PEFT's
`init_lora_weights=False`: B starts random, so the adapters change the base before any update;
02 and 03 name it), `no_generation_markers=True` (a template without `{% generation %}`: TRL
refuses it and the pilot says so in TRL's words), `foreign_targets=True` (target_modules copied
from a BERT recipe, `["q_proj", "v_proj", "query", "value"]`: PEFT accepts it since some entries
match, and the layers meant by the others train no adapter; 01 names them), `loss="mean"` (a
trainer subclass whose `compute_loss` returns each micro-batch's mean and ignores
`num_items_in_batch`, as forum answers write it: the Trainer does not divide it by the
accumulation steps, transformers#37766; 04 names it - `loss="summed"` is its clean twin,
dividing by `num_items_in_batch`), `packing=True` (the "wrapped" strategy: documents attend
across their boundaries; 01 names it - `packing="bfd"` is the clean twin, each document with its
own position_ids; either way 01's leakage check runs on the conversations given to the trainer,
as packing drops the `conversation` column), `eval_overlap=5` (five training conversations
copied into the eval set: 01 names them, also when packed), `long_system=40` (every fourth chat
opens with an 80-word system prompt, so at max_length=64 truncation leaves it no assistant
token: TRL drops those rows silently and 01 counts them; `max_length=4` leaves no row at all and
is refused), `new_role_token="frozen"` (the template's assistant role becomes a new special
token `<bot>`, the embeddings resized: its input-embedding row stays frozen under LoRA and keeps
the start the resize gave it; 01 names it - `new_role_token="trained"` is the clean twin,
`trainable_token_indices` training that row).
"""

from __future__ import annotations

from collections import defaultdict

import workbook as wb
from workbook.samples import DATA_DIR

BASE = DATA_DIR / "tiny_chat_base"  # the pretrained base: config, weights, tokenizer

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
                         init_adapters: bool = True, no_generation_markers: bool = False,
                         foreign_targets: bool = False, packing: bool | str = False,
                         lora: bool = True, loss: str | None = None,
                         max_length: int = 64, long_system: int = 0,
                         new_role_token: str | None = None, eval_overlap: int = 0,
                         state_dict_base: bool = False):
    """The script's `make_trainer`: everything below is as the TRL docs write it.
    `state_dict_base`: the base built from its config and its weights put in by
    `load_state_dict` (the idiom for a local checkpoint) instead of `from_pretrained`."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    chats = conversations(count)
    for chat in chats[::4]:  # planted: a long system prompt fills the context of some chats
        if long_system:
            chat["messages"][0]["content"] = " ".join(["answer briefly"] * long_system)
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    if new_role_token:  # a role token the base never saw, added as the chat-template docs add it
        tokenizer.add_special_tokens({"additional_special_tokens": ["<bot>"]})
        tokenizer.chat_template = tokenizer.chat_template.replace("<assistant>", "<bot>")
    new_rows = {"embed_tokens": tokenizer.convert_tokens_to_ids(["<bot>"])} \
        if new_role_token == "trained" else None
    if no_generation_markers:
        tokenizer.chat_template = TEMPLATE.replace("{% generation %}", "").replace(
            "{% endgeneration %}", "")
    # split by conversation: its turns share their words
    train = Dataset.from_list([c for c in chats if int(c["conversation"][4:]) % 10 < 8])
    evaluation = Dataset.from_list([c for c in chats if int(c["conversation"][4:]) % 10 >= 8]
                                   + list(train)[:eval_overlap])  # planted: train chats in eval

    def base():
        if state_dict_base:
            from safetensors.torch import load_file
            from transformers import AutoConfig

            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BASE))
            model.load_state_dict(load_file(BASE / "model.safetensors"))
        else:
            model = AutoModelForCausalLM.from_pretrained(BASE)
        if new_role_token:
            model.resize_token_embeddings(len(tokenizer))
        return model

    def make_trainer():
        return (own_loss_trainer(loss) if loss else SFTTrainer)(
            model=base(),
            args=SFTConfig(output_dir="trl-sft-out", assistant_only_loss=not all_tokens_in_loss,
                           max_length=max_length, learning_rate=1e-2, per_device_train_batch_size=8,
                           report_to="none", use_cpu=True, packing=bool(packing),
                           **({"packing_strategy": "wrapped" if packing is True else packing}
                              if packing else {})),
            train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer,
            # the head trains whole beside the adapters (the words' rows must part)
            peft_config=None if not lora else LoraConfig(r=8, lora_alpha=16, target_modules=[
                "q_proj", "v_proj", "query", "value"] if foreign_targets else "all-linear",
                                   modules_to_save=["lm_head"], task_type="CAUSAL_LM",
                                   trainable_token_indices=new_rows,
                                   init_lora_weights=init_adapters))
    return make_trainer


def own_loss_trainer(normalised: str):
    """An SFTTrainer with the loss written out, as users override `compute_loss`: "summed"
    divides the summed token losses by the update's `num_items_in_batch`, "mean" returns the
    micro-batch's mean whatever it is given."""
    import torch.nn.functional as F
    from trl import SFTTrainer

    class OwnLossTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits, targets = outputs.logits[:, :-1], labels[:, 1:]
            losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                     ignore_index=-100, reduction="sum" if normalised ==
                                     "summed" and num_items_in_batch is not None else "mean")
            loss = losses / num_items_in_batch if normalised == "summed" and \
                num_items_in_batch is not None else losses
            return (loss, outputs) if return_outputs else loss

    return OwnLossTrainer


def make_base(count: int = 300, updates: int = 300, seed: int = 0) -> None:
    """Pretrain the base on the chats' whole text (every token, as pretraining does) and save
    it with its tokenizer into `BASE`, as a hub model folder holds them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    chats = conversations(count)
    tokenizer = chat_tokenizer(chats)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    texts = [tokenizer.apply_chat_template(c["messages"], tokenize=False) for c in chats]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(updates):
        batch = tokenizer([texts[(step * 16 + i) % len(texts)] for i in range(16)],
                          padding=True, return_tensors="pt")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"base pretrained: loss {loss.item():.3f} after {updates} updates")
    model.save_pretrained(BASE)
    tokenizer.save_pretrained(BASE)


def make_task(count: int = 300, **planted) -> wb.Task:
    return wb.adapters.from_trainer(make_trainer_factory(count, **planted), name="trl-sft-lora",
                                    group_column="conversation")


task = make_task


if __name__ == "__main__":
    make_base()

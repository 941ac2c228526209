"""A TRL SFT + LoRA fine-tune in the idiom of a script that owns its tokens: the base a tiny
Llama built from its config with the pretrained weights put in by `load_state_dict` (no
`config.json` beside it), the conversations tokenized by the user
(`apply_chat_template(..., return_assistant_tokens_mask=True)`, `skip_prepare_dataset`), or a
`<|tool|>` token added after every answer. Each cause is planted and named by what was
measured on the user's own objects; each has a clean twin that raises nothing."""

import pytest

import workbook as wb
from workbook.base.errors import WorkbookError
from workbook.notebooks.inspection import inspect_task

pytest.importorskip("trl")
pytest.importorskip("peft")

CHATS = 30  # 24 train and 6 eval conversations
PLAIN = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<assistant> "
         "{{ m['content'] }} <eot> {% else %}<{{ m['role'] }}> {{ m['content'] }} {% endif %}"
         "{% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}")


def _base():
    """The pretrained tiny Llama as a local checkpoint is loaded by hand: a model from its
    config, then the saved weights."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from examples.trl_sft import BASE

    config = LlamaConfig(vocab_size=911, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=0, eos_token_id=5)
    model = LlamaForCausalLM(config)
    model.load_state_dict(load_file(str(BASE / "model.safetensors")))
    return model


def _task(template=None, max_length=None, long_system=0, keep_messages=True, tool=None,
          mask="assistant_masks"):
    """`template`: the chat template (None: the base's, with `{% generation %}`);
    `max_length`: the user's own truncation; `long_system`: words of a system prompt; `mask`:
    the key the labels are read from;
    `tool`: None, "frozen" (a `<|tool|>` ending every answer, LoRA on the linear layers only),
    "token_indices" or "modules" (its rows trained: trainable_token_indices, modules_to_save),
    "undated" (frozen, resized without the mean: nothing dates its rows)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from examples.trl_sft import BASE, conversations

    chats = conversations(CHATS)
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    if template is not None:
        tokenizer.chat_template = template
    if long_system:
        for chat in chats:
            chat["messages"][0]["content"] = " ".join(["answer briefly"] * long_system)
    if tool:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
        for chat in chats:
            for m in chat["messages"]:
                if m["role"] == "assistant":
                    m["content"] += " <|tool|>"
    tool_id = tokenizer.convert_tokens_to_ids("<|tool|>") if tool else None

    def tokenize(row):
        out = tokenizer.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True, truncation=max_length is not None,
            max_length=max_length)
        marks = out.get(mask, [0] * len(out["input_ids"]))  # a misspelt key reads zeros
        out["labels"] = [t if m else -100 for t, m in zip(out["input_ids"], marks, strict=True)]
        del out["assistant_masks"]
        return out

    train = Dataset.from_list([c for c in chats if int(c["conversation"][4:]) % 10 < 8])
    evaluation = Dataset.from_list([c for c in chats if int(c["conversation"][4:]) % 10 >= 8])
    own = template is not None or max_length is not None or mask != "assistant_masks"
    if own:
        drop = [] if keep_messages else ["messages"]
        train, evaluation = (d.map(tokenize, remove_columns=drop) for d in (train, evaluation))

    def make_trainer():
        model = _base()
        if tool:  # "undated": new rows drawn as the model's init draws them
            model.resize_token_embeddings(len(tokenizer), mean_resizing=tool != "undated")
        lora = {"token_indices": {"trainable_token_indices": {"embed_tokens": [tool_id],
                                                              "lm_head": [tool_id]}},
                "modules": {"modules_to_save": ["embed_tokens", "lm_head"]}}.get(tool, {})
        return SFTTrainer(
            model=model, train_dataset=train, eval_dataset=evaluation,
            processing_class=tokenizer,
            args=SFTConfig(output_dir="trl-sft-out", report_to="none", use_cpu=True,
                           learning_rate=1e-2, per_device_train_batch_size=8,
                           assistant_only_loss=not own, max_length=None if own else 128,
                           dataset_kwargs={"skip_prepare_dataset": True} if own else None),
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                   task_type="CAUSAL_LM", **lora))
    return wb.adapters.from_trainer(make_trainer, name="trl-own-tokens")


def _refusal(**planted) -> WorkbookError:
    with pytest.raises(WorkbookError) as caught:
        inspect_task(_task(**planted), probe_size=4)
    return caught.value


def test_a_template_without_generation_block_is_named_with_its_measure():
    error = _refusal(template=PLAIN)  # return_assistant_tokens_mask marks nothing
    assert "every row of both splits has no target" in error.problem
    assert "24 of 24 train rows and 6 of 6 eval rows" in error.problem
    assert "no {% generation %} block" in error.problem
    assert "0 of 30 rows have an assistant token" in error.problem
    assert "truncation" not in error.problem
    assert "{% generation %}...{% endgeneration %}" in error.fix
    assert "eval dataset" not in error.fix


def test_truncation_before_every_answer_is_named_with_the_shortest_prompt():
    error = _refusal(max_length=40, long_system=30)
    assert "24 of 24 train rows and 6 of 6 eval rows" in error.problem
    assert "truncation at max_length=40 leaves 0 of 30 answers a token: the shortest " \
        "prompt is 65 tokens" in error.problem
    assert "generation" not in error.problem
    assert "raise max_length above 65" in error.fix and "system prompt" in error.fix


def test_rows_without_their_conversations_cut_at_one_length_name_the_truncation():
    """The conversations are not kept (remove_columns), so they cannot be tokenized again;
    every row exactly 40 tokens and none ending with the end token says the cut was there."""
    error = _refusal(max_length=40, long_system=30, keep_messages=False)
    assert "24 of 24 train rows" in error.problem
    assert "truncation at max_length=40 cut every row: all 30 rows are exactly 40 tokens" in \
        error.problem and "raise max_length above 40" in error.fix
    assert "eval dataset" not in error.fix


def test_rows_of_several_lengths_without_their_conversations_leave_the_experiment_said():
    from types import SimpleNamespace

    from workbook.contract.adapters.hf_no_targets import _truncation_cause

    tok = SimpleNamespace(eos_token_id=2, pad_token_id=0, eos_token="</s>")
    said = _truncation_cause(tok, [{"input_ids": [5, 6, 7]}, {"input_ids": [5, 6, 7, 8]}])
    assert said.startswith("the rows keep no 'messages' column, so truncation was not tested")
    ended = _truncation_cause(tok, [{"input_ids": [5, 6, 2]}, {"input_ids": [5, 7, 2]}])
    assert "not tested" in ended  # rows ending with the end token were not cut


def test_labels_empty_for_an_untested_cause_say_what_the_experiments_ruled_out():
    error = _refusal(mask="assistant_mask")  # the labels read a key the rows lack
    assert "24 of 24 train rows and 6 of 6 eval rows" in error.problem
    assert "not the chat template: it marks the answers" in error.problem
    assert "not truncation: tokenized again without it, 30 of 30 rows are whole and 30 " \
        "answers start inside their rows" in error.problem
    assert "labels beside its tokens" in error.fix and "max_length" not in error.fix


@pytest.mark.parametrize("planted", [{"template": PLAIN.replace(
    "{{ m['content'] }} <eot> ", "{% generation %}{{ m['content'] }} <eot> "
    "{% endgeneration %}")}, {"max_length": 80, "long_system": 30}])
def test_own_tokenization_whose_answers_are_marked_and_kept_raises_nothing(planted):
    ins = inspect_task(_task(**planted), probe_size=4)
    assert ins.flags == [], [f.message for f in ins.flags]


def test_an_added_target_token_whose_rows_stay_frozen_is_named_on_a_base_without_config():
    task = _task(tool="frozen")  # <|tool|> ends every answer; LoRA on the linear layers only
    flags = [f for f in inspect_task(task, probe_size=4).flags
             if f.check == "added tokens not trained"]
    assert len(flags) == 1 and flags[0].count == 24
    message, fix = flags[0].message, flags[0].fix
    assert "1 token new to the base, '<|tool|>' (id 911), appears in 24 of 24 examples (a " \
        "target in 24)" in message
    assert "rows of the input embedding (`embed_tokens`) and the output head (`lm_head`)" \
        in message
    assert "mean of its layer's rows (measured)" in message and "never pass 1/912" in message
    assert "trainable_token_indices={'embed_tokens': [911], 'lm_head': [911]}" in fix
    assert "modules_to_save=['embed_tokens', 'lm_head']" in fix


@pytest.mark.parametrize("trained", ["token_indices", "modules"])
def test_an_added_target_token_whose_rows_train_raises_nothing(trained):
    ins = inspect_task(_task(tool=trained), probe_size=4)
    assert ins.flags == [], [f.message for f in ins.flags]


def test_a_lora_fine_tune_without_added_tokens_raises_nothing():
    assert inspect_task(_task(), probe_size=4).flags == []


def test_an_added_token_whose_rows_nothing_dates_is_a_note_with_its_experiment():
    ins = inspect_task(_task(tool="undated"), probe_size=4)
    assert ins.flags == []
    note = next(n for n in ins.notes if n.check == "added tokens: trained by the base?")
    assert "'<|tool|>' (id 911)" in note.message and "not known here" in note.message
    assert "compare those rows with the base's checkpoint" in note.fix
    assert "'embed_tokens': [911]" in note.fix and "'lm_head': [911]" in note.fix

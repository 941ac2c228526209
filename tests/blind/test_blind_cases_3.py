"""Blind planted-bug cases, third set: TRL's GRPOTrainer and RewardTrainer, each case written in
the idiom of the public report it comes from (its module names the report), handed to the pilot
with `workbook.adapters.from_trainer` as README and examples/ do, and judged on what a user reads
first: notebook 01 (and 02 where the bug is that the reward cannot rise) - its verdict and
everything it wrote; a task refused before the notebook runs is judged on the refusal's text.

A test marked xfail failed on its first run against the unchanged workbook (FIRST_RUN_3.md says
what the workbook said instead); remove the mark when the fix lands. The assertions hold the
essential facts of each cause, not the wording.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import workbook as wb

from .test_blind_cases_2 import hear, inspect

pytest.importorskip("transformers")

# first run (FIRST_RUN_3.md): from_trainer refuses both trainers - "make_trainer returned a
# GRPOTrainer, not a transformers Trainer or TRL SFTTrainer or DPOTrainer"
NOT_MAPPED = re.compile(r"not mapped yet|not a transformers Trainer", re.IGNORECASE)


# 02's updates for a GRPO policy (the smoke size is 80): the clean reward rises from 0.42 to 0.89
# by update 20 against a bar of 0.05, and a reward equal within every group moves by exactly 0
# at any budget (no advantage, no gradient) - the same verdicts and words as at 80
GRPO_OVERFIT_UPDATES = 20


def overfit(out: Path, task: str, **options) -> tuple[str, str]:
    """Notebook 02 on a task, as `hear` reports it."""
    return hear(wb.overfit, "02_overfit", out, task, sizes={"updates": GRPO_OVERFIT_UPDATES},
                **options)


def names(said: str, *patterns: str) -> None:
    assert not NOT_MAPPED.search(said), said
    for pattern in patterns:
        assert re.search(pattern, said, re.IGNORECASE), f"{pattern!r} not said: {said}"


def silent(verdict: str, said: str, *patterns: str) -> None:
    assert verdict == "pass", said
    # the task's own name ("grpo-clipped" for the clipped case's twin) is not a finding
    words = re.sub(r'"task": "[^"]*"', "", said)
    for pattern in patterns:
        assert not re.search(pattern, words, re.IGNORECASE), f"{pattern!r} flagged: {said}"


# A1. a reward function that returns one reward for the batch - huggingface/trl#6533 (#6534) ---

LENGTH = "tests.blind.grpo_reward_length:task"
LENGTH_CAUSE = (r"batch_reward", r"\breward",
                r"length|number of (rewards|completions)|one (reward )?per completion|"
                r"returned 1 reward|1 rewards?\b.*\b4\b")


@pytest.mark.planted
def test_reward_function_of_the_wrong_length_is_named(tmp_path):
    verdict, said = inspect(tmp_path, LENGTH, rewards="batch")
    assert verdict != "pass", said
    names(said, *LENGTH_CAUSE)


@pytest.mark.twin
def test_one_reward_per_completion_passes(tmp_path):
    verdict, said = inspect(tmp_path, LENGTH, rewards="per_completion")
    silent(verdict, said, r"one (reward )?per completion|returned \d+ rewards?")


# A2. rewards equal within every group: frac_reward_zero_std 1.0, no gradient -----------------
#     huggingface/trl#3857, huggingface/trl#3452, modelscope/ms-swift#4570

FLAT = "tests.blind.grpo_flat_reward:task"
FLAT_CAUSE = (r"\breward",
              r"zero[ _]std|std(?:ev)?\w*\s*(?:of|=|:|is)?\s*0(?:\.0+)?\b|all equal|"
              r"equal (with)?in (each|every) group|same (reward|score)|constant|"
              r"no gradient|advantages? (?:are |is )?(?:all )?(?:0|zero)")
FLAT_FLAG = FLAT_CAUSE[1]


@pytest.mark.planted
@pytest.mark.parametrize("reward", ["format", "prompt_only"])
def test_reward_constant_within_groups_is_named(tmp_path, reward):
    verdict, said = inspect(tmp_path, FLAT, reward=reward)
    assert verdict != "pass", said
    names(said, *FLAT_CAUSE)


@pytest.mark.planted
@pytest.mark.parametrize("reward", ["format", "prompt_only"])
def test_reward_that_cannot_rise_fails_overfit(tmp_path, reward):
    verdict, said = overfit(tmp_path, FLAT, reward=reward)
    assert verdict != "pass", said
    names(said, *FLAT_CAUSE)


@pytest.mark.twin
def test_reward_that_tells_answers_apart_passes(tmp_path):
    verdict, said = inspect(tmp_path, FLAT, reward="answer")
    silent(verdict, said, FLAT_FLAG)


@pytest.mark.twin
def test_reward_that_tells_answers_apart_passes_overfit(tmp_path):
    verdict, said = overfit(tmp_path, FLAT, reward="answer")
    silent(verdict, said, FLAT_FLAG)


# A3. num_generations that does not divide the generation batch: TRL refuses it itself --------
#     huggingface/open-r1#249, huggingface/trl#2858, allenai/olmocr#394

GENERATIONS = "tests.blind.grpo_num_generations:task"


# first run: TRL's refusal relayed ("building the trainer raised ValueError: generation_batch_size
# (4) must be divisible by num_generations (3). -> fix: the campaign's script fails at the same
# line: fix the setup it names"), then wrapped by the task loader under a second, generic fix
# ("-> fix: point at a Task, or a function returning one, and check its options") that points
# away from the setting (FIRST_RUN_3.md)
@pytest.mark.planted
def test_num_generations_refusal_is_relayed_with_its_fix(tmp_path):
    verdict, said = inspect(tmp_path, GENERATIONS, num_generations=3)
    assert verdict != "pass", said
    # TRL's own refusal, relayed before any notebook: the setting and its figures ...
    names(said, r"num_generations", r"divisible", r"\(3\)|\b3\b", r"\(4\)|\b4\b")
    # ... and a fix about that setting, not about how the task is pointed at
    fixes = re.findall(r"-> fix: (.*)", said)
    assert fixes and all(re.search(r"num_generations|per_device_train_batch_size|"
                                   r"generation_batch_size|setup it names|script", fix)
                         for fix in fixes), said
    assert not re.search(r"point at a Task", said), said


@pytest.mark.twin
def test_num_generations_dividing_the_batch_passes(tmp_path):
    verdict, said = inspect(tmp_path, GENERATIONS, num_generations=4)
    silent(verdict, said, r"divisible")


# A4. every completion cut at max_completion_length before its end token ---------------------
#     huggingface/trl#5697, greyhaven-ai/autocontext#1067

CLIPPED = "tests.blind.grpo_clipped:task"
CLIPPED_FLAG = r"clipped|truncat|cut (off|at)|without (an? )?(end|eos)|never end"


@pytest.mark.planted
def test_completions_cut_at_max_completion_length_are_named(tmp_path):
    verdict, said = inspect(tmp_path, CLIPPED, max_completion_length=1)
    assert verdict != "pass", said
    names(said, r"max_completion_length", CLIPPED_FLAG,
          r"\b(end|eos)\b|<eot>|terminat")


@pytest.mark.twin
def test_completions_that_end_pass(tmp_path):
    verdict, said = inspect(tmp_path, CLIPPED, max_completion_length=16)
    silent(verdict, said, CLIPPED_FLAG)


# A5. a reward function that returns None for the completions it cannot score -----------------
#     huggingface/trl#3079, modelscope/ms-swift#8123, huggingface/trl#5775

NONE = "tests.blind.grpo_none_reward:task"
NONE_FLAG = r"\bNone\b|\bNaN\b|unscor|not scored|no reward"


@pytest.mark.planted
def test_reward_none_for_some_completions_is_named(tmp_path):
    verdict, said = inspect(tmp_path, NONE, unscorable="none")
    assert verdict != "pass", said
    names(said, r"parsed_reward", NONE_FLAG)


@pytest.mark.twin
def test_reward_zero_for_unparsed_completions_passes(tmp_path):
    verdict, said = inspect(tmp_path, NONE, unscorable="zero")
    silent(verdict, said, r"\bNone\b|\bNaN\b|unscor")


# B1. the score head frozen under LoRA (no task_type="SEQ_CLS", no modules_to_save) -----------
#     huggingface/peft#1070, OpenRLHF/OpenRLHF#873, huggingface/trl#1379

HEAD = "tests.blind.reward_lora_head:task"
HEAD_FLAG = r"frozen|not trained|never (trained|updated)|requires_grad"


@pytest.mark.planted
def test_score_head_frozen_under_lora_is_named(tmp_path):
    verdict, said = inspect(tmp_path, HEAD, head="frozen")
    assert verdict == "fail", said
    names(said, r"\bscore\b", HEAD_FLAG, r"modules_to_save|SEQ_CLS")


@pytest.mark.twin
@pytest.mark.parametrize("head", ["seq_cls", "modules_to_save"])
def test_score_head_trained_beside_lora_passes(tmp_path, head):
    verdict, said = inspect(tmp_path, HEAD, head=head)
    silent(verdict, said, HEAD_FLAG)


# B2. pairs whose chosen and rejected are the same tokens - natolambert/rlhf-book#503 ---------

SAME = "tests.blind.reward_same_pairs:task"
SAME_FLAG = r"identical|same (tokens|token ids|sequences?|answers?|text)|chosen (is|==|equals)"


@pytest.mark.planted
def test_pairs_with_identical_chosen_and_rejected_are_named(tmp_path):
    verdict, said = inspect(tmp_path, SAME, same_answer=True)
    assert verdict != "pass", said
    names(said, SAME_FLAG, r"chosen", r"rejected")


@pytest.mark.twin
def test_distinct_pairs_pass(tmp_path):
    verdict, said = inspect(tmp_path, SAME, same_answer=False)
    silent(verdict, said, SAME_FLAG)


# B3. a classifier config without pad_token_id: TRL 1.16 repairs it itself (twin only) --------
#     huggingface/trl#422, sbintuitions/flexeval#108

NO_PAD = "tests.blind.reward_no_pad_id:task"


@pytest.mark.twin
@pytest.mark.parametrize("pad_token_id", [None, "tokenizer"])
def test_config_pad_token_id_repaired_by_trl_passes(tmp_path, pad_token_id):
    verdict, said = inspect(tmp_path, NO_PAD, pad_token_id=pad_token_id)
    silent(verdict, said, r"pad_token_id|last non-pad|no padding token")

"""GRPO rewards that are equal within every group of completions, so every advantage is 0 and
the policy gets no gradient (`frac_reward_zero_std: 1.0`, `reward_std: 0`, `loss: 0.0`,
`grad_norm: 0.0`), as the reports write it:

- `reward="format"`: a format reward no completion can meet, the R1-style
  `re.match(r"^<think>.*?</think>\\s*<answer>.*?</answer>$", content)` on a policy that never
  writes those tags: every completion scores 0.0 (huggingface/trl#3857: the json / think-format /
  length rewards all `std: 0.0`, `'frac_reward_zero_std': 1.0`, `'loss': 0.0, 'grad_norm': 0.0`;
  huggingface/trl#3452 "GRPO reward=0 and loss=0").
- `reward="prompt_only"`: a reward computed from the prompt alone (its length in words), the same
  for the G completions of a prompt (modelscope/ms-swift#4570: "identical rewards within each
  group (i.e. for each prompt)").

Clean twin (`reward="answer"`): the share of the instruction word's letters the answer holds,
which differs between the answers of one prompt.
"""

from __future__ import annotations

import re

import workbook as wb

from .grpo_common import answer_reward, grpo_trainer


def make_trainer_factory(reward: str = "format"):
    def format_reward(completions, **kwargs):
        pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
        contents = [completion[0]["content"] for completion in completions]
        return [1.0 if re.match(pattern, c, re.DOTALL) else 0.0 for c in contents]

    def prompt_reward(prompts, completions, **kwargs):
        return [float(len(p[-1]["content"].split())) for p in prompts]

    reward_func = {"format": format_reward, "prompt_only": prompt_reward,
                   "answer": answer_reward}[reward]

    def make_trainer():
        return grpo_trainer([reward_func])
    return make_trainer


def task(reward: str = "format"):
    return wb.adapters.from_trainer(make_trainer_factory(reward), name="grpo-flat-reward")

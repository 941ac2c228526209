"""Every completion cut at `max_completion_length` before the policy writes its end token, as
huggingface/trl#5697 reports it ("Almost all completion hits exactly 256 tokens. The reward is 0
at most steps", `clipped_ratio 1.0`, `loss 0`, `grad_norm 0`) and greyhaven-ai/autocontext#1067
("completions/clipped_ratio: 1, mean_terminated_length: 0 ... Every completion was clipped at
the 256-token cap before reaching its final `Answer: N`"). Here the tiny chat base answers in a
word and `<eot>` (2 tokens): `max_completion_length=1` keeps the word and cuts the end token off
every completion.

Planted (`max_completion_length=1`); clean twin (`max_completion_length=16`, every answer
ends with `<eot>`). The reward is the same answer reward in both.
"""

from __future__ import annotations

import workbook as wb

from .grpo_common import answer_reward, grpo_trainer


def make_trainer_factory(max_completion_length: int = 1):
    def make_trainer():
        return grpo_trainer(answer_reward, max_completion_length=max_completion_length)
    return make_trainer


def task(max_completion_length: int = 1):
    return wb.adapters.from_trainer(make_trainer_factory(max_completion_length),
                                    name="grpo-clipped")

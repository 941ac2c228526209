"""A GRPO reward function that returns `None` for the completions it cannot score, as TRL's
multi-task reward convention allows (huggingface/trl#3079, "Flexible_reward": a reward function
returns None where it does not apply) and as the reports of NaN rewards write it
(modelscope/ms-swift#8123: "A reward function that occasionally returns `None` (simulating API
failures, parsing errors, etc.)"; huggingface/trl#5775: NaN-poisoned group mean/std). Here the
only reward function returns None whenever the answer shares no letter with the instruction's
word (its "parser" finds nothing): TRL 1.16 marks those completions unscorable, leaves them out
of the group baseline and zeroes their advantage - the policy is never pushed away from its worst
answers, and a group of unscorable completions gives no gradient at all; TRL only warns ("All
reward functions returned None for the following kwargs").

Planted (`unscorable="none"`): `None` for those completions. Clean twin (`unscorable="zero"`):
`0.0` for them (the same reward as the other GRPO twins).
"""

from __future__ import annotations

import workbook as wb

from .grpo_common import answer_reward, grpo_trainer


def make_trainer_factory(unscorable: str = "none"):
    def parsed_reward(prompts, completions, **kwargs):
        scores = answer_reward(prompts, completions)
        if unscorable == "none":  # planted: the parser's failure is not a score
            return [s if s > 0 else None for s in scores]
        return scores

    def make_trainer():
        return grpo_trainer(parsed_reward)
    return make_trainer


def task(unscorable: str = "none"):
    return wb.adapters.from_trainer(make_trainer_factory(unscorable), name="grpo-none-reward")

"""A GRPO reward function that returns one reward for the whole batch, as huggingface/trl#6533
writes it: `def bad_reward(completions, **kwargs): return [1.0]` - here a judge that scores the
batch once (the mean word overlap of its completions) and returns `[score]`. Before
huggingface/trl#6534 the single value broadcast silently over every completion (rewards equal in
every group: no advantage, no gradient); TRL 1.16 refuses it at the first generation step:
"The reward function 'batch_reward' returned 1 rewards, but 4 were expected (one per
prompt-completion pair)".

Planted (`rewards="batch"`): `[score]`. Clean twin (`rewards="per_completion"`): one score per
completion, `answer_reward(prompts, completions)`.
"""

from __future__ import annotations

import workbook as wb

from .grpo_common import answer_reward, grpo_trainer


def make_trainer_factory(rewards: str = "batch"):
    def batch_reward(prompts, completions, **kwargs):
        scores = answer_reward(prompts, completions)
        if rewards == "batch":  # planted: one score for the batch
            return [sum(scores) / len(scores)]
        return scores

    def make_trainer():
        return grpo_trainer(batch_reward)
    return make_trainer


def task(rewards: str = "batch"):
    return wb.adapters.from_trainer(make_trainer_factory(rewards), name="grpo-reward-length")

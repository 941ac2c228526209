"""`num_generations` that does not divide the generation batch: `GRPOConfig(
per_device_train_batch_size=4, num_generations=3)` on one process, so the generation batch of 4
completions cannot hold whole groups of 3. TRL refuses it itself when the config is built
(grpo_config.py `__post_init__`): "generation_batch_size (4) must be divisible by num_generations
(3)." - the refusal users meet in huggingface/open-r1#249 ("ValueError: The global train batch
size (7 x 1) must be evenly divisible by the number of generations per prompt (8)"), asked about
in huggingface/trl#2858, and in TRL 1.16's wording in allenai/olmocr#394 ("generation_batch_size
(8) must be divisible by num_generations (28)").

Planted (`num_generations=3`); clean twin (`num_generations=4`).
"""

from __future__ import annotations

import workbook as wb

from .grpo_common import answer_reward, grpo_trainer


def make_trainer_factory(num_generations: int = 3):
    def make_trainer():
        return grpo_trainer(answer_reward, num_generations=num_generations,
                            per_device_train_batch_size=4)
    return make_trainer


def task(num_generations: int = 3):
    return wb.adapters.from_trainer(make_trainer_factory(num_generations),
                                    name="grpo-num-generations")

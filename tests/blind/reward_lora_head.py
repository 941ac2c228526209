"""A reward model trained under LoRA whose score head stays frozen at its random init: the
`LoraConfig` names the attention projections but neither `task_type="SEQ_CLS"` nor
`modules_to_save=["score"]`, so PEFT adapts `q_proj`/`v_proj` and leaves the newly initialised
`score` head (`Some weights of LlamaForSequenceClassification were not initialized ... ['score.
weight']`) untouched - the reward is a fixed random projection of the adapted features.

Sources: huggingface/peft#1070 ("modules_to_save not working for
AutoModelForSequenceClassification": the head trains only once `score` is in modules_to_save),
OpenRLHF/OpenRLHF#873 ("the score layer initialized at the beginning of the reward model
training, I would like to do full parameter tuning on the score layer"), huggingface/trl#1379
(the reward model's classification head); TRL's own RewardTrainer docstring: "it's highly
recommended to set `modules_to_save=["score"]` in the PEFT configuration to ensure that the
reward head is properly trained". (`task_type="CAUSAL_LM"` is refused by PEFT itself on a
sequence classifier: "'LlamaForSequenceClassification' object has no attribute
'prepare_inputs_for_generation'".)

Planted (`head="frozen"`): `LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj",
"v_proj"])`. Clean twins: `head="seq_cls"` (`task_type="SEQ_CLS"`: PEFT adds the score head to
modules_to_save) and `head="modules_to_save"` (`modules_to_save=["score"]`).
"""

from __future__ import annotations

import workbook as wb

from .reward_common import pairs, reward_trainer


def make_trainer_factory(head: str = "frozen"):
    from peft import LoraConfig

    extra = {"task_type": "SEQ_CLS"} if head == "seq_cls" else \
        {"modules_to_save": ["score"]} if head == "modules_to_save" else {}
    rows = pairs()

    def make_trainer():
        return reward_trainer(rows, peft_config=LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], **extra))
    return make_trainer


def task(head: str = "frozen"):
    return wb.adapters.from_trainer(make_trainer_factory(head), name="reward-lora-head")

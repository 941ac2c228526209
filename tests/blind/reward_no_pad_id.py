"""A reward model whose config has no `pad_token_id`: `LlamaConfig(..., pad_token_id=None)` with
`num_labels=1`. A sequence classifier reads its score at the last non-pad token, located through
`config.pad_token_id`; without it transformers refuses a batch ("Cannot handle batch sizes > 1 if
no padding token is defined.", huggingface/trl#422, sbintuitions/flexeval#108). TRL 1.16's
RewardTrainer repairs it itself when it is built (reward_trainer.py: "SequenceClassification
models need `config.pad_token_id` to locate the last non-pad token", `model.config.
get_text_config().pad_token_id = processing_class.pad_token_id`), so the built trainer's model
has the tokenizer's pad id: this case is a clean twin only - no pad_token_id finding may be
raised (`pad_token_id=None`), as with the pad id set (`pad_token_id="tokenizer"`).
"""

from __future__ import annotations

import workbook as wb

from .reward_common import pairs, reward_trainer


def make_trainer_factory(pad_token_id: str | None = None):
    rows = pairs()
    config = {} if pad_token_id == "tokenizer" else {"pad_token_id": None}

    def make_trainer():
        return reward_trainer(rows, config=config)
    return make_trainer


def task(pad_token_id: str | None = None):
    return wb.adapters.from_trainer(make_trainer_factory(pad_token_id), name="reward-no-pad-id")

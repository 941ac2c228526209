"""An LLM fine-tune as TRL and PEFT write it (examples/trl_sft.py, examples/trl_dpo.py,
examples/trl_reward.py, examples/hf_trainer.py, examples/llama_lora_campaign.py): the planted
bugs the pilot names and the clean twins' false alarms, the LoRA twin's predicted peaks against
its measured ones, and the time to size the 8 B LoRA campaign. Needs the [llm] extra.

    python benchmarks/llm_finetune.py

Prints `llm_finetune_named: X/Y  false_alarms: N`, one row per phase of the LoRA prediction
with its error and `lora_prediction_max_abs_error_pct`, and the campaign's first-update peak
(8 B LoRA and 70 B QLoRA, with and without activation checkpointing) with `lora_8b_sizing_s`
and `qlora_70b_sizing_s`.
"""

import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples package

from workbook import WorkbookError  # noqa: E402
from workbook.contract.data import encode_examples, prepare  # noqa: E402
from workbook.notebooks.gates import GateRun, GateSettings  # noqa: E402
from workbook.notebooks.inspection import inspect_task  # noqa: E402
from workbook.notebooks.overfit import overfit  # noqa: E402
from workbook.training.loop import UpdateShape  # noqa: E402
from workbook.training.predict import Plan, compare, predict  # noqa: E402

CHATS = 120
GIB = 2**30


def items(task):
    data = prepare(task, limits={"train": 64, "validation": 16})
    return {s: encode_examples(task, data.raw[s]) for s in ("train", "validation")}


def gates(task, its, shape=None):
    shape = shape or UpdateShape(2, 1)
    with tempfile.TemporaryDirectory() as tmp:
        return GateRun(task, GateSettings(shape, eval_batch=8, input_updates=1), its["train"],
                       its["validation"], Path(tmp)).run()


def sft(**planted):
    from examples.trl_sft import make_task

    return make_task(CHATS, **planted)


def dpo(**planted):
    from examples.trl_dpo import make_task

    return make_task(CHATS // 3, **planted)  # three pairs a conversation


def reward(**planted):
    from examples.trl_reward import make_task

    return make_task(CHATS // 3, **planted)  # three pairs a conversation


def hf(**planted):
    from examples.hf_trainer import make_task

    return make_task(conversations=CHATS, **planted)


def flags(task) -> set[str]:
    return {f.check for f in inspect_task(task).flags}


def forward_gate(task) -> str:
    row = {r.phase: r for r in gates(task, items(task)).rows}["forward + loss"]
    return row.detail if row.verdict == "fail" else ""


def accounting(loss: str) -> str:
    from workbook.commands import params
    from workbook.notebooks import accounting as notebook

    p = params.of("04_batch_accounting", small=True, task="examples.trl_sft:task",
                  task_options={"count": CHATS, "loss": loss})
    return " ".join(notebook.run(p).findings)


def packed(strategy) -> set[str]:
    from examples.trl_sft import make_trainer_factory
    from workbook.contract.adapters import from_trainer

    return flags(from_trainer(make_trainer_factory(CHATS, packing=strategy), name="packed"))


def refused(**planted) -> str:
    try:
        sft(**planted)
    except WorkbookError as exc:
        return exc.problem
    return ""


PLANTED = [  # (bug, what the pilot must say, how it is looked for)
    ("system and user tokens in the loss (assistant_only_loss off)", "loss on prompt",
     lambda: flags(sft(all_tokens_in_loss=True))),
    ("LoRA B not zero at the start (init_lora_weights=False)", "LoRA's B must start at zero",
     lambda: forward_gate(sft(init_adapters=False))),
    ("chat template without generation markers", "{% generation %}",
     lambda: refused(no_generation_markers=True)),
    ("pad_token == eos_token: the end token masked", "end token not a target",
     lambda: flags(hf(pad_is_eos=True))),
    ("LoRA target_modules copied from a BERT recipe", "adapter targets match no module",
     lambda: flags(sft(foreign_targets=True))),
    ("compute_loss ignores num_items_in_batch (transformers#37766)",
     "ignores num_items_in_batch", lambda: accounting("mean")),
    ("a long system prompt: TRL drops the truncated rows silently",
     "rows dropped before training", lambda: flags(sft(long_system=40))),
    ("a new role token whose embedding row stays frozen under LoRA",
     "added tokens not trained", lambda: flags(sft(new_role_token="frozen"))),
    ("packing without document boundaries ('wrapped')", "cross-document attention",
     lambda: packed(True)),
    ("training conversations copied into the eval set, packed", "group crosses splits",
     lambda: flags(sft(packing="bfd", eval_overlap=5))),
    ("DPO pairs whose rejected answer is the chosen one", "pair without preference",
     lambda: flags(dpo(same_answer=True))),
    ("DPO answers that part only after max_length", "pair without preference",
     lambda: flags(dpo(shared_opening=True))),
    ("DPO prompts that fill max_length: TRL drops the pairs", "rows dropped before training",
     lambda: flags(dpo(long_prompt=True))),
    ("reward pairs whose rejected answer is the chosen one", "pair without preference",
     lambda: flags(reward(same_answer=True))),
    ("reward pairs identical once the script's tokenization truncated them",
     "pair without preference", lambda: flags(reward(truncated=True))),
    ("reward pairs longer than max_length: RewardTrainer drops them",
     "rows dropped before training", lambda: flags(reward(long_answer=True))),
    ("a reward collator padding with the end token, not config.pad_token_id",
     "score read on padding", lambda: flags(reward(pad_with_eos=True))),
    ("a score head PEFT froze (LoraConfig without task_type)", "score head frozen",
     lambda: flags(reward(head="frozen"))),
    ("a score head started at std 20: first loss far from ln 2", "first loss far from ln 2",
     lambda: flags(reward(head_std=20.0))),
]


def clean_alarms() -> list[str]:
    """What the clean twins raise in 01, 02 and 03 (nothing, when all is well)."""
    alarms = [f"trl_sft 01: {f}" for f in flags(sft())]
    alarms += [f"hf_trainer 01: {f}" for f in flags(hf())]
    alarms += [f"trl_sft packed (bfd) 01: {f}" for f in flags(sft(packing="bfd"))]
    alarms += [f"trl_sft trained new token 01: {f}" for f in
               flags(sft(new_role_token="trained"))]
    alarms += [f"trl_sft own loss (summed) 04: {f}" for f in [accounting("summed")] if f]
    alarms += [f"trl_dpo 01: {f}" for f in flags(dpo())]
    for twin in ({}, {"lora": False}, {"head": "saved"}, {"no_pad_token": True}):
        alarms += [f"trl_reward {twin} 01: {f}" for f in flags(reward(**twin))]
    res = overfit(reward(), examples=8, updates=150)
    alarms += [f"trl_reward 02: {c}" for c in res.checks.loc[~res.checks.passed, "check"]]
    res = overfit(dpo(), examples=8, updates=150)
    alarms += [f"trl_dpo 02: {c}" for c in res.checks.loc[~res.checks.passed, "check"]]
    res = overfit(sft(), examples=4, updates=120)
    alarms += [f"trl_sft 02: {c}" for c in res.checks.loc[~res.checks.passed, "check"]]
    report = gates(sft(), items(sft()))
    alarms += [f"trl_sft 03: {r.phase}" for r in report.rows if r.verdict == "fail"]
    return alarms


def main():
    torch.set_num_threads(1)
    pd.set_option("display.width", 200)
    named = 0
    for bug, words, look in PLANTED:
        said = look()
        hit = words in (" ".join(sorted(said)) if isinstance(said, set) else said)
        named += hit
        print(f"{'named ' if hit else 'MISSED'} {bug}: {str(said)[:160]}", flush=True)
    alarms = clean_alarms()
    for alarm in alarms:
        print(f"false alarm: {alarm}")
    print(f"llm_finetune_named: {named}/{len(PLANTED)}  false_alarms: {len(alarms)}\n")

    task = sft()
    its = items(task)
    shape = UpdateShape(4, 2)
    measured = gates(task, its, shape).table()
    predicted = predict(task, its["train"], its["validation"], Plan(shape, 0), cpu_exact=True)
    table = compare(predicted, measured)
    print(table.to_string(index=False))
    print(f"lora_prediction_max_abs_error_pct: {table.error_pct.abs().max():.3f}\n")

    from examples.llama_lora_campaign import make_task as lora_8b
    from examples.llama_lora_campaign import qlora_70b

    for label, build in (("lora_8b", lora_8b), ("qlora_70b", qlora_70b)):
        big = build()
        its = items(big)
        for checkpointing in (False, True):
            start = time.perf_counter()
            sized = predict(big, its["train"], its["validation"],
                            Plan(UpdateShape(1, 1, "bf16", checkpointing), 1024),
                            campaign=True).set_index("phase")
            seconds = time.perf_counter() - start
            first, peak = sized.loc["update (first)"], sized.predicted_peak_bytes.max()
            print(f"{label} mb1 x 1024 bf16{' +ckpt' if checkpointing else ''}: peak "
                  f"{peak / GIB:.2f} GiB ({sized.predicted_peak_bytes.idxmax()}); first update: "
                  f"weights {first.parameter_bytes / GIB:.2f} + gradients "
                  f"{first.gradient_bytes / GIB:.2f} + optimizer state "
                  f"{first.optstate_bytes / GIB:.2f} GiB; sized in {seconds:.1f} s")
        print(f"{label}_sizing_s: {seconds:.1f}")


if __name__ == "__main__":
    main()

"""Blind planted-bug cases, second set: each written in the idiom of the public report it comes
from (the module of each case names it), run through the notebooks' public calls -
`wb.params.of(stem, small=True, ...)`, then the notebook module's `run` and `save` - and judged
on what a user reads: the verdict, `summary.json` and the tables written beside it.

A test marked xfail failed on its first run against the unchanged workbook (FIRST_RUN_2.md says
what the workbook said instead); remove the mark when the fix lands. The assertions hold the
essential facts of each cause, not the wording.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import workbook as wb

from .test_blind_cases import RESUME_PARAMS, planted_resume_cases, run_notebook

pytest.importorskip("transformers")


def needs(*modules: str) -> None:
    for module in modules:
        pytest.importorskip(module)


CHAT = "tests.blind.own_chat_tokens:task"


def everything_said(out: Path, summary: dict) -> str:
    """The summary and every table or text the notebook wrote beside it."""
    parts = [json.dumps(summary)]
    for path in sorted(out.rglob("*")):
        if path.is_file() and path.suffix in (".json", ".csv", ".txt", ".md") and \
                path.stat().st_size < 2_000_000:
            parts.append(path.read_text(errors="replace"))
    return "\n".join(parts)


EVAL_DATASET_ADVICE = re.compile(r"eval(uation)?[ _]dataset", re.IGNORECASE)
# "pass the eval dataset with its labelled rows": the adapter's advice for an eval set of padding
# rows (Hugging Face's -100 convention), which these datasets are not
EVAL_PADDING_ADVICE = re.compile(r"pass the eval(uation)? dataset with its labell?ed rows",
                                 re.IGNORECASE)


def hear(module, stem: str, out: Path, task: str, *, sizes: dict | None = None,
         **options) -> tuple[str, str]:
    """A notebook on a task (at its smoke sizes, then `sizes`): its verdict and everything it
    said - or, where the task is refused before the notebook runs, "refused" and the refusal's
    text."""
    needs("trl", "peft", "datasets")
    try:
        _, verdict, summary = run_notebook(module, stem, out, task=task, task_options=options,
                                           **(sizes or {}))
    except Exception as error:  # noqa: BLE001 - the refusal is what the user reads
        return "refused", f"{type(error).__name__}: {error}"
    return verdict, everything_said(out, summary)


def inspect(out: Path, task: str, **options) -> tuple[str, str]:
    """Notebook 01 on a task, as `hear` reports it."""
    return hear(wb.inspection, "01_inspect_examples", out, task, **options)


# 1. apply_chat_template(return_assistant_tokens_mask=True) without {% generation %} -----------
#    huggingface/trl#4147 (#4201), huggingface/transformers#34172

# first run: not named (FIRST_RUN_2.md); named since the fix landed
def test_assistant_mask_all_zero_without_generation_block_is_named(tmp_path):
    verdict, said = inspect(tmp_path, CHAT, generation_block=False)
    assert verdict != "pass", said
    assert re.search(r"\{% ?generation ?%\}|generation (block|marker|keyword|tag)|"
                     r"assistant[ _-]?masks?", said, re.IGNORECASE), said
    assert not EVAL_PADDING_ADVICE.search(said), said


@pytest.mark.twin
def test_assistant_mask_with_generation_block_passes(tmp_path):
    verdict, said = inspect(tmp_path, CHAT, generation_block=True)
    assert verdict == "pass", said
    assert not re.search(r"generation (block|marker)", said, re.IGNORECASE), said


# 2. the same own tokenization truncated at max_length=40 under a long system prompt ----------
#    huggingface/trl#3927

# first run: not named (FIRST_RUN_2.md); named since the fix landed
def test_truncation_that_leaves_no_answer_token_is_named(tmp_path):
    verdict, said = inspect(tmp_path, CHAT, generation_block=True, max_length=40,
                            system_words=48)
    assert verdict != "pass", said
    assert re.search(r"truncat", said, re.IGNORECASE), said
    assert re.search(r"\b40\b", said), said  # the figure: max_length 40
    assert not EVAL_PADDING_ADVICE.search(said), said


@pytest.mark.twin
def test_long_system_prompt_with_room_for_the_answers_passes(tmp_path):
    verdict, said = inspect(tmp_path, CHAT, generation_block=True, max_length=256,
                            system_words=48)
    assert verdict == "pass", said


# 3. <|tool|> added, resize_token_embeddings, LoRA on the linear layers only ------------------
#    huggingface/peft#337, huggingface/peft#2376

TOOL = "tests.blind.lora_tool_token:task"


# first run: not named (FIRST_RUN_2.md); named since the fix landed
def test_added_token_frozen_under_lora_is_named(tmp_path):
    verdict, said = inspect(tmp_path, TOOL, new_rows="frozen")
    assert verdict == "fail", said
    assert "<|tool|>" in said, said  # the token itself
    assert re.search(r"trainable_token_indices|modules_to_save", said), said  # the fix


@pytest.mark.twin
@pytest.mark.parametrize("new_rows", ["modules_to_save", "trainable_tokens"])
def test_added_token_trained_beside_lora_passes(tmp_path, new_rows):
    verdict, said = inspect(tmp_path, TOOL, new_rows=new_rows)
    assert verdict == "pass", said
    assert not re.search(r"not trained|frozen", said, re.IGNORECASE), said


# 4. streams resumed by their own state_dict, each from its report ----------------------------

STREAMS = "tests.blind.report_streams:task"

STREAM_CAUSES = {
    # huggingface/datasets#8295: state_dict stops advancing after load_state_dict
    "stale_reference": (r"load_state_dict", r"(did not|does not|never|not) advanc|stale|frozen"),
    # huggingface/transformers#26413: skip by global_step % len() on a stream
    "trainer_skip": (r"\blen\(\)|\blength\b", r"skip"),
    # Lightning-AI/litData#649: the position is committed only at the end of __iter__
    "commit_at_end": (r"\bend\b", r"commit|pass cut short|breaks? early|cut short"),
}


@pytest.mark.slow  # 30-40 s each: torchrun launches / resumed processes
@pytest.mark.parametrize("stream", sorted(STREAM_CAUSES))
def test_stream_resume_bug_is_named_by_its_own_cause(tmp_path, stream):
    _, verdict, summary = run_notebook(wb.resume, "07_resume_reload", tmp_path, task=STREAMS,
                                       task_options={"stream": stream}, **RESUME_PARAMS)
    assert verdict == "fail"
    failing = [case for case in summary["figures"]["cases"] if not case["exact"]]
    assert failing, summary["figures"]["cases"]
    said = " ".join(f"{case['data']} {case.get('error', '')}" for case in failing)
    for pattern in STREAM_CAUSES[stream]:
        assert re.search(pattern, said, re.IGNORECASE), said
    assert "epoch guard" not in said, said


@pytest.mark.slow  # 30-40 s each: torchrun launches / resumed processes
@pytest.mark.twin
def test_stateful_stream_resumes_exactly(tmp_path):
    _, verdict, summary = run_notebook(wb.resume, "07_resume_reload", tmp_path, task=STREAMS,
                                       task_options={"stream": "stateful"}, **RESUME_PARAMS)
    assert verdict == "pass", summary["figures"]["cases"]
    assert all(case["exact"] for case in summary["figures"]["cases"])


# 5. batch-level mixup / cutmix drawn per collated batch (torchvision references) -------------

MIXUP = "tests.blind.mixup_collate:task"


# first run: not named (FIRST_RUN_2.md); named since the fix landed
def test_mixup_in_collate_is_not_blamed_on_the_step(tmp_path):
    _, verdict, summary = run_notebook(wb.accounting, "04_batch_accounting", tmp_path,
                                       task=MIXUP, task_options={})
    findings = " ".join(summary["figures"]["findings"])
    assert "attention mask" not in findings, findings
    # either the mixing is held fixed (and the step passes), or the randomness is named
    assert verdict == "pass" or re.search(r"\bmix|random", findings, re.IGNORECASE), findings


@pytest.mark.twin
def test_no_mixing_passes_the_step_checks(tmp_path):
    _, verdict, summary = run_notebook(wb.accounting, "04_batch_accounting", tmp_path,
                                       task=MIXUP, task_options={"mixup_alpha": 0.0,
                                                                 "cutmix_alpha": 0.0})
    assert verdict == "pass", summary["figures"]["findings"]
    assert summary["figures"]["findings"] == []


# 6. an epoch-end metric of this rank's own counts, logged without sync_dist ------------------
#    Lightning-AI/pytorch-lightning#19620, #4529

EPOCH_END = "tests.blind.lightning_epoch_end_rank:task"


# about 30-50 s on one core: a torchrun launch of two processes
@pytest.mark.xfail(strict=False, reason="blind case: first run of 09 passed every rule: "
                   "'evaluation reduced as sums over ranks' reduced val_acc as a mean over "
                   "rows (27/30 from 14/15 and 13/15), which the unsynchronised log is not; "
                   "still so: 09 rebuilds the epoch-end value from each rank's sums, where "
                   "Lightning logs rank 0's own (judging that flips lightning_docs' control)")
@pytest.mark.slow  # 30-40 s each: torchrun launches / resumed processes
@pytest.mark.parametrize("val_log", ["epoch_end_unsynced", "epoch_end_sync_false"])
def test_unsynced_epoch_end_metric_is_described(tmp_path, val_log):
    needs("lightning")
    _, verdict, summary = run_notebook(wb.parallel, "09_data_parallel", tmp_path,
                                       task=EPOCH_END, task_options={"val_log": val_log},
                                       fsdp=False)
    said = everything_said(tmp_path, summary)
    assert verdict == "fail", summary["rules"]
    assert "val_acc" in said
    assert re.search(r"sync_dist|synchroni[sz]", said), said
    assert re.search(r"on_validation_epoch_end|epoch[- ]end", said), said
    assert re.search(r"\brank", said), said
    assert "epoch mean of a step log" not in said


@pytest.mark.slow  # 30-40 s each: torchrun launches / resumed processes
@pytest.mark.twin
def test_step_logged_metric_passes_data_parallel(tmp_path):
    needs("lightning")
    _, verdict, summary = run_notebook(wb.parallel, "09_data_parallel", tmp_path,
                                       task=EPOCH_END, task_options={"val_log": "step"},
                                       fsdp=False)
    assert verdict == "pass", summary["rules"]


# 7. a resumed process that rebuilds a different base (vocabulary from a cache) ---------------
#    MILVLG/mcan-vqa#18, SWivid/F5-TTS#642

VOCAB = "tests.blind.vocab_rebuilt:task"
SHAPE = re.compile(r"(\d+)\s*(?:,|x|×)\s*64\b")


def resume_errors(cases: list[dict]) -> str:
    return " ".join(f"{c['data']} {c.get('error', '')}" for c in cases if not c["exact"])


@pytest.mark.parametrize("own_checkpoint", [
    # first run: named with its tensor and shapes by the workbook's own checkpoint loader
    False,
    # first run: misnamed ('the task's restore_state failed: Error(s) in loading state_dict for
    # Net:', the size mismatch cut off; FIRST_RUN_2.md); named since the fix landed
    True,
])
def test_rebuilt_base_of_another_shape_is_named(tmp_path, own_checkpoint):
    cases = planted_resume_cases(
        tmp_path / "out", task=VOCAB,
        task_options={"pinned": False, "own_checkpoint": own_checkpoint,
                      "vocab_cache": str(tmp_path / "token_to_ix.json")})
    assert not all(case["exact"] for case in cases)
    said = resume_errors(cases)
    assert "embedding.weight" in said, said
    assert len({int(n) for n in SHAPE.findall(said)}) >= 2, said  # saved and rebuilt rows
    assert not re.search(r"did not bring back the model|fix restore_state", said), said


@pytest.mark.twin
def test_pinned_vocabulary_resumes_exactly(tmp_path):
    _, verdict, summary = run_notebook(
        wb.resume, "07_resume_reload", tmp_path / "out", task=VOCAB,
        task_options={"pinned": True, "vocab_cache": str(tmp_path / "token_to_ix.json")},
        **RESUME_PARAMS)
    assert verdict == "pass", summary["figures"]["cases"]
    assert all(case["exact"] for case in summary["figures"]["cases"])

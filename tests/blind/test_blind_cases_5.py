"""Blind planted-bug cases, fifth set: the learning-rate study (06) on a budget too short to call
a winner, on a task whose own warm-up outlasts the study, and under an optimizer that sets its
own step. Each case is written in the idiom of the public paper, script or docs page it comes
from (tests/blind/lr_study_5.py names them), run through 06's public calls -
`wb.params.of("06_lr_study", small=True, ...)`, then `run` and `save` - and judged on what a
user reads: the summary's figures and everything written beside it.

A test marked xfail failed on its first run against the unchanged workbook (FIRST_RUN_5.md says
what the workbook said instead); remove the mark when the fix lands.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import workbook as wb

from .test_blind_cases_2 import everything_said

pytest.importorskip("transformers")

TASK = "tests.blind.lr_study_5:task"

NO_RATE = re.compile(r"no (learning )?rate (tried )?(learn|lower|improv|beat)|none of the "
                     r"(learning )?rates|did not (learn|fall|improve) at any|no rate supported",
                     re.IGNORECASE)
LENGTHEN = re.compile(r"lengthen|longer (budget|run|study)|more updates|too short|clos(e|es|ing)"
                      r" (in|the gap|on)|overtak|catch(es|ing)? up", re.IGNORECASE)


def study(out: Path, options: dict, **params) -> tuple[dict, str]:
    """06 on a task: its figures and everything it said (the task's own option names, which
    the summary repeats, left out: "num_warmup_steps" is not the study naming a warm-up)."""
    out.mkdir(parents=True, exist_ok=True)
    p = wb.params.of("06_lr_study", small=True, task=TASK, task_options=options, **params)
    wb.study.save(wb.study.run(p, out), out)
    summary = json.loads((out / "summary.json").read_text())
    said = re.sub(r'"?(num_warmup_steps|relative_step|optimizer|noise|kind|own_step)"?\s*[:=]\s*'
                  r'("[^"]*"|[^,}\s]+)', "", everything_said(out, summary))
    return summary["figures"], said


def warnings(figures: dict) -> str:
    return json.dumps(figures.get("warnings"))


# 1. short-horizon bias: Wu et al. 2018 (https://arxiv.org/abs/1803.02021), the tuning playbook
#    (https://github.com/google-research/tuning_playbook: compare at the budget you will train)
#    constant-lr SGD on a noisy quadratic: 0.02 leads at 80 updates (flat since 60), 0.01 is
#    still falling and overtakes by 240

QUADRATIC = dict(micro_batch=4, accumulation=4, eval_every=10, eval_batch=64, eval_sample=0)
NOISY = {"kind": "horizon", "noise": 1.0}
CLEAN = {"kind": "horizon", "noise": 0.0}


@pytest.mark.planted
def test_short_horizon_winner_is_not_conclusive(tmp_path):
    figures, said = study(tmp_path, NOISY, lrs=[0.01, 0.02, 0.04], updates=80, **QUADRATIC)
    assert figures.get("best_lr") == 0.02, figures  # the case as written: the middle rate leads
    assert figures.get("conclusive") is False, figures
    assert LENGTHEN.search(warnings(figures)), figures.get("warnings")


def test_short_horizon_runner_up_wins_a_longer_study(tmp_path):
    """The case's own check: the same study at three times the budget prefers the smaller
    rate - the 60-update winner was an artefact of the horizon."""
    figures, _ = study(tmp_path, NOISY, lrs=[0.01, 0.02, 0.04], updates=240, extra_trials=0,
                       **QUADRATIC)
    assert figures["best_lr"] == 0.01, figures


@pytest.mark.twin
def test_steady_trailing_runner_up_reads_conclusive(tmp_path):
    figures, said = study(tmp_path, CLEAN, lrs=[0.1, 0.3, 0.9], updates=80, **QUADRATIC)
    assert figures.get("best_lr") == 0.3, figures  # 0.9 diverges, 0.1 trails 5x and more
    assert figures.get("conclusive") is True, figures
    assert not LENGTHEN.search(warnings(figures)), figures.get("warnings")


def test_steady_trailing_runner_up_stays_behind_in_a_longer_study(tmp_path):
    figures, _ = study(tmp_path, CLEAN, lrs=[0.1, 0.3, 0.9], updates=240, extra_trials=0,
                       **QUADRATIC)
    assert figures["best_lr"] == 0.3, figures


# 1b. a task that does not clip (grad_clip=None, "the gradient norm your campaign clips at, None
#     when it does not clip": docs/own-task.md): 06's trials of the workbook's own update must
#     run the paper's SGD step, the same curve as the task's own unclipped train_step

def test_task_that_does_not_clip_is_not_clipped(tmp_path):
    own, _ = study(tmp_path / "own", NOISY, lrs=[0.01, 0.02, 0.04], updates=60, **QUADRATIC)
    workbooks, said = study(tmp_path / "workbook", {**NOISY, "own_step": False},
                            lrs=[0.01, 0.02, 0.04], updates=60, **QUADRATIC)
    assert workbooks["best_lr"] == own["best_lr"], (workbooks, own)
    assert workbooks["best_metric"] == pytest.approx(own["best_metric"], rel=1e-3), workbooks


# 2. the task's own warm-up far longer than the study: run_glue_no_trainer.py's
#    get_linear_schedule_with_warmup(optimizer, num_warmup_steps=500, ...)

GLUE = dict(updates=60, eval_every=20)
LONG_WARMUP = {"kind": "glue", "optimizer": "adamw", "num_warmup_steps": 500}
SHORT_WARMUP = {"kind": "glue", "optimizer": "adamw", "num_warmup_steps": 2}
WARMUP = re.compile(r"warm-?\s?up", re.IGNORECASE)


@pytest.mark.planted
def test_long_task_warmup_is_not_read_as_nothing_learns(tmp_path):
    figures, said = study(tmp_path, LONG_WARMUP, **GLUE)
    assert not NO_RATE.search(said), figures.get("finding")
    assert not re.search(r"labels? (are|is|look)[^.]{0,40}(random|independent|wrong)|check the"
                         r" labels", said, re.IGNORECASE), figures.get("finding")
    assert figures.get("supported_lr") is not None or WARMUP.search(said), figures


@pytest.mark.twin
def test_short_task_warmup_supports_a_rate(tmp_path):
    figures, said = study(tmp_path, SHORT_WARMUP, **GLUE)
    assert figures.get("supported_lr") is not None, figures
    assert not NO_RATE.search(said), figures.get("finding")


# 3. Adafactor(..., relative_step=True, warmup_init=True, lr=None): the rate is ignored
#    https://huggingface.co/docs/transformers/main_classes/optimizer_schedules

RELATIVE = {"kind": "glue", "optimizer": "adafactor", "relative_step": True}
ABSOLUTE = {"kind": "glue", "optimizer": "adafactor", "relative_step": False}
OWN_STEP = re.compile(r"ignor\w*[^.]{0,60}(rate|lr)|(rate|lr)[^.]{0,60}ignor|sets its own "
                      r"(step|rate|learning rate)|own (step size|learning rate schedule)|does not"
                      r" (use|depend on) the (learning )?rate|every trial[^.]{0,40}"
                      r"(same|identical)",
                      re.IGNORECASE)


@pytest.mark.planted
def test_rate_ignoring_optimizer_gets_no_rate_recommended(tmp_path):
    figures, said = study(tmp_path, RELATIVE, **GLUE)
    assert not re.search(r"beat the control", str(figures.get("finding"))), figures
    assert OWN_STEP.search(said), figures.get("finding")


@pytest.mark.twin
def test_adafactor_with_a_given_rate_supports_one(tmp_path):
    figures, said = study(tmp_path, ABSOLUTE, **GLUE)
    assert figures.get("supported_lr") is not None, figures
    # judged on what the study says, its sentences: after the fix, summary.json carries a
    # figure named `rate_ignored` (false here), which the pattern read as a claim
    sentences = " ".join([str(figures.get("finding")), *map(str, figures.get("warnings", [])),
                          str(figures.get("range_test"))])
    assert not OWN_STEP.search(sentences), figures.get("finding")
    assert figures.get("rate_ignored") is False, figures


# the cases themselves, in a plain PyTorch loop (the task's pieces, no workbook loop)

def mean(values):
    return sum(values) / len(values)


@pytest.mark.parametrize("options, lr", [
    ({"kind": "glue", "optimizer": "adamw", "num_warmup_steps": 2}, 3e-3),
    ({"kind": "glue", "optimizer": "adafactor", "relative_step": False}, 3e-3),
    ({"kind": "horizon", "noise": 1.0}, 0.02),
    ({"kind": "horizon", "noise": 0.0}, 0.3)])
def test_clean_cases_train_with_plain_pytorch(options, lr):
    from .lr_study_5 import train_plainly

    losses = train_plainly(updates=60, lr=lr, batch=16 if options["kind"] == "horizon" else 4,
                           **options)
    assert mean(losses[-8:]) < 0.6 * mean(losses[:8]), losses


def test_planted_cases_do_not_move_in_plain_pytorch():
    """The long warm-up and the relative-step Adafactor: 60 plain updates at a rate the twins
    learn at leave the loss at chance (ln 2)."""
    from .lr_study_5 import train_plainly

    for options in ({"optimizer": "adamw", "num_warmup_steps": 500},
                    {"optimizer": "adafactor", "relative_step": True}):
        losses = train_plainly("glue", updates=60, lr=3e-3, **options)
        assert abs(mean(losses[-8:]) - 0.693) < 0.02, (options, losses)

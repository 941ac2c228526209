"""Side by side on the planted bugs of examples/lightning_module.py and examples/hf_trainer.py:
what the framework's own quick checks report (Lightning's `fast_dev_run` and `overfit_batches`,
a resume from its own checkpoint; the Hugging Face `Trainer` for a few steps) against what the
pilot's check reports for the same code through the adapters. The clean twin of each is run
too: a finding on it is a false alarm.

    python benchmarks/frameworks.py          (about 3 minutes on 2 cores)

Last line: `frameworks_named_by_pilot: <named>/<planted>  false_alarms: <n>`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from workbook import WorkbookError  # noqa: E402
from workbook import accounting as acc  # noqa: E402
from workbook.data import prepare  # noqa: E402
from workbook.inspection import inspect_task  # noqa: E402
from workbook.loop import UpdateShape  # noqa: E402
from workbook.overfit import overfit  # noqa: E402
from workbook.resume import recipe, run_recipe  # noqa: E402
from workbook.task import load_task  # noqa: E402

LIGHTNING = "examples.lightning_module:task"
HF = "examples.hf_trainer:task"


@contextlib.contextmanager
def quiet():
    """The frameworks' own output, counted: warnings and log records they raise."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    root = logging.getLogger()
    root.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught, \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("always")
        try:
            yield said
        finally:
            root.removeHandler(handler)
            said += [str(w.message) for w in caught]


def relevant(said: list[str], words: tuple[str, ...]) -> str:
    hits = [s for s in said if any(w in s.lower() for w in words)]
    return f"warns: {hits[0][:70]}" if hits else "no warning on it"


# --- Lightning's own checks

def lightning_run(option: str) -> str:
    import lightning.pytorch as pl

    from examples.lightning_module import LitLanguageModel, TextDataModule

    flags = {option: True} if option else {}
    model_flags = {k: v for k, v in flags.items() if k != "padded_training"}
    data = TextDataModule(conversations=60, padded_training=bool(flags.get("padded_training")))
    common = dict(accelerator="cpu", logger=False, enable_progress_bar=False,
                  enable_model_summary=False)
    with quiet() as said, tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        trainer = pl.Trainer(fast_dev_run=True, accumulate_grad_batches=4, **common)
        trainer.fit(LitLanguageModel(**model_flags), data)
        dev = {k: round(float(v), 3) for k, v in trainer.callback_metrics.items()}
        trainer = pl.Trainer(overfit_batches=2, max_epochs=40, accumulate_grad_batches=2,
                             enable_checkpointing=False, **common)
        trainer.fit(LitLanguageModel(**model_flags), data)
        over = float(trainer.callback_metrics.get("train_loss", float("nan")))
        resumed = ""
        if option == "drop_optimizer_state":
            first = pl.Trainer(max_steps=4, default_root_dir=tmp, **common)
            first.fit(LitLanguageModel(**model_flags), data)
            ckpt = next(Path(tmp).rglob("*.ckpt"))
            again = pl.Trainer(max_steps=6, default_root_dir=tmp, **common)
            again.fit(LitLanguageModel(**model_flags), data, ckpt_path=str(ckpt))
            resumed = "; resume from its checkpoint: ran on"
    words = {"padded_training": ("accumul", "normali"), "val_counts_padding": ("pad",),
             "drop_optimizer_state": ("optimizer",)}.get(option, ("",))
    return (f"fast_dev_run: ran, {dev}; overfit_batches=2: train_loss {over:.3f}{resumed}; "
            f"{relevant(said, words) if option else 'ran'}")


def pilot_lightning(option: str) -> str:
    task = load_task(LIGHTNING, conversations=60, **({option: True} if option else {}))
    prepared = prepare(task)
    found = []
    own = acc.normalisation_check(task, prepared.train[:8], (8, 2, 1))
    own = own[own.normalisation == "the task's train_step"]
    if not own.within_tolerance.all():
        found.append(f"04: train_step's gradient differs by "
                     f"{own.max_relative_deviation.max():.1%} between 8 x 1 and 1 x 8")
    found += [f"04: {f}" for f in acc.evaluation_findings(
        acc.evaluation_check(task, prepared.validation[:10]))]
    spec = recipe(LIGHTNING, {"conversations": 60, **({option: True} if option else {})},
                  UpdateShape(2, 2).train_config(updates=4))
    with tempfile.TemporaryDirectory() as tmp:
        reference, _ = run_recipe(spec, 4, Path(tmp) / "a", checkpoint_at=(2,))
        try:
            resumed, _ = run_recipe(spec, 4, start_from=Path(tmp) / "a" / "ckpt-000002")
            if resumed != reference[2:]:
                found.append("07: the resumed run differs")
        except WorkbookError as exc:
            found.append(f"07: {exc.problem[:90]}")
    return "; ".join(found) or "nothing"


# --- the Hugging Face Trainer's own run

def hf_run(option: str) -> str:
    from transformers import Trainer

    from examples.hf_trainer import trainer_pieces

    pieces = trainer_pieces(conversations=120, **({option: True} if option else {}))
    with quiet() as said, tempfile.TemporaryDirectory() as tmp:
        pieces["args"].output_dir = tmp
        pieces["args"].max_steps, pieces["args"].logging_steps = 20, 5
        pieces["args"].save_strategy = "no"
        trainer = Trainer(**pieces)
        result = trainer.train()
        losses = [round(h["loss"], 2) for h in trainer.state.log_history if "loss" in h]
        evaluated = trainer.evaluate()
    words = {"pad_in_labels": ("pad",), "lr_typo": ("learning rate", "nan", "inf")}
    return (f"20 steps: train_loss {result.training_loss:.3g} (logged {losses}), eval_loss "
            f"{evaluated['eval_loss']:.3g}; "
            f"{relevant(said, words.get(option, ('',))) if option else 'ran'}")


def pilot_hf(option: str) -> str:
    task = load_task(HF, conversations=120, **({option: True} if option else {}))
    found = [f"01: {f.check}" for f in inspect_task(task).flags]
    result = overfit(task, examples=8, updates=60)
    if result.verdict != "pass":
        found.append(f"02: {result.diagnosis[:90]}")
    return "; ".join(found) or "nothing"


CASES = [  # (framework, planted option or "" for the clean twin, notebook that must name it)
    ("Lightning", "", ""), ("Lightning", "padded_training", "04"),
    ("Lightning", "val_counts_padding", "04"), ("Lightning", "drop_optimizer_state", "07"),
    ("HF Trainer", "", ""), ("HF Trainer", "pad_in_labels", "01"),
    ("HF Trainer", "lr_typo", "02"),
]


def main() -> None:
    named = planted = false_alarms = 0
    print("| framework | planted | the framework's own check | the pilot |")
    print("|---|---|---|---|")
    for framework, option, notebook in CASES:
        lightning = framework == "Lightning"
        own = (lightning_run if lightning else hf_run)(option)
        pilot = (pilot_lightning if lightning else pilot_hf)(option)
        if option:
            planted += 1
            named += pilot.startswith(f"{notebook}:") or f"; {notebook}:" in pilot
        else:
            false_alarms += pilot != "nothing"
        print(f"| {framework} | {option or '(clean twin)'} | {own} | {pilot} |", flush=True)
    print(f"frameworks_named_by_pilot: {named}/{planted}  false_alarms: {false_alarms}")


if __name__ == "__main__":
    main()

"""Side by side on the planted bugs of five examples: what the framework's own quick checks
report against what the pilot reports for the same code. The clean twin of each is run too: a
finding on it is a false alarm.

- examples/lightning_module.py and examples/hf_trainer.py: Lightning's `fast_dev_run` and
  `overfit_batches` (and a resume from its own checkpoint), the Hugging Face `Trainer` for a few
  steps; the pilot's checks called as library functions through the adapters.
- examples/lightning_docs.py, examples/hf_docs.py (the frameworks' docs idioms) and
  examples/gpt_script.py (a nanoGPT-style script: no framework, so its own check is the
  script's plain loop, 20 AdamW steps of `forward(idx, targets)`): the same framework checks
  (the HF Trainer saving a checkpoint, as the docs' arguments ask), and the pilot's column is
  the notebook a user would read - `run_pilot(..., smoke=True, only=NN)` for a planted bug,
  the words of its summary.json (or a refusal before any notebook ran); all nine notebooks in
  smoke mode for a clean twin, a false alarm where any verdict is not "pass".

    python benchmarks/frameworks.py          (about 10 minutes on 2 cores)
    python benchmarks/frameworks.py --cases max_length,callback_eval   (those rows only)

Last line: `frameworks_named_by_pilot: <named>/<planted>  false_alarms: <n>`.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from workbook import WorkbookError  # noqa: E402
from workbook.contract.data import prepare  # noqa: E402
from workbook.contract.task import load_task  # noqa: E402
from workbook.notebooks import accounting as acc  # noqa: E402
from workbook.notebooks.inspection import inspect_task  # noqa: E402
from workbook.notebooks.overfit import overfit  # noqa: E402
from workbook.notebooks.resume import recipe, run_recipe  # noqa: E402
from workbook.training.loop import TrainConfig, UpdateShape  # noqa: E402

LIGHTNING = "examples.lightning_module:task"
HF = "examples.hf_trainer:task"
LIGHTNING_DOCS = "examples.lightning_docs:task"
HF_DOCS = "examples.hf_docs:task"
GPT = "examples.gpt_script:task"
CELL = 120  # characters of a table cell


@contextlib.contextmanager
def quiet():
    """The frameworks' own output, counted: warnings and log records they raise."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    root = logging.getLogger()
    root.addHandler(handler)
    sink = io.StringIO()
    streams = {h: h.setStream(sink) for h in {*root.handlers, *(
        h for lg in logging.root.manager.loggerDict.values() for h in getattr(lg, "handlers", ()))}
        if type(h) is logging.StreamHandler}  # the frameworks' own handlers print too
    with warnings.catch_warnings(record=True) as caught, \
            contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("always")
        try:
            yield said
        finally:
            root.removeHandler(handler)
            for h, stream in streams.items():
                h.setStream(stream)
            said += [str(w.message) for w in caught]


def relevant(said: list[str], words: tuple[str, ...] | None) -> str:
    """Whether the framework said anything on the bug (`words`; None for a clean twin)."""
    if words is None:
        return "ran"
    hits = [s for s in said if any(w in s.lower() for w in words)]
    return f"warns: {hits[0][:70]}" if hits else "no warning on it"


def shorten(text: str, limit: int = CELL) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --- Lightning's own checks, on a (module factory, datamodule) pair

def lm_pieces(options: dict) -> tuple[Callable, Any]:
    from examples.lightning_module import LitLanguageModel, TextDataModule

    model_flags = {k: v for k, v in options.items() if k != "padded_training"}
    data = TextDataModule(conversations=60, padded_training=bool(options.get("padded_training")))
    return lambda: LitLanguageModel(**model_flags), data


def docs_pieces(options: dict) -> tuple[Callable, Any, list]:
    """examples/lightning_docs.py's module, datamodule and callbacks, as its make_task hands
    them over."""
    from examples.lightning_docs import EvalModeCallback, LitClassifier, RowsDataModule

    flags = {k: v for k, v in options.items() if k != "callback_eval"}
    hook = options.get("callback_eval")
    return (lambda: LitClassifier(**flags), RowsDataModule(),
            [EvalModeCallback(hook)] if hook else [])


def lightning_run(pieces: Callable[[dict], tuple[Callable, Any]], case: Case) -> str:
    import lightning.pytorch as pl

    module, data, *more = pieces(case.options)
    callbacks = more[0] if more else []
    common = dict(accelerator="cpu", logger=False, enable_progress_bar=False,
                  enable_model_summary=False)
    with quiet() as said, tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        trainer = pl.Trainer(fast_dev_run=True, accumulate_grad_batches=4,
                             callbacks=list(callbacks), **common)  # a Trainer adds to the list
        trainer.fit(module(), data)
        dev = {k: round(float(v), 3) for k, v in trainer.callback_metrics.items()
               if not k.endswith(("_step", "_epoch"))}
        trainer = pl.Trainer(overfit_batches=2, max_epochs=40, accumulate_grad_batches=2,
                             enable_checkpointing=False, callbacks=list(callbacks), **common)
        trainer.fit(module(), data)
        over = float(trainer.callback_metrics.get("train_loss", float("nan")))
        resumed = ""
        if case.resume:
            first = pl.Trainer(max_steps=4, default_root_dir=tmp, callbacks=list(callbacks),
                               **common)
            first.fit(module(), data)
            ckpt = next(Path(tmp).rglob("*.ckpt"))
            again = pl.Trainer(max_steps=6, default_root_dir=tmp, callbacks=list(callbacks),
                               **common)
            again.fit(module(), data, ckpt_path=str(ckpt))
            resumed = "; resume from its checkpoint: ran on"
    return (f"{relevant(said, case.heard)}{resumed}; overfit_batches=2: train_loss {over:.3f}; "
            f"fast_dev_run: ran, {dev}")


def pilot_lightning(case: Case) -> str:
    task = load_task(LIGHTNING, conversations=60, **case.options)
    prepared = prepare(task)
    found = []
    own = acc.normalisation_check(task, prepared.train[:8], (8, 2, 1))
    own = own[own.normalisation == "the task's train_step"]
    if not own.within_tolerance.all():
        found.append(f"04: train_step's gradient differs by "
                     f"{own.max_relative_deviation.max():.1%} between 8 x 1 and 1 x 8")
    found += [f"04: {f}" for f in acc.evaluation_findings(
        acc.evaluation_check(task, prepared.validation[:10]))]
    spec = recipe(LIGHTNING, {"conversations": 60, **case.options},
                  TrainConfig(UpdateShape(2, 2), updates=4))
    with tempfile.TemporaryDirectory() as tmp:
        reference, _ = run_recipe(spec, 4, Path(tmp) / "a", checkpoint_at=(2,))
        try:
            resumed, _ = run_recipe(spec, 4, start_from=Path(tmp) / "a" / "ckpt-000002")
            if resumed != reference[2:]:
                found.append("07: the resumed run differs")
        except WorkbookError as exc:
            found.append(f"07: {exc.problem[:90]}")
    return "; ".join(found) or "nothing"


# --- the Hugging Face Trainer's own run, on what `transformers.Trainer(...)` receives

def pieces_of(module: str, function: str, **fixed: Any) -> Callable[[dict], dict]:
    """`module.function(**fixed, **options)`, imported when called: a Trainer's pieces."""
    def build(options: dict) -> dict:
        return getattr(importlib.import_module(module), function)(**fixed, **options)
    return build


def hf_run(pieces: Callable[[dict], dict], case: Case, save_steps: int | None = None) -> str:
    """20 steps of the Trainer, then its evaluate; `save_steps` saves checkpoints (the
    callbacks' on_save runs), `resume` trains again from the first one."""
    from transformers import Trainer

    def trainer(tmp: str, **args: Any) -> Trainer:
        given = pieces(case.options)
        given["args"].output_dir = tmp
        given["args"].max_steps, given["args"].logging_steps = 20, 5
        given["args"].save_strategy = "steps" if save_steps else "no"
        for key, value in args.items():
            setattr(given["args"], key, value)
        return Trainer(**given)

    with quiet() as said, tempfile.TemporaryDirectory() as tmp:
        first = trainer(tmp, **({"save_steps": save_steps} if save_steps else {}))
        result = first.train()
        losses = [round(h["loss"], 2) for h in first.state.log_history if "loss" in h]
        evaluated = first.evaluate()
        resumed = ""
        if case.resume:
            ckpt = min(Path(tmp).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
            trainer(tmp, save_steps=save_steps).train(resume_from_checkpoint=str(ckpt))
            resumed = f"; resume from its {ckpt.name}: ran on"
    scores = ", ".join(f"{k[5:]} {v:.3g}" for k, v in evaluated.items()
                       if k in ("eval_loss", "eval_accuracy"))
    return (f"{relevant(said, case.heard)}{resumed}; 20 steps: train_loss "
            f"{result.training_loss:.3g} (logged {losses}), {scores}")


def pilot_hf(case: Case) -> str:
    task = load_task(HF, conversations=120, **case.options)
    found = [f"01: {f.check}" for f in inspect_task(task).flags]
    result = overfit(task, examples=8, updates=60)
    if result.verdict != "pass":
        found.append(f"02: {result.diagnosis[:90]}")
    return "; ".join(found) or "nothing"


# --- a script's own loop (no framework: the loop the script runs)

def script_run(path: str, case: Case, steps: int = 20, batch: int = 8) -> str:
    """`steps` AdamW updates through the model's forward(idx, targets) -> (logits, loss), on
    random windows as the script's get_batch draws them; the loss it reports."""
    task = load_task(path, **case.options)
    with quiet() as said:
        torch.manual_seed(0)
        model = task.build_model()
        model.train()
        optimizer = task.optimizer(model, task.lr)
        examples = task.load_examples()
        pick = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(steps):
            rows = torch.randint(len(examples), (batch,), generator=pick).tolist()
            data = task.collate([task.encode(examples[i]) for i in rows])
            _, loss = model(data["input_ids"], data["labels"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
    return (f"{relevant(said, case.heard)}; {steps} AdamW steps: loss {losses[0]:.3f} -> "
            f"{losses[-1]:.3f} (min {min(losses):.3f})")


# --- the pilot's notebooks, as a user runs them

def problem(text: str) -> str:
    """An error's problem without its fix, and without the progress bars a process printed."""
    text = re.sub(r"\w+:\s*\d+%\|[^\]\n]*\]", "", str(text).split("\n  -> fix:")[0])
    return "\n".join(line for line in text.splitlines() if line.strip()).strip()


def notebook_words(out: Path, error: str = "") -> list[str]:
    """What a notebook's summary.json (and 03's gate table) says failed, was found or warned."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    f = summary.get("figures") or {}
    said = [problem(error), problem(summary.get("error") or "")]
    flags = out / "flags.json"  # 01's flags with their words (the summary names them only)
    said += [f"flag: {x['check']}: {x['message']}" for x in json.loads(flags.read_text())] \
        if flags.exists() else [f"flag: {x}" for x in summary.get("flags") or []]
    said += [f"failed: {x}" for x in summary.get("failed") or []]
    said += [summary.get("diagnosis") or ""] if summary.get("failed") else []
    said += [f"finding: {x}" for x in f.get("findings") or []]
    said += [f"warning: {x}" for x in f.get("warnings") or []]
    gates = out / "gates.json"
    if gates.exists():
        # a failing gate, or a passing one whose detail carries a note (a convention the
        # pilot names without failing: weight decay on norm weights and biases)
        said += [f"{g['phase']} {g['verdict']}: {g['detail']}"
                 for g in json.loads(gates.read_text())
                 if g.get("verdict") != "pass" or "note:" in (g.get("detail") or "")]
    else:
        said += [f"warned: {x}" for x in f.get("warned") or []]
    said += [f"{c['case']}: {problem(c['error'])}" for c in f.get("cases") or []
             if c.get("error")]
    rules = {**(summary.get("rules") or {}), **((f.get("fsdp") or {}).get("rules") or {})}
    said += [f"rule fails: {r}" for r, v in rules.items() if v == "fail"]
    said += [f"planted fault not caught: {k}"
             for k, v in (f.get("faults_caught") or {}).items() if v is False]
    return list(dict.fromkeys(s for s in said if s))


def pilot_notebooks(path: str, case: Case) -> str:
    """Run the pilot on `path` in smoke mode: the case's notebook alone for a planted bug (what
    it said, the parts with the case's `names` first; "nothing" when it passed without a word),
    all nine for a clean twin (each notebook whose verdict is not "pass", or "nothing")."""
    from workbook.commands.pilot import run_pilot
    from workbook.notebooks.registry import verdict_line

    notebook, names = case.notebook, case.names

    with tempfile.TemporaryDirectory() as tmp:
        try:
            with quiet():
                run, index = run_pilot(path, out=str(Path(tmp) / "run"), smoke=True,
                                       only=notebook or None, progress=False,
                                       task_options=case.options)
        except WorkbookError as exc:
            return f"load: {exc.problem}"
        found = []
        for row in index.itertuples():
            words = notebook_words(run / row.notebook, row.error)
            if notebook:
                words.sort(key=lambda s: not any(n in s.lower() for n in names))
            elif row.verdict == "pass":
                continue
            if row.verdict != "pass" or words:
                why = "; ".join(words) or verdict_line(run / row.notebook).split(" - ", 1)[-1]
                found.append(f"{row.notebook[:2]}: {row.verdict} - {why}")
    return "; ".join(found) or "nothing"


@dataclass
class Case:
    """One row: a planted bug (or a clean twin), the framework's check and the pilot's."""

    framework: str
    option: str  # the planted task option, "" for a clean twin
    notebook: str  # the notebook that must name it ("" for a clean twin)
    own: Callable[[Case], str]  # the framework's own check
    pilot: Callable[[Case], str]  # the pilot's report
    warns: tuple[str, ...] = ("",)  # words of a framework warning on the bug
    names: tuple[str, ...] = ()  # words of the notebook's report that name the bug
    resume: bool = False  # the framework's check also resumes from its own checkpoint
    warning: bool = False  # the notebook names it as a warning: its verdict may stay "pass"
    options: dict = field(default_factory=dict)  # the task options (default {option: True})

    def __post_init__(self):
        self.options = self.options or ({self.option: True} if self.option else {})

    @property
    def label(self) -> str:
        if self.option:
            return self.option
        extra = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"(clean twin{', ' + extra if extra else ''})"

    @property
    def heard(self) -> tuple[str, ...] | None:
        """The words of a framework warning to look for (None on a clean twin)."""
        return self.warns if self.option else None

    def run_own(self) -> str:
        try:
            return self.own(self)
        except Exception as exc:  # the framework's check stopping is what it reports
            return f"raised {type(exc).__name__}: {problem(exc)}"

    def named(self, pilot: str) -> bool:
        heads = (self.notebook, "load") if self.names else (self.notebook,)
        at = any(pilot.startswith(f"{h}:") or f"; {h}:" in pilot for h in heads)
        if self.names and not self.warning and pilot.startswith(f"{self.notebook}: pass"):
            return False  # a passing notebook's warnings name no bug
        return at and (not self.names or any(n in pilot.lower() for n in self.names))


LIT = dict(own=partial(lightning_run, lm_pieces), pilot=pilot_lightning)
HFT = dict(own=partial(hf_run, pieces_of("examples.hf_trainer", "trainer_pieces",
                                         conversations=120)), pilot=pilot_hf)
LIT_DOCS = dict(own=partial(lightning_run, docs_pieces),
                pilot=partial(pilot_notebooks, LIGHTNING_DOCS))
HF_DOCS_ = dict(own=partial(hf_run, pieces_of("examples.hf_docs", "trainer_pieces"),
                            save_steps=10), pilot=partial(pilot_notebooks, HF_DOCS))
SCRIPT = dict(own=partial(script_run, GPT), pilot=partial(pilot_notebooks, GPT))

CASES = [
    Case("Lightning", "", "", **LIT),
    Case("Lightning", "padded_training", "04", warns=("accumul", "normali"), **LIT),
    Case("Lightning", "val_counts_padding", "04", warns=("pad",), **LIT),
    Case("Lightning", "drop_optimizer_state", "07", warns=("optimizer",), resume=True, **LIT),
    Case("HF Trainer", "", "", **HFT),
    Case("HF Trainer", "pad_in_labels", "01", warns=("pad",), **HFT),
    Case("HF Trainer", "lr_typo", "02", warns=("learning rate", "nan", "inf"), **HFT),
    Case("Lightning docs", "", "", **LIT_DOCS),
    Case("Lightning docs", "weighted_mean_step", "04", warns=("accumul", "weight"),
         names=("normalis", "train_step", "step loss", "step's loss"), **LIT_DOCS),
    Case("Lightning docs", "val_mean_of_batch_means", "04", warns=("val_acc", "batch"),
         names=("val_acc", "evaluation batch"), **LIT_DOCS),
    Case("Lightning docs", "macro_f1", "09", warns=("sync_dist", "f1"),
         names=("sums over ranks",), **LIT_DOCS),
    Case("Lightning docs", "bn_train_in_validation", "04",
         warns=("batchnorm", "training mode", "per channel"), names=("in training mode",),
         **LIT_DOCS),
    Case("Lightning docs", "callback_eval", "04", warns=("eval mode", ".eval()"),
         names=("in eval mode",), options={"callback_eval": "train_epoch_start"}, **LIT_DOCS),
    Case("Lightning docs", "", "", options={"callback_eval": "validation_end"}, **LIT_DOCS),
    Case("Lightning docs", "epoch_interval", "04", warns=("interval", "epoch", "schedul"),
         names=("once per epoch",), **LIT_DOCS),
    Case("HF docs", "", "", **HF_DOCS_),
    Case("HF docs", "metrics_count_padding", "01", warns=("pad", "-100"),
         names=("compute_metrics", "padding rows"), **HF_DOCS_),
    Case("HF docs", "collator_drops_mask", "01", warns=("attention", "mask"),
         names=("padding changes outputs",), **HF_DOCS_),
    Case("HF docs", "save_only_model", "07", warns=("optimizer", "scheduler", "save_only"),
         names=("save_only_model",), resume=True, **HF_DOCS_),
    Case("HF docs", "callback_raises", "03", warns=("tokenizer", "callback"),
         names=("callback",), **HF_DOCS_),
    Case("HF docs", "max_length", "01", warns=("truncat", "max_length"),
         names=("truncation",), options={"max_length": 3}, **HF_DOCS_),
    Case("GPT script", "", "", **SCRIPT),
    Case("GPT script", "", "", options={"dropout": 0.1}, **SCRIPT),
    Case("GPT script", "targets_off_by_one", "01", warns=("target",),
         names=("targets copy the input",), **SCRIPT),
    Case("GPT script", "model_shifts", "01", warns=("shift", "target"),
         names=("model's own loss",), **SCRIPT),
    Case("GPT script", "decay_everything", "03", warns=("decay",), names=("weight decay",),
         warning=True, **SCRIPT),
]


def main() -> None:
    """`--cases a,b`: only the rows whose label (the planted option, or "(clean twin...)")
    contains one of the words."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="", help="comma-separated words of the rows to run")
    words = [w for w in parser.parse_args().cases.split(",") if w]
    named = planted = false_alarms = 0
    notes = []
    print("| framework | planted | the framework's own check | the pilot |")
    print("|---|---|---|---|")
    for case in CASES:
        if words and not any(w in case.label for w in words):
            continue
        own, pilot = case.run_own(), case.pilot(case)
        if case.option:
            planted += 1
            if case.named(pilot):
                named += 1
            else:
                notes.append(f"missed: {case.framework} {case.label} (wanted {case.notebook}): "
                             f"{pilot}")
        elif pilot != "nothing":
            false_alarms += 1
            notes.append(f"false alarm: {case.framework} {case.label}: {pilot}")
        print(f"| {case.framework} | {case.label} | {shorten(own)} | {shorten(pilot)} |",
              flush=True)
    for note in notes:
        print(note)
    print(f"frameworks_named_by_pilot: {named}/{planted}  false_alarms: {false_alarms}")


if __name__ == "__main__":
    main()

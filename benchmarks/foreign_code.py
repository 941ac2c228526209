"""Planted bugs and clean twins in training code nobody here wrote, written in the idioms of
public scripts (issue: "No false alarm and the right cause on code nobody here wrote"):

- examples/word_lm.py: pytorch/examples' word_language_model (an LSTM trained by truncated
  backpropagation through time, its hidden state carried across batches - declared, or kept in
  the script's own step as scripts keep it);
- examples/image_folder.py: torchvision's ImageFolder + resnet18 with random crops and flips
  in the training DataLoader's workers (needs torchvision: `pip install torchvision` for the
  torch you have; skipped and said so without it);
- examples/token_stream.py's pipeline bugs from public reports (datasets#8295, litData#649 and
  an epoch guard as users write it) beside the clean stream.

Each planted bug must be named in words that say its cause (the pilot's check called as a
library function, as the notebook calls it); each clean twin must raise nothing in the same
checks. The framework tasks (Lightning, Hugging Face) are `benchmarks/frameworks.py`'s.

    python benchmarks/foreign_code.py          (about 3 minutes on 2 cores)

Last line: `foreign_code_named: <named>/<planted>  false_alarms: <n>`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402

from workbook import TrainConfig, UpdateShape, WorkbookError, load_task  # noqa: E402
from workbook.contract.data import prepare  # noqa: E402
from workbook.notebooks import resume  # noqa: E402
from workbook.notebooks.inspection import inspect_task, probe_outputs  # noqa: E402
from workbook.notebooks.overfit import overfit  # noqa: E402
from workbook.notebooks.resume import position as resume_data  # noqa: E402
from workbook.notebooks.resume.position import pass_orders, repeated_pass, where_from  # noqa: E402
from workbook.notebooks.resume.undeclared import undeclared_state  # noqa: E402
from workbook.training.loop import train  # noqa: E402

WORD_LM = "examples.word_lm:task"
IMAGES = "examples.image_folder:task"
STREAM = "examples.token_stream:task"
VISION = importlib.util.find_spec("torchvision") is not None
SCRATCH = Path(tempfile.mkdtemp(prefix="foreign-code-"))


def flags(task) -> str:
    return " | ".join(f"{f.check}: {f.message}" for f in inspect_task(task).flags)


def word_lm_update(**planted) -> str:
    task = load_task(WORD_LM, **planted)
    data = prepare(task, limits={"train": 16})
    try:
        train(task, data.train, TrainConfig(UpdateShape(4, 1), updates=3, lr=5.0))
    except WorkbookError as exc:
        return exc.problem
    return ""


def word_lm_probe(**planted) -> str:
    task = load_task(WORD_LM, **planted)
    data = prepare(task, limits={"train": 8})
    _, found = probe_outputs(task, task.build_model().eval(), data.train[:4], data.train)
    return " | ".join(f.message for f in found)


def word_lm_resume(**planted) -> str:
    spec = resume.recipe(WORD_LM, {"dropout": 0.0, **planted},
                         TrainConfig(UpdateShape(4, 1), lr=5.0), train_limit=24)
    folder = SCRATCH / f"word_lm-{'-'.join(planted) or 'clean'}"
    reference, weights = resume.run_recipe(spec, 6, folder, checkpoint_at=(4,))
    resumed, w = resume.run_recipe(spec, 6, start_from=folder / "ckpt-000004")
    _, verdict = resume.compare(reference, resumed, weights, w)
    task, items, cfg = resume.rebuild(spec)
    said = repeated_pass(reference, pass_orders(task, items, cfg)) or (
        undeclared_state(task, items, cfg) if verdict["same_examples"] else "")
    return "" if verdict["exact"] and not said else f"not exact: {said or verdict}"


def word_lm_overfit() -> str:
    result = overfit(load_task(WORD_LM), examples=4, updates=80)
    return "" if result.verdict == "pass" else result.diagnosis


def images_resume(bug: tuple = ()) -> str:
    cfg = TrainConfig(UpdateShape(2, 2), lr=0.1, pipeline=True)
    spec = resume.recipe(IMAGES, {"per_class": 8}, cfg, train_limit=8)
    folder = SCRATCH / f"images-{'-'.join(bug) or 'clean'}"
    reference, weights = resume.run_recipe(spec, 4, folder, checkpoint_at=(3,))
    resumed, w = resume.run_recipe(spec, 4, start_from=folder / "ckpt-000003", faults=bug)
    task, items, cfg = resume.rebuild(spec)
    _, verdict = resume.compare(reference, resumed, weights, w)
    said = where_from(reference, resumed, 3, pass_orders(task, items, cfg, 8), 2)
    return "" if verdict["exact"] else f"not exact (max parameter difference " \
        f"{verdict['max_param_diff']:.3g}) {said}".strip()


def stream_file() -> str:
    path = SCRATCH / "stream.bin"
    np.array(np.arange(20_000) % 251, dtype=np.uint16).tofile(path)
    return str(path)


def stream_spec(bug: str = ""):
    cfg = TrainConfig(UpdateShape(micro_batch=2, accumulation=4), lr=1e-3, seed=0, device="cpu")
    cfg.pipeline = True
    return resume.recipe(STREAM, {"data_file": stream_file(), "block_size": 16, "n_layer": 1,
                                  "n_embd": 32, "pipeline_bug": bug}, cfg, 32)


def stream_resumes(bug: str = "", loop_order: bool = False, twice: bool = False) -> str:
    """What 07 says of a resume at update 5 (and of a resume of that at 6, `twice`)."""
    spec = stream_spec(bug)
    folder = SCRATCH / f"stream-{bug or 'clean'}-{loop_order}-{twice}"
    reference, weights = resume.run_recipe(spec, 8, folder, checkpoint_at=(5,))
    first, w = resume.run_recipe(spec, 8, folder, (6,) if twice else (),
                                 start_from=folder / "ckpt-000005", name=lambda step: "again",
                                 loop_order=loop_order)
    run, step = first, 5
    if twice:
        run, w = resume.run_recipe(spec, 8, start_from=folder / "again")
        step = 6
    task, items, cfg = resume.rebuild(spec)
    order = pass_orders(task, items, cfg, 32)
    exact = resume.compare(reference, run, weights, w)[1]["exact"]
    first_resume = resume_data.position_before(reference, 6) if twice else None
    said = where_from(reference, run, step, order, 2, first_resume) or \
        repeated_pass(reference, order)
    return "" if exact and not said else said or "not exact"


def stream_repeated(bug: str = "") -> str:
    spec = stream_spec(bug)
    reference, _ = resume.run_recipe(spec, 8, SCRATCH / f"stream-pass-{bug or 'clean'}")
    task, items, cfg = resume.rebuild(spec)
    return repeated_pass(reference, pass_orders(task, items, cfg, 32))


PLANTED = [  # (bug, the words the pilot must say, how it is looked for, needs torchvision)
    ("word_lm without repackage_hidden (detach=False)",
     "still attached to the previous batch's graph", lambda: word_lm_update(detach=False),
     False),
    ("word_lm's forward(input, hidden) with no state declared", "needs `hidden`",
     lambda: word_lm_probe(declare=False), False),
    ("word_lm's hidden state kept in its own train_step's closure, undeclared",
     "carries state from one call to the next that the task does not declare",
     lambda: word_lm_resume(closure=True), False),
    ("ImageFolder val/ without one class folder (labels shift)",
     "class map differs between splits", lambda: flags(load_task(IMAGES, per_class=8,
                                                                  val_missing_class=True)),
     True),
    ("augmented ResNet resumed with its sampler restarted", "not exact",
     lambda: images_resume(("sampler",)), True),
    ("an epoch guard as users write it, restored as a training loop does",
     "the pass restarted from its beginning on restore (an epoch guard",
     lambda: stream_resumes("guard_as_written", loop_order=True), False),
    ("a state that stops advancing after load_state_dict (datasets#8295)",
     "did not advance after load_state_dict",
     lambda: stream_resumes("restart_after_load", twice=True), False),
    ("a pipeline that commits its epoch only at a pass's end (litData#649)",
     "commits its epoch only when a pass runs to its end",
     lambda: stream_repeated("commit_at_end"), False),
]

CLEAN = [  # (twin, what it raises: '' when clean, needs torchvision)
    ("word_lm 01", lambda: flags(load_task(WORD_LM)), False),
    ("word_lm 02 (4 examples, 80 updates)", word_lm_overfit, False),
    ("word_lm 07 resume mid-pass", word_lm_resume, False),
    ("image_folder 01", lambda: flags(load_task(IMAGES, per_class=8)), True),
    ("image_folder 07 (random crops in 2 workers)", images_resume, True),
    ("token stream 07 in the loop's order", lambda: stream_resumes(loop_order=True), False),
    ("token stream 07 resumed twice", lambda: stream_resumes(twice=True), False),
    ("token stream passes", stream_repeated, False),
]


def main() -> None:
    named = planted = alarms = 0
    for bug, words, look, vision in PLANTED:
        if vision and not VISION:
            print(f"skipped (torchvision not installed): {bug}")
            continue
        said = look()
        planted += 1
        named += words in said
        print(f"{'named' if words in said else 'MISSED'}: {bug}\n    {said[:300]}")
    for twin, look, vision in CLEAN:
        if vision and not VISION:
            print(f"skipped (torchvision not installed): {twin}")
            continue
        said = look()
        alarms += bool(said)
        print(f"{'clean' if not said else 'FALSE ALARM'}: {twin}" + (f"\n    {said[:300]}"
                                                                     if said else ""))
    print(f"foreign_code_named: {named}/{planted}  false_alarms: {alarms}")


if __name__ == "__main__":
    main()

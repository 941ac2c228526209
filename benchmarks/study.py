"""The default three-trial learning-rate study against bare loops of the same updates.

Each trial (tracking in SQLite, evaluation every 50 updates, top-N checkpoints, predictions) is
timed between two bare PyTorch loops of the same model, data order and updates (bare, tracked,
bare: the machine's drift cancels out). Prints per-trial times and ends with
`study_overhead_ratio: <median>`. Target <= 1.15.

    python benchmarks/study.py [--updates 200] [--eval-every 50]
"""

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from workbook.notebooks.study import Study, StudyDesign

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_overhead import bare_loop  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        design = StudyDesign("bench", "workbook.samples.generation:task", updates=args.updates,
                             eval_every=args.eval_every)
        study = Study(Path(tmp) / "study", design)
        torch.manual_seed(0)
        initial = study.task.build_model()
        ratios = []

        def bare(lr):
            start = time.perf_counter()
            bare_loop(study.task, study.train_items, copy.deepcopy(initial), args.updates,
                      design.shape.micro_batch, design.shape.accumulation, lr)
            return time.perf_counter() - start

        for trial in design.trials():  # bare, tracked, bare: drift of the machine cancels out
            before = bare(trial["lr"])
            start = time.perf_counter()
            study.run_trial(trial["lr"], trial["seed"])
            tracked = time.perf_counter() - start
            after = bare(trial["lr"])
            ratios.append(tracked / ((before + after) / 2))
            print(f"lr {trial['lr']:g}: bare loop {before:.2f} s / {after:.2f} s, tracked "
                  f"trial {tracked:.2f} s (ratio {ratios[-1]:.3f})", flush=True)
        evals = len(study.evals())
        print(f"{len(ratios)} trials of {args.updates} updates, {evals} evaluations of "
              f"{len(study.val_items)} validation examples, eval every {args.eval_every}")
    print(f"study_overhead_ratio: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()

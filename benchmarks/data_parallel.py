"""Notebook 09's launch on both samples (the classification one with batch norm): the gradient
of one update as 1 x 16 in one process against 2 x 8, 2 x (2 x 4) and 8 + 7 examples on two
processes - with how far a mean per rank would be off on the same examples, the margin by which
the check can catch that bug - exact resume in two new processes, every rule's verdict, and the
seconds a launch costs on this machine.

    python benchmarks/data_parallel.py [--replicas 2]

Last line: `data_parallel_gradient_max_relative_deviation: <value> (tolerance 1e-04)`.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workbook as wb  # noqa: E402
from workbook.notebooks.parallel import ReplicaSpec  # noqa: E402
from workbook.training.loop import UpdateShape  # noqa: E402

TASKS = (("workbook.samples.generation:task", {}),
         ("workbook.samples.classification:task", {"batch_norm": "batch"}))
TOLERANCE = 1e-4  # notebook 04's


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    worst = 0.0
    for task, options in TASKS:
        spec = ReplicaSpec(task, options, UpdateShape(2, 2, replicas=args.replicas),
                           checkpoint_at=5, validation_limit=63, eval_batch=6)
        items = wb.prepare(wb.load_task(task, **options), ("train",),
                           {"train": spec.train_limit}).train
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            result = wb.parallel.launch(spec, Path(tmp) / "run")
            launch_s = time.perf_counter() - start
            rules = wb.parallel.rules(result, items, TOLERANCE)
            row, _ = wb.parallel.resume_check(spec, result, Path(tmp) / "run",
                                              Path(tmp) / "resumed")
            rules = wb.parallel.with_row(rules, row)
        phases = wb.parallel.phase_table(result)
        share = (phases[phases.phase == "all-reduce"].median_s.median() /
                 phases[phases.phase == "backward"].median_s.median())
        print(f"--- {task} {options or ''}")
        for check in result["gradient_check"]:
            print(f"  {check['case']:13s} {check['split']:>13s} vs 1 x {check['examples']}: "
                  f"max relative deviation {check['max_relative_deviation']:.1e}, targets per "
                  f"rank {[int(t) for t in check['targets_per_rank']]}; a per-rank mean would "
                  f"deviate by {check['rank_mean_deviation']:.1e}")
            worst = max(worst, check["max_relative_deviation"])
        counts = rules.verdict.value_counts().to_dict()
        print(f"  rules: {counts}; failing: {list(rules.rule[rules.verdict == 'fail'])}")
        print(f"  resume: {row['measured']}")
        print(f"  launch: {launch_s:.1f} s for {spec.updates} updates on {args.replicas} "
              f"processes; all-reduce / backward time (median, CPU gloo): {share:.2f}")
    print(f"data_parallel_gradient_max_relative_deviation: {worst:.1e} (tolerance {TOLERANCE:.0e})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())

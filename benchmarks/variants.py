"""Memory variants of the generation sample at a length where activations dominate.

Peak memory per variant (CPU live-tensor peak over the training phases, as notebook 05 records
it) and time per update (interleaved repeats of the same update, median), both relative to the
control. Ends with `activation_checkpointing_memory_ratio: <value>`.

    python benchmarks/variants.py [--length 512] [--micro-batch 8] [--repeats 5]
"""

import argparse
import statistics
import time

import pandas as pd
import torch

from workbook.contract.data import encode_examples
from workbook.notebooks.gates import GateSettings
from workbook.notebooks.variants import Variant, VariantStudy, default_variants
from workbook.training.loop import UpdateShape, build_stepper
from workbook.training.predict import sized_batches


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pd.set_option("display.width", 200)
    study = VariantStudy("workbook.samples.generation:task", {}, updates=2, length=args.length,
                         train_limit=400, val_limit=16, eval_batch=args.micro_batch)
    variants = default_variants(Variant("control", UpdateShape(args.micro_batch, 2)), 20)
    table = study.run(variants).set_index("id")
    measured = [v for v in variants if table.loc[v.id, "status"] == "measured"]
    steppers, groups = {}, {}
    for v in measured:
        task = study.task_for(v)
        settings = GateSettings(v.shape, length=min(args.length, v.max_length or args.length))
        encoded = encode_examples(task, study.splits["train"])
        _, groups[v.id], _ = sized_batches(task, encoded, encoded[:8], settings.plan())
        steppers[v.id] = build_stepper(task, settings.train_config())
    times = {v.id: [] for v in measured}
    for rep in range(args.repeats):  # interleaved: each repeat times every variant once
        for v in (measured if rep % 2 == 0 else measured[::-1]):
            start = time.perf_counter()
            steppers[v.id].accumulate(groups[v.id])
            steppers[v.id].step()
            times[v.id].append(time.perf_counter() - start)
    table["time_per_update_s"] = pd.Series({k: statistics.median(t) for k, t in times.items()})
    table["time_ratio"] = (table.time_per_update_s / table.loc["control", "time_per_update_s"])
    out = table[["micro_batch", "accumulation", "precision", "activation_checkpointing",
                 "status", "peak_bytes", "memory_ratio", "time_per_update_s", "time_ratio"]]
    print(f"generation sample, length {args.length}, control {args.micro_batch} x 2, "
          f"{args.repeats} interleaved repeats, 1 thread")
    print(out.round(3).to_string())
    ratio = table.loc["checkpointing", "memory_ratio"]
    print(f"activation checkpointing costs {table.loc['checkpointing', 'time_ratio']:.2f}x the "
          f"control's time per update")
    print(f"activation_checkpointing_memory_ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()

"""Predicted (fake tensors, no allocation) against measured peak memory per training phase.

Both sample models over micro-batch x sequence length, plus activation-checkpointing and bf16
autocast variants. Measured: CPU live-tensor peak rebuilt from profiler allocation events
(or `torch.cuda.max_memory_allocated` with --device cuda). Prints one row per configuration and
phase with the error of the prediction and of the "4 x model size" rule, and ends with
`memory_prediction_max_abs_error_pct: <value>`. Targets: 2% on CPU, 10% on CUDA.

    python benchmarks/memory_prediction.py [--device cpu|cuda] [--quick]
"""

import argparse
import tempfile
from pathlib import Path

import pandas as pd
import torch

from workbook import encode_examples, load_examples, load_task, split_examples
from workbook.gates import GateRun, GateSettings
from workbook.predict import compare, model_size_rule, predict

GRID = [  # (task, micro_batch, length, precision, activation checkpointing)
    *[("generation", mb, length, "fp32", False) for mb in (1, 4, 16) for length in (64, 256, 512)],
    ("generation", 4, 256, "fp32", True), ("generation", 16, 512, "fp32", True),
    ("generation", 2, 128, "bf16", False), ("generation", 2, 128, "bf16", True),
    *[("classification", mb, length, "fp32", False) for mb in (1, 16) for length in (64, 256)],
    ("classification", 4, 128, "bf16", False),
]
QUICK = [GRID[0], GRID[4], GRID[9], GRID[11], GRID[13], GRID[-1]]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="six configurations only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pd.set_option("display.width", 200)
    tasks, rows = {}, []
    for name, mb, length, precision, ac in (QUICK if args.quick else GRID):
        if name not in tasks:
            task = load_task(f"workbook.samples.{name}:task")
            splits = split_examples(task, load_examples(task))
            tasks[name] = (task, encode_examples(task, splits["train"][:400]),
                           encode_examples(task, splits["validation"][:64]))
        task, train, val = tasks[name]
        settings = GateSettings(micro_batch=mb, accumulation=2, eval_batch=mb, length=length,
                                precision=precision, activation_checkpointing=ac,
                                device=args.device, input_updates=1)
        with tempfile.TemporaryDirectory() as tmp:
            gates = GateRun(task, settings, train, val, Path(tmp)).run().table()
        predicted = predict(task, train, val, settings.plan(), device=args.device)
        table = compare(predicted, gates)
        rule = model_size_rule(task.build_model())
        table["rule_error_pct"] = (100 * (rule - table.measured_peak_bytes)
                                   / table.measured_peak_bytes).round(1)
        table.insert(0, "config", f"{name} {predicted.config[0]}")
        rows.append(table)
        print(table.to_string(index=False, header=len(rows) == 1), flush=True)
    result = pd.concat(rows, ignore_index=True)
    worst = result.error_pct.abs().max()
    print(f"\n{len(result)} phase peaks over {len(rows)} configurations on {args.device}; "
          f"'4 x model size' rule error from {result.rule_error_pct.min():.1f}% to "
          f"{result.rule_error_pct.max():.1f}%")
    print(f"memory_prediction_max_abs_error_pct: {worst:.3f}")


if __name__ == "__main__":
    main()

"""Predicted (fake tensors, no allocation) against measured peak memory per training phase.

Both sample models over micro-batch x sequence length, plus activation-checkpointing and bf16
autocast variants, and a plain `nn.TransformerEncoder` model (examples/transformer_lm.py).
Measured: CPU live-tensor peak rebuilt from profiler allocation events (or
`torch.cuda.max_memory_allocated` with --device cuda). Prints one row per configuration and phase
with the error of the prediction and of the "4 x model size" rule, and ends with
`memory_prediction_max_abs_error_pct: <value>`. Targets: 2% on CPU, 10% on CUDA.

    python benchmarks/memory_prediction.py [--device cpu|cuda] [--quick] [--hf] [--modules]

`--modules` sizes the standard torch.nn building blocks instead (convolutions with batch norm,
LSTM, GRU, multi-head attention over embeddings: examples/module_families.py).
`--hf` sizes three Hugging Face families built from small configs instead (GPT-2, a BERT-style
encoder, a Llama-style decoder: examples/hf_families.py; needs the [hf] extra) and a TRL SFT
fine-tune with LoRA (examples/trl_sft.py; the [llm] extra). A configuration
the prediction cannot run, or a phase it cannot size (the model takes another path on real tensors
than on fake ones), is printed as "not predicted: <reason>", never left out silently.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples package

from workbook import WorkbookError, encode_examples, load_examples, load_task, split_examples
from workbook.notebooks.gates import GateRun, GateSettings  # noqa: E402
from workbook.training.loop import UpdateShape
from workbook.training.predict import compare, model_size_rule, predict  # noqa: E402

GRID = [  # (task, micro_batch, length, precision, activation checkpointing)
    *[("generation", mb, length, "fp32", False) for mb in (1, 4, 16) for length in (64, 256, 512)],
    ("generation", 4, 256, "fp32", True), ("generation", 16, 512, "fp32", True),
    ("generation", 2, 128, "bf16", False), ("generation", 2, 128, "bf16", True),
    *[("classification", mb, length, "fp32", False) for mb in (1, 16) for length in (64, 256)],
    ("classification", 4, 128, "bf16", False),
    # plain torch.nn modules: nn.TransformerEncoder (examples/transformer_lm.py)
    *[("transformer_lm:task", mb, 128, "fp32", False) for mb in (1, 8)],
    ("transformer_lm:task", 8, 128, "fp32", True),
]
QUICK = [GRID[0], GRID[4], GRID[9], GRID[11], GRID[13], GRID[-1]]
MODULES = [(f"module_families:task:{family}", mb, 0, "fp32", False)  # torch.nn blocks
           for family in ("conv2d+batchnorm", "conv1d", "lstm", "gru",
                          "embedding+multihead-attention") for mb in (4, 16)]
HF = [  # Hugging Face families from small configs (examples/hf_families.py)
    *[("hf_families:gpt2", mb, 64, "fp32", False) for mb in (1, 4, 16)],
    ("hf_families:gpt2", 4, 64, "fp32", True),
    *[("hf_families:bert", mb, length, "fp32", False) for mb in (1, 16) for length in (64, 256)],
    *[("hf_families:llama", mb, length, "fp32", False) for mb in (1, 4) for length in (64, 256)],
    ("hf_families:llama", 4, 256, "fp32", True),
]


def load(name: str):
    """A sample, an example task, or an example family (`module:attr:family`)."""
    path, _, family = name.partition(":")[2].partition(":")
    if ":" not in name:
        return load_task(f"workbook.samples.{name}:task")
    module = name.split(":")[0]
    return load_task(f"examples.{module}:{path}", **({"family": family} if family else {}))


LORA = [("trl_sft:task", 4, 0, "fp32", False)]  # TRL SFT with LoRA (examples/trl_sft.py)


def measure_grid(grid: list, device: str) -> tuple[pd.DataFrame, list[str]]:
    """Predicted against measured peaks per configuration and phase on `device`, and the
    configurations or phases not predicted (each printed with its reason as it goes)."""
    tasks, rows, skipped = {}, [], []
    for name, mb, length, precision, ac in grid:
        if name not in tasks:
            task = load(name)
            splits = split_examples(task, load_examples(task))
            tasks[name] = (task, encode_examples(task, splits["train"][:400]),
                           encode_examples(task, splits["validation"][:64]))
        task, train, val = tasks[name]
        settings = GateSettings(UpdateShape(mb, 2, precision, ac), eval_batch=mb, length=length,
                                device=device, input_updates=1)
        with tempfile.TemporaryDirectory() as tmp:
            gates = GateRun(task, settings, train, val, Path(tmp)).run().table()
        try:
            predicted = predict(task, train, val, settings.plan(), device=device,
                                cpu_exact=True)  # judged against this CPU itself
        except WorkbookError as exc:
            skipped.append(f"{name} mb{mb} len{length}")
            print(f"{name} mb{mb} len{length} {precision}{' ac' if ac else ''}: not predicted: "
                  f"{exc.problem}", flush=True)
            continue
        table = compare(predicted, gates)
        for _, row in table[table.note != ""].iterrows():
            skipped.append(f"{name} mb{mb} len{length} {row.phase}")
            print(f"{name} mb{mb} len{length} {precision}{' ac' if ac else ''} {row.phase}: "
                  f"{row.note}", flush=True)
        table = table.drop(columns="note")
        rule = model_size_rule(task.build_model())
        table["rule_error_pct"] = (100 * (rule - table.measured_peak_bytes)
                                   / table.measured_peak_bytes).round(1)
        table.insert(0, "config", f"{name} {predicted.config[0]}")
        rows.append(table)
        print(table.to_string(index=False, header=len(rows) == 1), flush=True)
    result = pd.concat(rows, ignore_index=True).dropna(subset=["error_pct"]) if rows else \
        pd.DataFrame(columns=["config", "phase", "error_pct", "rule_error_pct"])
    return result, skipped


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="six configurations only")
    parser.add_argument("--hf", action="store_true",
                        help="the Hugging Face families and a LoRA fine-tune instead")
    parser.add_argument("--modules", action="store_true",
                        help="torch.nn building blocks instead (examples/module_families.py)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pd.set_option("display.width", 200)
    grid = [*HF, *LORA] if args.hf else MODULES if args.modules else \
        QUICK if args.quick else GRID
    result, skipped = measure_grid(grid, args.device)
    if skipped:
        print(f"not predicted: {len(skipped)} configurations or phases ({', '.join(skipped)})")
    worst = result.error_pct.abs().max()
    print(f"\n{len(result)} phase peaks over {len(grid)} configurations on {args.device}; "
          f"'4 x model size' rule error from {result.rule_error_pct.min():.1f}% to "
          f"{result.rule_error_pct.max():.1f}%")
    print(f"memory_prediction_max_abs_error_pct: {worst:.3f}")


if __name__ == "__main__":
    main()

"""Workbook loop (records, progress bar, DataLoader) against a bare PyTorch loop.

Same model, data, order, per-read encoding, micro-batch 2 x accumulation 8, gradient clipping and
AdamW; the two are interleaved in one process and repeated. Prints per-repeat times and, last,
`loop_overhead_ratio: <median workbook/bare>`. Target <= 1.05.

    python benchmarks/loop_overhead.py [--updates 40] [--repeats 11] [--threads 1]
"""

import argparse
import contextlib
import copy
import io
import statistics
import time

import torch
from torch import nn

from workbook import TrainConfig, encode_examples, load_examples, load_task, split_examples, train
from workbook.contract.data import collate_items, encode_example, epoch_order, epoch_updates
from workbook.training.loop import UpdateShape


def bare_loop(task, items, model, updates, micro, accum, lr):
    """The loop people write by hand: a Dataset that encodes each example when it is read (as
    the workbook's loader does on every pass), loss summed and divided by the update's target
    count."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    groups = epoch_updates(epoch_order(len(items), 0, 0), micro, accum, False)
    losses = []
    for group in groups[:updates]:
        batches = [collate_items(task, [encode_example(task, items[i].raw) for i in mb]).tensors
                   for mb in group]
        total = sum(int((b["labels"] != -100).sum()) for b in batches)
        loss_sum = 0.0
        for b in batches:
            logits = model(b["input_ids"], b["attention_mask"])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(),
                                               ignore_index=-100, reduction="sum") / total
            loss.backward()
            loss_sum += float(loss.detach())
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum)
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = load_task("workbook.samples.generation:task")
    items = encode_examples(task, split_examples(task, load_examples(task))["train"])
    torch.manual_seed(0)
    initial = task.build_model()
    cfg = TrainConfig(UpdateShape(2, 8), updates=args.updates, lr=1e-3, seed=0, device="cpu",
                      grad_clip=1.0, progress=True)

    def run_bare():
        return bare_loop(task, items, copy.deepcopy(initial), args.updates, 2, 8, 1e-3)

    def run_workbook():
        with contextlib.redirect_stderr(io.StringIO()):  # the bar is drawn, not shown
            return [s.loss for s in train(task, items, cfg, model=copy.deepcopy(initial)).steps]

    a, b = run_bare(), run_workbook()  # warm-up, and the two loops must do the same work
    drift = max(abs(x - y) for x, y in zip(a, b, strict=True))
    print(f"same losses check: max |bare - workbook| = {drift:.2e} over {args.updates} updates")
    assert drift < 1e-3, "the loops do not compute the same thing"
    ratios = []
    for rep in range(args.repeats):
        times = {}
        for name, fn in sorted({"bare": run_bare, "workbook": run_workbook}.items(),
                               reverse=rep % 2 == 1):
            start = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - start
        ratios.append(times["workbook"] / times["bare"])
        print(f"repeat {rep}: bare {times['bare']:.3f} s, workbook {times['workbook']:.3f} s, "
              f"ratio {ratios[-1]:.3f}")
    print(f"threads {args.threads}, {args.updates} updates of 2 x 8, {args.repeats} repeats")
    print(f"loop_overhead_ratio: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()

"""Notebook 01 (inspect examples) against one plain pass of the same data, as the data grows.

Writes generation-sample data under a temporary folder (nothing is downloaded) at two sizes 10x
apart, by cycling the rows of data_samples/generation.jsonl with a fresh word per group (the
sample's word plus the cycle number, so every id, group and input is unique; groups of 3, 4 and
5 rows in turn, 4 on average; responses recomputed from the operation). Each format is a named
pipeline, with the task that reads it: `jsonl` (the sample's own format, read by the generation
sample's `data_file` option), `arrow` (an Arrow stream file as `datasets` caches one, when
`datasets` is installed: `arrow_task` below, the generation sample reading the file through
`datasets.Dataset.from_file`, memory-mapped, a batch of 1000 rows at a time) and `bin` (uint16
token ids, `<s> instruction \\n response </s>` one after another, as nanoGPT's prepare step writes
them: examples/token_stream.py's task, its windows of `block_size + 1` = 65 tokens cut from a
memmap - one example per 64 tokens, not per row written).

For each size and pipeline, each in a fresh subprocess (OMP_NUM_THREADS=1, a time limit each):

  plain  one pass through the task's own `encode`, keeping nothing: `jsonl` reads the file line
         by line with `json`, `arrow` reads it as `arrow_task` does, `bin` walks the token
         stream task's own examples (window starts). The task's `collate` also runs over
         these encodings 64 at a time, as 01 collates, on a clock of its own: it is left out
         of the pass's seconds and shown as `plain_collate_s`, its CPU seconds as
         `plain_collate_cpu_s` (what of 01's time is the task's own collate, which a plain pass
         does not need; `cpu_ratio_collated`: 01's CPU seconds against plain's + these)
  01     `workbook.inspection.run(params, out)` with
         `params = workbook.params.of("01_inspect_examples", task=..., task_options={"data_file":
         PATH})` - notebook 01's work without papermill (`--save` adds `inspection.save`, the
         notebook's last cell).

Seconds are the child's own clock around the work (imports before it), and beside them its CPU
seconds (user + system, its ended workers' included: what a machine shared with other work
still measures); 01 forks its scan workers (`scan_workers`, one per other core) inside that
clock, and they are part of its memory. Peak resident memory is the child's VmHWM from
/proc/self/status (its high-water mark since exec; getrusage's ru_maxrss also counts the
parent's pages when the child is started with vfork), read at the end of the work, falling
back to getrusage(RUSAGE_SELF) where /proc is
missing, plus for 01 each worker at the largest one's peak (RUSAGE_CHILDREN: an upper bound,
what a worker shares with the child since the fork counted twice). A run that fails or passes
`--timeout` is a row with its error. A second run of each (`--sampled`) has a thread sample
the anonymous memory of the child and its workers together (RssAnon every 10 ms; while there
are workers, the sum of each one's proportional share, Pss_Anon, every 100 ms): the memory the
pass holds. That run's clock is not used: a read of a worker's smaps_rollup costs 7-8 ms of
CPU, which in the clock's run would be 01's alone (about 0.1 s at 200 k rows). VmHWM
also counts the pages of a file the task memory-maps (the whole Arrow or token file by the end
of a pass): the kernel's page cache, resident while there is room, which grows with the file
and is dropped when memory is needed. Prints a table, a line with 01 against plain +
`plain_collate_s` and the growth of VmHWM with those mapped pages, then last

    data_scale_pass_ratio: <max 01/plain> rss_growth: <01's anonymous peak at the large size /
    at the small> peak_rss_gib: <max 01 peak, VmHWM and workers>

(all on one line). Targets (issue "Campaign-scale data", item 6; measured here, not asserted):
ratio <= 1.5, growth <= 1.2, peak <= 2 GiB.

    python benchmarks/data_scale.py [--sizes 200000,2000000] [--pipelines jsonl,arrow,bin]
        [--timeout 1800] [--tmp DIR] [--save] [--o1-param NAME=VALUE ...]

`--sizes 1000000,10000000` is the large setting (about 1.1 GB of JSONL at 10 M rows); a quick
look: `--sizes 2000,20000`. `--o1-param` passes a parameter of notebook 01 (`scan_limit`,
`scan_sample`), checked by `params.of` as the notebook checks it.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data_samples" / "generation.jsonl"
TASK = "workbook.samples.generation:task"  # the jsonl pipeline's; each pipeline names its own
NOTEBOOK = "01_inspect_examples"
MIB, GIB = 2**20, 2**30
GROUP_SIZES = (3, 4, 5)  # rows per group in turn: 4 on average
CHUNK = 50_000  # rows written at a time
OPS: dict[str, Callable[[str], str]] = {"upper": str.upper, "reverse": lambda w: w[::-1],
                                        "repeat": lambda w: f"{w} {w}"}


# --- the data -----------------------------------------------------------------------------
def sample_conversations() -> list[tuple[str, list[str]]]:
    """(word, operations in turn order) of each conversation of the generation sample."""
    convs: dict[str, tuple[str, list[str]]] = {}
    with SAMPLE.open(encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            op, word = row["instruction"].split(": ", 1)
            if op not in OPS or not (word.isascii() and word.isalpha()):
                raise SystemExit(f"{SAMPLE}: unexpected instruction {row['instruction']!r}")
            convs.setdefault(row["conversation"], (word, []))[1].append(op)
    return list(convs.values())


def rows(n: int) -> Iterator[tuple[str, str, str, str]]:
    """n rows (conversation, id, instruction, response), generated as they are read."""
    convs = sample_conversations()
    done, group = 0, 0
    while done < n:
        word, ops = convs[group % len(convs)]
        word = f"{word}{group // len(convs)}"  # letters then digits: unique per group
        for turn in range(min(GROUP_SIZES[group % len(GROUP_SIZES)], n - done)):
            op = ops[turn % len(ops)]
            x = word if turn < len(ops) else f"{word}x{turn}"  # a later turn: its own input
            yield f"conv{group:08d}", f"g{group:08d}-{turn}", f"{op}: {x}", OPS[op](x)
            done += 1
        group += 1


def chunks(n: int) -> Iterator[list[tuple[str, str, str, str]]]:
    chunk = []
    for row in rows(n):
        chunk.append(row)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def write_jsonl(path: Path, n: int) -> None:
    # the fields hold letters, digits, spaces and colons only: nothing to escape
    with path.open("w", encoding="utf-8") as handle:
        for chunk in chunks(n):
            handle.writelines(f'{{"conversation": "{c}", "id": "{i}", "instruction": "{q}", '
                              f'"response": "{r}"}}\n' for c, i, q, r in chunk)


def write_arrow(path: Path, n: int) -> None:
    import pyarrow as pa

    names = ["conversation", "id", "instruction", "response"]
    schema = pa.schema([(name, pa.string()) for name in names])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for chunk in chunks(n):
            writer.write_batch(pa.record_batch([list(col) for col in zip(*chunk, strict=True)],
                                               schema=schema))


def write_bin(path: Path, n: int) -> None:
    import numpy as np

    from workbook.samples import tokenizer as tok

    with path.open("wb") as handle:
        for chunk in chunks(n):
            ids: list[int] = []
            for _, _, q, r in chunk:
                ids += [tok.BOS, *tok.encode(q + "\n"), *tok.encode(r), tok.EOS]
            np.asarray(ids, dtype=np.uint16).tofile(handle)


# --- the tasks and their plain passes (run in the child) ------------------------------------
class ArrowRows:
    """The rows of an Arrow file as dicts, through `datasets.Dataset.from_file` (memory-mapped:
    nothing is loaded), a batch of 1000 at a time - a map-style Dataset read row by row costs
    about 55 us a row in `datasets` itself, more than the task's encode."""

    def __init__(self, path: str | Path):
        import datasets

        self.rows = datasets.Dataset.from_file(str(path))

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict]:
        for batch in self.rows.iter(batch_size=1000):
            for values in zip(*batch.values(), strict=True):
                yield dict(zip(batch, values, strict=True))


def arrow_task(data_file: str):
    """The generation sample over an Arrow file of its rows (the `arrow` pipeline's task)."""
    from functools import partial

    import workbook as wb

    task = wb.load_task(TASK)
    task.load_examples = partial(ArrowRows, data_file)
    return task


class Collated:
    """The task's collate over the plain pass's encodings, 64 at a time as 01 collates, on a
    clock of its own (kept off the pass's seconds: `plain_collate_s`)."""

    def __init__(self, task):
        self.task, self.chunk, self.seconds, self.cpu = task, [], 0.0, 0.0

    def add(self, tensors: dict) -> None:
        self.chunk.append(tensors)
        if len(self.chunk) == 64:
            self.flush()

    def flush(self) -> None:
        start, cpu = time.perf_counter(), time.process_time()
        if self.chunk:
            self.task.collate(self.chunk)
        self.chunk = []
        self.seconds += time.perf_counter() - start
        self.cpu += time.process_time() - cpu


def plain_jsonl(task, path: Path, collated: Collated) -> int:
    count = 0
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            collated.add(task.encode(json.loads(line)))
            count += 1
    return count


def plain_examples(task, path: Path, collated: Collated) -> int:
    """The task's own examples, each through its own encode."""
    count = 0
    for example in task.load_examples():
        collated.add(task.encode(example))
        count += 1
    return count


@dataclass
class Pipeline:
    """One on-disk format: how it is written, the task that reads it and its plain pass."""

    suffix: str
    needs: tuple[str, ...]
    write: Callable[[Path, int], None]
    task: str
    plain: Callable[[object, Path], int]


PIPELINES = {
    "jsonl": Pipeline("jsonl", (), write_jsonl, TASK, plain_jsonl),
    "arrow": Pipeline("arrow", ("datasets",), write_arrow, "benchmarks.data_scale:arrow_task",
                      plain_examples),
    "bin": Pipeline("bin", ("numpy",), write_bin, "examples.token_stream:task", plain_examples),
}


# --- one measured run: the child ------------------------------------------------------------
def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _cpu() -> float:
    """CPU seconds (user and system) of this process and of its children that have ended (01's
    scan workers, ended by the end of the work)."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def _children() -> list[str]:
    """The pids of this process's children (01's scan workers)."""
    pids = []
    for children in Path("/proc/self/task").glob("*/children"):
        try:
            pids += children.read_text().split()
        except OSError:
            pass
    return pids


def _pss_anon_kib(pid: str) -> int:
    """A process's proportional share of anonymous memory: a page it shares with the process it
    was forked from counts half in each."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss_Anon:"):
                return int(line.split()[1])
    except OSError:  # a worker that has just ended, or a kernel without Pss_Anon
        pass
    return 0


def _anon_kib() -> tuple[int, bool]:
    """The anonymous memory of this process and its children: RssAnon alone, or with children
    the sum of their and its Pss_Anon (pages shared since the fork counted once); and whether
    there were children."""
    pids = _children()
    if not pids:
        return _status_kib("RssAnon") or 0, False
    return sum(_pss_anon_kib(pid) for pid in ["self", *pids]), True


class AnonPeak(threading.Thread):
    """The largest anonymous resident memory of the child and its scan workers together
    (without the pages of files they map, which VmHWM counts - a memory-mapped Arrow or token
    file adds its whole size there, pages the kernel drops when it needs them), read every
    10 ms while the work runs (every 100 ms while there are workers: a read of smaps_rollup
    costs 7-8 ms of CPU: the clock's run has no sampler)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.done = 0, threading.Event()

    def run(self) -> None:
        workers = False
        while not self.done.wait(0.1 if workers else 0.01):
            kib, workers = _anon_kib()
            self.peak = max(self.peak, kib)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, _anon_kib()[0]) * 1024


def child(mode: str, pipeline: str, path: Path, o1_params: dict, save: bool,
          sampled: bool) -> None:
    """Run one measurement and print its result as the last line, in JSON; `sampled`: with
    the sampler of anonymous memory (AnonPeak) running beside the work."""
    import workbook as wb

    pipe = PIPELINES[pipeline]
    for module in (*pipe.needs, TASK.split(":")[0], pipe.task.split(":")[0]):
        importlib.import_module(module)  # imports before the clock
    anon = AnonPeak() if sampled else None
    if anon:
        anon.start()
    if mode == "plain":
        start, cpu_start = time.perf_counter(), _cpu()
        rss_before = _status_kib("VmRSS")
        task = wb.load_task(pipe.task, data_file=str(path))
        collated = Collated(task)
        result = {"rows": pipe.plain(task, path, collated)}
        collated.flush()
        result["collate_seconds"], result["collate_cpu"] = collated.seconds, collated.cpu
    else:
        wb.inspection, wb.params  # noqa: B018 - imports before the clock
        start, cpu_start = time.perf_counter(), _cpu()
        rss_before = _status_kib("VmRSS")
        params = wb.params.of(NOTEBOOK, task=pipe.task, task_options={"data_file": str(path)},
                              **o1_params)
        out = path.parent / f"out-01-{path.stem}"
        out.mkdir(exist_ok=True)
        ins = wb.inspection.run(params, out)
        if save:
            wb.inspection.save(ins, out)
        result = {"rows": int(ins.figures["examples"]), "verdict": ins.verdict,
                  "flags": [f.check for f in ins.flags], "workers": ins.figures["scan_workers"]}
    seconds = time.perf_counter() - start - result.get("collate_seconds", 0.0)
    result["cpu_seconds"] = _cpu() - cpu_start - result.get("collate_cpu", 0.0)
    if anon:
        result["anon_peak_bytes"] = anon.stop()
    hwm = _status_kib("VmHWM")
    rss_source = "VmHWM" if hwm is not None else "ru_maxrss"
    peak = (hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    # each worker at the peak of the largest (they have ended): an upper bound, since the pages
    # a worker shares with this process since the fork are counted again
    peak += result.get("workers", 0) * resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps({**result, "seconds": seconds, "peak_rss_bytes": peak,
                      "rss_before_bytes": (rss_before or 0) * 1024, "rss_source": rss_source}))


# --- the parent -------------------------------------------------------------------------------
def measure(mode: str, pipeline: str, path: Path, args, sampled: bool = False) -> dict:
    """One fresh subprocess; its result, or {"error": ...} on a failure or a timeout."""
    cmd = [sys.executable, __file__, "--child", mode, pipeline, str(path),
           *(["--sampled"] if sampled else []),
           *sum((["--o1-param", p] for p in args.o1_param), []), *(["--save"] if args.save else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:g} s (killed)"}
    if done.returncode:
        tail = " | ".join(line.strip() for line in done.stderr.strip().splitlines()[-3:])
        return {"error": f"exit {done.returncode}: {tail[-400:] or 'no output'}"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"no result line in its output: {done.stdout[-300:]!r}"}


def o1_param(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="200000,2000000",
                        help="rows per file, comma-separated (two sizes 10x apart)")
    parser.add_argument("--pipelines", default=",".join(PIPELINES))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--tmp", default=None, help="where the temporary folder goes")
    parser.add_argument("--save", action="store_true", help="01 also runs inspection.save")
    parser.add_argument("--o1-param", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "PIPELINE", "PATH"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--sampled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    o1_params = dict(map(o1_param, args.o1_param))
    if args.child:
        mode, pipeline, path = args.child
        return child(mode, pipeline, Path(path), o1_params, args.save, args.sampled)

    import pandas as pd

    sizes = sorted({int(s.replace("_", "")) for s in args.sizes.split(",") if s.strip()})
    names = [n.strip() for n in args.pipelines.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PIPELINES))
    if len(sizes) < 2 or unknown:
        parser.error(f"--sizes needs two sizes or more; unknown pipelines {unknown}"
                     if unknown else "--sizes needs two sizes or more")
    print(f"notebook 01 against a plain pass; sizes {sizes}; pipelines "
          f"{', '.join(f'{n} ({PIPELINES[n].task})' for n in names)}; "
          f"{os.cpu_count()} CPU cores, OMP_NUM_THREADS=1, timeout {args.timeout:g} s per run"
          + (f"; 01 parameters {o1_params}" if o1_params else ""), flush=True)
    table = []
    tmp = Path(tempfile.mkdtemp(prefix="data_scale-", dir=args.tmp))
    try:
        for size in sizes:
            for name in names:
                pipe = PIPELINES[name]
                row = {"size": size, "pipeline": name}
                missing = [m for m in pipe.needs if importlib.util.find_spec(m) is None]
                if missing:
                    table.append({**row, "note": f"skipped: {', '.join(missing)} not installed"})
                    continue
                path = tmp / f"{size}.{pipe.suffix}"
                start = time.perf_counter()
                pipe.write(path, size)
                written = time.perf_counter() - start
                runs = {"plain": measure("plain", name, path, args),
                        "o1": measure("o1", name, path, args)}
                for mode, r in runs.items():  # the memory runs, apart from the clock's
                    if "seconds" in r:
                        r["anon_peak_bytes"] = measure(mode, name, path, args, True).get(
                            "anon_peak_bytes", math.nan)
                notes = [f"{m}: {r['error']}" for m, r in runs.items() if "error" in r]
                o1 = runs.get("o1", {})
                if "verdict" in o1:
                    notes.append(f"01 {o1['verdict']} on {o1['rows']} rows"
                                 + (f" ({', '.join(sorted(set(o1['flags'])))})"
                                    if o1["flags"] else ""))
                for mode, r in runs.items():
                    if "seconds" in r:
                        row[f"{mode}_s"] = r["seconds"]
                        row[f"{mode}_cpu_s"] = r["cpu_seconds"]
                        if "collate_seconds" in r:
                            row["plain_collate_s"] = r["collate_seconds"]
                            row["plain_collate_cpu_s"] = r["collate_cpu"]
                        row[f"{mode}_peak_rss_mib"] = r["peak_rss_bytes"] / MIB
                        row[f"{mode}_start_rss_mib"] = r["rss_before_bytes"] / MIB
                        row[f"{mode}_anon_peak_mib"] = r["anon_peak_bytes"] / MIB
                        if "workers" in r:
                            row["o1_workers"] = r["workers"]
                        row["rss_source"] = r["rss_source"]
                row.update(file_mib=path.stat().st_size / MIB, write_s=written,
                           note="; ".join(notes))
                table.append(row)
                path.unlink()
                print(f"  {size} {name}: written in {written:.1f} s; " + ", ".join(
                    f"{m} {r['seconds']:.2f} s" if "seconds" in r else f"{m} failed"
                    for m, r in runs.items()), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    columns = ["size", "pipeline", "plain_s", "o1_s", "ratio", "plain_collate_s",
               "ratio_collated", "plain_cpu_s", "o1_cpu_s", "cpu_ratio", "plain_collate_cpu_s",
               "cpu_ratio_collated", "o1_workers",
               "plain_peak_rss_mib", "o1_peak_rss_mib", "o1_anon_peak_mib",
               "plain_start_rss_mib", "o1_start_rss_mib", "file_mib", "write_s", "note"]
    frame = pd.DataFrame(table).reindex(columns=[*columns, "rss_source"])
    frame["ratio"] = frame["o1_s"] / frame["plain_s"]
    frame["ratio_collated"] = frame["o1_s"] / (frame["plain_s"] + frame["plain_collate_s"])
    frame["cpu_ratio"] = frame["o1_cpu_s"] / frame["plain_cpu_s"]
    frame["cpu_ratio_collated"] = frame["o1_cpu_s"] / (frame["plain_cpu_s"]
                                                       + frame["plain_collate_cpu_s"])
    sources = sorted(set(frame["rss_source"].dropna()))
    print(frame[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print("seconds: the child's clock around the work (imports before it); plain_collate_s: "
          "the task's collate over the plain pass's encodings 64 at a time, timed apart and not "
          "in plain_s (01 collates as much); ratio_collated: 01 against plain + collate; "
          "*_cpu_s: CPU seconds (user + system) of the child and its ended workers on the same "
          "clock (plain without its collate's), cpu_ratio 01's over plain's - the ratio a "
          "machine shared with other work still measures; plain_collate_cpu_s: the CPU "
          "seconds of that collate, cpu_ratio_collated: 01's CPU against plain's + its; "
          "o1_workers: the processes 01 forked to count beside the reading one; "
          "*_start_rss_mib: its resident size when the clock started; peak: "
          + (", ".join(sources) or "none measured") + " of the child process, plus for 01 each "
          "worker at the largest one's peak (an upper bound: what a worker shares with the child "
          "is counted twice); anon_peak: the largest anonymous memory of the child and its "
          "workers together (RssAnon, or Pss_Anon summed while there are workers; without the "
          "pages of a file they map)")

    def growth(column: str) -> float:
        grown = [g.set_index("size")[column] for _, g in frame.groupby("pipeline")]
        grown = [s[sizes[-1]] / s[sizes[0]] for s in grown
                 if sizes[0] in s.index and sizes[-1] in s.index]
        return max((g for g in grown if not math.isnan(g)), default=math.nan)

    print(f"without the task's collate: ratio_collated {frame['ratio_collated'].max():.3f}, "
          f"cpu_ratio_collated {frame['cpu_ratio_collated'].max():.3f}; "
          f"with the pages of mapped files (peak, VmHWM): growth "
          f"{growth('o1_peak_rss_mib'):.3f}; anonymous memory peak "
          f"{frame['o1_anon_peak_mib'].max() / 1024:.3f} GiB")
    ratio, peak = frame["ratio"].max(), frame["o1_peak_rss_mib"].max() * MIB / GIB
    # growth: of the memory the pass holds (anonymous, reader and workers); a mapped source's
    # pages are the kernel's page cache, resident while there is room and grown with the file
    print(f"data_scale_pass_ratio: {ratio:.3f} rss_growth: {growth('o1_anon_peak_mib'):.3f} "
          f"peak_rss_gib: {peak:.3f}")


if __name__ == "__main__":
    main()

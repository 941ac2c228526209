"""A causal LM whose data is a streaming `datasets.IterableDataset` read from local JSONL shards,
set up as a Hugging Face user writes it - nothing is downloaded:

    stream = load_dataset("json", data_files=shards, split="train", streaming=True)
    stream = stream.map(tokenize)       # lazily, one row at a time as the stream is read

and `load_examples` returns that stream itself: the workbook reads it row by row (notebook 01
scans it once in bounded memory, the training notebooks read the first rows they need and stop),
never as a list.

    python -m workbook pilot --task examples.hf_stream:task --smoke
    python -m workbook pilot --task examples.hf_stream:trainer --smoke     (through from_hf)
    python -m examples.hf_stream --out FOLDER --shards 8 --rows 30000      (prepare shards)

The shards hold the generation sample's rows (`{"id", "conversation", "instruction",
"response"}`; more rows than its 4,350 come from the same generator,
`data_samples/make_samples.py`, with new words), consecutive rows per shard
(`train-00000-of-00004.jsonl`, ...). `prepare` writes each shard atomically - a temporary name
beside it, flushed, then renamed - and last `prepared.json`, which names them; a folder already
prepared the same way is kept as it is. The default folder is prepared into a cache on first use
(loading the task writes nothing).

`tokenize` makes `<s> instruction \\n response </s>` with a byte-level tokenizer built in memory
(GPT-2's byte-level BPE without merges: byte b is id b, then <pad>, <s>, </s>, the ids of
`workbook.tokenizer`), labels aligned with input_ids and -100 on the prompt (`label_shift=1`).
The model is a `GPT2LMHeadModel` of a small `GPT2Config` (2 layers, 64 wide, dropout 0.1,
LayerNorm; `examples/hf_gpt2.py`), left-padded batches with `position_ids`
(`examples/shifted_lm.py`'s collate). Groups are conversations.

`trainer` hands the same shards to `wb.adapters.from_hf` as a Trainer gets them: a train and an
eval stream (`.filter` by a hash of the conversation), `DataCollatorForSeq2Seq` padding the
labels, `TrainingArguments(max_steps=...)` (a stream has no length) and
`response_template="\\n"`, so 01 checks the collator keeps the prompt out of the loss.

`train_pipeline` is the training stream a campaign iterates: the train split's rows (a
`.filter` by the task's split rule), `split_dataset_by_node` for the rank, a torchdata
`StatefulDataLoader` with workers; notebook 07 trains from it and resumes it by the stream's own
`state_dict`, 09 checks its ranks. `shuffle_buffer=N` adds `.shuffle(seed, buffer_size=N)`,
whose buffer is not part of that state: 07 then says the resumed run read the pass's examples in
another order.

Options: `data_dir` (your own folder of `*.jsonl` shards, read as it is; default: the prepared
sample), `shards` (4) and `rows` (4,350) size the prepared sample, `max_length` (64),
`shuffle_buffer` (0) and the model's size. Refused with a `workbook.WorkbookError` naming the
fix: a missing folder, a folder without `.jsonl` shards, a shard that cannot be read or holds a
malformed line (named with the file and line: datasets' own error says only "JSON parse error:
... in row 1"), a row without its text columns; rows without an id are named by the workbook's
own check of every row.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import json
import math
import os
import tempfile
import warnings
import zlib
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Callable

import torch
from datasets import IterableDataset
from torch import Tensor

import workbook as wb
from examples.hf_gpt2 import build_model
from examples.shifted_lm import collate, generate
from workbook import tokenizer as tok
from workbook.base.errors import reason
from workbook.contract.task import split_by_group_hash
from workbook.samples import DATA_DIR

ROWS = 4350  # the generation sample's rows, once
FRACTIONS = (0.8, 0.1, 0.1)  # train, validation, test: by the hash of the conversation
SHARDS = 4
MAX_ROWS = 300_000  # the sample's generator runs out of new words near 1M rows
FORMAT = 1  # bump when the prepared rows change, so an old cached folder is not reused
MANIFEST = "prepared.json"
GENERATOR = DATA_DIR / "make_samples.py"
# where the default sample is prepared (one folder per generator digest, rows and shards)
CACHE_DIR = Path(os.environ.get("HF_STREAM_CACHE")
                 or Path(tempfile.gettempdir()) / "workbook-hf-stream")


# ---------------------------------------------------------------------------------------------
# prepare: the sample's rows -> JSONL shards, each written atomically


def sample_rows(rows: int) -> list[dict]:
    """The first `rows` rows of the generation sample's generator (the file's 4,350 first)."""
    spec = importlib.util.spec_from_file_location("make_samples", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generation(conversations=math.ceil(rows / 3))[:rows]


def write_rows(handle, rows: list[dict]) -> None:
    """Rows as JSON lines into an open text file (the one place shard bytes are written)."""
    for row in rows:
        handle.write(json.dumps(row) + "\n")


def write_atomically(path: Path, write: Callable[[Any], None]) -> None:
    """`write(handle)` into a temporary file beside `path`, flushed to disk, then renamed over
    it; a failure removes the temporary file, so `path` is never partial."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, 0o644)  # mkstemp's 0600 would hide the cache from other users
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def shard_names(shards: int) -> list[str]:
    return [f"train-{i:05d}-of-{shards:05d}.jsonl" for i in range(shards)]


def prepare(folder: str | Path, shards: int = SHARDS, rows: int = ROWS) -> list[Path]:
    """Write `rows` rows of the sample as `shards` JSONL files of consecutive rows, each
    atomically, then `prepared.json` naming them (so a folder cut short by a failure is written
    again). A folder whose prepared.json records the same shards and rows is kept as it is; one
    holding other .jsonl files is refused (the task would read them with the new shards)."""
    folder = Path(folder)
    for name, value, low, high in (("shards", shards, 1, 1024), ("rows", rows, 1, MAX_ROWS)):
        if isinstance(value, bool) or int(value) != value or not low <= value <= high:
            raise wb.WorkbookError(f"cannot prepare {name}={value!r} into {folder}",
                                   f"give {name} as a whole number from {low} to {high}")
    shards, rows = int(shards), int(rows)
    if shards > rows:
        raise wb.WorkbookError(f"cannot prepare {rows} rows into {shards} shards",
                               "give at least one row per shard")
    names = shard_names(shards)
    paths = [folder / n for n in names]
    wanted = {"format": FORMAT, "rows": rows, "shards": names}
    try:
        if json.loads((folder / MANIFEST).read_text()) == wanted and \
                all(p.is_file() for p in paths):
            return paths
    except (OSError, ValueError):
        pass
    folder.mkdir(parents=True, exist_ok=True)
    others = sorted(p.name for p in folder.glob("*.jsonl") if p.name not in names)
    if others:
        raise wb.WorkbookError(f"{folder} already holds other shards ({', '.join(others[:3])}"
                               f"{', ...' if len(others) > 3 else ''})",
                               "prepare into a new or empty folder: the task reads every "
                               ".jsonl file of its folder")
    data = sample_rows(rows)
    for i, path in enumerate(paths):
        part = data[i * rows // shards:(i + 1) * rows // shards]
        write_atomically(path, partial(write_rows, rows=part))
    write_atomically(folder / MANIFEST, lambda handle: json.dump(wanted, handle))
    return paths


@lru_cache(maxsize=4)
def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def default_folder(shards: int = SHARDS, rows: int = ROWS) -> Path:
    """The cached sample's folder: a pure function of the generator's bytes, rows, shards."""
    return CACHE_DIR / f"generation-v{FORMAT}-{_digest(GENERATOR)}-{rows}x{shards}"


def shard_files(folder: Path) -> list[Path]:
    """The folder's `*.jsonl` shards in name order; a missing folder or one without shards is
    refused with the fix."""
    if not folder.is_dir():
        raise wb.WorkbookError(f"data folder {folder} does not exist" if not folder.exists()
                               else f"data folder {folder} is not a folder",
                               "check data_dir, or leave it out to read the prepared sample "
                               "(python -m examples.hf_stream --out FOLDER writes shards)")
    files = sorted(p for p in folder.glob("*.jsonl") if not p.is_dir())
    if not files:
        held = sorted(p.name for p in folder.iterdir())
        raise wb.WorkbookError(
            f"data folder {folder} holds no .jsonl shards "
            f"({'it holds ' + ', '.join(held[:5]) if held else 'it is empty'})",
            "write the rows as JSON lines into files named *.jsonl, one object per line "
            "(python -m examples.hf_stream --out FOLDER writes the sample's)")
    return files


# ---------------------------------------------------------------------------------------------
# the stream: load_dataset(..., streaming=True).map(tokenize)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (the byte-level BPE alphabet)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


@lru_cache(maxsize=1)
def byte_tokenizer():
    """A `PreTrainedTokenizerFast` built in memory: GPT-2's byte-level BPE without merges, so
    byte b is id b; then <pad>, <s>, </s> (256, 257, 258, as `workbook.tokenizer`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab.update({"<pad>": tok.PAD, "<s>": tok.BOS, "</s>": tok.EOS})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def tokenize(row: dict, max_length: int = 64) -> dict[str, list[int]]:
    """<s> instruction \\n response </s>, cut at `max_length`; labels are the ids, -100 on the
    prompt (the model shifts them: position t predicts labels[t + 1])."""
    missing = [c for c in ("instruction", "response") if not isinstance(row.get(c), str)]
    if missing:
        raise wb.WorkbookError(f"a row of the shards has no text {missing[0]!r} (id "
                               f"{row.get('id')!r}, columns "
                               f"{sorted(k for k, v in row.items() if v is not None)})",
                               "write every row with an 'instruction' and a 'response' string")
    tokenizer = byte_tokenizer()
    prompt = [tokenizer.bos_token_id, *tokenizer(row["instruction"] + "\n",
                                                 add_special_tokens=False)["input_ids"]]
    answer = [*tokenizer(row["response"], add_special_tokens=False)["input_ids"],
              tokenizer.eos_token_id]
    ids = (prompt + answer)[:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids),
            "labels": ([wb.IGNORE_INDEX] * len(prompt) + answer)[:max_length]}


def bad_shard(files: tuple[Path, ...]) -> wb.WorkbookError | None:
    """The first shard line that cannot be read as a JSON object (read as the workbook reads
    JSONL, `wb.data.JsonlRows`), as an error naming the file and line; None when every line
    reads."""
    for path in files:
        try:
            for _ in wb.data.JsonlRows(path):
                pass
        except wb.WorkbookError as exc:
            return wb.WorkbookError(f"shard {exc.problem}", f"{exc.fix}, or write the shard "
                                    "again (a shard cut while being written ends in a partial "
                                    "line)")
        except (OSError, UnicodeDecodeError) as exc:
            return wb.WorkbookError(f"shard {path} cannot be read ({type(exc).__name__}: "
                                    f"{reason(exc)})", f"replace {path} with a UTF-8 JSONL "
                                    "file, or move it out of the data folder")
    return None


class ShardStream(IterableDataset):
    """load_dataset's stream as it is, but for one thing: an error while reading the shards
    names the first shard and line that cannot be read (datasets' own error names neither).
    The shards are read again to find it only when reading has failed."""

    shards: tuple[Path, ...] = ()

    @classmethod
    def of(cls, stream: IterableDataset, shards: list[Path]) -> "ShardStream":
        stream.__class__ = cls
        stream.shards = tuple(shards)
        return stream

    def __iter__(self):
        try:
            yield from super().__iter__()
        except GeneratorExit:  # closed before its end (first, so nothing else is looked up)
            raise
        except wb.WorkbookError:  # tokenize's own
            raise
        except Exception as exc:
            found = bad_shard(self.shards)
            if found is None:
                raise
            raise found from exc


class Shards:
    """A data folder and how its stream is opened; nothing is read (or prepared) until a stream
    is asked for, and every ask opens a new one."""

    def __init__(self, folder: str | Path, max_length: int = 64,
                 prepared: tuple[int, int] | None = None):
        self.folder, self.max_length, self.prepared = Path(folder), max_length, prepared

    def files(self) -> list[Path]:
        if self.prepared is not None:
            prepare(self.folder, *self.prepared)
        return shard_files(self.folder)

    def stream(self, keep: Callable[[dict], bool] | None = None) -> ShardStream:
        """load_dataset's stream of the shards, tokenized as it is read (`keep`: a filter)."""
        from datasets import load_dataset

        files = self.files()
        stream = load_dataset("json", data_files=[str(f) for f in files], split="train",
                              streaming=True)
        if keep is not None:
            stream = stream.filter(keep)
        return ShardStream.of(stream.map(partial(tokenize, max_length=self.max_length)), files)


def encode(row: dict, max_length: int = 64) -> dict[str, Tensor]:
    """A tokenized row as tensors, cut at `max_length` (a shorter task's encode cuts a row
    tokenized longer); the prompt is the positions before the first label."""
    ids = torch.tensor(row["input_ids"][:max_length], dtype=torch.long)
    labels = torch.tensor(row["labels"][:max_length], dtype=torch.long)
    learned = (labels != wb.IGNORE_INDEX).nonzero()
    prompt = int(learned[0]) if len(learned) else len(labels)
    return {"input_ids": ids, "labels": labels, "prompt_mask": torch.arange(len(ids)) < prompt}


def decode(ids) -> str:
    """Ids back to text, markers shown; -100 is skipped."""
    return byte_tokenizer().decode([int(i) for i in ids if int(i) >= 0])


def source(data_dir: str, shards: int | None, rows: int | None, max_length: int) -> Shards:
    if int(max_length) != max_length or max_length < 2:
        raise ValueError(f"max_length must be a whole number of at least 2, got {max_length!r}")
    if data_dir and (shards is not None or rows is not None):
        raise ValueError("shards and rows size the prepared sample; a data_dir is read as it "
                         "is - give one or the other")
    if data_dir:
        return Shards(data_dir, max_length)
    shards, rows = SHARDS if shards is None else shards, ROWS if rows is None else rows
    return Shards(default_folder(shards, rows), max_length, prepared=(shards, rows))


def train_pipeline(data: Shards, shuffle_buffer: int, seed: int, rank: int = 0, world: int = 1,
                   workers: int = 0):
    """The training rows as a campaign streams them: the train split's conversations (the
    task's split rule, as a `.filter`), a shuffle buffer when asked for, this rank's share
    (`split_dataset_by_node`) and, with workers, a torchdata StatefulDataLoader. The
    `datasets.IterableDataset`'s own state_dict is its data position. A shuffle buffer's
    content is not part of that state (datasets refills it on resume), which 07 shows."""
    from datasets.distributed import split_dataset_by_node

    stream = data.stream(keep=lambda row: split_by_group_hash(
        row["conversation"], FRACTIONS) == "train")
    if shuffle_buffer:  # one shard feeds the buffer at a time (as before datasets 5): with its
        # default of up to 10 interleaved, the state fails to load in a DataLoader worker
        one = {"max_buffer_input_shards": 1} if "max_buffer_input_shards" in \
            inspect.signature(stream.shuffle).parameters else {}
        stream = stream.shuffle(seed=seed, buffer_size=shuffle_buffer, **one)
    stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    if not workers:
        return stream
    from torchdata.stateful_dataloader import StatefulDataLoader

    warnings.filterwarnings("ignore", "'set_vital' is deprecated")  # torchdata 0.11's own
    return StatefulDataLoader(stream, batch_size=None, num_workers=workers,
                              generator=torch.Generator().manual_seed(seed))


def make_task(data_dir: str = "", shards: int | None = None, rows: int | None = None,
              max_length: int = 64, positions: int = 64, layers: int = 2,
              width: int = 64, shuffle_buffer: int = 0) -> wb.Task:
    data = source(data_dir, shards, rows, max_length)
    return wb.Task(
        name="hf-stream", kind="generation",
        load_examples=data.stream,  # the datasets.IterableDataset itself
        encode=partial(encode, max_length=max_length), collate=collate,
        build_model=partial(build_model, max(positions, max_length), layers, width),
        decode=decode, generate=generate, label_shift=1, padding_side="left",
        model_inputs=("input_ids", "attention_mask", "position_ids"),
        group_key="conversation", prompt_field="instruction", response_field="response",
        split_fractions=FRACTIONS,
        train_pipeline=partial(train_pipeline, data, shuffle_buffer))


task = make_task


def held_out(row: dict) -> bool:
    """The eval stream's rows: a tenth of the conversations, by a stable hash."""
    return zlib.crc32(str(row["conversation"]).encode()) % 10 == 0


def make_trainer(data_dir: str = "", shards: int | None = None, rows: int | None = None,
                 positions: int = 64, layers: int = 2, width: int = 64,
                 max_steps: int = 1000) -> wb.Task:
    """The same shards and model as a Trainer receives them, through `from_hf`."""
    from transformers import DataCollatorForSeq2Seq, TrainingArguments

    data = source(data_dir, shards, rows, 64)
    tokenizer = byte_tokenizer()
    args = TrainingArguments(output_dir="hf-stream-out", learning_rate=3e-3, weight_decay=0.01,
                             per_device_train_batch_size=8, max_steps=max_steps,
                             report_to="none", use_cpu=True)
    return wb.adapters.from_hf(
        partial(build_model, positions, layers, width),
        data.stream(lambda row: not held_out(row)), data.stream(held_out),
        DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=wb.IGNORE_INDEX),
        tokenizer, args, name="hf-stream-trainer", group_column="conversation",
        response_template="\n")


trainer = make_trainer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare the hf_stream sample as JSONL shards.")
    parser.add_argument("--shards", type=int, default=SHARDS)
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the folder to write (default: the cache, under {CACHE_DIR})")
    args = parser.parse_args(argv)
    paths = prepare(args.out or default_folder(args.shards, args.rows), args.shards, args.rows)
    print(f"{paths[0].parent}: {len(paths)} shards, {args.rows} rows")


if __name__ == "__main__":
    main()

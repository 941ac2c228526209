"""A language model trained on a token stream, in the pretraining format nanoGPT uses: a prepare
step writes the token ids of a corpus as one flat `uint16` file (`np.array(ids,
dtype=np.uint16).tofile(path)`, nanoGPT's `train.bin`), and training cuts windows out of it
through `np.memmap`, never reading the whole file into memory:

    x = ids[i:i + block_size]        y = ids[i + 1:i + 1 + block_size]

    python -m workbook pilot --task examples.token_stream:task --smoke
    python -m examples.token_stream --tokens 300000 --out corpus.bin   # prepare a file by hand

The corpus is the generation sample's conversations (data_samples/generation.jsonl) as plain
text, tokenized by the workbook's byte tokenizer (`workbook.tokenizer`: 256 byte ids plus
<pad>, <s> and </s>), an </s> after each conversation as nanoGPT puts an end-of-text token after
each document, and the whole pass repeated until `tokens` ids are written (nothing is
downloaded). A pass is made odd in length (one more </s> when needed), so a window of a
power-of-two `block_size` never lines up with the same text one or two passes later: no two
windows are identical. The repeated text is still seen by every split at other offsets, so the
validation loss of this sample is optimistic; a real corpus does not repeat.

Examples are the non-overlapping windows `{"id": w, "group": w // group_windows, "start": w *
block_size}` - a file of N tokens gives (N - 1) // block_size of them - produced by a generator
that reads the file only in chunks as it goes (and checks every id is inside the vocabulary).
Groups are runs of `group_windows` neighbouring windows, the unit of leakage: neighbouring
windows share a token at their edge and continue the same text, so they stay in one split.
`encode` reads its own window from the memmap, opened lazily once per process (the open memmap
is never pickled), so DataLoader workers receive the task pickled and open the file themselves.

The model is examples/gpt_script.py's GPT (nanoGPT's idioms: `forward(idx, targets) -> (logits,
loss)`, weight tying, `configure_optimizers` with decay/no-decay groups) over the tokenizer's 259
ids, with dropout 0.1; `model_inputs=("input_ids", "labels")` passes the labels as `targets`.

Options: `block_size` (64), `data_file` (your own `.bin`, used as it is; default: a file this
module prepares into a cache folder, deterministic and written atomically - a temporary name,
then `os.replace`), `tokens` (how many ids to prepare; 300,000), `group_windows` (16) and the
model's size. A `.bin` whose size is not a multiple of 2 bytes, one shorter than one window, or
holding ids beyond the vocabulary is refused with a `workbook.WorkbookError` naming the file and
the fix.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import warnings
from functools import lru_cache, partial
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

import workbook as wb
from examples.gpt_script import GPT, GPTConfig, build_optimizer, collate
from workbook import tokenizer as tok
from workbook.contract.task import split_by_group_hash
from workbook.samples import DATA_DIR

DTYPE = np.uint16  # 2 bytes a token, as nanoGPT writes train.bin (any vocabulary below 65,536)
TOKEN_BYTES = np.dtype(DTYPE).itemsize
VOCAB = tok.VOCAB_SIZE  # 256 bytes + <pad>, <s>, </s>
SOURCE = DATA_DIR / "generation.jsonl"
TOKENS = 300_000  # the prepared file's default length: about three passes of the sample
FORMAT = 1  # bump when the prepared stream changes, so an old cached file is not reused
# where the default file is prepared (one file per source digest and length; safe to delete)
CACHE_DIR = Path(os.environ.get("TOKEN_STREAM_CACHE")
                 or Path(tempfile.gettempdir()) / "workbook-token-stream")
SCAN_TOKENS = 1 << 20  # ids read at a time when checking the vocabulary (2 MiB)


# ---------------------------------------------------------------------------------------------
# prepare: text -> a flat uint16 file, written atomically


def corpus_pass(source: Path = SOURCE) -> list[int]:
    """One pass over the corpus as token ids: each conversation's turns as text, then </s>;
    one more </s> when the pass would be even in length (see the module's docstring)."""
    convs: dict[str, list[str]] = {}
    for row in wb.read_jsonl(source):
        convs.setdefault(row["conversation"], []).append(
            f"{row['instruction']}\n{row['response']}\n")
    ids: list[int] = []
    for turns in convs.values():
        ids += tok.encode("\n".join(turns))
        ids.append(tok.EOS)
    if len(ids) % 2 == 0:
        ids.append(tok.EOS)
    return ids


def write_tokens(handle, ids: np.ndarray) -> None:
    """Append one chunk of ids to an open binary file (the one place bytes are written)."""
    ids.tofile(handle)


def prepare(path: str | Path, tokens: int = TOKENS, source: Path = SOURCE) -> Path:
    """Write `tokens` ids of the corpus, pass after pass, to `path` as uint16 - atomically: into
    a temporary file beside it, flushed to disk, then renamed over `path`; a failure removes the
    temporary file, so `path` never holds a partial stream (processes preparing the same file at
    once each write their own temporary file and the last rename wins, with the same bytes).
    An existing `path` of the right size is kept."""
    path = Path(path)
    if int(tokens) != tokens or tokens < 2:
        raise wb.WorkbookError(f"cannot prepare {tokens!r} tokens into {path}",
                               "ask for a whole number of tokens, at least one window "
                               "(block_size + 1)")
    tokens = int(tokens)
    if path.is_file() and path.stat().st_size == tokens * TOKEN_BYTES:
        return path
    one_pass = np.asarray(corpus_pass(source), dtype=DTYPE)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            left = tokens
            while left > 0:
                chunk = one_pass[:left]
                write_tokens(handle, chunk)
                left -= len(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        written = os.path.getsize(temp)
        if written != tokens * TOKEN_BYTES:
            raise OSError(f"wrote {written} bytes to {temp}, expected {tokens * TOKEN_BYTES}")
        os.chmod(temp, 0o644)  # mkstemp's 0600 would hide the cache from other users
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path


@lru_cache(maxsize=8)
def _digest(source: Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()[:12]


def default_file(tokens: int = TOKENS, source: Path = SOURCE) -> Path:
    """The cached file's name: a pure function of the source's bytes, the length and FORMAT."""
    return CACHE_DIR / f"{source.stem}-v{FORMAT}-{_digest(source)}-{tokens}.bin"


# ---------------------------------------------------------------------------------------------
# the stream: windows of a memmap


class TokenStream:
    """Non-overlapping windows of `block_size` + 1 ids of a uint16 file. The memmap is opened
    lazily and once per process; pickling leaves it behind (a DataLoader worker opens its own).
    `tokens`: the default file, prepared on first use when it is missing."""

    def __init__(self, path: str | Path, block_size: int, group_windows: int = 16,
                 vocab_size: int = VOCAB, tokens: int | None = None,
                 scan_tokens: int = SCAN_TOKENS):
        self.path, self.block_size, self.group_windows = Path(path), block_size, group_windows
        self.vocab_size, self.tokens, self.scan_tokens = vocab_size, tokens, scan_tokens
        self._ids: np.memmap | None = None
        self._pid: int | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_ids": None, "_pid": None}

    def length(self) -> int:
        """The file's length in tokens, from its size alone (nothing is read); a missing file,
        a size that is not whole tokens or a file shorter than one window is refused."""
        if self.tokens is not None:
            prepare(self.path, self.tokens)
        if not self.path.is_file():
            raise wb.WorkbookError(f"token file {self.path} does not exist",
                                   "check data_file, or leave it out to use the prepared sample "
                                   "(python -m examples.token_stream --out FILE writes one)")
        size = self.path.stat().st_size
        if size % TOKEN_BYTES:
            raise wb.WorkbookError(
                f"token file {self.path} is {size} bytes, not a whole number of {TOKEN_BYTES}-"
                f"byte uint16 tokens (a truncated or foreign file)",
                "write it with np.array(ids, dtype=np.uint16).tofile(path) and nothing else; "
                "a file cut while being written must be prepared again")
        n, window = size // TOKEN_BYTES, self.block_size + 1
        if n < window:
            raise wb.WorkbookError(
                f"token file {self.path} holds {n} tokens, fewer than one window of block_size "
                f"+ 1 = {window}", f"prepare at least {window} tokens (far more to train on), or "
                "lower block_size")
        return n

    def windows(self) -> int:
        """How many windows the file gives: (N - 1) // block_size."""
        return (self.length() - 1) // self.block_size

    def ids(self) -> np.memmap:
        """The memmap of this process (opened on first use, again after a fork)."""
        if self._ids is None or self._pid != os.getpid():
            self.length()
            self._ids, self._pid = np.memmap(self.path, dtype=DTYPE, mode="r"), os.getpid()
        return self._ids

    def check_vocabulary(self, start: int, stop: int) -> None:
        """Every id of tokens [start, stop) must be below the vocabulary size."""
        chunk = np.asarray(self.ids()[start:stop])
        if chunk.size and int(chunk.max()) >= self.vocab_size:
            at = int(np.argmax(chunk >= self.vocab_size))
            raise wb.WorkbookError(
                f"token file {self.path} holds id {int(chunk[at])} at token {start + at}, beyond "
                f"the model's vocabulary of {self.vocab_size} ids (0..{self.vocab_size - 1})",
                "prepare the file with the tokenizer the model is built for (workbook.tokenizer, "
                f"{VOCAB} ids), or build the model with that tokenizer's vocabulary size")

    def examples(self):
        """The windows as raw examples, one at a time. The file's size is checked before the
        first; its ids are read (and checked against the vocabulary) a chunk of `scan_tokens`
        ahead of the window being yielded, so memory never holds more than one chunk."""
        n = self.length()
        count, block = (n - 1) // self.block_size, self.block_size
        checked = 0
        for w in range(count):
            end = n if w == count - 1 else w * block + block + 1  # the last one checks the tail
            if end > checked:
                stop = min(n, max(end, checked + self.scan_tokens))
                self.check_vocabulary(checked, stop)
                checked = stop
            yield {"id": w, "group": w // self.group_windows, "start": w * block}

    def encode(self, example: dict) -> dict[str, Tensor]:
        """x = ids[i:i + T], y = ids[i + 1:i + 1 + T], read from the memmap."""
        i, block = int(example["start"]), self.block_size
        window = torch.from_numpy(self.ids()[i:i + block + 1].astype(np.int64))
        if len(window) != block + 1:
            raise wb.WorkbookError(f"window {example.get('id')!r} at token {i} of {self.path} "
                                   f"has {len(window)} of {block + 1} tokens",
                                   "load the examples again from this file (it changed)")
        if int(window.max()) >= self.vocab_size:
            self.check_vocabulary(i, i + block + 1)
        return {"input_ids": window[:-1], "labels": window[1:]}


def collate_windows(items: list[dict[str, Tensor]], pad_id: int) -> dict[str, Tensor]:
    """Windows of one length stacked, as nanoGPT's get_batch does; padded with <pad> (and a
    mask) when a probe has cut one shorter."""
    try:
        x = torch.stack([it["input_ids"] for it in items])
    except RuntimeError:  # windows of different lengths
        return collate(items, pad_id=pad_id)
    return {"input_ids": x, "labels": torch.stack([it["labels"] for it in items]),
            "attention_mask": torch.ones_like(x)}


# ---------------------------------------------------------------------------------------------
# the training pipeline: what a campaign's loader reads, with its position for exact resume

PIPELINE_BUGS = ("state_frozen", "epoch_guard", "lost_at_yield", "workers_replay",
                 "ranks_same", "skip_in_batches",  # planted, for 07 and 09 to name
                 # from public reports: huggingface/datasets#8295 (a second resume restarts
                 # the stream), an epoch guard as users write it (set_epoch resets a position
                 # load_state_dict gave back), Lightning-AI/litData#649 (the epoch moves on
                 # only when a pass runs to its end)
                 "restart_after_load", "guard_as_written", "commit_at_end",
                 # huggingface/transformers#26413: a Trainer-style resume that skips
                 # `steps_done % len(dataloader)` - len the shard count, or no len at all
                 "skip_by_length", "skip_without_length")
SKIP_BY_COUNT = ("skip_by_length", "skip_without_length")


class TrainWindows(torch.utils.data.IterableDataset):
    """The training split's windows as a campaign reads them: shards of `shard_windows`
    neighbouring windows in an order shuffled per pass (seed, epoch), dealt to the ranks and
    then to each rank's DataLoader workers. `state_dict` is the pass and the windows this
    reader has yielded in it; `load_state_dict` goes on from there on the next `iter`. `bug`
    plants one of PIPELINE_BUGS."""

    def __init__(self, stream: TokenStream, train: list[int], seed: int, rank: int = 0,
                 world: int = 1, micro_batch: int = 1, shard_windows: int = 16, bug: str = ""):
        self.stream, self.train, self.seed = stream, train, seed
        self.rank, self.world, self.micro_batch = rank, world, micro_batch
        self.shard_windows, self.bug = shard_windows, bug
        self.epoch, self.position = 0, 0
        self._resume: dict | None = None
        self._frozen: dict | None = None
        self._loaded, self._ended, self._asked = False, True, 0
        self.seen = 0  # examples yielded since the run began (a Trainer's steps done)

    def set_epoch(self, epoch: int) -> None:
        if self.bug == "commit_at_end":  # taken up when the last pass has run to its end
            self._asked = epoch
            return
        if self.bug == "guard_as_written" and epoch != self.epoch:
            self.position, self._resume = 0, None  # a new epoch starts at its beginning
        self.epoch = epoch

    def mine(self) -> list[int]:
        """This reader's windows of the pass, in order."""
        shards = [self.train[i:i + self.shard_windows]
                  for i in range(0, len(self.train), self.shard_windows)]
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(shards))
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info and \
            self.bug != "workers_replay" else (0, 1)
        rank, world = (0, 1) if self.bug == "ranks_same" else (self.rank, self.world)
        reader = rank * workers + worker
        return [w for s in order[reader::world * workers] for w in shards[s]]

    def __iter__(self):
        if self.bug == "commit_at_end" and self._ended:
            self.epoch = self._asked
        self._ended = False
        start, resume, self._resume = 0, self._resume, None
        if self.bug in ("guard_as_written", *SKIP_BY_COUNT) and resume is not None:
            start = resume["position"]
        elif resume is not None and resume["epoch"] == self.epoch and \
                (self.epoch == 0 or self.bug != "epoch_guard"):
            start = resume["position"] * (self.micro_batch if self.bug == "skip_in_batches"
                                          else 1)
        block, windows = self.stream.block_size, self.mine()
        for k in range(start, len(windows)):
            # lost_at_yield counts the window it reads ahead as if it were trained on
            self.position = min(k + 2, len(windows)) if self.bug == "lost_at_yield" else k + 1
            self.seen += 1
            w = windows[k]
            yield {"id": w, "group": w // self.stream.group_windows, "start": w * block}
        self._ended = True

    def state_dict(self) -> dict:
        if self.bug == "state_frozen" and self._frozen is not None:
            return dict(self._frozen)  # the loaded state, never advanced
        if self.bug == "restart_after_load" and self._loaded:
            return {"epoch": self.epoch, "position": 0}  # the loaded stream's own start
        if self.bug in SKIP_BY_COUNT:
            return {"seen": self.seen}  # the steps done, as a Trainer's checkpoint holds them
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self._resume, self._loaded = dict(state), True
        if self.bug in SKIP_BY_COUNT:  # epochs done and the skip, from the steps done
            self.seen = state["seen"]
            self.epoch, skip = divmod(self.seen, len(self)) if self.bug == "skip_by_length" \
                else (0, self.seen)  # no length: the whole run counted as one pass
            self._resume = {"epoch": self.epoch, "position": skip}
            return
        if self.bug == "guard_as_written":  # the position comes back, the epoch does not
            self.position = state["position"]
            return
        self.epoch, self.position = state["epoch"], state["position"]
        if self.bug == "state_frozen":
            self._frozen = dict(state)


class ShardCounted(TrainWindows):
    """TrainWindows whose len() is its shard count, as a sharded stream states one."""

    def __len__(self) -> int:
        return -(-len(self.train) // self.shard_windows)


def train_pipeline(stream: TokenStream, fractions: tuple, bug: str, seed: int, rank: int = 0,
                   world: int = 1, workers: int = 0, micro_batch: int = 1):
    """The training windows as the campaign's loader gives them: the dataset itself, or, with
    workers, a torchdata StatefulDataLoader over it (a plain DataLoader without torchdata: the
    workbook then resumes by count-and-skip); one raw example at a time (batch_size=None)."""
    train = [w for w in range(stream.windows())
             if split_by_group_hash(w // stream.group_windows, fractions) == "train"]
    kind = ShardCounted if bug == "skip_by_length" else TrainWindows
    windows = kind(stream, train, seed, rank, world, micro_batch, bug=bug)
    if not workers:
        return windows
    try:
        warnings.filterwarnings("ignore", "'set_vital' is deprecated")  # torchdata 0.11's own
        from torchdata.stateful_dataloader import StatefulDataLoader as Loader
    except ImportError:
        Loader = torch.utils.data.DataLoader
    # its own generator: without one, each pass's iterator draws the workers' seed from the
    # global random stream, and a resumed run's dropout differs from the uninterrupted one's
    return Loader(windows, batch_size=None, num_workers=workers,
                  generator=torch.Generator().manual_seed(seed))


def decode(ids) -> str:
    """Ids back to text, markers shown (</s> ends a conversation); -100 is skipped."""
    return tok.decode([int(i) for i in ids if int(i) >= 0], keep_special=True)


def make_task(block_size: int = 64, data_file: str = "", tokens: int | None = None,
              group_windows: int = 16, n_layer: int = 3, n_embd: int = 96,
              dropout: float = 0.1, pipeline_bug: str = "") -> wb.Task:
    if int(block_size) != block_size or block_size < 1:
        raise ValueError(f"block_size must be a positive whole number, got {block_size!r}")
    if int(group_windows) != group_windows or group_windows < 1:
        raise ValueError(f"group_windows must be a positive whole number, got {group_windows!r}")
    if pipeline_bug and pipeline_bug not in PIPELINE_BUGS:
        raise ValueError(f"pipeline_bug {pipeline_bug!r} is not one of {PIPELINE_BUGS}")
    if data_file and tokens is not None:
        raise ValueError("tokens sizes the prepared sample; a data_file is used as it is - "
                         "give one or the other")
    if data_file:
        stream = TokenStream(data_file, block_size, group_windows)
    else:
        tokens = TOKENS if tokens is None else tokens
        stream = TokenStream(default_file(tokens), block_size, group_windows, tokens=tokens)
    config = GPTConfig(block_size=block_size, vocab_size=VOCAB, n_layer=n_layer, n_head=4,
                       n_embd=n_embd, dropout=dropout)
    return wb.Task(
        name="token-stream",
        kind="generation",
        load_examples=stream.examples,
        encode=stream.encode,
        collate=partial(collate_windows, pad_id=tok.PAD),
        build_model=partial(GPT, config),
        decode=decode,
        build_optimizer=build_optimizer,
        lr=3e-3,
        group_key="group",
        model_inputs=("input_ids", "labels"),  # "labels" reaches forward's `targets`
        prompt_in_loss=True,  # pretraining: every token is learned, there is no prompt
        train_pipeline=partial(train_pipeline, stream, (0.8, 0.1, 0.1), pipeline_bug),
    )


task = make_task


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare the token-stream sample as a uint16 "
                                     "file (nanoGPT's train.bin format).")
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the file to write (default: the cache, under {CACHE_DIR})")
    args = parser.parse_args(argv)
    path = prepare(args.out or default_file(args.tokens), args.tokens)
    print(f"{path}: {path.stat().st_size // TOKEN_BYTES} tokens")


if __name__ == "__main__":
    main()

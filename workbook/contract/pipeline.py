"""The task's own training pipeline (`Task.train_pipeline`): opened with the arguments its
factory takes, read a pass at a time as raw examples in the order training reads them, and its
data position taken and given back - by the pipeline's own `state_dict`/`load_state_dict` where
it has both (a StatefulDataLoader, a streaming `datasets.IterableDataset`, your own), else by
counting the examples read and reading that many again on resume (count-and-skip)."""

from __future__ import annotations

import inspect
import io
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..base.errors import WorkbookError, reason
from .outputs import accepted
from .sources import numbered, split_of
from .task import Task, own_code

OWN_STATE, COUNT_AND_SKIP = "its own state_dict", "count-and-skip"


@dataclass(frozen=True)
class DataPosition:
    """Where a pipeline stands between updates: the pass, the examples read in it, and the
    pipeline's own state (None for count-and-skip)."""

    epoch: int = 0
    examples: int = 0
    state: Any = None


@dataclass
class Skipped:
    """What a count-and-skip resume cost: the examples read again and the seconds it took."""

    examples: int = 0
    seconds: float = 0.0


def arguments(task: Task, **given: Any) -> dict[str, Any]:
    """The arguments of `given` that the task's train_pipeline accepts (all of them when it
    takes **kwargs); it must take `seed`."""
    params = accepted(task.train_pipeline)
    if "**" in params:
        return dict(given)
    if "seed" not in params:
        raise WorkbookError(f"the task's train_pipeline takes {list(params)}, not `seed`",
                            "define train_pipeline(seed, rank=0, world=1, workers=0, "
                            "micro_batch=1) - any of the last four it needs, by name")
    return {k: v for k, v in given.items() if k in params}


def _set_epoch(source: Any, epoch: int) -> None:
    """set_epoch on the pipeline, or on a DataLoader's sampler, batch sampler's sampler and
    dataset (as Lightning and Accelerate do)."""
    if callable(getattr(source, "set_epoch", None)):
        source.set_epoch(epoch)
        return
    for part in (getattr(source, "sampler", None),
                 getattr(getattr(source, "batch_sampler", None), "sampler", None),
                 getattr(source, "dataset", None)):
        if callable(getattr(part, "set_epoch", None)):
            part.set_epoch(epoch)


@dataclass
class Pipeline:
    """One opened pipeline; `read(start)` yields (epoch, examples read in the pass, example)
    pass after pass, from a data position."""

    task: Task
    source: Any
    limit: int = 0  # a pass is the first `limit` examples of the pipeline's pass (0: all)
    # give a position back as a training loop does: load_state_dict, then set_epoch at the
    # top of the pass (else set_epoch first, the order an epoch guard always survives)
    loop_order: bool = False
    seed: int = 0  # the run's seed: a worker DataLoader's generator is reseeded from it per pass
    skipped: Skipped = field(default_factory=Skipped)
    _epoch: int = 0
    _read: int = 0

    @property
    def resumes_by(self) -> str:
        own = all(callable(getattr(self.source, m, None))
                  for m in ("state_dict", "load_state_dict"))
        return OWN_STATE if own else COUNT_AND_SKIP

    def position(self) -> DataPosition:
        """The data position now (call it between updates): the pipeline's own state is taken
        and checked to load back from a `weights_only` checkpoint."""
        state = None
        if self.resumes_by == OWN_STATE:
            state = own_code("train_pipeline's state_dict", self.source.state_dict,
                             receives="nothing")
            loadable(state)
        return DataPosition(self._epoch, self._read, state)

    def read(self, start: DataPosition = DataPosition()) -> Iterator[tuple[int, int, dict]]:
        """Examples from `start` on, pass after pass, each pass closed by (epoch, read, None).
        The position is given back before the first example is read: the pipeline's own state
        loaded (a state that fails to load is named, nothing read), or the examples of the
        pass read again and dropped."""
        epoch, read, resumed = start.epoch, start.examples, True
        # a pass already cut at the limit has nothing left: its state is not loaded (a pending
        # state would be taken up by the next pass's iter, as datasets and torchdata do)
        done = bool(self.limit) and read >= self.limit
        if not self.loop_order:
            _set_epoch(self.source, epoch)
        if start.state is not None and not done:
            try:
                self.source.load_state_dict(start.state)
            except Exception as exc:
                raise WorkbookError(f"the training pipeline's state failed to load: "
                                    f"{type(exc).__name__}: {reason(exc, 300)} (nothing was "
                                    "trained)", "resume with the task, options and pipeline "
                                    "that wrote the checkpoint, or from an earlier one") from exc
        if self.loop_order:
            _set_epoch(self.source, epoch)
        examples = self._pass(epoch)
        if start.state is None and read and not done:
            begin = time.perf_counter()
            for done in range(read):
                if next(examples, None) is None:
                    raise WorkbookError(f"the training pipeline's pass {epoch} ended after "
                                        f"{done} examples; the checkpoint had read {read}",
                                        "resume with the task and options that wrote the "
                                        "checkpoint: its pipeline must give the same passes")
            self.skipped = Skipped(read, time.perf_counter() - begin)
        while True:
            self._epoch, self._read = epoch, read
            given = 0
            while not (self.limit and read >= self.limit):  # checked before the next is read
                example = next(examples, None)
                if example is None:
                    break
                read, given = read + 1, given + 1
                self._read = read
                yield epoch, read, example
            if not given and not (resumed and read):
                raise WorkbookError(f"the training pipeline gave no examples in pass {epoch}",
                                    "train_pipeline must give every pass at least one example "
                                    "(check its files and its rank/worker sharding)")
            yield epoch, read, None  # the pass ended: nothing of the next one is read yet
            epoch, read, resumed = epoch + 1, 0, False
            _set_epoch(self.source, epoch)
            examples = self._pass(epoch)

    def _pass(self, epoch: int) -> Iterator[dict]:
        """One pass of the source as single raw examples (a batch of them, as a DataLoader with
        collate_fn=list gives, is taken apart), each checked; a failure is named with where."""
        key = self.task.id_key
        position, last = 0, None
        if self.resumes_by == COUNT_AND_SKIP:
            reseed_workers(self.source, self.seed, epoch)

        def failed(_: int, exc: Exception) -> WorkbookError:  # where the reading stopped
            return self._failed(exc, epoch, position, last)

        try:
            iterator = iter(self.source)
        except Exception as exc:
            raise failed(0, exc) from exc
        for _, got in numbered(iterator, failed):
            for example in (got if isinstance(got, list) else [got]):
                if not isinstance(example, dict) or key not in example or \
                        isinstance(example[key], (torch.Tensor, list, tuple)):
                    raise WorkbookError(
                        f"the training pipeline's item at position {position} of pass {epoch} "
                        f"is {_shown(example, key)}, not a raw example with {key!r}",
                        "yield raw example dicts (a DataLoader with batch_size=None, or "
                        "collate_fn=list); the workbook encodes and collates them")
                if split_of(self.task, example) != "train":
                    raise WorkbookError(
                        f"the training pipeline gave example {example[key]!r} (position "
                        f"{position} of pass {epoch}) of the {split_of(self.task, example)} "
                        "split: training on it leaks it into the evaluation",
                        "give train_pipeline only the training split's examples (the task's "
                        "split rule: split_of, or the hash of the group key)")
                position, last = position + 1, example[key]
                yield example

    def _failed(self, exc: Exception, epoch: int, position: int, last: Any) -> WorkbookError:
        after = f", after example {last!r}" if last is not None else ""
        return WorkbookError(f"the training pipeline raised {type(exc).__name__} at position "
                             f"{position} of pass {epoch}{after}: {reason(exc, 300)}",
                             "fix the pipeline (a DataLoader worker's traceback is in the "
                             "message); its files must be readable on every pass")


def reseed_workers(source: Any, seed: int, epoch: int) -> None:
    """A DataLoader with worker processes draws its workers' seeds (the random augmentation
    in them) from its generator, or torch's global one, at each `iter()`: pass p of a process
    that opened p passes and pass p of one that resumed there (count-and-skip opens it first)
    would augment differently. Its generator is seeded from (seed, pass) before each pass, so
    the augmentation is a function of the pass and both runs compare; a campaign resuming this
    loader without doing the same gets other augmentations after the resume (harmless, but not
    bit-exact)."""
    if not isinstance(source, torch.utils.data.DataLoader) or not source.num_workers:
        return
    if source.generator is None:
        source.generator = torch.Generator()
    source.generator.manual_seed((seed * 1_000_003 + epoch) % 2**63)


def _shown(item: Any, key: str) -> str:
    if isinstance(item, dict):
        batched = [k for k, v in item.items() if isinstance(v, (torch.Tensor, list, tuple))]
        return (f"a collated batch {{{', '.join(map(repr, batched[:4]))}...}}" if batched
                else f"a dict without {key!r} (keys {sorted(map(str, item))[:6]})")
    return f"a {type(item).__name__}"


def loadable(state: Any) -> None:
    """A pipeline state must come back from a `weights_only` checkpoint: refused here, with
    what in it cannot, instead of failing the resume."""
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as exc:
        raise WorkbookError(f"the training pipeline's state_dict cannot be stored in a "
                            f"checkpoint loaded with weights_only=True ({reason(exc, 240)})",
                            "return plain ints, floats, strings, lists, dicts and tensors "
                            "from state_dict (no numpy arrays or objects)") from None


def open_pipeline(task: Task, seed: int, rank: int = 0, world: int = 1, workers: int = 0,
                  micro_batch: int = 1, limit: int = 0, loop_order: bool = False) -> Pipeline:
    """The task's train_pipeline opened for one rank; `limit` cuts every pass to its first
    examples (the pilot's small passes; the cut is part of the data position)."""
    if task.train_pipeline is None:
        raise WorkbookError(f"task {task.name!r} has no train_pipeline",
                            "give the task train_pipeline(seed, ...) returning your training "
                            "data pipeline, or train from its examples")
    given = arguments(task, seed=seed, rank=rank, world=world, workers=workers,
                      micro_batch=micro_batch)
    source = own_code("train_pipeline", lambda: task.train_pipeline(**given),
                      receives=", ".join(f"{k}={v!r}" for k, v in given.items()))
    if source is None or isinstance(source, (str, bytes, dict)) or \
            not hasattr(source, "__iter__"):
        raise WorkbookError(f"the task's train_pipeline returned {type(source).__name__}, not "
                            "an iterable of raw examples", "return the pipeline itself (a "
                            "DataLoader, an IterableDataset, a generator function's result)")
    if inspect.isgenerator(source):
        raise WorkbookError("the task's train_pipeline returned a generator, which gives one "
                            "pass only", "return an object whose __iter__ starts a new pass "
                            "(an IterableDataset) - a resume needs every pass again")
    return Pipeline(task, source, limit, loop_order=loop_order, seed=seed)

"""State a task carries from one batch to the next - an RNN's hidden state in truncated
backpropagation through time (pytorch/examples' word_language_model), a memory, a cache -
declared once on the Task (`state=CarriedState(...)`) and kept by the workbook, one slice per
stream (a batch column of `batchify`), so any split of an update into micro-batches sees the
same state. The model call (`Task.outputs`) passes it in and takes the next one back; the loop
resets it at the start of each pass, detaches it after each micro-batch (the script's
`repackage_hidden`), and saves it in every checkpoint (notebook 07 checks it comes back). A
call outside a carry (a probe of one batch) starts every stream from `init`."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..base.errors import WorkbookError
from .outputs import forward_owner


def detached(state: Any) -> Any:
    """Every tensor of `state` cut from the graph that made it (word_language_model's
    `repackage_hidden`)."""
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, state)


@dataclass(frozen=True)
class CarriedState:
    """How a task's state travels. `init(model, rows)` is the state at a stream's start for a
    batch of `rows` streams (`model.init_hidden(rows)`); the forward receives it as
    `argument` and returns the next one at `returned_at` of its output (a tuple index or a
    key); `stream_key` is the batch key holding each row's stream id (an int tensor [rows]);
    `detach` cuts it from the graph between micro-batches (default: `detached`; a task passing
    its own `repackage_hidden` is taken at its word, and 03 names one that does not cut)."""

    init: Callable[[nn.Module, int], Any]
    argument: str = "hidden"
    returned_at: int | str = -1
    stream_key: str = "stream"
    detach: Callable[[Any], Any] = detached

    def rows_dim(self, model: nn.Module) -> list[int]:
        """Per tensor of the state, the dimension that holds the streams: the one whose size
        follows `rows` (an LSTM's (h, c) of [layers, rows, hidden]: 1)."""
        one, two = (pytree.tree_leaves(self.start(model, n)) for n in (1, 2))
        dims = []
        for a, b in zip(one, two, strict=True):
            grown = [d for d in range(a.dim()) if a.shape[d] == 1 and b.shape[d] == 2]
            if not grown:
                raise WorkbookError(
                    f"the carried state's init(model, rows) gives a tensor of shape "
                    f"{tuple(a.shape)} for 1 row and {tuple(b.shape)} for 2: no dimension "
                    "holds the rows", "return a state with one slice per batch row, e.g. "
                    "weight.new_zeros(layers, rows, hidden)")
            dims.append(grown[0])
        return dims

    def start(self, model: nn.Module, rows: int) -> Any:
        """The state at the start of `rows` streams (`init` gets the user's model, never a
        DistributedDataParallel or compile wrapper)."""
        try:
            return self.init(forward_owner(model), rows)
        except Exception as exc:
            raise WorkbookError(f"the carried state's init(model, {rows}) raised "
                                f"{type(exc).__name__}: {exc}", "init(model, rows) returns "
                                "the state for a batch of `rows` streams, as "
                                "model.init_hidden(rows)") from exc

    def next_state(self, output: Any) -> tuple[Any, Any]:
        """(the state the forward returned, its output without it)."""
        where = self.returned_at
        if isinstance(output, dict) and isinstance(where, str) and where in output:
            return output[where], {k: v for k, v in output.items() if k != where}
        if isinstance(output, (tuple, list)) and isinstance(where, int) and \
                -len(output) <= where < len(output):
            index = where % len(output)
            rest = tuple(v for i, v in enumerate(output) if i != index)
            return output[index], rest[0] if len(rest) == 1 else rest
        raise WorkbookError(f"the model's output has no carried state at {where!r} (it returns "
                            f"a {type(output).__name__})", "set CarriedState(returned_at=...) to "
                            "where the forward returns the next state, e.g. 1 for "
                            "(output, hidden)")


class Carry:
    """The state of every stream between batches: one slice each, detached, on the model's
    device. `state_dict()` / `load_state_dict()` travel in checkpoints."""

    def __init__(self, declared: CarriedState):
        self.declared = declared
        self.streams: dict[int, list[Tensor]] = {}
        self._dims: list[int] | None = None
        self._spec: Any = None

    def reset(self) -> None:
        """A new pass: every stream starts again from `init`."""
        self.streams.clear()

    def gather(self, model: nn.Module, streams: list[int]) -> Any:
        """The state of a batch of these streams, in their order (a new stream from `init`)."""
        if len(set(streams)) != len(streams):
            twice = sorted({s for s in streams if streams.count(s) > 1})
            raise WorkbookError(
                f"one micro-batch holds stream {twice[0]} twice: a carried state has one value "
                "per stream, so a batch can continue each stream only once",
                "make each micro-batch hold distinct streams in order (position by position, "
                "as batchify's columns are read), e.g. a micro-batch of at most as many "
                "examples as streams")
        if self._dims is None:
            self._dims = self.declared.rows_dim(model)
            self._spec = pytree.tree_flatten(self.declared.start(model, 1))[1]
        fresh = None
        parts = []
        for s in streams:
            if s not in self.streams:
                if fresh is None:
                    fresh = pytree.tree_leaves(self.declared.start(model, 1))
                self.streams[s] = [t.detach() for t in fresh]
            parts.append(self.streams[s])
        leaves = [torch.cat([p[i] for p in parts], dim=d) for i, d in enumerate(self._dims)]
        return pytree.tree_unflatten(leaves, self._spec)

    def keep(self, streams: list[int], state: Any) -> None:
        """Store each stream's slice of the state a batch returned, cut from its graph."""
        cut = self.declared.detach(state)
        leaves = pytree.tree_leaves(cut)
        dims = self._dims or [0] * len(leaves)
        for row, s in enumerate(streams):
            self.streams[s] = [t.narrow(d, row, 1) for t, d in zip(leaves, dims, strict=True)]

    def state_dict(self) -> dict[str, list[Tensor]]:
        return {str(s): [t.detach().cpu().clone() for t in v] for s, v in self.streams.items()}

    def load_state_dict(self, state: dict[str, list[Tensor]], device: Any = None) -> None:
        self.streams = {int(s): [t.to(device) if device is not None else t for t in v]
                        for s, v in state.items()}


_CARRY: contextvars.ContextVar[Carry | None] = contextvars.ContextVar("carry", default=None)


@contextlib.contextmanager
def carrying(carry: Carry | None) -> Iterator[Carry | None]:
    """Model calls inside take their state from `carry` and give the next one back to it."""
    token = _CARRY.set(carry)
    try:
        yield carry
    finally:
        _CARRY.reset(token)


def stream_ids(declared: CarriedState, batch: dict[str, Tensor]) -> Tensor:
    """The batch's tensor of stream ids, one per row."""
    value = batch.get(declared.stream_key)
    if not isinstance(value, Tensor) or value.dim() != 1:
        raise WorkbookError(f"the batch has no {declared.stream_key!r} tensor of one stream id "
                            "per row, which a carried state needs",
                            f"return {declared.stream_key!r} from encode (an int per example) "
                            "and stack it in collate, or set CarriedState(stream_key=...)")
    return value


def streams_of(declared: CarriedState, batch: dict[str, Tensor]) -> list[int]:
    """The stream id of each row of a batch."""
    return [int(v) for v in stream_ids(declared, batch).tolist()]


def state_in(declared: CarriedState, model: nn.Module, batch: dict[str, Tensor]) -> Any:
    """The state a model call receives: the current carry's, else every stream from `init`."""
    carry = _CARRY.get()
    if carry is None:  # the rows are all it needs: fake tensors (sizing) have no values
        return declared.start(model, stream_ids(declared, batch).shape[0])
    return carry.gather(model, streams_of(declared, batch))


def state_out(declared: CarriedState, batch: dict[str, Tensor], output: Any) -> Any:
    """The model's output without its state; the state goes back to the current carry."""
    state, rest = declared.next_state(output)
    carry = _CARRY.get()
    if carry is not None:
        carry.keep(streams_of(declared, batch), state)
    return rest


NOT_DETACHED = "Trying to backward through the graph a second time"


def not_detached(exc: BaseException, declared: CarriedState | None) -> WorkbookError | None:
    """PyTorch's "backward through the graph a second time" (whose advice, retain_graph=True,
    is wrong here) said as what it is in a training loop: a tensor kept from the previous
    batch still holds that batch's graph."""
    if NOT_DETACHED not in str(exc):
        return None
    where = (f"the carried state ({declared.argument!r}) came back from CarriedState.detach "
             "still attached to the previous batch's graph" if declared is not None else
             "a tensor kept from the previous batch (an RNN's hidden state carried across "
             "batches, a running memory or cache on the model) still holds that batch's graph")
    return WorkbookError(
        f"the backward reached into an earlier batch's graph: {where}. PyTorch's advice "
        "(retain_graph=True) would backpropagate through every earlier batch, growing memory "
        "and time without bound",
        "detach the state between batches (word_language_model's repackage_hidden: "
        "h.detach() for each tensor), or declare it as Task(state=CarriedState(init=...)) and "
        "let the workbook carry and detach it")


def whole_update(task: Any, items: list) -> tuple[int, int]:
    """(micro-batch, accumulation) that takes `items` in one update: one micro-batch, or for a
    task carrying state, micro-batches of distinct streams in order (a batch continues each
    stream once), as many as the items' positions."""
    if task.state is None:
        return len(items), 1
    key = task.state.stream_key
    streams = len({int(it.tensors[key]) for it in items if key in it.tensors}) or len(items)
    if len(items) % streams:
        raise WorkbookError(f"{len(items)} examples of {streams} streams do not fill whole "
                            "positions: a carried state needs every stream at every position",
                            f"take a multiple of {streams} examples")
    return streams, len(items) // streams

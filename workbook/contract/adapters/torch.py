"""`from_torch`: a plain PyTorch `Dataset` + `collate_fn` + model + criterion as a Task. A
dataset read by iterating (a torch `IterableDataset`, any re-iterable) is a `Stream`: never
indexed nor held, its items read in turn as the notebooks ask for examples, each example
carrying its item."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import IterableDataset, default_collate

from ...base.errors import WorkbookError, reason
from .. import class_maps, kinds
from ..sources import SPLITS, length, numbered
from ..targets import contributes
from ..task import Task
from .base import Adapter

LABELS = "labels"


@contextlib.contextmanager
def real_on_cpu() -> Iterator[None]:
    """Real tensors on the CPU, whatever device or fake-tensor mode the caller is in."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.device("cpu"):
        yield


def loading_weights(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """`factory`, also on the meta device when it loads weights (`from_pretrained` refuses a
    meta device): there it is built for real on the CPU and its model moved to meta - the
    pilot's models are twins, small enough to build."""
    def build() -> nn.Module:
        if torch.get_default_device().type != "meta":
            return factory()
        try:
            return factory()
        except Exception:  # weights read from disk: build for real, then keep only shapes
            with real_on_cpu():
                return factory().to("meta")
    return build


def probe_on_meta(factory: Callable[[], nn.Module], what: str, fix: str) -> nn.Module:
    """The user's `what` ("model", "module") built by `factory` on the meta device, to read
    its class and shapes; a factory that fails says so with `fix`."""
    try:
        with torch.device("meta"):
            return factory()
    except Exception as exc:
        raise WorkbookError(f"the {what} factory failed on the meta device: {reason(exc)}",
                            fix) from exc


def as_dict(item: Any, fields: Sequence[str] | None, where: str) -> dict[str, Any]:
    """A dataset item or a collated batch as a dict: dicts as they are, other mappings
    (Hugging Face's `BatchEncoding`, what its collators return) as dicts, tuples/lists by
    `fields` (default: every element but the last is an input, the last the labels)."""
    if isinstance(item, dict):
        return item
    if isinstance(item, Mapping):
        return dict(item)
    if isinstance(item, (tuple, list)) and len(item) >= 2:
        names = list(fields) if fields else [f"input{i}" if len(item) > 2 else "inputs"
                                             for i in range(len(item) - 1)] + [LABELS]
        if len(names) != len(item):
            raise WorkbookError(f"{where} has {len(item)} elements but fields names "
                                f"{len(names)} ({list(names)})",
                                "give one name per element, the labels named 'labels'")
        return dict(zip(names, item, strict=True))
    raise WorkbookError(f"{where} is a {type(item).__name__}, not a dict or an (inputs..., "
                        "labels) tuple", "return a dict of tensors with 'labels', or a tuple "
                        "whose last element is the labels")


def streams(data: Any) -> bool:
    """Whether a dataset is read by iterating: a torch IterableDataset (its inherited
    __getitem__ raises), or anything without both __len__ and __getitem__."""
    return isinstance(data, IterableDataset) or not (
        hasattr(data, "__getitem__") and hasattr(data, "__len__"))


class Stream:
    """A dataset read by iterating, never indexed nor held: its first item is read here, to
    check it and read the structure from; every other one when a pass reaches it. Refused:
    what cannot be iterated, an iterator that is read once only, no items (unless `may_be_empty`).
    A framework's own kind of stream (`hf_rows.RowStream`) says its own `unit`, what it
    `wants` in its place and which iterables start `again`."""

    unit = "item"  # what one element is called in the refusals
    may_be_empty = False
    wants = ("a map-style Dataset (__len__ and __getitem__) nor an iterable one",
             "a map-style Dataset, a torch IterableDataset or a list")  # (in words, as given)
    again = ("a torch IterableDataset or a class whose __iter__ opens the data anew (a list, if "
             "it fits in memory)")

    def __init__(self, data: Any, split: str | None):
        self.data, self.name = data, self.named(split)
        kind = type(data).__name__
        if not hasattr(data, "__iter__"):
            raise WorkbookError(f"{self.name} is a {kind}, not {self.wants[0]}",
                                f"pass {self.wants[1]}")
        if iter(data) is data:
            raise WorkbookError(f"{self.name} is a {kind} that can be read once only, not "
                                f"{self.wants[0]} that starts again: the pilot reads it once "
                                "per notebook (and the campaign once per pass)", "pass "
                                f"something that starts again on every iter(): {self.again}")
        items = self.items()
        found = next(items, None)
        items.close()
        if found is None and not self.may_be_empty:
            raise WorkbookError(f"{self.name} ({kind}) has no items: its first iter() ended "
                                "at once", "check what its __iter__ reads (an empty folder or "
                                "shard list, a worker split that leaves nothing)")
        self.first = found[1] if found is not None else None

    @staticmethod
    def named(split: str | None) -> str:
        return f"the {split} dataset" if split else "the dataset"

    def items(self) -> Iterator[tuple[int, Any]]:
        """(position, item) in order; a failure while reading names the item it had
        reached."""
        return numbered(self.data, lambda i, exc: WorkbookError(
            f"reading {self.name} failed at {self.unit} {i}: {type(exc).__name__}: "
            f"{reason(exc, 200)}", f"fix {self.name}'s source at that {self.unit} (the file or "
            "shard it reads there)"))

    def length(self) -> int | None:
        """The items the stream says it has (an IterableDataset with __len__), else None."""
        return length(self.data)


def per_target(criterion: Any) -> Callable[[Tensor, Tensor], Tensor]:
    """The criterion per target (summed by the task's loss under a mask, never by indexing: a
    data-dependent shape does not run on the fake tensors that size the rental): an `nn` loss
    is copied with reduction 'none'; a function is called with `reduction="none"`."""
    if isinstance(criterion, nn.Module):
        if not hasattr(criterion, "reduction"):
            raise WorkbookError(f"the criterion {type(criterion).__name__} has no `reduction`, so "
                                "its sum over targets is unknown",
                                "pass a torch.nn loss (CrossEntropyLoss, MSELoss, ...) or a "
                                "function taking reduction='none', or write Task.loss yourself")
        each = copy.copy(criterion)
        each.reduction = "none"
        return each
    if callable(criterion):
        return lambda outputs, labels: criterion(outputs, labels, reduction="none")
    raise WorkbookError(f"the criterion is a {type(criterion).__name__}, not callable",
                        "pass the loss you train with, e.g. nn.CrossEntropyLoss()")


class TorchAdapter(Adapter):
    """A plain dataset (or a dict of splits), collate_fn, model factory and criterion, read
    once; the Task's steps read, encode, collate and score them (see `from_torch`)."""

    def __init__(self, dataset: Any, build_model: Callable[[], nn.Module], criterion: Any, *,
                 name: str, kind: str = "classification", collate_fn: Callable | None = None,
                 fields: Sequence[str] | None = None,
                 group_of: Callable[[int, Any], Any] | None = None,
                 label_names: list[str] | None = None, **task_fields: Any):
        target = kinds.KINDS.get(kind)
        if target is None or (target.per_position and not target.causal):
            raise WorkbookError(f"from_torch maps classification, regression and generation, "
                                f"not {kind!r}", "give kind='classification', 'regression' or "
                                "'generation', or write a workbook.Task for per-position "
                                "classes")
        if target.per_position and "decode" not in task_fields:
            raise WorkbookError("a generation task needs decode (token ids -> text)",
                                "pass decode=your_tokenizer.decode")
        self.name, self.kind, self.target = name, kind, target
        self.build_model, self.fields, self.group_of = build_model, fields, group_of
        self.task_fields = dict(task_fields)
        self.read_splits(dataset, label_names)
        self.user_collate = collate_fn or default_collate
        self.each = per_target(criterion) if criterion is not None or not target.per_position \
            else None
        self.weight = getattr(criterion, "weight", None) if isinstance(
            criterion, (nn.CrossEntropyLoss, nn.NLLLoss)) else None
        self.read_structure()
        self.label_names = label_names
        if target.named_classes and label_names is None:
            seen = sorted({int(self.item(i)[LABELS]) for i in range(len(self.index))})
            self.label_names = [str(c) for c in range(max(seen) + 1)] if seen else []

    # -- reading the datasets ------------------------------------------------------------------

    def read_splits(self, dataset: Any, label_names: list[str] | None) -> None:
        """The splits as given (one dataset: split by group later), each a Stream when it is
        read by iterating; a map-style split's (split, position) per example id."""
        splits = dict(dataset) if isinstance(dataset, dict) else {None: dataset}
        for split in splits:
            if split not in (None, *SPLITS):
                raise WorkbookError(f"the datasets are named {sorted(map(str, splits))}; "
                                    f"{split!r} is not a split", f"name them {list(SPLITS)}")
        self.splits = {split: Stream(data, split) if streams(data) else data
                       for split, data in splits.items()}
        self.streamed = any(isinstance(data, Stream) for data in self.splits.values())
        if "train" in self.splits and not self.streamed and not len(self.splits["train"]):
            raise WorkbookError("the train dataset has no items", "pass the data you train on")
        if self.streamed and self.target.named_classes and label_names is None:
            raise WorkbookError("the dataset is read as a stream, so its classes are not known "
                                "before all of it is read", "pass label_names=[...]: the class "
                                "names in class-id order")
        self.index = [] if self.streamed else [(split, i) for split, data in self.splits.items()
                                               for i in range(len(data))]

    def read_structure(self) -> None:
        """The first item's fields: the model's inputs and whether items are tuples."""
        first_data = next(iter(self.splits.values()))
        first_raw = first_data.first if isinstance(first_data, Stream) else \
            first_data[0] if len(first_data) else None
        self.tuple_items = first_raw is not None and not isinstance(first_raw, dict)
        self.first = self.tensors(first_raw, "dataset item 0") if first_raw is not None else {}
        self.inputs = tuple(k for k in self.first if k != LABELS)

    def at(self, split: str | None, j: int) -> Any:
        try:
            return self.splits[split][j]
        except Exception as exc:
            raise WorkbookError(f"the {split or ''} dataset raised on item {j}: "
                                f"{reason(exc)}".replace("  ", " "),
                                "fix the dataset's __getitem__") from exc

    def raw(self, i: int) -> Any:
        return self.at(*self.index[i])

    def tensors(self, raw_item: Any, where: str) -> dict[str, Any]:
        out = as_dict(raw_item, self.fields, where)
        if LABELS not in out:
            raise WorkbookError(f"{where} has no 'labels' (keys {sorted(out)})",
                                "name the labels 'labels' (fields=(..., 'labels') for tuples)")
        return {k: torch.as_tensor(v) for k, v in out.items()}

    def item(self, i: int) -> dict[str, Any]:
        return self.tensors(self.raw(i), f"dataset item {i}")

    def class_name(self, label: Tensor, where: str) -> str:
        names = self.label_names
        if label.numel() != 1:
            raise WorkbookError(f"{where} has {label.numel()} labels; from_torch classifies "
                                "one label per example", "write a token-level task with "
                                "workbook.Task")
        if names and not 0 <= int(label) < len(names):
            raise WorkbookError(f"{where} has the class id {int(label)}, outside label_names "
                                f"({len(names)} classes)", "pass label_names naming every "
                                "class id, in order")
        return names[int(label)] if names else str(int(label))

    def group(self, split: str | None, j: Any, it: Any) -> str:
        """The example's unit of leakage: `group_of(position, item)`, else its position."""
        return str(self.group_of(j, it) if self.group_of else (f"{split}-{j}" if split else j))

    def load_examples(self) -> list[dict]:
        """Map-style splits: one example per item, its id the position in `index`."""
        rows = []
        for i, (split, j) in enumerate(self.index):
            ex = {"id": i, "group": self.group(split, j, self.raw(i) if self.group_of else None)}
            if split:
                ex["split"] = split
            if self.target.named_classes:
                ex["label"] = self.class_name(self.item(i)[LABELS], f"dataset item {i}")
            rows.append(ex)
        return rows

    def read(self, split: str | None, data: Any) -> Iterator[dict]:
        """A split's examples in order, read lazily, each carrying its item; an item whose
        fields differ from the first item's is named with its position."""
        pairs = data.items() if isinstance(data, Stream) else \
            ((j, self.at(split, j)) for j in range(len(data)))
        for j, it in pairs:
            where = f"the {split + ' ' if split else ''}dataset's item {j}"
            given = as_dict(it, self.fields, where)
            if list(given) != list(self.first):
                raise WorkbookError(f"{where} has the fields {list(given)}, not the first "
                                    f"item's {list(self.first)}: the items change structure",
                                    "give every item the same structure: the same tuple "
                                    "length or dict keys")
            ex = {"id": f"{split}-{j}" if split else j, "item": it,
                  "group": self.group(split, j, it)}
            if split:
                ex["split"] = split
            if self.target.named_classes:
                ex["label"] = self.class_name(self.tensors(it, where)[LABELS], where)
            yield ex

    def load_stream(self) -> Iterator[dict]:
        """Every split read in turn, one item of each at a time, so the first examples of
        each split come without reading the others whole."""
        readers = [self.read(split, data) for split, data in self.splits.items()]
        while readers:
            for reader in list(readers):
                ex = next(reader, None)
                if ex is None:
                    readers.remove(reader)
                else:
                    yield ex

    def encode(self, ex: dict) -> dict[str, Tensor]:
        if "item" in ex:  # read from a stream: never indexed
            return self.tensors(ex["item"], f"dataset item {ex['id']}")
        return self.item(ex["id"])

    # -- the batch structure -------------------------------------------------------------------

    def collate(self, batch: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        """The user's collate_fn over the items (as tuples when the dataset's are), named."""
        names = [*self.inputs, LABELS]
        given = [tuple(b[k] for k in names) for b in batch] if self.tuple_items else batch
        out = as_dict(self.user_collate(given), names if self.tuple_items else None,
                      "the collated batch")
        return dict(out)

    # -- the loss and what people read ---------------------------------------------------------

    def loss(self, outputs: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The criterion per target: (sum, count), padding copies and ignored targets
        weighing 0; a weighted criterion counts its targets' weights."""
        labels, each = batch[LABELS], self.each
        keep = contributes(labels)  # padding copies (-100 / NaN) and ignored targets weigh 0
        if self.target.float_targets:
            losses = each(outputs.reshape(labels.shape), torch.where(keep, labels, 0.0))
            return torch.where(keep, losses, 0.0).sum(), keep.sum().to(losses.dtype)
        clean = torch.where(keep, labels, 0)
        losses = torch.where(keep, each(outputs, clean), 0.0)
        if self.weight is not None:  # a weighted mean divides by the targets' weights
            return losses.sum(), (self.weight.to(labels.device)[clean] * keep).sum()
        return losses.sum(), keep.sum()

    def decode(self, ids: Any) -> str:
        """Class ids as their names, or regression targets as numbers."""
        if self.target.named_classes:
            names = self.label_names
            return ", ".join(names[int(i)] if 0 <= int(i) < len(names) else f"<{int(i)}?>"
                             for i in ids)
        return ", ".join(f"{float(v):.3g}" for v in ids)

    def task(self) -> Task:
        fields, named = dict(self.task_fields), self.target.named_classes
        if self.each is not None:
            fields["loss"] = self.loss
        if None not in self.splits:
            fields.setdefault("split_of", split_of)
        if named:  # each split's own numbering (ImageFolder's class_to_idx), for 01
            fields["class_maps"] = {**class_maps.of_datasets(self.splits),
                                    **(fields.get("class_maps") or {})}
        decode = fields.pop("decode", None) or self.decode
        return Task(name=self.name, kind=self.kind,
                    load_examples=self.load_stream if self.streamed else self.load_examples,
                    encode=self.encode, collate=self.collate,
                    build_model=self.build_model, decode=decode, model_inputs=self.inputs,
                    label_names=self.label_names if named else None,
                    label_field="label" if named else None, **fields)


def split_of(ex: dict) -> str:
    """The split a framework's own datasets put the example in."""
    return ex["split"]


def from_torch(dataset: Any, build_model: Callable[[], nn.Module], criterion: Any, *,
               name: str, kind: str = "classification", collate_fn: Callable | None = None,
               fields: Sequence[str] | None = None, group_of: Callable[[int, Any], Any] | None
               = None, label_names: list[str] | None = None, **task_fields: Any) -> Task:
    """A Task over a `dataset` (items: dicts with 'labels', or (inputs..., labels) tuples
    named by `fields`) - map-style, or iterable (a torch `IterableDataset`, any re-iterable),
    read lazily: each example carries its item and its position is its id, and a classifier's
    classes need `label_names` - the user's `collate_fn` (default: torch's `default_collate`),
    model factory and criterion (`reduction="mean"` or `"sum"`, as you train with it: the task's
    loss is its sum over targets with their number, so every batch is normalised over the whole
    update). `dataset` may also be a dict of splits ({"train": ..., "validation": ...,
    "test": ...}, a framework's own datasets); one dataset is split by group. `group_of(index,
    item)` names each example's group, the unit of leakage (default: the index - say what
    leaks: patient, document, source image). Classification labels are class ids; `label_names`
    (default: the ids seen) name them. Generation (token ids in, token ids as labels, -100
    where nothing is learned) needs `decode` and takes `criterion=None` for the task's token
    cross-entropy. Other Task fields (`lr`, `build_optimizer`, `train_step`, `save_state`,
    ...) pass through."""
    return TorchAdapter(dataset, build_model, criterion, name=name, kind=kind,
                        collate_fn=collate_fn, fields=fields, group_of=group_of,
                        label_names=label_names, **task_fields).task()

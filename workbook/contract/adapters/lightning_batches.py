"""The structure of a Lightning loader's items and batches (`BatchShape`): flattened to the
pilot's {name: tensor} and built back for the module's steps, and the fields its forward takes."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Sequence

import torch
from torch import nn

from ...base.errors import WorkbookError
from ..outputs import accepted
from .torch import LABELS, Stream


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The structure of an item or a batch: a leaf (named), or a tuple, list or dict of
    shapes. The pilot's batches are flat {name: tensor}; the module's steps get the
    structure back."""

    form: str  # "leaf", "tuple", "list", "dict"
    name: str = ""
    parts: tuple = ()  # shapes (tuple, list) or (key, shape) pairs (dict)

    def names(self) -> list[str]:
        if self.form == "leaf":
            return [self.name]
        shapes = [s for _, s in self.parts] if self.form == "dict" else list(self.parts)
        return [n for s in shapes for n in s.names()]

    def flatten(self, obj: Any, where: str) -> dict[str, Any]:
        if self.form == "leaf":
            return {self.name: obj}
        if self.form == "dict":
            if not isinstance(obj, dict) or list(obj) != [k for k, _ in self.parts]:
                raise _structure_changed(where, self, obj)
            return {n: v for k, s in self.parts for n, v in s.flatten(obj[k], where).items()}
        if not isinstance(obj, (tuple, list)) or len(obj) != len(self.parts):
            raise _structure_changed(where, self, obj)
        return {n: v for s, o in zip(self.parts, obj, strict=True)
                for n, v in s.flatten(o, where).items()}

    def build(self, flat: dict[str, Any]) -> Any:
        if self.form == "leaf":
            return flat[self.name]
        if self.form == "dict":
            return {k: s.build(flat) for k, s in self.parts}
        built = [s.build(flat) for s in self.parts]
        return tuple(built) if self.form == "tuple" else built


def _structure_changed(where: str, shape: BatchShape, obj: Any) -> WorkbookError:
    return WorkbookError(f"{where} is a {type(obj).__name__} of another structure than the "
                         f"first one (fields {shape.names()})", "give every item (and every "
                         "batch) the same structure: the same tuple length or dict keys")


def _paths(obj: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _paths(v, (*path, str(k)))]
    if isinstance(obj, (tuple, list)):
        return [p for i, v in enumerate(obj) for p in _paths(v, (*path, str(i)))]
    return [path]


def shape_of(obj: Any, fields: Sequence[str] | None, where: str) -> BatchShape:
    """The structure of `obj` with its leaves named: by `fields` in order (depth first) when
    given for a tuple or list, by their keys (joined by '.') in a dict, and a flat pair by
    from_torch's default ('inputs', 'labels')."""
    paths = _paths(obj)
    if isinstance(obj, dict) and not fields:
        names = [".".join(p) for p in paths]
    elif fields:
        names = list(fields)
        if len(names) != len(paths):
            raise WorkbookError(f"{where} has {len(paths)} fields but fields= names "
                                f"{len(names)} ({names})", "give one name per element (depth "
                                "first), the target named 'labels'")
    elif isinstance(obj, (tuple, list)) and len(obj) == 2 and len(paths) == 2:
        names = ["inputs", LABELS]
    else:
        raise WorkbookError(f"{where} is a {type(obj).__name__} of {len(paths)} fields and "
                            "which one is the target is unknown",
                            "name every element in order, the target 'labels': e.g. "
                            "fields=('x', 'labels', 'w') for (x, y, sample_weight)")
    if len(set(names)) != len(names):
        raise WorkbookError(f"the fields of {where} repeat a name ({names})",
                            "give every element its own name")
    leaves = iter(names)

    def build(o: Any) -> BatchShape:
        if isinstance(o, dict):
            return BatchShape("dict", parts=tuple((k, build(v)) for k, v in o.items()))
        if isinstance(o, (tuple, list)):
            return BatchShape("tuple" if isinstance(o, tuple) else "list",
                          parts=tuple(build(v) for v in o))
        return BatchShape("leaf", next(leaves))
    return build(obj)


class FlatItems(torch.utils.data.Dataset):
    """A dataset whose items are the user's items flattened to {name: leaf}."""

    def __init__(self, data: Any, shape: BatchShape, split: str):
        self.data, self.shape, self.split = data, shape, split

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.shape.flatten(self.data[i], f"the {self.split} dataset's item {i}")


class FlatStream(torch.utils.data.IterableDataset):
    """A `Stream` whose items are the user's items flattened to {name: leaf}, read in turn;
    an item of another structure than the first is named with its position."""

    def __init__(self, stream: Stream, shape: BatchShape, split: str):
        self.stream, self.shape, self.split = stream, shape, split

    def __iter__(self) -> Any:
        for i, item in self.stream.items():
            yield self.shape.flatten(item, f"the {self.split} dataset's item {i}")


def flat_items(data: Any, shape: BatchShape, split: str) -> torch.utils.data.Dataset:
    """A split's items flattened: indexed (a map-style dataset) or read in turn (a Stream)."""
    return FlatStream(data, shape, split) if isinstance(data, Stream) else \
        FlatItems(data, shape, split)


def model_inputs_of(probe: nn.Module, names: list[str], dict_batch: bool) -> tuple[str, ...]:
    """The batch fields the module's forward takes: by name for a dict batch, the first ones
    (as many as forward's positional arguments) for a tuple."""
    candidates = [n for n in names if n != LABELS]
    params = [p for name, p in inspect.signature(type(probe).forward).parameters.items()
              if name != "self"]
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params) or not candidates:
        return tuple(candidates)
    if dict_batch:
        takes = accepted(type(probe).forward)
        taken = [n for n in candidates if "**" in takes or n in takes]
        return tuple(taken or candidates[:1])
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return tuple(candidates[:max(len(positional), 1)])

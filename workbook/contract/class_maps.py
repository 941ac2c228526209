"""The class maps (class name -> id) a task's own objects carry: a dataset's `class_to_idx` or
`classes` (torchvision's ImageFolder/DatasetFolder, CIFAR, MNIST), a `datasets` ClassLabel's
names, a model config's `id2label`, a module's `label_names` - read through the wrappers that
hold a dataset (a `Subset`'s or a loader's `.dataset`, an adapter's `.data`). Adapters record
the datasets' maps per split in `Task.class_maps`; notebook 01 checks they agree."""

from __future__ import annotations

import os
import re
from typing import Any

WRAPPED = ("dataset", "data", "stream")  # attributes that hold the dataset a wrapper reads
LABEL_COLUMNS = ("label", "labels", "label_ids")
DEFAULT_LABEL = re.compile(r"LABEL_\d+")  # transformers' id2label when none was given


class ClassMap(dict):
    """{class name: id}, with where it was read (`where`: "val/" for a class folder) and
    whether each class is a folder there (an ImageFolder's root)."""

    def __init__(self, ids: dict[str, int], where: str, folders: bool = False):
        super().__init__(ids)
        self.where, self.folders = where, folders


def _names_in_order(names: Any) -> dict[str, int] | None:
    if isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names):
        return {n: i for i, n in enumerate(names)}
    return None


def _own_map(obj: Any, what: str, label_column: str | None) -> ClassMap | None:
    """The map `obj` itself carries, or None."""
    try:
        given = getattr(obj, "class_to_idx", None)
        if isinstance(given, dict) and given and all(
                isinstance(k, str) and isinstance(v, int) for k, v in given.items()):
            root = getattr(obj, "root", None)
            if isinstance(root, (str, os.PathLike)):
                return ClassMap(given, f"{os.path.basename(os.fspath(root).rstrip('/'))}/",
                                folders=True)
            return ClassMap(given, f"{what}'s class_to_idx")
        ids = _names_in_order(getattr(obj, "classes", None))
        if ids:
            return ClassMap(ids, f"{what}'s classes")
        features = getattr(obj, "features", None)
        if isinstance(features, dict):
            for column in ([label_column] if label_column else []) + list(LABEL_COLUMNS):
                ids = _names_in_order(getattr(features.get(column), "names", None))
                if ids:
                    return ClassMap(ids, f"{what}'s ClassLabel names ({column!r})")
    except Exception:  # a user's property that raises: no map read, nothing judged
        return None
    return None


def of_dataset(data: Any, what: str, label_column: str | None = None,
               depth: int = 4) -> ClassMap | None:
    """The class map of a dataset or of the dataset a wrapper holds; None when it has none."""
    seen: set[int] = set()
    todo = [data]
    for _ in range(depth):
        nested = []
        for obj in todo:
            if obj is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            found = _own_map(obj, what, label_column)
            if found is not None:
                return found
            for attr in WRAPPED:
                try:
                    nested.append(getattr(obj, attr, None))
                except Exception:
                    continue
        todo = nested
    return None


def of_datasets(splits: dict[Any, Any], label_column: str | None = None) -> dict[str, ClassMap]:
    """{split: map} of the named splits whose datasets carry one."""
    maps = {}
    for split, data in splits.items():
        if split is None or data is None:
            continue
        found = of_dataset(data, f"the {split} dataset", label_column)
        if found is not None:
            maps[str(split)] = found
    return maps


def of_model(model: Any) -> list[tuple[str, ClassMap]]:
    """(what, map) of the maps a model carries: its config's `id2label` (unless transformers'
    default LABEL_i names) and a `label_names` attribute (a Lightning module's)."""
    maps = []
    config = getattr(model, "config", None)
    id2label = getattr(config, "id2label", None)
    if isinstance(id2label, dict) and id2label:
        try:
            ids = {str(name): int(i) for i, name in id2label.items()}
        except (TypeError, ValueError):
            ids = {}
        if ids and not all(DEFAULT_LABEL.fullmatch(n) for n in ids):
            maps.append(("the model config's id2label", ClassMap(ids, "id2label")))
    own = _names_in_order(getattr(model, "label_names", None))
    if own:
        maps.append((f"{type(model).__name__}.label_names", ClassMap(own, "label_names")))
    return maps

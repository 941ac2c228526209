"""The target kinds, one module each: what a kind decides (its default loss and metrics, what a
target is and how it is counted, the expected initial loss, 02's reproduction rule, 01's
per-kind statistics) lives in its `Kind` object. No module outside this folder tests a kind's
name. A new kind: one module here with a `Kind` subclass, added to `KINDS`."""

from __future__ import annotations

from ...base.errors import WorkbookError
from .base import Kind
from .classification import Classification
from .generation import Generation
from .policy import Policy
from .preference import Preference
from .ranking import Ranking
from .regression import Regression
from .token_classification import TokenClassification

KINDS: dict[str, Kind] = {k.name: k for k in (Generation(), Classification(), Regression(),
                                              TokenClassification(), Preference(),
                                              Policy(), Ranking())}


def of(name: str) -> Kind:
    """The kind named `name`, or the error listing the kinds there are."""
    try:
        return KINDS[name]
    except (KeyError, TypeError):
        raise WorkbookError(f"`kind` must be one of {tuple(KINDS)}, got {name!r}",
                            "set the task's kind to the kind of its targets") from None


__all__ = ["KINDS", "Kind", "of"]

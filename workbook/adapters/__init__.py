"""Adapters: the code a user already has turned into a `workbook.Task`, one file per framework
(`from_torch`: a plain `Dataset`, `collate_fn`, model and criterion). Each runs the user's own
pieces, so every notebook checks them rather than a hand translation, and refuses what it cannot
map with the piece named."""

from .torch import from_torch

__all__ = ["from_torch"]

"""Adapters: the code a user already has turned into a `workbook.Task`, one file per framework
(`from_torch`: a plain `Dataset`, `collate_fn`, model and criterion; `from_hf`: a Hugging Face
Trainer's pieces, needs `transformers`; `from_lightning`: a LightningModule and its
LightningDataModule, needs `lightning`; `from_trainer`: the Trainer or TRL SFTTrainer a script
builds, read through `from_hf`; `from_accelerate`: an Accelerate loop's factories, DataLoaders
and loop body, needs `accelerate`). Each runs the user's own
pieces, so every notebook checks them rather than a hand translation, and refuses what it cannot
map with the piece named."""

from .accelerate import from_accelerate
from .hf import from_hf
from .lightning import from_lightning
from .torch import from_torch
from .trainer import from_trainer

__all__ = ["from_accelerate", "from_hf", "from_lightning", "from_torch", "from_trainer"]

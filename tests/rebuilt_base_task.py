"""A fine-tune in the idiom of an adapter over a pretrained base: the base (embeddings, output
head) is frozen and built by a factory that reads the environment (`ADDED_TOKENS`: tokens
added to the vocabulary), and save_state/restore_state keep only what trains, as an adapter's
checkpoint does. `forget_model`: a restore_state that brings back the optimizer only."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from workbook import tokenizer as tok
from workbook.samples import generation
from workbook.samples.models import TinyDecoder

ADDED = "ADDED_TOKENS"


def build_model() -> torch.nn.Module:
    model = TinyDecoder(tok.VOCAB_SIZE + int(os.environ.get(ADDED, "0")), 32, 1, 4, 64)
    for module in (model.embed, model.pos, model.head):
        module.requires_grad_(False)
    return model


def save_state(folder: Path, objects: dict) -> None:
    model = objects["model"]
    trained = {k: v for k, v in model.state_dict().items()
               if dict(model.named_parameters()).get(k, v).requires_grad}
    torch.save({"adapter": trained, "optimizer": objects["optimizer"].state_dict(),
                "scheduler": objects["scheduler"].state_dict()}, Path(folder) / "adapter.pt")


def make_restore(forget_model: bool):
    def restore_state(folder: Path, objects: dict) -> None:
        state = torch.load(Path(folder) / "adapter.pt", weights_only=True)
        if not forget_model:
            objects["model"].load_state_dict(state["adapter"], strict=False)
        objects["optimizer"].load_state_dict(state["optimizer"])
        objects["scheduler"].load_state_dict(state["scheduler"])
    return restore_state


def task(forget_model: bool = False):
    return dataclasses.replace(generation.make_task(max_length=32), name="adapter-over-base",
                               build_model=build_model, save_state=save_state,
                               restore_state=make_restore(forget_model))

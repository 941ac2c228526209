"""What every launch of notebook 09 runs, shared by the DDP launch (`replica.ReplicaSpec`) and
the FSDP launch (`sharded_replica.ShardedSpec`): the task, the update shape, the data, the
budget and the collectives' time limit; passed as JSON on the command line (never read from a
folder) and checked against its schema (`schemas.LaunchSpec`, `schemas.ShardedSpec`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from ..base.errors import WorkbookError
from ..contract.shape import UpdateShape
from ..storage import schemas
from .loop import TrainConfig

S = TypeVar("S", bound="LaunchBase")


@dataclass
class LaunchBase:
    """The settings both launches share; a subclass adds its own, names its settings in
    errors (`what`) and its schema (`schema`)."""

    # class attributes, not fields: the settings as errors name them, and the schema a spec
    # given as JSON is checked against
    what = "launch settings"
    schema = schemas.LaunchBase

    task: str
    task_options: dict = field(default_factory=dict)
    shape: UpdateShape = UpdateShape(2, 2, replicas=2)  # replicas: the processes launched
    updates: int = 10
    lr: float = 1e-3
    seed: int = 0
    train_limit: int = 32  # examples of the training split (0: all)
    validation_limit: int = 0
    eval_batch: int = 8
    drop_partial: bool = False
    checkpoint_at: int = 0  # the update after which the ranks checkpoint (0: none)
    device: str = "cpu"
    collective_timeout_s: float = 120.0  # a rank waiting longer on the others raises

    @classmethod
    def from_dict(cls: type[S], data: Any) -> S:
        """A spec given as JSON back: unknown settings and shape fields are named, then every
        value is checked against the class's schema."""
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or not isinstance(data.get("task"), str):
            raise WorkbookError(f"the {cls.what} must be an object with a 'task' path, got "
                                f"{str(data)[:80]!r}", 'give --spec \'{"task": "pkg.mod:attr", '
                                '...}\'')
        unknown = sorted(set(data) - known)
        if unknown:
            raise WorkbookError(f"unknown {cls.what} {unknown}", f"use {sorted(known)}")
        shape = UpdateShape.from_dict(data.get("shape", {}))  # names unknown shape fields
        schemas.check(cls.schema, data, "--spec", "launch spec",
                      "give --spec with values of the right types")
        return cls(**{**data, "shape": shape})

    def train_config(self) -> TrainConfig:
        """The loop's configuration each process trains with."""
        return self.shape.train_config(
            updates=self.updates, lr=self.lr, seed=self.seed, device=self.device,
            drop_partial=self.drop_partial, eval_batch=self.eval_batch)

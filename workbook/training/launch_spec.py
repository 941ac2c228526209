"""What every launch of notebook 09 runs, shared by the DDP launch (`replica.ReplicaSpec`) and
the FSDP launch (`sharded_replica.ShardedSpec`): the task, the update shape, the data, the
budget and the collectives' time limit; passed as JSON on the command line (never read from a
folder) and checked against the schema derived from the class's own fields
(`schemas.derived`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..contract.data import Prepared, prepare
from ..contract.shape import UpdateShape
from ..storage import schemas
from ..storage.schemas import (
    Count,
    Index,
    Name,
    Options,
    Positive,
    Seed,
    StrictBool,
    StrictStr,
)
from .loop import TrainConfig, seed_everything

S = TypeVar("S", bound="LaunchBase")


@dataclass
class LaunchBase:
    """The settings both launches share; a subclass adds its own and names its settings in
    errors (`what`). A spec given as JSON is checked against the schema derived from the
    class's fields (their annotations are the schema's types)."""

    what = "launch settings"  # a class attribute, not a field

    task: Name
    task_options: Options = field(default_factory=dict)
    shape: UpdateShape = UpdateShape(2, 2, replicas=2)  # replicas: the processes launched
    updates: Count = 10
    lr: Positive = 1e-3
    seed: Seed = 0
    train_limit: Index = 32  # examples of the training split (0: all)
    validation_limit: Index = 0
    eval_batch: Count = 8
    drop_partial: StrictBool = False
    checkpoint_at: Index = 0  # the update after which the ranks checkpoint (0: none)
    device: StrictStr = "cpu"
    collective_timeout_s: Positive = 120.0  # a rank waiting longer on the others raises

    @classmethod
    def from_dict(cls: type[S], data: Any) -> S:
        """A spec given as JSON back, checked against the class's schema (unknown settings and
        shape fields named, every value of its type and range)."""
        return schemas.built(cls, data, cls.what, "give --spec with values of the right types")

    def train_config(self) -> TrainConfig:
        """The loop's configuration each process trains with."""
        return TrainConfig(
            self.shape, updates=self.updates, lr=self.lr, seed=self.seed, device=self.device,
            drop_partial=self.drop_partial, eval_batch=self.eval_batch)

    def prepared(self, task: Any) -> tuple[Prepared, TrainConfig]:
        """The task's data as every rank encodes it (seeded alike: the same tensors, a random
        augmentation too) and the loop's configuration, checked against its training split."""
        seed_everything(self.seed)
        data = prepare(task, limits={"train": self.train_limit,
                                     "validation": self.validation_limit})
        return data, self.train_config().validate(len(data.train))

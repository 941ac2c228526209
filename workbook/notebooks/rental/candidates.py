"""Notebook 08's candidates: the configurations to rent for (a named plan and how it spreads
over GPUs), read from the notebook's parameters and checked."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...base.errors import WorkbookError
from ...training import sharding
from ...training.loop import UpdateShape
from ...training.predict import Plan
from ..parameters import CandidateSpec


@dataclass
class Candidate:
    """One configuration to rent for: a named plan and the result it is meant to produce, and
    how it spreads over GPUs (`strategy`): "single" (one GPU), "ddp" (data parallel, one whole
    copy of the model per GPU, `plan.shape.replicas` GPUs) or "fsdp" (FSDP2 full sharding over
    `world` GPUs, 2..64, `gpus_per_node` per node; no `world`: every count of
    `sharding.WORLDS` is sized and each GPU type gets the smallest that fits). Under fsdp
    micro_batch x accumulation is the whole update, split evenly over the GPUs
    (`sharding.per_gpu_split`), so every count trains the same experiment; `offload_optimizer`
    keeps the sharded state in host memory (FSDP2 CPUOffloadPolicy)."""

    name: str
    plan: Plan
    expected: str = ""
    strategy: str = ""  # "" : "single" or "ddp" by the plan's replicas
    world: int | None = None
    gpus_per_node: int = 8
    offload_optimizer: bool = False

    @property
    def parallelism(self) -> str:
        """How the update is spread: \"single\", \"ddp\" or \"fsdp\"."""
        if self.strategy:
            return self.strategy
        return "single" if self.plan.shape.replicas == 1 else "ddp"

    def label(self, world: int | None = None) -> str:
        """The strategy in words, as the sheet's `strategy` column shows it."""
        if self.parallelism == "fsdp":
            world = world or self.world
            nodes = sharding.nodes(world, self.gpus_per_node) if world else None
            return (f"FSDP2 full sharding x{world or 'N'}" +
                    (f" ({nodes} nodes of {self.gpus_per_node})" if nodes and nodes > 1
                     else "") + (" + optimizer offload" if self.offload_optimizer else ""))
        replicas = self.plan.shape.replicas
        return "single device" if replicas == 1 else f"data parallel x{replicas}"

    def described(self, gpu: str, gib: float, world: int | None = None,
                  shape: UpdateShape | None = None) -> dict:
        """The first columns of its selection-sheet row on `gpu` (`world` GPUs, each making
        `shape`'s micro-batches, for fsdp)."""
        shape = shape or self.plan.shape
        count = world if self.parallelism == "fsdp" else shape.replicas
        return {"candidate": self.name, "gpu": gpu, "gpu_memory_gib": gib,
                "precision": shape.precision, "micro_batch": shape.micro_batch,
                "accumulation": shape.accumulation,
                "activation_checkpointing": shape.activation_checkpointing,
                "strategy": self.label(world), "gpus": count,
                "nodes": sharding.nodes(count, self.gpus_per_node) if count else None,
                "max_length": self.plan.length,
                "examples_per_update": shape.micro_batch * shape.accumulation * (count or 1)}


def same_update(a: Candidate, b: Candidate) -> bool:
    """Whether two candidates train the same experiment: the same examples per update, the
    precision and the length (how they are spread over GPUs aside)."""
    sa, sb = a.plan.shape, b.plan.shape
    return (sa.examples_per_update, sa.precision, a.plan.length) == \
        (sb.examples_per_update, sb.precision, b.plan.length)


def candidates_from(specs: list[CandidateSpec]) -> list[Candidate]:
    """Candidates from the notebook's `candidates`, records its parameter model checked
    (`parameters.CandidateSpec`: keys, types, ranges; precision bf16 unless given), each
    checked by the rule across its fields (`check_strategy`)."""
    out = []
    for spec in specs:
        shape = UpdateShape(**{"precision": "bf16", **{k: v for k, v in spec.items()
                                                       if k in UpdateShape.__dataclass_fields__}})
        cand = Candidate(spec["name"], Plan(shape, spec.get("length"), spec.get("eval_batch")),
                         spec.get("expected", ""), spec.get("strategy", ""), spec.get("world"),
                         spec.get("gpus_per_node", 8), spec.get("offload_optimizer", False))
        check_strategy(cand)
        out.append(cand)
    return out


def check_strategy(cand: Candidate) -> None:
    """A candidate's strategy and its settings agree, named when they do not."""
    strategy, replicas = cand.parallelism, cand.plan.shape.replicas
    found = [problem for broken, problem in (
        (strategy == "single" and replicas != 1,
         f"strategy single with replicas={replicas} (that is ddp)"),
        (strategy == "ddp" and replicas < 2, "strategy ddp needs replicas of 2 or more"),
        (strategy == "fsdp" and replicas != 1,
         f"strategy fsdp with replicas={replicas}: under FSDP every GPU of the world is a "
         "data-parallel rank; give the GPU count as world"),
        (strategy != "fsdp" and (cand.world is not None or cand.offload_optimizer),
         "world and offload_optimizer belong to strategy fsdp")) if broken]
    if found:
        raise WorkbookError(f"candidate {cand.name!r}: " + "; ".join(found),
                            'e.g. {"name": "sharded", "strategy": "fsdp", "micro_batch": 2, '
                            '"accumulation": 16, "activation_checkpointing": True} (world '
                            "2..64, or none: the smallest that fits each GPU)")


def sharded_default(first: Candidate, why: str = "no candidate fits one GPU") -> Candidate:
    """The fsdp candidate added for a campaign model (`why`: no candidate fits one GPU, or the
    strategies compared): the first candidate's update
    (the same examples per update and precision) sharded over the smallest world that fits
    each GPU, micro-batches of at most 2 per GPU (padded, as a campaign's are) and activation
    checkpointing."""
    shape = first.plan.shape
    total = shape.examples_per_update
    micro = min(2, shape.micro_batch) if total % 2 == 0 else 1
    return Candidate(
        "sharded", Plan(replace(shape, micro_batch=micro, accumulation=total // micro,
                                replicas=1, activation_checkpointing=True),
                        first.plan.length, first.plan.eval_batch, first.plan.eval_length),
        f"the update of candidate {first.name} ({total} examples) sharded over N GPUs with "
        f"FSDP2 and activation checkpointing: added because {why}", "fsdp")

"""FSDP2 sizing on fake tensors over a fake process group (training/sharding.py): the sharded state
shrinks as 1/N and activations do not, worlds derived from one run agree with direct runs, the
campaign model is never allocated, and bad input is named."""

import resource

import pytest
import torch
from torch import nn

from workbook import WorkbookError
from workbook.training import sharding
from workbook.training.loop import UpdateShape
from workbook.training.predict import Plan, predict
from workbook.training.sharding import CHECKPOINT_SAVE, SHARDED_PHASES, predict_sharded

PLAN = Plan(UpdateShape(4, 2, precision="fp32"), length=64, eval_batch=4)


@pytest.fixture(scope="module")
def small(gen_items):
    return gen_items["train"][:40], gen_items["validation"][:8]


@pytest.fixture(scope="module")
def derived(gen_task, small):
    """One fake run at 2 GPUs: exact there, world 4 derived from it."""
    return sharding.predict_sharded_worlds(gen_task, *small, PLAN, (2, 4), at=2)


@pytest.fixture(scope="module")
def worlds(gen_task, small, derived):
    """Each world's prediction from a run at that world: 2 the run `derived` made, 4 its own."""
    return {2: derived[derived.world == 2].set_index("phase"),
            4: predict_sharded(gen_task, *small, PLAN, 4).set_index("phase")}


def test_sharded_state_shrinks_as_one_over_n_and_activations_do_not(gen_task, small, worlds):
    single = predict(gen_task, *small, PLAN).set_index("phase")
    two, four = worlds[2], worlds[4]
    assert list(two.index) == list(SHARDED_PHASES) and (two.world == 2).all()
    state = {w: f.loc["update (first)", "breakdown"]["sharded_state"] for w, f in worlds.items()}
    # parameters, gradients and optimizer state of one device, sharded over 2 and over 4
    full = single.loc["update (later)", ["parameter_bytes", "gradient_bytes",
                                          "optstate_bytes"]].sum()
    steady = {w: f.loc[CHECKPOINT_SAVE, "breakdown"]["sharded_state"] for w, f in worlds.items()}
    assert steady[2] == pytest.approx(2 * steady[4], rel=0.02)
    assert steady[2] == pytest.approx((single.loc["validation", "parameter_bytes"] +
                                       single.loc["validation", "optstate_bytes"]) / 2, rel=0.02)
    assert state[2] == pytest.approx(2 * state[4], rel=0.05) and state[2] < full
    # activations are every rank's own: the forward's peak hardly moves with N, and matches
    # the single device's less the state it does not hold
    act = {w: f.loc["forward + loss", "breakdown"]["activations"] for w, f in worlds.items()}
    assert act[2] == act[4]
    assert act[2] == pytest.approx(single.loc["forward + loss", "activation_bytes"], rel=0.02)
    assert four.loc["update (first)", "predicted_peak_bytes"] < \
        two.loc["update (first)", "predicted_peak_bytes"] < \
        single.loc["update (first)", "predicted_peak_bytes"]


def test_a_world_derived_from_one_run_matches_the_direct_run(derived, worlds):
    four = derived[derived.world == 4].set_index("phase")
    for phase in SHARDED_PHASES:
        assert four.loc[phase, "predicted_peak_bytes"] == pytest.approx(
            worlds[4].loc[phase, "predicted_peak_bytes"], rel=0.01), phase
    assert four.note.str.contains("derived from the fake run at 2 GPUs").all()


@pytest.mark.parametrize("world", [0, 1, 65, 2.0, True])
def test_a_world_outside_2_to_64_is_refused(gen_task, small, world):
    with pytest.raises(WorkbookError, match=r"FSDP full sharding is sized over 2 to 64 GPUs"):
        predict_sharded(gen_task, *small, PLAN, world)


def test_a_model_without_blocks_is_named(gen_task, small):
    import dataclasses

    class Flat(nn.Module):  # no ModuleList, no _no_split_modules: nothing to shard by block
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(gen_task.build_model().config.vocab_size
                                      if hasattr(gen_task.build_model(), "config") else 64, 8)
            self.out = nn.Linear(8, self.embed.num_embeddings)

        def forward(self, input_ids, **_):
            return self.out(self.embed(input_ids))

    flat = dataclasses.replace(gen_task, build_model=Flat)
    with pytest.raises(WorkbookError, match=r"needs blocks to shard one by one, and Flat"):
        predict_sharded(flat, *small, PLAN, 2)
    assert not torch.distributed.is_initialized(), "the fake process group is torn down"


def test_a_process_group_already_up_is_refused(gen_task, small):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(WorkbookError, match="a default process group is already"):
            predict_sharded(gen_task, *small, PLAN, 2)
    finally:
        dist.destroy_process_group()


def test_offload_leaves_the_sharded_state_in_host_memory(gen_task, small, worlds):
    off = predict_sharded(gen_task, *small, PLAN, 2, offload_optimizer=True).set_index("phase")
    first = off.loc["update (first)"]
    assert "sharded_state_in_host_memory" in first.breakdown
    assert first.predicted_peak_bytes < worlds[2].loc["update (first)", "predicted_peak_bytes"]
    assert "host memory" in first.note


def test_the_campaign_model_is_never_allocated(small):
    # a Llama of 0.7 B parameters (2.8 GiB of fp32 weights, 11 GiB with gradients and Adam) sized
    # over 8 fake ranks: the process grows by far less than one copy of its weights
    from examples.llama_campaign import make_task

    task = make_task(layers=2, width=4096, heads=32, kv_heads=8, ffn=11008, vocab=32000)
    from workbook.contract.data import prepare

    data = prepare(task, limits={"train": 20})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    frame = predict_sharded(task, data.train, data.validation,
                            Plan(UpdateShape(2, 2, precision="bf16"), 128, 2), 8)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    peak = frame.predicted_peak_bytes.max()
    assert frame.model.iloc[0] == "campaign model"
    assert peak > 2**30, "the prediction is of the big model"
    assert grown < 512 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB"


def test_an_update_splits_evenly_or_not_at_all():
    assert sharding.per_gpu_split(2, 16, 8) == (2, 2)
    assert sharding.per_gpu_split(16, 2, 4) == (8, 1)
    assert sharding.per_gpu_split(2, 16, 32) == (1, 1)
    assert sharding.per_gpu_split(2, 16, 64) is None
    assert sharding.nodes(16, 8) == 2 and sharding.nodes(4, 8) == 1


@pytest.fixture(scope="module")
def deep_llama():
    """A small Llama config 8 layers deep (a `campaign.Deep`: sized through sharded traces at 3
    and 4 layers) and its data. Its vocabulary is large next to a layer (as a 70 B Llama's
    root is next to what the optimizer's temporaries add per layer): the later update's peak
    moves from the end of the backward to the optimizer step between 4 and 8 layers, which a
    stretch carried by its largest operator at 3 and 4 layers misses (4.6% low in bf16 with
    checkpointing over 2 GPUs)."""
    from examples.llama_campaign import make_task
    from workbook.contract.data import prepare

    task = make_task(layers=8, width=512, heads=4, kv_heads=1, ffn=1792, vocab=8192,
                     positions=256)
    data = prepare(task, limits={"train": 12})
    return task, data.train, data.validation


def test_a_deep_campaign_model_is_sized_sharded_from_two_shallow_traces_to_the_byte(
        deep_llama, monkeypatch):
    # every phase's per-GPU peak and breakdown carried from sharded runs at 3 and 4 layers
    # equals the sharded fake run at the full depth (8), at the run's world (2) and at a world
    # derived from it (8). One configuration, the one whose traces hold the most: bf16
    # (MixedPrecisionPolicy) with checkpointing (each block's recompute in the backward), over
    # 2 GPUs, where the later update's peak moves past the backward's end (a carry of the
    # stretch by its largest operator is 4.6% low here, and 0% off in fp32 without
    # checkpointing over 8, the case this test also ran: the carry's arithmetic is the same for
    # every precision and world; the fp32 sharded run itself is the tests above, the fp32
    # carry to the byte on one device test_campaign.py's)
    from workbook.training import campaign

    world, other = 2, 8
    task, train, val = deep_llama
    plan = Plan(UpdateShape(2, 2, precision="bf16", activation_checkpointing=True), 32, 2)
    carried = sharding.sharded_run(task, train, val, plan, world)
    assert carried.sized == ("each operator's memory carried from sharded fake runs at 3 and 4 "
                             "layers to 8")
    with monkeypatch.context() as patch:  # the same task, its depth not carried: run at 8
        patch.setattr(campaign, "depth_of", lambda task: None)
        reference = sharding.sharded_run(task, train, val, plan, world)
    assert reference.sized == "run at its full depth"
    for w in (world, other):
        a, b = carried.at(w), reference.at(w)
        assert a.phase.tolist() == list(SHARDED_PHASES)
        assert a.predicted_peak_bytes.tolist() == b.predicted_peak_bytes.tolist(), w
        assert a.breakdown.tolist() == b.breakdown.tolist(), w
        assert a.note.tolist() == b.note.tolist()
    # and no phase is vacuous: each was carried, and its peak at 8 layers is above the one its
    # trace at 4 layers had
    for phase, data in carried.phases.items():
        four = max(sum(kinds) for _, kinds in data["carry"][1])
        assert four < data["peak"], phase

"""contract/pipeline.py: a task's own training pipeline read pass by pass as raw examples, its
data position taken and given back (its own state_dict, else count-and-skip), and every
malformed pipeline named with the fix before anything trains."""

import numpy as np
import pytest
import torch

from examples import token_stream as ts
from workbook import WorkbookError, load_task
from workbook.contract.pipeline import COUNT_AND_SKIP, OWN_STATE, DataPosition, open_pipeline

TASK = "examples.token_stream:task"


@pytest.fixture
def task(tmp_path):
    path = tmp_path / "stream.bin"
    np.array(np.arange(20_000) % 251, dtype=np.uint16).tofile(path)
    return load_task(TASK, data_file=str(path), block_size=16, n_layer=1, n_embd=32)


def ids(pipe, start=None, count=10):
    got = []
    for epoch, _, ex in pipe.read(start or DataPosition()):
        got.append(None if ex is None else (epoch, ex["id"]))
        if len(got) == count:
            return got
    return got


class Plain:
    """A pipeline without state_dict: the workbook counts and skips."""

    def __init__(self, inner):
        self.inner = inner

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)

    def __iter__(self):
        return iter(self.inner)


def test_the_position_comes_back_by_its_own_state_and_by_count_and_skip(task):
    for wrap, how in ((None, OWN_STATE), (Plain, COUNT_AND_SKIP)):
        if wrap is not None:
            own = task.train_pipeline
            task.train_pipeline = lambda seed, _wrap=wrap, _own=own, **kw: _wrap(_own(seed, **kw))
        pipe = open_pipeline(task, seed=3, micro_batch=2, limit=12)
        assert pipe.resumes_by == how
        first = pipe.read()
        head = [next(first) for _ in range(7)]
        position = pipe.position()
        rest = [next(first) for _ in range(12)]  # across the end of the 12-example pass
        assert position.epoch == 0 and position.examples == 7
        assert (position.state is not None) == (how == OWN_STATE)
        again = open_pipeline(task, seed=3, micro_batch=2, limit=12)
        assert [next(again.read(position)) for _ in range(1)] == rest[:1]
        fresh = open_pipeline(task, seed=3, micro_batch=2, limit=12).read(position)
        assert [next(fresh) for _ in range(12)] == rest
        assert rest[5] == (0, 12, None)  # the pass closed before the next one is read
        assert rest[6][0] == 1 and head[0][2]["id"] != rest[6][2]["id"]  # a new order


def test_count_and_skip_says_what_it_read_again(task):
    own = task.train_pipeline
    task.train_pipeline = lambda seed: Plain(own(seed))
    pipe = open_pipeline(task, seed=0)
    reader = pipe.read(DataPosition(1, 9))
    next(reader)
    assert pipe.skipped.examples == 9 and pipe.skipped.seconds >= 0


@pytest.mark.parametrize("returned, words", [
    (lambda seed: (x for x in []), "a generator, which gives one pass only"),
    (lambda seed: {"id": 1}, "not an iterable of raw examples"),
    (lambda seed: None, "not an iterable of raw examples"),
])
def test_what_is_not_a_pipeline_is_named(task, returned, words):
    task.train_pipeline = returned
    with pytest.raises(WorkbookError, match=words):
        open_pipeline(task, seed=0)


def test_a_factory_without_seed_is_named(task):
    task.train_pipeline = lambda rank=0: []
    with pytest.raises(WorkbookError, match="not `seed`"):
        open_pipeline(task, seed=0)


def test_collated_batches_and_foreign_splits_are_named(task):
    examples = [ex for ex in task.load_examples()][:64]
    task.train_pipeline = lambda seed: torch.utils.data.DataLoader(
        [{"id": i, "group": 0} for i in range(8)], batch_size=4)
    with pytest.raises(WorkbookError, match="(?s)collated batch.*batch_size=None"):
        next(open_pipeline(task, seed=0).read())
    validation = next(ex for ex in examples if task.split(ex) != "train")
    task.train_pipeline = lambda seed: [validation]
    with pytest.raises(WorkbookError, match="leaks it into the evaluation"):
        next(open_pipeline(task, seed=0).read())


def test_a_state_a_checkpoint_cannot_load_is_refused_when_taken(task):
    class NumpyState(Plain):
        def state_dict(self):
            return {"order": np.arange(3)}

        def load_state_dict(self, state):
            pass

    own = task.train_pipeline
    task.train_pipeline = lambda seed: NumpyState(own(seed))
    pipe = open_pipeline(task, seed=0)
    next(pipe.read())
    with pytest.raises(WorkbookError, match="(?s)weights_only=True.*no numpy arrays"):
        pipe.position()


def test_a_state_that_fails_to_load_is_named_before_anything_is_read(task):
    class Refuses(Plain):
        def state_dict(self):
            return {"position": 1}

        def load_state_dict(self, state):
            raise KeyError("shard")

    own = task.train_pipeline
    task.train_pipeline = lambda seed: Refuses(own(seed))
    with pytest.raises(WorkbookError, match="state failed to load: KeyError.*nothing was "
                       "trained"):
        next(open_pipeline(task, seed=0).read(DataPosition(0, 3, {"position": 3})))


def test_a_pipeline_that_raises_or_runs_dry_is_named_with_where(task):
    def failing(seed):
        class Source:
            def __iter__(self):
                yield from ({"id": i, "group": 0} for i in range(3))
                raise OSError("shard-00003.jsonl: unreadable")
        return Source()

    task.train_pipeline = failing
    task.split_of = lambda ex: "train"
    with pytest.raises(WorkbookError, match="raised OSError at position 3 of pass 0, after "
                       "example 2: shard-00003"):
        list(zip(range(10), open_pipeline(task, seed=0).read(), strict=False))
    task.train_pipeline = lambda seed: []
    with pytest.raises(WorkbookError, match="gave no examples in pass 0"):
        next(open_pipeline(task, seed=0).read())


def test_the_sample_pipeline_deals_ranks_and_workers_disjoint_shards(task):
    def first(count, **how):
        return [i for _, i in ids(open_pipeline(task, seed=0, **how), count=count)]

    ranks = [set(first(40, rank=r, world=2)) for r in (0, 1)]
    assert len(ranks[0]) == 40 and not ranks[0] & ranks[1]
    with_workers = first(40, workers=2)
    assert len(set(with_workers)) == 40  # two workers, no window twice
    assert ts.PIPELINE_BUGS[:6] == ("state_frozen", "epoch_guard", "lost_at_yield",
                                    "workers_replay", "ranks_same", "skip_in_batches")
    assert "" not in ts.PIPELINE_BUGS  # the clean stream is no bug


def test_a_pass_cut_at_its_limit_does_not_hand_its_state_to_the_next_pass(task):
    """datasets and torchdata take up a loaded state at the next iter, whatever its pass: a
    position at the end of a cut pass must start the next pass from its beginning."""
    class Pending:
        def __init__(self, rows):
            self.rows, self.at, self.pending = rows, 0, None

        def __iter__(self):
            start, self.pending = self.pending or 0, None
            for at in range(start + 1, len(self.rows) + 1):
                self.at = at
                yield self.rows[at - 1]

        def state_dict(self):
            return {"at": self.at}

        def load_state_dict(self, state):
            self.pending = state["at"]

    rows = [ex for ex in task.load_examples() if task.split(ex) == "train"][:40]
    task.train_pipeline = lambda seed: Pending(rows)
    pipe = open_pipeline(task, seed=0, limit=12)
    reader = pipe.read()
    for _ in range(12):
        next(reader)
    position = pipe.position()
    assert (position.examples, position.state) == (12, {"at": 12})
    resumed = ids(open_pipeline(task, seed=0, limit=12), position, count=3)
    assert resumed == [None, (1, rows[0]["id"]), (1, rows[1]["id"])]

"""examples/token_stream.py: a nanoGPT-style token stream (a flat uint16 file read through
np.memmap) as a Task. Windows and their shifted targets match the file, the examples come from
a generator that reads the file a chunk at a time, neighbouring windows share a group and a
split, each bad file is refused with a WorkbookError naming it and the fix, the prepared file
is written atomically, and the task loads, pickles and runs its GPT."""

import os
import pickle
import tracemalloc
import types

import numpy as np
import pytest
import torch

import workbook as wb
from examples import token_stream as ts
from workbook import WorkbookError, load_task

TASK = "examples.token_stream:task"


def write(path, ids) -> str:
    np.array(ids, dtype=np.uint16).tofile(path)
    return str(path)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """The prepared sample goes to this test's own folder."""
    folder = tmp_path / "cache"
    monkeypatch.setattr(ts, "CACHE_DIR", folder)
    return folder


@pytest.fixture
def tokens_file(tmp_path):
    """1,000 ids that differ from their neighbours' (id = position mod 251)."""
    return write(tmp_path / "stream.bin", np.arange(1000) % 251)


@pytest.mark.parametrize("n, block", [(1000, 16), (16 * 20 + 1, 16), (16 * 20, 16), (17, 16)])
def test_a_file_of_n_tokens_gives_n_minus_1_over_block_windows(tmp_path, n, block):
    path = write(tmp_path / "n.bin", np.arange(n) % 251)
    examples = list(load_task(TASK, data_file=path, block_size=block).load_examples())
    assert len(examples) == (n - 1) // block
    assert [ex["start"] for ex in examples] == [w * block for w in range(len(examples))]
    assert [ex["id"] for ex in examples] == list(range(len(examples)))


def test_windows_and_targets_line_up_with_the_memmap(tokens_file):
    task = load_task(TASK, data_file=tokens_file, block_size=16)
    ids = np.memmap(tokens_file, dtype=np.uint16, mode="r")
    for ex in list(task.load_examples())[::7]:
        item = task.encode(ex)
        x, y, i = item["input_ids"], item["labels"], ex["start"]
        assert x.dtype == y.dtype == torch.int64 and len(x) == len(y) == 16
        assert x.tolist() == ids[i:i + 16].tolist()
        assert y.tolist() == ids[i + 1:i + 17].tolist()
        assert y[:-1].tolist() == x[1:].tolist()  # y is x shifted by one
    batch = task.collate([task.encode(ex) for ex in list(task.load_examples())[:3]])
    assert batch["input_ids"].shape == batch["labels"].shape == (3, 16)
    assert bool(batch["attention_mask"].all())


def test_load_examples_is_a_generator_that_reads_a_chunk_at_a_time(tmp_path, monkeypatch):
    n, block, scan = 4096, 16, 256
    ids = np.arange(n) % 251
    ids[-1] = 300  # beyond the vocabulary, in the last token only
    path = write(tmp_path / "late.bin", ids)
    stream = ts.TokenStream(path, block, scan_tokens=scan)
    read: list[tuple[int, int]] = []
    check = ts.TokenStream.check_vocabulary
    monkeypatch.setattr(ts.TokenStream, "check_vocabulary",
                        lambda self, a, b: (read.append((a, b)), check(self, a, b))[1])
    examples = stream.examples()
    assert isinstance(examples, types.GeneratorType)
    assert read == []  # nothing is read before the first example is asked for
    assert next(examples) == {"id": 0, "group": 0, "start": 0}
    assert read == [(0, scan)]  # the first chunk only: the bad last id is not reached yet
    with pytest.raises(WorkbookError, match=r"id 300 at token 4095"):
        list(examples)
    assert all(b - a <= scan for a, b in read) and read[-1][1] == n


def test_the_memmap_is_never_copied_into_memory(tmp_path):
    n = 4_000_000  # 8 MB
    path = write(tmp_path / "big.bin", np.arange(n) % 251)
    task = load_task(TASK, data_file=path, block_size=64)
    tracemalloc.start()
    try:
        count = sum(1 for _ in task.load_examples())
        task.encode({"id": count - 1, "group": 0, "start": (count - 1) * 64})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == (n - 1) // 64
    assert peak < n * 2 / 8, f"{peak} bytes traced while reading a {n * 2}-byte file"


def test_groups_keep_neighbouring_windows_in_one_split(tokens_file):
    task = load_task(TASK, data_file=tokens_file, block_size=4, group_windows=16)
    examples = list(task.load_examples())
    assert [ex["group"] for ex in examples] == [w // 16 for w in range(len(examples))]
    splits = [task.split(ex) for ex in examples]
    assert len(set(splits)) == 3  # 250 windows, 16 groups: every split gets some
    for w in range(len(examples) - 1):
        if splits[w] != splits[w + 1]:
            assert (w + 1) % 16 == 0, f"windows {w} and {w + 1} of one group in two splits"


def test_a_size_that_is_not_whole_tokens_is_refused(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(np.arange(100, dtype=np.uint16).tobytes() + b"\x01")
    with pytest.raises(WorkbookError) as caught:
        list(load_task(TASK, data_file=str(path), block_size=16).load_examples())
    assert str(path) in caught.value.problem and "201 bytes" in caught.value.problem
    assert "np.uint16" in caught.value.fix


def test_a_file_shorter_than_one_window_is_refused(tmp_path):
    path = write(tmp_path / "short.bin", range(16))
    with pytest.raises(WorkbookError) as caught:
        list(load_task(TASK, data_file=path, block_size=16).load_examples())
    assert path in caught.value.problem and "16 tokens, fewer than one window" in \
        caught.value.problem
    assert "block_size" in caught.value.fix


def test_ids_beyond_the_vocabulary_are_refused(tmp_path):
    ids = np.arange(1000) % 251
    ids[500] = ts.VOCAB  # 259: one past the byte tokenizer's </s>
    path = write(tmp_path / "vocab.bin", ids)
    task = load_task(TASK, data_file=path, block_size=16)
    with pytest.raises(WorkbookError) as caught:
        wb.load_examples(task)  # the workbook passes the task's own error through
    assert path in caught.value.problem and f"id {ts.VOCAB} at token 500" in caught.value.problem
    assert "workbook.tokenizer" in caught.value.fix
    with pytest.raises(WorkbookError, match="beyond the model's vocabulary"):
        task.encode({"id": 31, "group": 1, "start": 31 * 16})  # encode checks its window too


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(WorkbookError, match="does not exist"):
        list(load_task(TASK, data_file=str(tmp_path / "none.bin")).load_examples())


def test_the_prepared_file_is_deterministic_and_the_sample_text(tmp_path):
    a, b = ts.prepare(tmp_path / "a.bin", 5000), ts.prepare(tmp_path / "b.bin", 5000)
    assert a.read_bytes() == b.read_bytes() and a.stat().st_size == 5000 * 2
    ids = np.memmap(a, dtype=np.uint16, mode="r")
    assert int(ids.max()) < ts.VOCAB
    one_pass = ts.corpus_pass()
    assert len(one_pass) % 2 == 1 and one_pass[-1] == wb.tokenizer.EOS
    assert wb.tokenizer.decode(ids[:14].tolist()) == "repeat: fosadu"
    repeated = ts.prepare(tmp_path / "r.bin", len(one_pass) + 10)  # a second pass begins
    tail = np.memmap(repeated, dtype=np.uint16, mode="r")[len(one_pass):]
    assert tail.tolist() == one_pass[:10]


def test_a_failing_write_leaves_no_file_under_either_name(tmp_path, monkeypatch):
    def disk_full(handle, ids):
        handle.write(ids[:100].tobytes())  # half written, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ts, "write_tokens", disk_full)
    path = tmp_path / "out" / "stream.bin"
    with pytest.raises(OSError, match="No space left"):
        ts.prepare(path, 5000)
    assert os.listdir(path.parent) == []  # neither stream.bin nor its temporary file


def test_a_failing_rename_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = ts.prepare(tmp_path / "stream.bin", 3000)
    before = path.read_bytes()

    def refused(src, dst):
        raise PermissionError("rename refused")

    monkeypatch.setattr(ts.os, "replace", refused)
    with pytest.raises(PermissionError):
        ts.prepare(path, 5000)  # another length: written anew
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["stream.bin"]


def test_an_existing_prepared_file_is_not_written_again(tmp_path, monkeypatch):
    path = ts.prepare(tmp_path / "stream.bin", 3000)
    monkeypatch.setattr(ts, "write_tokens", lambda handle, ids: pytest.fail("written again"))
    assert ts.prepare(path, 3000) == path


def test_the_task_loads_validated_and_prepares_its_file_on_first_use(cache):
    task = load_task(TASK)
    assert isinstance(task, wb.Task) and task.kind == "generation" and task.prompt_in_loss
    assert not cache.exists()  # loading the task writes nothing
    small = load_task(TASK, tokens=5000)
    examples = small.load_examples()
    assert next(examples)["start"] == 0
    assert [p.name for p in cache.iterdir()] == [ts.default_file(5000).name]
    assert 1 + sum(1 for _ in examples) == (5000 - 1) // 64


def test_tokens_and_a_data_file_together_are_refused(tokens_file):
    with pytest.raises(WorkbookError, match="give one or the other"):
        load_task(TASK, data_file=tokens_file, tokens=1000)


def test_the_task_pickles_without_its_memmap_and_the_gpt_takes_the_targets(tokens_file):
    task = load_task(TASK, data_file=tokens_file, block_size=16)
    examples = list(task.load_examples())
    task.encode(examples[0])  # the memmap is open in this process now
    copy = pickle.loads(pickle.dumps(task))
    assert len(pickle.dumps(task)) < 4000  # the file's ids (MBs) do not travel with it
    assert copy.encode(examples[5])["labels"].tolist() == \
        task.encode(examples[5])["labels"].tolist()
    model = task.build_model().eval()
    assert 2e5 < sum(p.numel() for p in model.parameters()) < 1e6
    batch = task.collate([task.encode(ex) for ex in examples[:4]])
    args, kwargs = task.forward_arguments(model, batch)
    assert len(args) == 1 and set(kwargs) == {"targets"}
    with torch.no_grad():
        out = task.outputs(model, batch)
    assert out.logits.shape == (4, 16, ts.VOCAB)
    summed, count = task.loss(out.logits, batch)
    assert float(out.loss) == pytest.approx(float(summed) / float(count), rel=1e-5)

"""examples/hf_stream.py: a streaming `datasets.IterableDataset` read from local JSONL shards
(load_dataset("json", ..., streaming=True).map(tokenize)) as a Task's source. The shards are the
sample's rows, written atomically; load_examples returns the stream itself and the workbook
reads only the rows it needs; each bad folder, shard or row is refused naming it and the fix;
the same shards reach from_hf as a Trainer's train and eval streams."""

import json
import os

import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")

import workbook as wb  # noqa: E402
from examples import hf_stream as hs  # noqa: E402
from workbook import WorkbookError, load_task  # noqa: E402
from workbook.contract.data import prepare  # noqa: E402
from workbook.samples import DATA_DIR  # noqa: E402

TASK = "examples.hf_stream:task"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """The default sample is prepared into this test's own folder."""
    folder = tmp_path / "cache"
    monkeypatch.setattr(hs, "CACHE_DIR", folder)
    return folder


@pytest.fixture
def shards(tmp_path):
    """600 rows of the sample in 3 shards."""
    return hs.prepare(tmp_path / "shards", shards=3, rows=600)


def test_prepare_writes_the_sample_as_shards_of_consecutive_rows(shards):
    folder = shards[0].parent
    assert [p.name for p in shards] == [f"train-0000{i}-of-00003.jsonl" for i in range(3)]
    assert sorted(p.name for p in folder.iterdir()) == sorted([*(p.name for p in shards),
                                                               "prepared.json"])
    rows = [json.loads(line) for p in shards for line in p.read_text().splitlines()]
    sample = [json.loads(line) for line in
              (DATA_DIR / "generation.jsonl").read_text().splitlines()[:600]]
    assert rows == sample and [len(p.read_text().splitlines()) for p in shards] == [200] * 3
    assert len(hs.sample_rows(5000)) == 5000  # beyond the file: the same generator, new words
    assert hs.sample_rows(4350) == [json.loads(line) for line in
                                    (DATA_DIR / "generation.jsonl").read_text().splitlines()]


def test_a_prepared_folder_is_kept_and_one_with_other_shards_refused(shards, tmp_path,
                                                                     monkeypatch):
    before = [p.stat().st_mtime_ns for p in shards]
    monkeypatch.setattr(hs, "write_rows", lambda handle, rows: pytest.fail("written again"))
    assert hs.prepare(shards[0].parent, shards=3, rows=600) == shards
    assert [p.stat().st_mtime_ns for p in shards] == before
    with pytest.raises(WorkbookError, match="already holds other shards") as caught:
        hs.prepare(shards[0].parent, shards=2, rows=600)  # 3 shards stay beside 2 new ones
    assert "new or empty folder" in caught.value.fix
    for bad in ({"shards": 0}, {"rows": 2.5}, {"shards": 5, "rows": 4}):
        with pytest.raises(WorkbookError, match="cannot prepare"):
            hs.prepare(tmp_path / "x", **bad)


def test_a_failing_write_leaves_no_partial_shard_and_no_manifest(tmp_path, monkeypatch):
    def disk_full(handle, rows):
        handle.write(json.dumps(rows[0]) + "\n{\"id\": ")  # part written, then the disk is full
        raise OSError(28, "No space left on device")

    folder = tmp_path / "out"
    monkeypatch.setattr(hs, "write_rows", disk_full)
    with pytest.raises(OSError, match="No space left"):
        hs.prepare(folder, shards=2, rows=30)
    assert os.listdir(folder) == []  # neither a shard, its temporary file nor prepared.json
    monkeypatch.undo()
    assert len(hs.prepare(folder, shards=2, rows=30)) == 2


def test_load_examples_is_the_streaming_dataset_read_lazily(shards, monkeypatch):
    from datasets import IterableDataset

    tokenized = []
    tokenize = hs.tokenize
    monkeypatch.setattr(hs, "tokenize", lambda row, **kw: (tokenized.append(row["id"]),
                                                           tokenize(row, **kw))[1])
    task = load_task(TASK, data_dir=str(shards[0].parent))
    stream = task.load_examples()
    assert isinstance(stream, IterableDataset) and not hasattr(stream, "__len__")
    assert tokenized == []  # nothing is read before a row is asked for
    rows = iter(stream)
    first = [next(rows) for _ in range(3)]
    assert [r["id"] for r in first] == ["g00000-0", "g00000-1", "g00000-2"]
    assert tokenized == ["g00000-0", "g00000-1", "g00000-2"]  # one row at a time
    rows.close()
    tokenized.clear()
    got = prepare(task, limits={"train": 4, "validation": 2})
    assert [len(got.raw[s]) for s in ("train", "validation")] == [4, 2]
    assert len(tokenized) < 100, f"{len(tokenized)} of 600 rows read for 6 examples"
    tokenized.clear()
    assert len(wb.load_examples(task)) == 600 == len(tokenized)  # a whole pass: every row once


def test_rows_encode_collate_and_run_through_the_gpt2(shards):
    task = load_task(TASK, data_dir=str(shards[0].parent))
    rows = list(zip(range(3), task.load_examples(), strict=False))
    item = task.encode(rows[0][1])
    text = "repeat: fosadu\nfosadu fosadu"
    assert task.decode(item["input_ids"]) == f"<s>{text}</s>"
    assert int(item["prompt_mask"].sum()) == 1 + len("repeat: fosadu\n")
    assert (item["labels"][item["prompt_mask"]] == -100).all()
    assert (item["labels"][~item["prompt_mask"]] == item["input_ids"][~item["prompt_mask"]]).all()
    assert hs.byte_tokenizer()(text)["input_ids"] == wb.tokenizer.encode(text)  # byte ids
    short = load_task(TASK, data_dir=str(shards[0].parent), max_length=8)
    assert len(short.encode(rows[0][1])["input_ids"]) == 8  # a row tokenized longer is cut
    batch = task.collate([task.encode(row) for _, row in rows])
    model = task.build_model().eval()
    assert any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    assert any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    with torch.no_grad():
        logits = task.forward(model, batch)
    assert logits.shape == (*batch["input_ids"].shape, wb.tokenizer.VOCAB_SIZE)


def test_a_missing_folder_or_one_without_shards_is_refused(tmp_path):
    with pytest.raises(WorkbookError, match="does not exist") as caught:
        load_task(TASK, data_dir=str(tmp_path / "none")).load_examples()
    assert "python -m examples.hf_stream --out" in caught.value.fix
    (tmp_path / "empty").mkdir()
    with pytest.raises(WorkbookError, match="holds no .jsonl shards .it is empty"):
        load_task(TASK, data_dir=str(tmp_path / "empty")).load_examples()
    (tmp_path / "empty" / "rows.json").write_text("[]")
    with pytest.raises(WorkbookError, match="it holds rows.json") as caught:
        load_task(TASK, data_dir=str(tmp_path / "empty")).load_examples()
    assert "*.jsonl" in caught.value.fix
    with pytest.raises(WorkbookError, match="give one or the other"):
        load_task(TASK, data_dir=str(tmp_path), rows=100)


def test_a_malformed_or_unreadable_shard_is_named_with_its_file_and_line(shards):
    task = load_task(TASK, data_dir=str(shards[0].parent))
    lines = shards[1].read_text().splitlines()
    shards[1].write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # cut while written
    with pytest.raises(WorkbookError) as caught:
        wb.load_examples(task)
    assert f"shard {shards[1]}:200: malformed JSON" in caught.value.problem
    assert "write the shard again" in caught.value.fix
    shards[1].write_bytes(b"\x1f\x8b\x08\x00\xff\xfe compressed, not text\n")
    with pytest.raises(WorkbookError, match=f"shard {shards[1]} cannot be read") as caught:
        wb.load_examples(task)
    assert "UTF-8 JSONL" in caught.value.fix


def test_rows_without_an_id_or_their_text_are_named(shards):
    task = load_task(TASK, data_dir=str(shards[0].parent))
    rows = [json.loads(line) for line in shards[2].read_text().splitlines()]
    shards[2].write_text("".join(json.dumps({k: v for k, v in r.items() if k != "id"}) + "\n"
                                 for r in rows))
    with pytest.raises(WorkbookError, match=r"200 of 600 examples have no id 'id'") as caught:
        wb.load_examples(task)
    assert "give every example a 'id' field" in caught.value.fix
    rows[5].pop("response")  # datasets fills the column in with None
    shards[2].write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(WorkbookError) as caught:
        wb.load_examples(task)
    assert caught.value.problem == ("a row of the shards has no text 'response' (id "
                                    f"{rows[5]['id']!r}, columns ['conversation', 'id', "
                                    "'instruction'])")


def test_the_same_shards_reach_from_hf_as_a_trainers_train_and_eval_streams(shards):
    task = load_task("examples.hf_stream:trainer", data_dir=str(shards[0].parent))
    assert (task.kind, task.label_shift, task.prompt_in_loss) == ("generation", 1, False)
    assert any("train and eval datasets are read as a stream" in n for n in task.framework.notes)
    examples = list(task.load_examples())
    assert len(examples) == 600 and {ex["split"] for ex in examples} == {"train", "validation"}
    held = {ex["group"] for ex in examples if ex["split"] == "validation"}
    assert held and not held & {ex["group"] for ex in examples if ex["split"] == "train"}
    one = task.encode(examples[0])
    assert (one["labels"][one["prompt_mask"]] == -100).all()  # the prompt, by "\n"


@pytest.mark.slow  # 5.5 and 8 minutes on 2 cores: every notebook, as the docs claim
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("path", [TASK, "examples.hf_stream:trainer"])
def test_the_streaming_tasks_pass_all_nine_notebooks(path, tmp_path):
    from workbook.commands.pilot import run_pilot

    _, index = run_pilot(path, out=str(tmp_path / "run"), smoke=True, progress=False)
    assert index.verdict.tolist() == ["pass"] * 9, index[["notebook", "verdict", "error"]]

"""Instruction data as the Hub serves it and `datasets` saves it: .parquet and .arrow files, folders whose file names
give the splits, read as Hugging Face `datasets` reads them (the tests write every file with `datasets` itself)."""
import json
import os
import re
import sys
from pathlib import Path
from unittest import mock

import pytest

from minigpt.errors import InputError
from minituner.sft import split_records
from minituner.sft.files import data_files, is_structured, read_file, read_records, split_named

datasets = pytest.importorskip("datasets")

CHATS = [{"messages": [{"role": "user", "content": f"wind {i}?"}, {"role": "assistant", "content": f"force {i % 7}"}],
          "source": None if i % 3 else "ship", "id": i} for i in range(40)]


pytestmark = pytest.mark.usefixtures("datasets_offline")  # tests/minituner/conftest.py


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def content(records):
    """What a record holds, without where it was read."""
    return [(r.format, r.text, r.prompt, r.completion, r.messages, r.split) for r in records]


def test_parquet_and_arrow_read_as_their_jsonl_twin(tmp_path):
    twin = read_file(write_jsonl(tmp_path / "chats.jsonl", CHATS))
    ds = datasets.Dataset.from_list(CHATS)
    ds.to_parquet(str(tmp_path / "chats.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))  # data-00000-of-00001.arrow (an IPC stream), state.json, dataset_info.json
    parquet = read_file(tmp_path / "chats.parquet")
    saved = read_records(tmp_path / "saved")
    assert content(parquet) == content(saved) == content(twin)
    assert parquet[3].where == f"{tmp_path / 'chats.parquet'}:row 4"
    assert [p.name for p, _ in data_files(tmp_path / "saved")] == ["data-00000-of-00001.arrow"]
    assert is_structured(tmp_path / "saved") and is_structured(tmp_path / "chats.parquet")


def test_arrow_file_format_and_every_shape(tmp_path):
    import pyarrow as pa

    rows = [{"instruction": "Add.", "input": None, "output": "4"}, {"instruction": "Say hi.", "input": "x", "output": "hi"}]
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(tmp_path / "a.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)  # the IPC file format (Feather v2), not datasets' stream
    a, b = read_file(tmp_path / "a.arrow")
    assert a.format == "alpaca" and a.messages[0]["content"] == "Add." and b.messages[0]["content"] == "Say hi.\n\nx"
    share = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ho"}]}]
    datasets.Dataset.from_list(share).to_parquet(str(tmp_path / "s.parquet"))
    assert read_file(tmp_path / "s.parquet")[0].messages[1] == {"role": "assistant", "content": "ho"}


LAYOUTS = [  # file -> rows; datasets.load_dataset on the folder decides the splits we must match
    {"train.jsonl": 12, "test.jsonl": 5},
    {"chats_training.jsonl": 9, "chats_eval.jsonl": 4, "dev.jsonl": 3},
    {"x/train/a.jsonl": 6, "x/train/b.jsonl": 2, "x/valid/c.jsonl": 3},
    {"data/train-00000-of-00002.parquet": 7, "data/train-00001-of-00002.parquet": 4,
     "data/validation-00000-of-00001.parquet": 3, "data/test-00000-of-00001.parquet": 2, "README.md": 0},
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: ",".join(d))
def test_split_names_match_datasets(tmp_path, layout):
    root, start = tmp_path / "data-set", 0
    for name, n in layout.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"text": f"row {i}"} for i in range(start, start + n)]
        start += n
        if name.endswith(".parquet"):
            datasets.Dataset.from_list(rows).to_parquet(str(path))
        elif name.endswith(".md"):
            path.write_text("---\nlicense: mit\n---\n# A dataset card, not data\n")
        else:
            write_jsonl(path, rows)
    theirs = datasets.load_dataset(str(root), cache_dir=str(tmp_path / "cache"))
    ours = {}
    for r in read_records(root):
        ours.setdefault({"val": "validation"}.get(r.split, r.split), []).append(r.text)
    assert ours == {split: theirs[split]["text"] for split in theirs}


def test_split_records_honours_the_named_splits(tmp_path):
    rows = [{"text": f"row {i}"} for i in range(60)]
    write_jsonl(tmp_path / "a" / "train.jsonl", rows[:40])
    write_jsonl(tmp_path / "a" / "test.jsonl", rows[40:50])
    parts = split_records(read_records(tmp_path / "a"))
    # no val file: val carved from train (one in 20), the test slot left to train as test.jsonl is the test split
    assert [len(parts[s]) for s in ("train", "val", "test")] == [38, 2, 10]
    assert {r.text for r in parts["test"]} == {f"row {i}" for i in range(40, 50)}
    write_jsonl(tmp_path / "a" / "validation.jsonl", rows[50:])
    parts = split_records(read_records(tmp_path / "a"))
    assert [len(parts[s]) for s in ("train", "val", "test")] == [40, 10, 10]
    write_jsonl(tmp_path / "b" / "train.jsonl", rows)  # one named split alone: carved as an unnamed file is
    assert ({s: [r.text for r in v] for s, v in split_records(read_records(tmp_path / "b")).items()}
            == {s: [r.text for r in v] for s, v in split_records(read_file(tmp_path / "b" / "train.jsonl")).items()})


def test_a_datasetdict_saved_to_disk(tmp_path):
    ds = datasets.Dataset.from_list(CHATS)
    datasets.DatasetDict({"train": ds.select(range(30)), "validation": ds.select(range(30, 36)),
                          "test": ds.select(range(36, 40))}).save_to_disk(str(tmp_path / "dd"))
    parts = split_records(read_records(tmp_path / "dd"))
    assert [len(parts[s]) for s in ("train", "val", "test")] == [30, 6, 4]
    assert parts["test"][0].messages[0]["content"] == "wind 36?"


@pytest.mark.parametrize("files, message", [
    ({"train.jsonl": 3, "more.jsonl": 3}, r"train.jsonl is in the train split by its name, but more.jsonl names none"),
    ({"train_test.jsonl": 3}, r"'train_test' names two splits \(test, train\)"),
    ({"train.jsonl": 3, "notes.txt": 0}, r"holds data files and text files \(notes.txt\)"),
])
def test_ambiguous_folders_are_refused(tmp_path, files, message):
    for name, n in files.items():
        write_jsonl(tmp_path / name, [{"text": f"r{i}"} for i in range(n)])
    with pytest.raises(InputError, match=message):
        read_records(tmp_path)


def test_names_that_are_not_split_words():
    for name in ("devops.jsonl", "retrain/x.jsonl", "contest-2024.jsonl", "Train.jsonl", "chats.jsonl"):
        assert split_named(Path(name)) is None, name  # whole words only, and as datasets matches: case-sensitive
    assert split_named(Path("a/validation_set/x.jsonl")) == "val"
    assert split_named(Path("train/eval_notes.jsonl")) == "train"  # folder names first


def test_damaged_tables_are_one_line(tmp_path):
    datasets.Dataset.from_list(CHATS).to_parquet(str(tmp_path / "a.parquet"))
    data = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"cut\.parquet: not a readable Parquet file"):
        read_file(tmp_path / "cut.parquet")
    (tmp_path / "fake.arrow").write_text('{"text": "json, not arrow"}\n')
    with pytest.raises(InputError, match=r"fake\.arrow: not a readable Arrow file"):
        read_file(tmp_path / "fake.arrow")
    datasets.Dataset.from_list([{"q": "a", "a": "b"}]).to_parquet(str(tmp_path / "odd.parquet"))
    with pytest.raises(InputError, match=r"odd\.parquet:row 1: fields found: a, q; a record needs"):
        read_file(tmp_path / "odd.parquet")
    datasets.Dataset.from_list([{"text": b"bytes"}]).to_parquet(str(tmp_path / "bin.parquet"))
    with pytest.raises(InputError, match=r"bin\.parquet:row 1: field 'text' must be a string, got bytes"):
        read_file(tmp_path / "bin.parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), str(tmp_path / "empty.parquet"))
    with pytest.raises(InputError, match=r"empty\.parquet: no records"):
        read_file(tmp_path / "empty.parquet")


def test_without_pyarrow_the_message_says_what_to_install(tmp_path, monkeypatch):
    import builtins

    datasets.Dataset.from_list(CHATS).to_parquet(str(tmp_path / "a.parquet"))
    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.split(".")[0] == "pyarrow":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(InputError, match=r"reading \.parquet files needs pyarrow \(pip install pyarrow\)"):
        read_file(tmp_path / "a.parquet")
    assert os.path.exists(tmp_path / "a.parquet")


def test_columns_rename_a_data_set_to_the_fields_a_shape_reads(tmp_path):
    from minituner.sft.formats import parse_columns

    dolly = [{"instruction": "Add.", "context": "2 and 2", "response": "4", "category": "math"}]
    datasets.Dataset.from_list(dolly).to_parquet(str(tmp_path / "dolly.parquet"))
    (r,) = read_file(tmp_path / "dolly.parquet", columns=parse_columns("input=context,output=response"))
    assert r.format == "alpaca" and list(r.messages) == [{"role": "user", "content": "Add.\n\n2 and 2"},
                                                         {"role": "assistant", "content": "4"}]
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "2+2?", "answer": " 4"}, {"question": "3+3?"}])
    columns = parse_columns("prompt=question, completion=answer")
    with pytest.raises(InputError, match=r"gsm\.jsonl:2: no column 'answer' \(--columns prompt=question,"
                                         r"completion=answer; fields found: question\)"):
        read_file(gsm, columns=columns)
    write_jsonl(gsm, [{"question": "2+2?", "answer": " 4"}])
    (r,) = read_file(gsm, columns=columns)
    assert (r.format, r.prompt, r.completion) == ("prompt-completion", "2+2?", " 4")
    for spec, message in [("prompt", "each item is FIELD=COLUMN"), ("question=prompt", "'question' is not a field"),
                          ("prompt=a,prompt=b", "names a field twice")]:
        with pytest.raises(InputError, match=message):
            parse_columns(spec)


def test_compressed_json_and_csv_read_as_datasets_reads_them(tmp_path):
    import gzip
    import lzma

    import zstandard

    rows = [{"prompt": f"wind {i}?", "completion": f" force {i},\n\"rising\""} for i in range(5)]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    with lzma.open(tmp_path / "b.json.xz", "wt", encoding="utf-8") as f:
        json.dump(rows, f)
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "c.csv"), index=False)
    (tmp_path / "e.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps(r) + "\n" for r in rows).encode()))
    for name in ("a.jsonl.gz", "b.json.xz", "c.csv", "e.jsonl.zst"):
        theirs = datasets.load_dataset("csv" if name.endswith(".csv") else "json", data_files=str(tmp_path / name),
                                       cache_dir=str(tmp_path / "cache"))["train"]
        ours = read_file(tmp_path / name)
        assert [(r.prompt, r.completion) for r in ours] == [(t["prompt"], t["completion"]) for t in theirs], name
    # a frame written with a long window (zstd --long=28), past zstandard's default limit of 128 MiB
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=28, write_content_size=False)
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(
            open(tmp_path / "long.jsonl.zst", "wb")) as w:
        w.write("".join(json.dumps(r) + "\n" for r in rows).encode())
    assert [(r.prompt, r.completion) for r in read_file(tmp_path / "long.jsonl.zst")] == [
        (r["prompt"], r["completion"]) for r in rows]
    with mock.patch.dict(sys.modules, {"zstandard": None}):  # an install without it: one line, no traceback
        with pytest.raises(InputError, match=r"e\.jsonl\.zst: reading \.zst files needs zstandard"):
            read_file(tmp_path / "e.jsonl.zst")
    for name, kind in (("a.jsonl.gz", "gz"), ("e.jsonl.zst", "zst")):  # cut short
        (tmp_path / f"cut-{name}").write_bytes((tmp_path / name).read_bytes()[:20])
        with pytest.raises(InputError, match=rf"cut-{re.escape(name)}: not a readable {kind} file"):
            read_file(tmp_path / f"cut-{name}")
    (tmp_path / "d.tsv").write_text("prompt\tcompletion\na?\t b\nc?\t d\textra\n")
    with pytest.raises(InputError, match=r"d\.tsv:3: 3 cells, the header names 2"):
        read_file(tmp_path / "d.tsv")


def test_a_saved_dataset_reads_its_own_files_not_the_caches_beside_them(tmp_path):
    ds = datasets.Dataset.from_list(CHATS)
    datasets.DatasetDict({"train": ds.select(range(30)), "test": ds.select(range(30, 40))}).save_to_disk(
        str(tmp_path / "dd"))
    datasets.load_from_disk(str(tmp_path / "dd"))["train"].map(lambda r: r)  # writes train/cache-<hash>.arrow
    assert any(p.name.startswith("cache-") for p in (tmp_path / "dd" / "train").iterdir())
    parts = split_records(read_records(tmp_path / "dd"))
    assert len(parts["train"]) + len(parts["val"]) == 30 and len(parts["test"]) == 10


@pytest.mark.parametrize("files, message", [
    ({"data/train_sft-00000-of-00001.parquet": 3, "data/test_sft-00000-of-00001.parquet": 3},
     r"its split 'test_sft' is none of train, validation or test \(its splits: test_sft, train_sft\); say which to "
     r"read with --data-split"),
    ({"data/train_sft-00000-of-00001-a3ecf92756993583.parquet": 3, "data/train_gen-00000-of-00001-bb.parquet": 2},
     r"its split 'train_gen' is none of train"),  # older push_to_hub names end in a hash
    ({"train.jsonl": 3, "test.jsonl.lz4": 0}, r"test\.jsonl\.lz4 is data this does not read"),
    # compressed, but not JSON or CSV inside: refused, not skipped
    ({"train.jsonl": 3, "more.parquet.zst": 0}, r"more\.parquet\.zst is data this does not read"),
    ({"train.jsonl": 3, "archive.tar.gz": 0}, r"archive\.tar\.gz is data this does not read"),
    ({"train.jsonl": 3, "dump.zst": 0}, r"dump\.zst is data this does not read"),
    ({"README.md": "---\nconfigs:\n- config_name: up\n  data_dir: ../outside\n---\n", "data/train.jsonl": 3},
     r"config 'up': data_dir is a folder inside the data set, got '\.\./outside'"),
    ({"data/all/train.jsonl": 3, "data/magpie/train.jsonl": 3,
      "README.md": "---\nconfigs:\n- config_name: all\n  data_dir: data/all\n- config_name: magpie\n  "
                   "data_dir: data/magpie\n---\n# card\n"},
     r"its dataset card declares the configs all, magpie, subsets with data files of their own; choose one with "
     r"--data-config NAME"),
])
def test_folders_that_datasets_would_read_otherwise_are_refused(tmp_path, files, message):
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content)
        elif name.endswith(".parquet"):
            datasets.Dataset.from_list([{"text": f"r{i}"} for i in range(content)]).to_parquet(str(path))
        else:
            write_jsonl(path, [{"text": f"r{i}"} for i in range(content)])
    with pytest.raises(InputError, match=message):
        read_records(tmp_path)


def test_metadata_beside_json_is_not_data(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}, {"text": "b"}])
    (tmp_path / "dataset_infos.json").write_text('{"default": {"features": {}}}')
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n")
    assert [r.text for r in read_records(tmp_path)] == ["a", "b"]


def test_parquet_columns_that_are_the_union_of_record_shapes(tmp_path):
    """A Parquet file's columns are the union of its records' fields, the missing ones null: ShareGPT turns written
    {from, value} beside {role, content}, and a messages column null beside prompt/completion."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    turn = pa.struct([("from", pa.string()), ("value", pa.string()), ("role", pa.string()),
                      ("content", pa.string())])
    table = pa.table({"conversations": pa.array([[
        {"from": "human", "value": "hi", "role": None, "content": None},
        {"from": None, "value": None, "role": "assistant", "content": "ho"}]], pa.list_(turn))})
    pq.write_table(table, str(tmp_path / "share.parquet"))
    (r,) = read_file(tmp_path / "share.parquet")
    assert list(r.messages) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]
    pq.write_table(pa.table({"messages": pa.array([None], pa.list_(pa.struct([("role", pa.string())]))),
                             "prompt": ["2+2="], "completion": ["4"]}), str(tmp_path / "pc.parquet"))
    (r,) = read_file(tmp_path / "pc.parquet")
    assert (r.format, r.prompt, r.completion) == ("prompt-completion", "2+2=", "4")


def test_shard_names_count_only_in_a_snapshots_data_folder(tmp_path):
    """datasets reads {split}-00000-of-00001 names exactly in data/ alone; elsewhere words decide, and a
    push_to_hub card declaring its one default config is read as the data files say."""
    layouts = {
        "a": {"train/shard-00000-of-00002.jsonl": 2, "train/shard-00001-of-00002.jsonl": 2},
        "b": {"alpaca_train-00000-of-00001.jsonl": 2, "alpaca_test-00000-of-00001.jsonl": 1},
        "c": {"data-00000-of-00001.jsonl": 3},
        "d": {"data/train-00000-of-00001.jsonl": 3, "README.md": "---\nconfigs:\n- config_name: default\n  "
              "data_files:\n  - split: train\n    path: data/train-*\n---\n"},
    }
    for name, files in layouts.items():
        root = tmp_path / name
        for file, content in files.items():
            path = root / file
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, str):
                path.write_text(content)
            else:
                write_jsonl(path, [{"text": f"{file} {i}"} for i in range(content)])
        theirs = datasets.load_dataset(str(root), cache_dir=str(tmp_path / "cache"))
        ours = {}
        for r in read_records(root):
            ours.setdefault({"val": "validation", None: "train"}.get(r.split, r.split), []).append(r.text)
        assert ours == {split: theirs[split]["text"] for split in theirs}, name
    ds = datasets.Dataset.from_list(CHATS)
    ds.save_to_disk(str(tmp_path / "e" / "data"))  # a save_to_disk folder that happens to be named data
    assert len(read_records(tmp_path / "e" / "data")) == 40


def test_damaged_compressed_and_quoted_files_are_one_line(tmp_path):
    import gzip

    data = bytearray(gzip.compress(("".join(json.dumps(r) + "\n" for r in CHATS)).encode()))
    for i in range(30, 60):
        data[i] ^= 0x55
    (tmp_path / "bad.jsonl.gz").write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"bad\.jsonl\.gz: not a readable gz file"):
        read_file(tmp_path / "bad.jsonl.gz")
    (tmp_path / "quote.csv").write_text('prompt,completion\nq1, a1\nq2,"a2 is wide\nq3, a3\n')
    with pytest.raises(InputError, match=r"quote\.csv:3: not valid CSV"):  # the line the bad record starts on
        read_file(tmp_path / "quote.csv")
    (tmp_path / "quoted.csv").write_text('prompt,completion\n"q1\non two lines",a1\nq2,a2\n')
    assert [r.where.rsplit(":", 1)[1] for r in read_file(tmp_path / "quoted.csv")] == ["2", "4"]
    (tmp_path / "twice.csv").write_text("prompt,prompt\nq1,a1\n")  # DictReader kept the last one, silently
    with pytest.raises(InputError, match=r"twice\.csv:1: the header names 'prompt' twice"):
        read_file(tmp_path / "twice.csv")

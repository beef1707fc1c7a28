"""A Hub snapshot's dataset card: the configs (subsets) its README.md declares and the files of each split, read as
`datasets.load_dataset(folder, name)` reads them (every layout is checked against datasets itself)."""
import json

import pytest

from minigpt.errors import InputError
from minituner.sft.dataset_card import card_config_name, card_configs
from minituner.sft.files import read_records
from minituner.sft.formats import DataSelection, parse_data_splits

datasets = pytest.importorskip("datasets")


pytestmark = pytest.mark.usefixtures("datasets_offline")  # tests/minituner/conftest.py


def write_tree(root, files: dict):
    """Files under root: a str is written as is (a card), an int n is n JSON lines of text records naming the file."""
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content, encoding="utf-8")
        else:
            path.write_text("".join(json.dumps({"text": f"{name} {i}"}) + "\n" for i in range(content)))
    return root


def card(*configs: str) -> str:
    return "---\nlicense: mit\nconfigs:\n" + "".join(configs) + "---\n# A dataset card\n"


SNAPSHOT = {  # two subsets, the second the default; splits named as the card names them
    "README.md": card(
        "- config_name: en\n  data_files:\n  - split: train\n    path: en/train-*.jsonl\n"
        "  - split: test\n    path:\n    - en/holdout.jsonl\n",
        "- config_name: all\n  default: true\n  data_files:\n  - split: train\n    path: '**/train-*.jsonl'\n"
        "  - split: validation\n    path: [en/holdout.jsonl, fr/dev.jsonl]\n",
        "- config_name: fr\n  data_dir: fr\n",
        "- config_name: one\n  data_files: en/train-1.jsonl\n"),
    "en/train-0.jsonl": 3, "en/train-1.jsonl": 2, "en/holdout.jsonl": 2,
    "fr/train-0.jsonl": 4, "fr/dev.jsonl": 1,
}
OURS_AS_THEIRS = {"train": "train", "val": "validation", "test": "test"}


def read_as_datasets(root, selection=DataSelection()) -> dict:
    """Our records of a folder, grouped per split under datasets' split names."""
    names = {ours: theirs for ours, theirs in selection.splits} or OURS_AS_THEIRS
    grouped = {}
    for r in read_records(root, selection=selection):
        grouped.setdefault(names[r.split or "train"], []).append(r.text)
    return grouped


@pytest.mark.parametrize("config", [None, "en", "all", "fr", "one"])
def test_a_cards_configs_read_as_datasets_reads_them(tmp_path, config):
    root = write_tree(tmp_path / "snap", SNAPSHOT)
    theirs = datasets.load_dataset(str(root), config, cache_dir=str(tmp_path / "cache"))
    assert read_as_datasets(root, DataSelection(config=config)) == {s: theirs[s]["text"] for s in theirs}
    assert card_config_name(root, config) == (config or "all")


def test_splits_named_otherwise_are_read_as_data_split_says(tmp_path):
    """ultrachat_200k's layout: one config, splits train_sft, test_sft, train_gen, test_gen."""
    splits = ("train_sft", "test_sft", "train_gen", "test_gen")
    root = write_tree(tmp_path / "chat", {
        "README.md": card("- config_name: default\n  data_files:\n"
                          + "".join(f"  - split: {s}\n    path: data/{s}-*\n" for s in splits)),
        **{f"data/{s}-00000-of-00001.jsonl": 2 + i for i, s in enumerate(splits)}})
    theirs = datasets.load_dataset(str(root), cache_dir=str(tmp_path / "cache"))
    selection = DataSelection(splits=parse_data_splits("train=train_sft,val=test_sft"))
    assert read_as_datasets(root, selection) == {s: theirs[s]["text"] for s in ("train_sft", "test_sft")}
    with pytest.raises(InputError, match=r"its split 'train_sft' is none of train, validation or test \(its splits: "
                                         r"train_sft, test_sft, train_gen, test_gen\); say which to read with "
                                         r"--data-split, e.g. train=train_sft,val=test_sft$"):
        read_records(root)
    (root / "README.md").unlink()  # no card: the Hub shards' names say the same splits (files in name order)
    assert read_as_datasets(root, selection) == {s: theirs[s]["text"] for s in ("train_sft", "test_sft")}
    with pytest.raises(InputError, match=r"its split 'test_gen' is none of train, validation or test \(its splits: "
                                         r"test_gen, test_sft, train_gen, train_sft\); say which to read with "
                                         r"--data-split, e.g. train=train_gen,val=test_gen$"):
        read_records(root)


@pytest.mark.parametrize("spec", ["train=train,val=validation", "train=train,val=val"])
def test_data_split_finds_a_split_by_the_name_of_its_files_or_by_ours(tmp_path, spec):
    """validation.jsonl is the val split; --data-split may call it as its file does, as a card or shard would."""
    root = write_tree(tmp_path / "d", {"train.jsonl": 3, "validation.jsonl": 2, "test.jsonl": 1})
    theirs = datasets.load_dataset(str(root), cache_dir=str(tmp_path / "cache"))
    records = read_records(root, selection=DataSelection(splits=parse_data_splits(spec)))
    assert [(r.split, r.text) for r in records] == [
        *(("train", t) for t in theirs["train"]["text"]), *(("val", t) for t in theirs["validation"]["text"])]
    with pytest.raises(InputError, match=r"--data-split: val, validation name one split of .* twice"):
        read_records(root, selection=DataSelection(splits=parse_data_splits("test=val,val=validation")))


@pytest.mark.parametrize("files, selection, message", [
    ({"README.md": card("- config_name: a\n  data_files: a.jsonl\n", "- config_name: b\n  data_files: b.jsonl\n"),
      "a.jsonl": 1, "b.jsonl": 1}, {},
     r"declares the configs a, b, subsets with data files of their own; choose one with --data-config NAME"),
    ({"README.md": card("- config_name: a\n  data_files: a.jsonl\n"), "a.jsonl": 1}, {"config": "b"},
     r"--data-config b: .*'s dataset card declares a$"),
    ({"a.jsonl": 1}, {"config": "a"}, r"--data-config a: .* has no dataset card \(README\.md\) declaring configs"),
    ({"README.md": card("- config_name: a\n  data_files:\n  - split: train\n    path: data/*.jsonl\n"),
      "a.jsonl": 1}, {}, r"config 'a', split 'train': no file matches 'data/\*\.jsonl'"),
    ({"README.md": card("- config_name: a\n  data_files:\n  - split: train\n    path: ../x.jsonl\n"), "a.jsonl": 1},
     {}, r"'\.\./x\.jsonl' is not a path inside the data set"),
    ({"README.md": card("- config_name: a\n  data_files:\n  - split: validation\n    path: a.jsonl\n"
                        "  - split: dev\n    path: b.jsonl\n"), "a.jsonl": 1, "b.jsonl": 1}, {},
     r"its splits validation and dev both read as val; say which to read with --data-split val=validation"),
    ({"README.md": card("- config_name: a\n  data_files: a.jsonl\n"), "a.jsonl": 1},
     {"splits": (("train", "train_sft"),)}, r"--data-split: .* has no split 'train_sft' \(its splits are train\)"),
    ({"README.md": "---\nconfigs: [a: b: c]\n---\n", "a.jsonl": 1}, {}, r"README\.md: its YAML header does not parse"),
    ({"README.md": card("- data_files: a.jsonl\n"), "a.jsonl": 1}, {}, r"each entry of configs needs a config_name"),
    ({"README.md": card("- config_name: a\n  data_files: a.txt\n"), "a.txt": "words"}, {},
     r"a\.txt is not a data file this reads"),
    ({"README.md": card("- config_name: a\n  data_files: a.jsonl.lz4\n"), "a.jsonl.lz4": "x"}, {},
     r"a\.jsonl\.lz4 is data this does not read"),
    ({"README.md": card("- config_name: a\n  data_dir: missing\n"), "a.jsonl": 1}, {},
     r"config 'a' of its dataset card names the folder missing, which is not there"),
])
def test_cards_that_do_not_say_what_to_read_are_refused(tmp_path, files, selection, message):
    root = write_tree(tmp_path / "d", files)
    with pytest.raises(InputError, match=message):
        read_records(root, selection=DataSelection(**selection))


def test_selection_flags_are_checked(tmp_path):
    f = write_tree(tmp_path, {"a.jsonl": 2}) / "a.jsonl"
    with pytest.raises(InputError, match=r"--data-config and --data-split choose among a folder's configs"):
        read_records(f, selection=DataSelection(config="x"))
    for spec, message in (("train", "each item is SPLIT=NAME"), ("dev=x", "'dev' is not one of train, val, test"),
                          ("train=a,train=b", "names a split twice"), ("train=a,val=a", "names a split twice")):
        with pytest.raises(InputError, match=message):
            parse_data_splits(spec)
    assert card_configs(tmp_path) == [] and card_config_name(f, None) is None

"""`dataset: owner/name` (TRL's `dataset_name`) reads a dataset from the `datasets` library's local cache, never
from the network; a name that is not there, or a configuration or split it lacks, is one line that says what to do.

The cache here is made the way `datasets` lays out a dataset it saved (HF_DATASETS_CACHE/owner___name/config/
version/hash: its Arrow files and dataset_info.json), and `datasets.load_dataset(name)` itself, offline, reads the
same rows from it: gspo reads what the library wrote, not a layout of its own.
"""

import json
import shutil
import socket

import datasets
import pytest
from datasets.packaged_modules.json.json import Json

from conftest import TINY_RUN, gspo_env, read_metrics, run_gspo
from gspo.config import DataSettings, TrainConfig, make_config
from gspo.data.rows import load_rows, load_splits
from gspo.tasks import build_char_tokenizer

ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(10)]


def cache_dataset(cache, name: str, config: str, splits: dict[str, list[dict]]) -> None:
    """Lay out `splits` in `cache` as `datasets` does for the dataset `name`, configuration `config`."""
    owner, base = name.split("/")
    files = {}
    for split, rows in splits.items():
        files[split] = cache.parent / f"{base}-{config}-{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    built = Json(cache_dir=str(cache.parent / "build"), data_files={k: str(v) for k, v in files.items()})
    built.download_and_prepare()
    target = cache / f"{owner}___{base}" / config / "0.0.0" / "0123456789abcdef"
    target.mkdir(parents=True)
    for f in (cache.parent / "build").glob("json/*/0.0.0/**/*"):
        if f.is_file():
            shutil.copy(f, target / f.name.replace("json-", f"{base}-"))
    info = json.loads((target / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(json.dumps({**info, "config_name": config, "dataset_name": base}))
    shutil.rmtree(cache.parent / "build")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A `datasets` cache holding someone/tiny-sums (configuration main: train and test splits), in use."""
    root = tmp_path / "hf-datasets"
    cache_dataset(root, "someone/tiny-sums", "main", {"train": ROWS[:7], "test": ROWS[7:]})
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", root)
    return root


def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_a_cached_dataset_is_read_by_name_with_no_connection(cache, monkeypatch):
    no_network(monkeypatch)
    train = load_rows("someone/tiny-sums")
    assert [(r["prompt"], r["answer"]) for r in train] == [(r["prompt"], r["answer"]) for r in ROWS[:7]]
    assert train[2].where == "someone/tiny-sums (main, train) row 2"
    test = load_rows("someone/tiny-sums", config="main", split="test")
    assert [r["answer"] for r in test] == ["14", "16", "18"]


def test_the_library_reads_the_same_rows_from_this_cache(cache, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    no_network(monkeypatch)
    theirs = datasets.load_dataset("someone/tiny-sums", "main", split="train", cache_dir=str(cache))
    assert list(theirs) == [dict(r) for r in load_rows("someone/tiny-sums")]


def test_trl_names_pick_the_dataset_its_configuration_and_splits(cache):
    cfg = make_config(TrainConfig, {"dataset_name": "someone/tiny-sums", "dataset_config": "main",
                                    "dataset_train_split": "test", "eval_dataset": "someone/tiny-sums",
                                    "dataset_test_split": "train"})
    assert (cfg.dataset, cfg.dataset_config, cfg.dataset_train_split) == ("someone/tiny-sums", "main", "test")
    data = DataSettings(task=None, dataset=cfg.dataset, eval_dataset=cfg.eval_dataset,
                        dataset_config=cfg.dataset_config, dataset_train_split=cfg.dataset_train_split,
                        dataset_test_split=cfg.dataset_test_split)
    train, held_out = load_splits(data, build_char_tokenizer(), 0, eval_num_prompts=4, seed=0)
    assert sorted(r["answer"] for r in train) == ["14", "16", "18"]  # the splits swapped, as asked
    assert [r["answer"] for r in held_out] == ["0", "2", "4", "6"]


@pytest.mark.parametrize("name, options, message", [
    ("someone/other", {}, "dataset: someone/other does not exist as a local file or folder, and the datasets "
                          "library's cache ({cache}) does not hold a dataset of that name; gspo never downloads: save "
                          "it there once, online, with python -c \"import datasets; datasets.load_dataset("
                          "'someone/other')\""),
    ("someone/tiny-sums", {"config": "socratic"}, "dataset: someone/tiny-sums: the datasets cache holds no "
                                                  "configuration 'socratic' of it (it holds main); set dataset_config"),
    ("someone/tiny-sums", {"split": "validation"}, "dataset: someone/tiny-sums (main) has no split 'validation' in "
                                                   "the datasets cache (splits: train, test); set dataset_train_split"),
    ("no/such/dir", {}, "dataset: no/such/dir does not exist"),
    ("data.jsonl", {}, "dataset: data.jsonl does not exist"),
])
def test_what_the_cache_lacks_is_one_line_that_says_what_to_do(cache, name, options, message):
    with pytest.raises(ValueError) as refused:
        load_rows(name, **options)
    assert str(refused.value).startswith(message.format(cache=cache)), str(refused.value)
    assert "\n" not in str(refused.value)


def test_two_cached_configurations_need_dataset_config(cache):
    cache_dataset(cache, "someone/tiny-sums", "socratic", {"train": ROWS[:2]})
    with pytest.raises(ValueError, match=r"^dataset: someone/tiny-sums: the datasets cache holds 2 configurations "
                                         r"of it \(main, socratic\); set dataset_config to one$"):
        load_rows("someone/tiny-sums")
    assert len(load_rows("someone/tiny-sums", config="socratic")) == 2


def test_gspo_train_trains_on_a_cached_dataset_named_as_trl_names_it(cache, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({**TINY_RUN, "dataset_name": "someone/tiny-sums", "dataset_config": "main",
                                  "max_steps": 1, "output_dir": str(tmp_path / "run")}))
    done = run_gspo("train", "--config", config, cwd=tmp_path,
                    env=gspo_env(HF_DATASETS_CACHE=str(cache)))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "eval: holding out 1 of 7 rows of someone/tiny-sums (eval_holdout=0.1)" in done.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1]  # the evaluation before training, a step

"""Hub dataset ids as data paths (issue 29 item 4), read offline from a real HF hub cache.

The cache is written in a temporary ``HF_HOME`` in the layout ``huggingface_hub`` writes (blobs, snapshot
symlinks, ``refs/main``: ``verl_trainer.testing.hub_cache``) and checked with the library's own
``scan_cache_dir``; the data modules then read it by id through ``snapshot_download(local_files_only=True)``
and ``datasets``: a TRL-style RL dataset with two configs (dataset-card YAML, parquet shards) and a
conversational SFT dataset with no card (splits from the file names, jsonl).
"""

from __future__ import annotations

import json

import pytest

from verl_trainer.algorithms.data import DataConfig, PromptDataModule, SFTDataModule
from verl_trainer.data.hub import HubDatasetNotFoundError, data_fingerprint, parse_hub_dataset
from verl_trainer.data.prompts import PromptDataset
from verl_trainer.data.schema import non_tensor_list
from verl_trainer.data.sft import SFTDataset
from verl_trainer.models.tiny import build_tokenizer
from verl_trainer.testing.hub_cache import parquet_bytes, write_cached_dataset

datasets = pytest.importorskip("datasets")

COMMIT = "1234567890abcdef1234567890abcdef12345678"
CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
# tiny-math: a+b= with TRL's solution column
"""
CHAT = [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]


def _math_rows(offset: int, n: int) -> list[dict]:
    return [{"prompt": f"{i}+{offset}=", "solution": str(i + offset), "level": i % 2} for i in range(n)]


@pytest.fixture()
def hf_home(tmp_path, monkeypatch):
    """A hub cache holding ``tiny-org/tiny-math`` (2 configs) and ``tiny-org/tiny-chat`` (no card)."""
    home = tmp_path / "hf_home"
    write_cached_dataset(home / "hub", "tiny-org/tiny-math", {
        "README.md": CARD,
        "main/train-00000-of-00002.parquet": parquet_bytes(_math_rows(1, 4)),
        "main/train-00001-of-00002.parquet": parquet_bytes(_math_rows(1, 8)[4:]),
        "main/test-00000-of-00001.parquet": parquet_bytes(_math_rows(2, 2)),
        "socratic/train-00000-of-00001.parquet": parquet_bytes(_math_rows(3, 2)),
    }, COMMIT)
    write_cached_dataset(home / "hub", "tiny-org/tiny-chat", {
        "train.jsonl": "".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(4)),
        "test.jsonl": json.dumps({"messages": CHAT[:1] + [{"role": "assistant", "content": "5"}]}) + "\n",
    })
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(home / "datasets"))  # read at import
    return home


def test_the_cache_is_the_layout_huggingface_hub_reads(hf_home):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hf_home / "hub")
    assert not info.warnings
    found = {r.repo_id: (r.repo_type, sorted(r.refs), r.nb_files) for r in info.repos}
    assert found == {"tiny-org/tiny-math": ("dataset", ["main"], 5),
                     "tiny-org/tiny-chat": ("dataset", ["main"], 2)}


def test_grpo_data_module_reads_a_cached_hub_id_train_and_test_splits(hf_home):
    tok = build_tokenizer()
    config = DataConfig(train_files="tiny-org/tiny-math:main", val_files="tiny-org/tiny-math:main",
                        train_batch_size=4, max_prompt_length=16, shuffle=False)
    data = PromptDataModule(config, tok)
    data.check(dp_size=1)
    assert len(data._train) == 8 and len(data._val) == 2  # both train shards; val: TRL's default "test"
    batch = next(iter(data.train_dataloader()))
    assert non_tensor_list(batch, "ground_truth") == ["1", "2", "3", "4"]  # TRL's solution column
    assert [c["level"] for c in non_tensor_list(batch, "columns")] == [0, 1, 0, 1]  # by name to rewards
    assert tok.decode(batch["prompts"][0][-4:].tolist()) == "0+1="
    val = next(iter(data.val_dataloader()))
    assert non_tensor_list(val, "ground_truth") == ["2", "3"]
    assert data.fingerprint()["train_files"] == {"path": "tiny-org/tiny-math:main",
                                                 "content": f"hub:tiny-org/tiny-math@{COMMIT}"}


def test_split_and_config_in_the_id_and_the_python_entry_points(hf_home):
    tok = build_tokenizer()
    assert [r["ground_truth"] for r in PromptDataset("tiny-org/tiny-math:socratic", tok)] == ["3", "4"]
    assert len(PromptDataset("tiny-org/tiny-math:main@test", tok)) == 2
    chats = SFTDataset("tiny-org/tiny-chat", tok, max_length=64)  # the only config, split train
    assert len(chats) == 4 and sum(chats[0].loss_mask) == 2  # "4\n": the assistant turn only
    data = SFTDataModule(DataConfig(train_files="tiny-org/tiny-chat", val_files="tiny-org/tiny-chat",
                                    train_batch_size=2, max_length=64), tok)
    data.check(dp_size=1)
    assert (len(data._train), len(data._val)) == (4, 1)  # val: test.jsonl
    assert next(iter(data.train_dataloader()))["input_ids"].shape[0] == 2


def test_a_missing_id_config_or_split_is_named_with_the_fix(hf_home, tmp_path, monkeypatch):
    tok = build_tokenizer()
    data = PromptDataModule(DataConfig(train_files="openai/gsm8k", train_batch_size=2), tok)
    with pytest.raises(HubDatasetNotFoundError) as missing:
        data.check(dp_size=1)
    message = str(missing.value)
    assert message.startswith("data.train_files='openai/gsm8k' is not a local file, and it looks like a hub "
                              "dataset id but 'openai/gsm8k' is not in the local HF hub cache")
    assert str(hf_home / "hub" / "datasets--openai--gsm8k") in message
    assert "huggingface-cli download --repo-type dataset openai/gsm8k" in message
    assert "never downloads data" in message and "local .parquet / .jsonl file" in message
    data = PromptDataModule(DataConfig(train_files="tiny-org/tiny-math", train_batch_size=2), tok)
    with pytest.raises(ValueError, match=r"^data.train_files='tiny-org/tiny-math' \(the cached dataset at "
                                         r".*\) has several configs and no default; its configs: main, "
                                         r"socratic\. Choose one: tiny-org/tiny-math:main$"):
        data.check(dp_size=1)
    with pytest.raises(ValueError, match=r"has no split 'validation'; its splits: train, test\. "
                                         r"Choose one: tiny-org/tiny-math:main@train$"):
        PromptDataset("tiny-org/tiny-math:main@validation", tok)
    with pytest.raises(ValueError, match=r"has no config 'nope'; its configs: main, socratic"):
        PromptDataset("tiny-org/tiny-math:nope", tok)


def test_local_files_come_first_and_data_file_names_are_never_hub_ids(hf_home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-org").mkdir()
    (tmp_path / "tiny-org" / "tiny-math").write_text(json.dumps({"prompt": "local", "solution": "1"}) + "\n")
    assert parse_hub_dataset("tiny-org/tiny-math") is None  # a local file of that name
    for local in ("missing/train.parquet", "missing/train.csv", "./a/b", "../a", "/abs/path"):
        assert parse_hub_dataset(local) is None, local
    assert parse_hub_dataset("org/name:cfg@test").text() == "org/name:cfg@test"
    with pytest.raises(ValueError, match="cannot read prompts from 'tiny-org/tiny-math': use a .parquet"):
        PromptDataset("tiny-org/tiny-math", build_tokenizer())  # the local file, not the cached dataset
    assert data_fingerprint("missing/train.parquet") is None and data_fingerprint("nobody/nothing") is None


def test_a_snapshot_the_cache_knows_is_partial_is_read_for_the_files_it_has(hf_home):
    """``hf download --include 'main/*'`` fetches one config's files and caches the repository's file
    listing, which names all of them, so ``local_files_only`` raises ``IncompleteSnapshotError``: its
    ``snapshot_path`` (documented for this) is read, with a warning."""
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    repo = hf_home / "hub" / "datasets--tiny-org--tiny-math"
    listed = [p.relative_to(repo / "snapshots" / COMMIT).as_posix()
              for p in (repo / "snapshots" / COMMIT).rglob("*") if p.is_file()]
    entries = {name: TreeCacheEntry(size=1, blob_id="0" * 40) for name in [*listed, "extra/train.parquet"]}
    write_tree_cache(str(repo), COMMIT, entries)
    with pytest.warns(UserWarning, match=r"is incomplete: 1 file\(s\) are missing \(extra/train.parquet\)"):
        assert len(PromptDataset("tiny-org/tiny-math:main", build_tokenizer())) == 8

import json

import pytest
import torch

from verl_trainer.data import schema
from verl_trainer.data.prompts import (
    PromptDataset,
    collate_prompts,
    encode_prompt,
    load_prompts,
    make_prompt_dataloader,
    save_rows,
    to_verl_row,
)
from verl_trainer.data.schema import non_tensor_lists, prompt_token_lists
from verl_trainer.models import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _rows(chat_only=False):
    def chat(text):
        return [{"role": "user", "content": text}]

    return [
        to_verl_row(chat("3+4=") if chat_only else "3+4=", "7", "arithmetic", {"split": "train", "index": 0}),
        to_verl_row([{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+30="}], "42",
                    "arithmetic", {"split": "train", "index": 1}),
        to_verl_row(chat("Q: 2*3?") if chat_only else "Q: 2*3?", "6", "gsm8k",
                    {"split": "train", "index": 2}),
    ]


@pytest.mark.parametrize(("suffix", "chat_only"), [("jsonl", False), ("jsonl", True), ("parquet", True)])
def test_round_trip(tmp_path, suffix, chat_only):
    rows = _rows(chat_only)
    path = save_rows(rows, tmp_path / f"sub/prompts.{suffix}")
    records = load_prompts(path)
    assert [r["prompt"] for r in records] == [row["prompt"] for row in rows]
    assert [r["ground_truth"] for r in records] == ["7", "42", "6"]
    assert [r["data_source"] for r in records] == ["arithmetic", "arithmetic", "gsm8k"]
    assert [r["extra_info"] for r in records] == [row["extra_info"] for row in rows]
    assert [r["index"] for r in records] == [0, 1, 2]


def test_parquet_plain_prompts_and_mixed_error(tmp_path):
    rows = [to_verl_row("3+4=", "7", "a"), to_verl_row("1+1=", "2", "a", {"k": 1})]
    records = load_prompts(save_rows(rows, tmp_path / "plain.parquet"))
    assert [r["prompt"] for r in records] == ["3+4=", "1+1="]
    assert records[0]["extra_info"] == {"k": None}  # typed columns: missing keys read back as None
    with pytest.raises(ValueError, match="one type"):
        save_rows(_rows(), tmp_path / "mixed.parquet")


def test_flattened_and_top_level_ground_truth(tmp_path):
    path = tmp_path / "flat.jsonl"
    lines = [{"prompt": "1+1=", "reward_model.ground_truth": "2", "data_source": "a"},
             {"prompt": "2+2=", "ground_truth": 4}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    records = load_prompts(path)
    assert [r["ground_truth"] for r in records] == ["2", 4]
    assert records[1]["data_source"] == "unknown" and records[1]["extra_info"] == {}
    arr = tmp_path / "rows.json"
    arr.write_text(json.dumps(lines))
    assert load_prompts(arr) == records


def test_bad_rows(tmp_path):
    missing = tmp_path / "m.jsonl"
    missing.write_text(json.dumps({"prompt": "x", "data_source": "a"}) + "\n")
    assert load_prompts(missing)[0]["ground_truth"] is None  # optional: only rewards that need it refuse
    bad_prompt = tmp_path / "b.jsonl"
    bad_prompt.write_text(json.dumps({"prompt": [{"text": "x"}], "ground_truth": "1"}) + "\n")
    with pytest.raises(ValueError, match="chat list"):
        load_prompts(bad_prompt)
    with pytest.raises(ValueError, match="parquet"):
        load_prompts(tmp_path / "x.csv")


def test_encode_prompt_plain_and_chat(tok):
    assert tok.decode(encode_prompt(tok, "3+4=")) == "3+4="
    chat = [{"role": "user", "content": "3+4="}]
    assert tok.decode(encode_prompt(tok, chat)) == "user: 3+4=\nassistant: "
    assert encode_prompt(tok, "3+4=", chat_template=True) == encode_prompt(tok, chat)
    assert tok.decode(encode_prompt(tok, chat, chat_template=False)) == "user: 3+4=\n"


def test_dataset_truncation_and_collate(tok):
    records = load_prompts_from_rows(_rows())
    with pytest.raises(ValueError, match="max_prompt_length=10"):
        PromptDataset(records, tok, max_prompt_length=10)
    filtered = PromptDataset(records, tok, max_prompt_length=10, filter_overlong_prompts=True)
    assert [it["index"] for it in filtered] == [0, 2]
    left = PromptDataset(records, tok, max_prompt_length=6, truncation="left")
    assert tok.decode(left[2]["input_ids"]) == ": 2*3?" and len(left[0]["input_ids"]) == 4
    right = PromptDataset(records, tok, max_prompt_length=6, truncation="right")
    assert tok.decode(right[2]["input_ids"]) == "Q: 2*3"
    middle = PromptDataset(records, tok, max_prompt_length=6, truncation="middle")
    assert tok.decode(middle[2]["input_ids"]) == "Q: *3?"  # the first 3 and the last 3 tokens
    with pytest.raises(ValueError, match="filter_overlong_prompts left none"):
        PromptDataset(records, tok, max_prompt_length=1, filter_overlong_prompts=True)
    ds = PromptDataset(records, tok, max_prompt_length=64)
    batch = ds.collate([ds[0], ds[1], ds[2]])
    lens = [len(ds[i]["input_ids"]) for i in range(3)]
    assert batch[schema.PROMPT_LEN].tolist() == lens
    assert batch[schema.PROMPTS].shape == (3, max(lens))
    assert (batch[schema.PROMPTS][0, : max(lens) - lens[0]] == tok.pad_token_id).all()  # left padding
    assert prompt_token_lists(batch) == [ds[i]["input_ids"] for i in range(3)]
    assert batch[schema.UID].tolist() == [0, 1, 2]
    data = non_tensor_lists(batch)
    assert data["ground_truth"] == ["7", "42", "6"] and data["data_source"][2] == "gsm8k"
    sub = batch[torch.tensor([2, 0])]
    assert non_tensor_lists(sub)["ground_truth"] == ["6", "7"]
    with pytest.raises(ValueError, match="empty prompt"):
        collate_prompts([{"input_ids": [], "index": 0}])


def load_prompts_from_rows(rows):
    from verl_trainer.data.prompts import normalize_record

    return [normalize_record(r, i) for i, r in enumerate(rows)]


def test_dataloader_shards(tok):
    records = load_prompts_from_rows([to_verl_row(f"{i}+0=", str(i), "a") for i in range(10)])
    ds = PromptDataset(records, tok)
    seen = []
    for rank in range(2):
        loader = make_prompt_dataloader(ds, batch_size=2, seed=3, rank=rank, world_size=2)
        batches = list(loader)
        assert len(batches) == 2 and all(b.batch_size[0] == 2 for b in batches)
        seen += [u for b in batches for u in b[schema.UID].tolist()]
    assert len(set(seen)) == 8  # disjoint shards (drop_last drops 2 of 10)
    again = [u for b in make_prompt_dataloader(ds, batch_size=2, seed=3, rank=0, world_size=2)
             for u in b[schema.UID].tolist()]
    assert again == seen[:4]


def test_prompt_key_is_honoured_before_any_model_loads(tmp_path, tok):
    from verl_trainer.algorithms.data import DataConfig, PromptDataModule

    rows = [{("question" if k == "prompt" else k): v for k, v in row.items()} for row in _rows()]
    path = save_rows(rows, tmp_path / "q.jsonl")
    data = PromptDataModule(DataConfig(train_files=str(path), train_batch_size=3, prompt_key="question"), tok)
    data.check(dp_size=1)
    want = PromptDataset(load_prompts(save_rows(_rows(), tmp_path / "p.jsonl")), tok)
    assert [it["input_ids"] for it in data._train.items] == [it["input_ids"] for it in want.items]
    with pytest.raises(ValueError, match=r"no 'prompt' column.*'question'.*Set data.prompt_key"):
        PromptDataModule(DataConfig(train_files=str(path), train_batch_size=3), tok).check(dp_size=1)

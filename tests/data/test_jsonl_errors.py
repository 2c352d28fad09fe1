"""Malformed data files fail at load time naming the file and the line; empty prompts are refused."""

from __future__ import annotations

import json

import pytest

from verl_trainer.data.prompts import load_prompts, read_rows
from verl_trainer.data.sft import SFTDataset

ROW = json.dumps({"prompt": "1+1=", "reward_model": {"ground_truth": "2"}})


def test_invalid_json_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(f"{ROW}\n\n{ROW}\n{{\"prompt\": \"2+2=\", \n")
    with pytest.raises(ValueError, match=r"train.jsonl:4: invalid JSON .*one complete JSON object"):
        load_prompts(path)


def test_non_utf8_byte_names_file_line_and_column(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(f"{ROW}\n".encode() + b'{"prompt": "caf\xe9", "ground_truth": "1"}\n')
    with pytest.raises(ValueError, match=r"train.jsonl:2: byte 0xe9 at column 16 is not UTF-8"):
        read_rows(path)


def test_a_row_that_is_not_an_object_names_the_line(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n["a", "b"]\n')
    with pytest.raises(ValueError, match=r"sft.jsonl:2: expected a JSON object .*got list"):
        SFTDataset(path, tokenizer=None)
    array = tmp_path / "rows.json"
    array.write_text('[{"prompt": "a"},\n 3]')
    with pytest.raises(ValueError, match=r"rows.json:2: expected a JSON object"):
        read_rows(array)


@pytest.mark.parametrize("prompt", ["", "   ", [{"role": "user", "content": " "}]])
def test_empty_prompt_fails_at_load_time(tmp_path, prompt):
    path = tmp_path / "train.jsonl"
    path.write_text(ROW + "\n" + json.dumps({"prompt": prompt, "ground_truth": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl: prompt row 1: the (chat )?prompt (is empty|has no)"):
        load_prompts(path)

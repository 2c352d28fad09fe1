"""Tool schemas in the prompts: with multi-turn on, the chat template renders the tools (``tools=`` of
``apply_chat_template``), so the prompt ids the rollout starts from contain them; a template that ignores
tools, or plain-text prompts, fail early with the fix."""

from __future__ import annotations

import json

import pytest

from verl_trainer.agents import MultiTurnConfig, prompt_tool_schemas
from verl_trainer.algorithms import DataConfig, PromptDataModule
from verl_trainer.data.prompts import save_rows, to_verl_row
from verl_trainer.models.tiny import CHAT_TEMPLATE, build_tokenizer

TOOLS_TEMPLATE = (
    "{% if tools %}system: tools {% for tool in tools %}{{ tool | tojson }}{% endfor %}\n{% endif %}"
    + CHAT_TEMPLATE
)
"""The tiny template with a system line listing the tools' JSON schemas (the way Qwen / Hermes do)."""

CALCULATOR = "verl_trainer.agents.builtin_tools:calculator"


def _tokenizer(template: str):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def _data(tmp_path, tokenizer, tools, prompt=None) -> PromptDataModule:
    rows = [to_verl_row(prompt or [{"role": "user", "content": "12*34="}], "408", "arithmetic")] * 2
    save_rows(rows, tmp_path / "train.jsonl")
    cfg = DataConfig(train_files=str(tmp_path / "train.jsonl"), train_batch_size=2, max_prompt_length=512)
    return PromptDataModule(cfg, tokenizer, tools=tools)


def test_prompt_ids_contain_the_tool_schemas_when_multi_turn_is_on(tmp_path):
    tokenizer = _tokenizer(TOOLS_TEMPLATE)
    tools = prompt_tool_schemas(MultiTurnConfig(enable=True, tools=[CALCULATOR]))
    assert [t["function"]["name"] for t in tools] == ["calculator"]
    data = _data(tmp_path, tokenizer, tools)
    data.check(1)
    ids = next(iter(data.train_dataloader()))["prompts"][0].tolist()
    schema_ids = tokenizer.encode(json.dumps(tools[0]), add_special_tokens=False)
    text = tokenizer.decode(ids)
    assert any(ids[i: i + len(schema_ids)] == schema_ids for i in range(len(ids))), text
    assert '"expression"' in text and text.endswith("user: 12*34=\nassistant: ")
    without = _data(tmp_path, tokenizer, None)
    without.check(1)
    assert tokenizer.decode(next(iter(without.train_dataloader()))["prompts"][0].tolist()) == \
        "user: 12*34=\nassistant: "


def test_no_schemas_when_multi_turn_or_tools_in_prompt_is_off():
    assert prompt_tool_schemas(MultiTurnConfig(enable=False, tools=[CALCULATOR])) is None
    off = MultiTurnConfig(enable=True, tools=[CALCULATOR], tools_in_prompt=False)
    assert prompt_tool_schemas(off) is None


def test_a_template_that_ignores_tools_or_a_plain_text_prompt_is_refused_with_the_fix(tmp_path):
    tools = prompt_tool_schemas(MultiTurnConfig(enable=True, tools=[CALCULATOR]))
    with pytest.raises(ValueError, match=r"ignores tools=.*'calculator'.*tools_in_prompt=false"):
        _data(tmp_path, _tokenizer(CHAT_TEMPLATE), tools).check(1)
    with pytest.raises(ValueError, match=r"plain text.*data.chat_template=true.*tools_in_prompt=false"):
        _data(tmp_path, _tokenizer(TOOLS_TEMPLATE), tools, prompt="12*34=").check(1)


def test_trls_per_sample_tools_column_is_refused_naming_the_run_setting(tmp_path):
    tokenizer = _tokenizer(TOOLS_TEMPLATE)
    row = {**to_verl_row([{"role": "user", "content": "12*34="}], "408", "arithmetic"),
           "tools": [json.dumps({"name": "calculator"})]}  # TRL's dataset column: this row's tools
    save_rows([row] * 2, tmp_path / "train.jsonl")
    cfg = DataConfig(train_files=str(tmp_path / "train.jsonl"), train_batch_size=2, max_prompt_length=512)
    with pytest.raises(ValueError, match=r"row 0 has a `tools` column \(TRL's per-sample tools.*"
                                         r"algorithm.rollout.multi_turn.tools"):
        PromptDataModule(cfg, tokenizer).check(1)

"""A saved adapter is checked before peft and before any model loads: files, config, tensor names."""

from __future__ import annotations

import json
import shutil

import pytest
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from tests.engine.common import tiny_model
from verl_trainer.algorithms.sft import SFT, SFTConfig
from verl_trainer.engine import EngineConfig
from verl_trainer.engine.lora import apply_lora
from verl_trainer.engine.lora_files import AdapterFilesError
from verl_trainer.models import load_causal_lm


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny base model and a real peft adapter saved for it (q_proj and v_proj, rank 2)."""
    root = tmp_path_factory.mktemp("lora_files")
    model_path = tiny_model(str(root / "model"))
    peft_model = get_peft_model(load_causal_lm(model_path), LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    peft_model.save_pretrained(str(root / "adapter"))
    return model_path, root / "adapter"


def _copy(saved, tmp_path):
    shutil.copytree(saved[1], tmp_path / "adapter")
    return tmp_path / "adapter"


def _check(model_path, adapter):
    """What Trainer.check runs: the adapter against the base model's config, before any model loads."""
    from verl_trainer import Trainer

    module = SFT(SFTConfig(model_path=model_path, engine=EngineConfig(lora_adapter_path=str(adapter))))
    Trainer(strategy="fsdp2", devices=1, logger=False).check(module)


def test_a_good_adapter_passes_and_loads(saved, tmp_path):
    model_path, adapter = saved
    _check(model_path, adapter)
    config = EngineConfig(lora_adapter_path=str(adapter))
    model = apply_lora(load_causal_lm(model_path), config, "language_model")
    assert model.peft_config["default"].r == 2


def test_missing_or_malformed_files_are_named_before_peft(saved, tmp_path):
    model_path = saved[0]
    with pytest.raises(AdapterFilesError, match=r"lora_adapter_path=.*nowhere' does not exist .*local"):
        _check(model_path, tmp_path / "nowhere")
    adapter = _copy(saved, tmp_path)
    (adapter / "adapter_model.safetensors").unlink()  # peft used to ask the Hub for this local path
    with pytest.raises(AdapterFilesError, match=r"has no adapter_model.safetensors; save the adapter"):
        _check(model_path, adapter)
    shutil.copy(saved[1] / "adapter_model.safetensors", adapter)
    config_file = adapter / "adapter_config.json"
    good = json.loads(config_file.read_text())
    config_file.write_text('{"r": 2, "target_modules": ["q_proj"')
    with pytest.raises(AdapterFilesError, match=r"adapter_config.json' is not valid JSON \(.*\); save"):
        _check(model_path, adapter)
    config_file.write_text(json.dumps({**good, "r": "two", "target_modules": None}))
    with pytest.raises(AdapterFilesError, match=r"adapter_config.json' is not a usable LoRA adapter config: "
                                                r"'r' must be an int >= 1, got 'two'; 'target_modules'"):
        _check(model_path, adapter)
    with pytest.raises(AdapterFilesError, match="'r' must be an int"):  # and the engine's own path
        apply_lora(load_causal_lm(model_path), EngineConfig(lora_adapter_path=str(adapter)), "language_model")


def test_missing_or_unexpected_adapter_tensors_are_an_error(saved, tmp_path):
    model_path = saved[0]
    adapter = _copy(saved, tmp_path)
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(weights)
    dropped = sorted(tensors)[0]
    extra = dropped.replace("q_proj", "o_proj").replace("v_proj", "o_proj")
    save_file({**{k: v for k, v in tensors.items() if k != dropped}, extra: tensors[dropped]}, weights)
    message = rf"does not fit the model \(llama, target_modules=\[.*\]\): tensors 1 missing \({dropped}\); "
    with pytest.raises(AdapterFilesError, match=message + rf"1 unexpected \({extra}\)"):
        _check(model_path, adapter)
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(ValueError, match="adapter_model.safetensors' is damaged"):
        _check(model_path, adapter)

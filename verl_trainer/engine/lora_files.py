"""A saved peft adapter directory, checked before any model loads: :func:`check_adapter_dir`.

``EngineConfig.lora_adapter_path`` names a local directory with ``adapter_config.json`` and
``adapter_model.safetensors``. peft itself reads a missing file from the Hub (taking the local path for a
repo id), reports a malformed config deep inside ``json``, and loads adapter tensors that fit no layer of
the model with only a warning (missing ones stay at their fresh initialisation). Here, before peft and
before the base model is loaded:

* the directory and both files must exist locally (``adapter_model.bin`` is refused: it is a pickle);
* ``adapter_config.json`` must be a JSON object of a LoRA adapter (``peft_type`` LORA, an int ``r`` > 0,
  ``target_modules``), else :class:`AdapterFilesError` names the file and the problem;
* the weights file's header must be intact (:func:`~verl_trainer.models.weight_files.check_safetensors`);
* with the base model's config: the tensor names must be exactly those peft expects for that model and
  that adapter config (computed on an instance on the ``meta`` device), else the missing and the
  unexpected names are listed.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from verl_trainer.models.source import resolve_model_path
from verl_trainer.models.weight_files import check_safetensors
from verl_trainer.utils.listing import first_of

if TYPE_CHECKING:
    from collections.abc import Mapping

    from transformers import PretrainedConfig


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "AdapterFilesError", "check_adapter_dir", "check_adapters",
           "read_adapter_config"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_SHOWN = 4


class AdapterFilesError(ValueError):
    """A peft adapter directory is missing, malformed, or does not fit the model."""


def read_adapter_config(path: str | os.PathLike) -> dict[str, Any]:
    """The adapter config of directory ``path``, checked (see the module).

    Raises:
        AdapterFilesError: Naming the file, the problem and the fix.
    """
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise AdapterFilesError(
            f"lora_adapter_path={str(path)!r} is not a peft adapter directory (no {ADAPTER_CONFIG}); point "
            f"it at a local directory written by engine.save_adapter or PeftModel.save_pretrained"
        )
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AdapterFilesError(f"{str(file)!r} is not valid JSON ({exc}); save the adapter again") from None
    problems = []
    if not isinstance(config, dict):
        raise AdapterFilesError(f"{str(file)!r} is not a JSON object; save the adapter again")
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type is {config.get('peft_type')!r}, only 'LORA' is supported")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        problems.append(f"'r' must be an int >= 1, got {rank!r}")
    targets = config.get("target_modules")
    if not isinstance(targets, (str, list)) or not targets:
        problems.append(f"'target_modules' must be a module name, a list of them or 'all-linear', got "
                        f"{targets!r}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        problems.append(f"'lora_alpha' must be a number, got {alpha!r}")
    if problems:
        raise AdapterFilesError(f"{str(file)!r} is not a usable LoRA adapter config: {'; '.join(problems)}")
    return config


def _expected_names(directory: Path, model_config: PretrainedConfig, model_type: str) -> set[str]:
    """The tensor names peft saves for this adapter config on this model (built on ``meta``)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    from verl_trainer.models.hf_dir import auto_model_class  # lazy: 7 more modules only when used

    config = copy.deepcopy(model_config)
    if model_type == "value_model":
        config.num_labels = 1
    with torch.device("meta"):
        model = auto_model_class(model_type, config).from_config(config)
    peft_config = LoraConfig.from_pretrained(str(directory))  # local: the file exists
    peft_config.inference_mode = False
    peft_model = get_peft_model(model, peft_config)
    return set(get_peft_model_state_dict(peft_model))


def _listed(names: set[str]) -> str:
    return first_of(sorted(names), _SHOWN)


def check_adapter_dir(path: str | os.PathLike, model_config: PretrainedConfig | None = None,
                      model_type: str = "language_model") -> dict[str, Any]:
    """Check a peft adapter directory (see the module) and return its adapter config.

    Args:
        path: ``EngineConfig.lora_adapter_path``.
        model_config: The base model's HF config (``None``: the tensor names are not compared).
        model_type: ``"language_model"`` or ``"value_model"``.

    Raises:
        AdapterFilesError: Naming the directory or file, the problem and the fix.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterFilesError(f"lora_adapter_path={str(path)!r} does not exist (adapters load from a local "
                                f"directory only)")
    config = read_adapter_config(directory)
    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickled = " (it has adapter_model.bin, a pickle: save it as safetensors)" if (
            directory / "adapter_model.bin").is_file() else ""
        raise AdapterFilesError(f"lora_adapter_path={str(path)!r} has no {ADAPTER_WEIGHTS}{pickled}; save "
                                f"the adapter with engine.save_adapter or PeftModel.save_pretrained")
    stored = set(check_safetensors(weights))
    if model_config is not None:
        expected = _expected_names(directory, model_config, model_type)
        missing, unexpected = expected - stored, stored - expected
        if missing or unexpected:
            parts = ([f"{len(missing)} missing ({_listed(missing)})"] if missing else []) + (
                [f"{len(unexpected)} unexpected ({_listed(unexpected)})"] if unexpected else [])
            raise AdapterFilesError(
                f"the adapter at {str(path)!r} does not fit the model "
                f"({getattr(model_config, 'model_type', '?')}, target_modules={config['target_modules']!r}): "
                f"tensors {'; '.join(parts)}; use the adapter saved for this base model"
            )
    return config


def check_adapters(specs: Mapping[str, object]) -> None:
    """:func:`check_adapter_dir` for every engine spec with a ``lora_adapter_path`` (no model is loaded).

    Values that are not an ``EngineSpec`` (built engines) are skipped.

    Specs with a model factory are checked without a base config (their model is only known once built).
    """
    from transformers import AutoConfig

    from verl_trainer.engine.config import EngineSpec  # lazy: 44 more modules only when used

    for spec in specs.values():
        if not isinstance(spec, EngineSpec) or not spec.config.lora_adapter_path:
            continue
        model_config = None
        if spec.model is None and spec.config.model_path:
            model_config = AutoConfig.from_pretrained(resolve_model_path(spec.config.model_path))
        check_adapter_dir(spec.config.lora_adapter_path, model_config, spec.model_type)

"""LoRA part: peft adapters on an engine's HF model, applied before sharding, one place for every backend.

With ``EngineConfig.lora_rank > 0`` (or ``lora_adapter_path``) :func:`apply_lora` wraps the loaded model in a
``PeftModel`` before FSDP, FSDP2 or DeepSpeed shards it: every base weight is frozen, only the adapters (and
a value model's ``score`` head, through ``modules_to_save``) are trainable, so the optimizer holds the
adapters alone. peft passes the forward keywords through unchanged, so packed varlen attention, Ulysses SP
and dynamic micro-batching run as without LoRA.

An engine whose model carries adapters holds one :class:`LoRAAdapters` (``engine.lora``; ``None`` without,
and then nothing of this file runs during a step), to which ``BaseEngine``'s ``get_per_tensor_param``,
``disable_adapters`` and ``save_adapter`` delegate. ``Linear`` LoRA layers and LoRA on parameters (peft's
``ParamWrapper``: a MoE model's fused experts, ``engine/lora_params.py``; fsdp2 only, ``models/moe_lora.py``)
are supported; DoRA and embedding adapters are refused at build time.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from verl_trainer.engine.config import EngineConfig
from verl_trainer.engine.lora_export import (
    adapter_state_dict,
    clean_name,
    is_adapter_name,
    lora_targets,
    merged_hf_tensors,
)
from verl_trainer.engine.lora_files import check_adapter_dir
from verl_trainer.engine.lora_params import is_param_wrapper, param_targets
from verl_trainer.models.moe_lora import refuse_expert_lora
from verl_trainer.models.vlm import lora_exclusions
from verl_trainer.utils.distributed import barrier, get_rank

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel, TaskType

VALUE_HEADS = ("score", "classifier")
"""Head names of token-classification (value) models; kept fully trainable via ``modules_to_save``."""

NamedFullTensors = Callable[[Callable[[str], bool] | None], Iterator[tuple[str, torch.Tensor]]]
"""A backend's ``named_full_tensors(keep)``: ``(name, full tensor)`` for the names ``keep`` accepts."""


def _task_type(model_type: str) -> TaskType:
    from peft import TaskType

    return {"language_model": TaskType.CAUSAL_LM, "value_model": TaskType.TOKEN_CLS}[model_type]


def value_heads(model: torch.nn.Module) -> list[str]:
    """The head module names of a value model present in ``model`` (``score`` for most architectures)."""
    return [name for name in VALUE_HEADS if isinstance(getattr(model, name, None), torch.nn.Module)]


def build_lora_config(config: EngineConfig, model_type: str, model: torch.nn.Module) -> LoraConfig:
    """The peft ``LoraConfig`` of ``config`` for ``model``.

    A value model's head is excluded from the adapters and trained in full (``modules_to_save``); a
    vision-language model's vision tower gets no adapters (it stays frozen with the base weights).
    """
    from peft import LoraConfig

    heads = value_heads(model) if model_type == "value_model" else []
    vision = lora_exclusions(model)  # a VLM: adapters on the language model only (models/vlm.py)
    return LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=config.target_modules,
        target_parameters=config.target_parameters,
        lora_dropout=config.lora_dropout,
        bias="none",
        task_type=_task_type(model_type),
        exclude_modules=vision or heads or None,
        modules_to_save=heads or None,
        base_model_name_or_path=config.model_path or None,
    )


def find_peft_model(module: torch.nn.Module | None) -> PeftModel | None:
    """The ``PeftModel`` inside ``module`` (looking through wrappers with ``.module``), or ``None``."""
    from peft import PeftModel

    while module is not None and not isinstance(module, PeftModel) and hasattr(module, "module"):
        module = module.module
    return module if isinstance(module, PeftModel) else None


def check_supported(peft_model: PeftModel) -> None:
    """Refuse adapters the per-tensor export cannot merge (DoRA, embedding or convolution LoRA).

    Raises:
        ValueError: Naming the layer and the fix.
    """
    from peft.tuners.lora import Linear, LoraLayer

    adapter = peft_model.active_adapter
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if is_param_wrapper(module):  # LoRA on a parameter: MoE fused experts (engine/lora_params.py)
            refuse_expert_lora(name, module)
            continue
        if not isinstance(module, Linear):
            raise ValueError(
                f"LoRA on {name} ({type(module.get_base_layer()).__name__}) is not supported, only on linear "
                f"layers; set target_modules='all-linear' or list linear layers (e.g. ['q_proj', 'v_proj'])"
            )
        if module.use_dora.get(adapter, False):
            raise ValueError(f"DoRA adapters ({name}) are not supported; save the adapter without use_dora")


def apply_lora(model: torch.nn.Module, config: EngineConfig, model_type: str) -> torch.nn.Module:
    """Add LoRA adapters to ``model`` as ``config`` asks (before sharding); returns ``model`` when off.

    Args:
        model: The HF model (or a ``PeftModel`` from a user's factory, returned as is when LoRA is off).
        config: ``lora_rank``, ``lora_alpha``, ``target_modules``, ``lora_dropout``, ``lora_adapter_path``.
        model_type: ``"language_model"`` or ``"value_model"``.

    Returns:
        A ``PeftModel`` whose base weights are frozen, or ``model``.

    Raises:
        ValueError: LoRA asked for a model that has adapters already, an adapter directory that is not
            one or does not fit the model (``lora_files.AdapterFilesError``), a ``lora_rank`` that
            contradicts the saved adapter's, or unsupported layers.
    """
    peft_model = find_peft_model(model)
    if not config.lora_enabled:
        if peft_model is not None:
            check_supported(peft_model)
        return model
    if peft_model is not None:
        raise ValueError(
            f"the model factory returned a {type(peft_model).__name__} (it has adapters) and lora_rank="
            f"{config.lora_rank} / lora_adapter_path={config.lora_adapter_path!r} asks for more; set "
            f"lora_rank=0 and lora_adapter_path=null, or return the base model"
        )
    from peft import PeftModel, get_peft_model

    if config.lora_adapter_path is not None:

        path = Path(config.lora_adapter_path)
        check_adapter_dir(path, getattr(model, "config", None), model_type)  # local files, before peft
        peft_model = PeftModel.from_pretrained(
            model, str(path), is_trainable=True, autocast_adapter_dtype=False
        )
        saved_rank = peft_model.peft_config[peft_model.active_adapter].r
        if config.lora_rank not in (0, saved_rank):
            raise ValueError(
                f"lora_rank={config.lora_rank} but the adapter at {str(path)!r} has rank {saved_rank}; set "
                f"lora_rank=0 (take the adapter's) or {saved_rank}"
            )
    else:
        peft_model = get_peft_model(model, build_lora_config(config, model_type, model),
                                    autocast_adapter_dtype=False)
    check_supported(peft_model)
    return peft_model


def require_lora(lora: LoRAAdapters | None, owner: str, what: str) -> LoRAAdapters:
    """``lora``, the engine's LoRA part, when there is one.

    Args:
        lora: The engine's part (``engine.lora``).
        owner: The engine's class name, for the message.
        what: The call that needs adapters, for the message.

    Raises:
        RuntimeError: ``lora`` is ``None``; the message names the call and how to add adapters.
    """
    if lora is None:
        raise RuntimeError(
            f"{what} needs LoRA adapters, but {owner} has none; set "
            f"EngineConfig.lora_rank > 0 (or lora_adapter_path, or a model factory returning a PeftModel)"
        )
    return lora


class LoRAAdapters:
    """The LoRA part of an engine: its ``PeftModel`` and what only a model with adapters does.

    Args:
        peft_model: The engine's ``PeftModel`` (the same object before and after sharding wraps it).
    """

    def __init__(self, peft_model: PeftModel) -> None:
        self.peft_model = peft_model

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Inside the block the model computes as the base model (adapters and saved heads bypassed)."""
        with self.peft_model.disable_adapter():
            yield

    def per_tensor_params(self, named_full_tensors: NamedFullTensors, adapters_only: bool = False
                          ) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine's full tensors with the adapters merged, or the adapters alone; a collective.

        Args:
            named_full_tensors: The backend's ``(state-dict name, full tensor)`` source, given the names to
                keep (``None``: all).
            adapters_only: Yield only the adapter tensors, under peft's file names
                (``base_model.model.<...>.q_proj.lora_A.weight``; what ``adapter_model.safetensors`` holds).

        Yields:
            Without ``adapters_only``: the base model's HF names and shapes, LoRA merged
            (``W + lora_alpha/r · B·A``, computed per tensor; the engine's weights are not modified), so the
            tensors load into the plain transformers model (rollout weight sync, HF export).
        """
        peft_model = self.peft_model
        adapter = peft_model.active_adapter
        if adapters_only:
            yield from adapter_state_dict(named_full_tensors(is_adapter_name), peft_model, adapter).items()
        else:
            yield from merged_hf_tensors(named_full_tensors(None), lora_targets(peft_model, adapter), adapter,
                                         param_targets(peft_model, adapter, clean_name))

    def save(self, path: str | os.PathLike, tensors: dict[str, torch.Tensor], model_path: str | None) -> str:
        """Write ``tensors`` (the adapters, gathered on every rank) as a peft directory; rank 0 writes.

        Returns:
            ``path`` as a string, once the files exist (every rank waits for rank 0).
        """
        from safetensors.torch import save_file

        peft_model = self.peft_model
        if get_rank() == 0:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            peft_config = copy.deepcopy(peft_model.peft_config[peft_model.active_adapter])
            peft_config.inference_mode = True
            if not peft_config.base_model_name_or_path and model_path:
                peft_config.base_model_name_or_path = model_path
            peft_config.save_pretrained(str(out))
            save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        barrier()
        return str(path)

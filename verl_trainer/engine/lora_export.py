"""Export of a LoRA model's weights: merged full tensors under the base model's HF names, or the adapters.

The engines stream ``(name, full_tensor)`` pairs of the peft model's state dict one at a time (each gathered
when reached). :func:`merged_hf_tensors` turns that stream into the base model's tensors: a LoRA layer's
``base_layer.weight`` ``W [out, in]`` becomes ``W + scale · B·A`` (``A [r, in]``, ``B [out, r]``) computed
from the gathered tensors — the model itself is never merged in place — and every name loses peft's
prefixes, so the result loads into the plain transformers model (``load_state_dict``, a rollout's
``update_weights``). :func:`adapter_state_dict` gives the adapters under peft's file names (what
``adapter_model.safetensors`` holds). LoRA on parameters (fused MoE experts) merges through
``lora_params.ParamMerger``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verl_trainer.engine.lora_params import ParamMerger, ParamTarget, is_param_wrapper, without_base_layers

if TYPE_CHECKING:
    from peft import PeftModel

PEFT_PREFIX = "base_model.model."
WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_LORA_PART = re.compile(r"^(?P<prefix>.+?)\.(?P<part>base_layer|lora_A|lora_B)\.(?P<rest>.+)$")
_SAVED_PART = re.compile(r"^(?P<prefix>.+?)\.(?P<part>original_module|modules_to_save)\.(?P<rest>.+)$")


def clean_name(name: str) -> str:
    """A state-dict / module name without FSDP1, activation-checkpoint or ``torch.compile`` wrapper parts."""
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def is_adapter_name(name: str) -> bool:
    """Whether a peft state-dict name is an adapter tensor (LoRA ``A``/``B``, a ``modules_to_save`` copy)."""
    return "lora_" in name or ".modules_to_save." in name


@dataclass(frozen=True)
class LoraTarget:
    """How one LoRA layer's delta is formed.

    Attributes:
        scale: ``lora_alpha / r`` (or peft's rsLoRA scale) of the active adapter.
        fan_in_fan_out: The base weight is stored ``[in, out]`` (GPT-2's ``Conv1D``): the delta is transposed.
    """

    scale: float
    fan_in_fan_out: bool


def lora_targets(peft_model: torch.nn.Module, adapter: str) -> dict[str, LoraTarget]:
    """The LoRA layers of ``peft_model`` by module name (wrapper parts removed), for ``adapter``."""
    from peft.tuners.lora import LoraLayer

    return {
        clean_name(name): LoraTarget(
            float(module.scaling[adapter]), bool(getattr(module, "fan_in_fan_out", False))
        )
        for name, module in peft_model.named_modules()
        if isinstance(module, LoraLayer) and not is_param_wrapper(module) and adapter in module.lora_A
    }


def hf_name(name: str) -> str:
    """The base model's name of a peft state-dict name: ``base_model.model.``, all ``.base_layer`` dropped."""
    return without_base_layers(name.removeprefix(PEFT_PREFIX))


def merge_delta(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                target: LoraTarget) -> torch.Tensor:
    """``W + scale · B·A`` in float32, returned in ``W``'s dtype (a new tensor; ``W`` is not modified).

    Args:
        weight: ``[out, in]`` (``[in, out]`` when ``fan_in_fan_out``).
        lora_a: ``[r, in]``.
        lora_b: ``[out, r]``.
        target: The layer's scale and layout.
    """
    delta = lora_b.float() @ lora_a.float()
    if target.fan_in_fan_out:
        delta = delta.T
    return (weight.float() + target.scale * delta).to(weight.dtype)


def merged_hf_tensors(named: Iterable[tuple[str, torch.Tensor]], targets: dict[str, LoraTarget],
                      adapter: str, params: dict[str, ParamTarget] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn a peft model's ``(name, full_tensor)`` stream into the base model's merged tensors.

    A LoRA layer's weight is held until its ``A`` and ``B`` have arrived (state-dict order puts them right
    after it), so at most a few full tensors are alive at once. ``modules_to_save`` copies (a value model's
    head) replace their originals; other adapters than ``adapter`` are dropped.

    Args:
        named: ``(peft_name, full_tensor)`` in state-dict order.
        targets: :func:`lora_targets` of the model (names as in the stream, wrapper parts removed).
        adapter: The active adapter's name.
        params: ``lora_params.param_targets`` of the model (LoRA on parameters, e.g. fused MoE experts):
            each parameter is held until its ``A`` and ``B`` arrived, then merged (``lora_params``).

    Yields:
        ``(hf_name, tensor)`` with the base model's names and shapes.

    Raises:
        RuntimeError: If the stream ends with a LoRA layer whose weight, ``A`` or ``B`` never arrived.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    param_merger = ParamMerger(params or {})
    for raw_name, tensor in named:
        name = clean_name(raw_name)
        if param_merger.owns(name):
            merged_param = param_merger.add(name, tensor)
            if merged_param is not None:
                yield hf_name(merged_param[0]), merged_param[1]
            continue
        lora = _LORA_PART.match(name)
        if lora and lora["prefix"] in targets:
            prefix, part, rest = lora["prefix"], lora["part"], lora["rest"]
            if part == "base_layer" and rest != "weight":
                yield hf_name(name), tensor  # the base layer's bias
                continue
            if part != "base_layer" and rest != f"{adapter}.weight":
                continue  # another adapter's A / B
            parts = pending.setdefault(prefix, {})
            parts[part] = tensor
            if len(parts) == 3:
                del pending[prefix]
                merged = merge_delta(parts["base_layer"], parts["lora_A"], parts["lora_B"], targets[prefix])
                yield hf_name(f"{prefix}.weight"), merged
            continue
        saved = _SAVED_PART.match(name)
        if saved:
            if saved["part"] == "modules_to_save" and saved["rest"].startswith(f"{adapter}."):
                rest = saved["rest"].removeprefix(f"{adapter}.")
                yield hf_name(f"{saved['prefix']}.{rest}"), tensor
            continue
        yield hf_name(name), tensor
    if pending or param_merger.pending:
        incomplete = {prefix: sorted(parts) for prefix, parts in pending.items()} | param_merger.incomplete()
        raise RuntimeError(f"LoRA layers whose weight, lora_A or lora_B never arrived: {incomplete}")


def adapter_state_dict(named: Iterable[tuple[str, torch.Tensor]], peft_model: PeftModel,
                       adapter: str) -> dict[str, torch.Tensor]:
    """The adapters under peft's file names (``...q_proj.lora_A.weight``, ``score.weight``), as peft saves.

    Args:
        named: ``(peft_name, full_tensor)`` of the adapter tensors (see :func:`is_adapter_name`).
        peft_model: The ``PeftModel`` (for its config and ``modules_to_save``).
        adapter: The adapter's name.

    Returns:
        ``{name: tensor}`` — what ``adapter_model.safetensors`` holds (peft's ``get_peft_model_state_dict``
        naming), contiguous CPU copies.
    """
    from peft.utils import get_peft_model_state_dict

    full = {clean_name(name): tensor.detach().cpu().contiguous().clone() for name, tensor in named}
    return get_peft_model_state_dict(peft_model, state_dict=full, adapter_name=adapter,
                                     save_embedding_layers=False)

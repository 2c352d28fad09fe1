"""LoRA part: peft adapters on an engine's HF model, applied before sharding, one place for every backend.

With ``EngineConfig.lora_rank > 0`` (or ``lora_adapter_path``) :func:`apply_lora` wraps the loaded model in a
``PeftModel`` (``get_peft_model`` / ``PeftModel.from_pretrained``) before FSDP, FSDP2 or DeepSpeed shards it:
every base weight is frozen, only the adapters (and a value model's ``score`` head, through peft's
``modules_to_save``) are trainable, so ``optim.build_optimizer`` (trainable parameters only) gives AdamW and
its state the adapters alone. peft's wrapper passes the forward keywords through unchanged
(``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``, the Ulysses group), so packed varlen attention,
Ulysses SP and dynamic micro-batching run as without LoRA.

:class:`LoRAMixin` gives an engine:

* ``build_model()``: the user's model factory or the HF checkpoint, varlen attention, then the adapters;
* ``get_per_tensor_param(adapters_only=False)``: merged full weights under the base model's HF names
  (``W + scale·B·A`` per tensor, nothing merged in place), or with ``adapters_only=True`` the adapter
  tensors under peft's file names;
* ``disable_adapters()``: a context in which the model is the base model (the reference policy of RL
  without a second copy of the weights);
* ``save_adapter(path)``: a peft adapter directory loadable with ``PeftModel.from_pretrained``;
* ``num_trainable_parameters()``.

Only ``Linear`` LoRA layers are supported (``"all-linear"`` and the usual projection names); DoRA and
embedding adapters are refused at build time.
"""

from __future__ import annotations

import contextlib
import copy
import os
from abc import abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from verl_trainer.engine.config import EngineConfig
from verl_trainer.engine.lora_export import (
    adapter_state_dict,
    is_adapter_name,
    lora_targets,
    merged_hf_tensors,
)
from verl_trainer.utils.distributed import barrier, get_rank, get_world_size, is_initialized

VALUE_HEADS = ("score", "classifier")
"""Head names of token-classification (value) models; kept fully trainable via ``modules_to_save``."""

ModelFactory = Callable[[], torch.nn.Module]
"""A zero-argument callable returning the model (a transformers model or ``PeftModel``)."""


def _task_type(model_type: str) -> Any:
    from peft import TaskType

    return {"language_model": TaskType.CAUSAL_LM, "value_model": TaskType.TOKEN_CLS}[model_type]


def value_heads(model: torch.nn.Module) -> list[str]:
    """The head module names of a value model present in ``model`` (``score`` for most architectures)."""
    return [name for name in VALUE_HEADS if isinstance(getattr(model, name, None), torch.nn.Module)]


def build_lora_config(config: EngineConfig, model_type: str, model: torch.nn.Module) -> Any:
    """The peft ``LoraConfig`` of ``config`` for ``model``.

    A value model's head is excluded from the adapters and trained in full (``modules_to_save``).
    """
    from peft import LoraConfig

    heads = value_heads(model) if model_type == "value_model" else []
    return LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=config.target_modules,
        lora_dropout=config.lora_dropout,
        bias="none",
        task_type=_task_type(model_type),
        exclude_modules=heads or None,
        modules_to_save=heads or None,
        base_model_name_or_path=config.model_path or None,
    )


def find_peft_model(module: torch.nn.Module | None) -> Any:
    """The ``PeftModel`` inside ``module`` (looking through wrappers with ``.module``), or ``None``."""
    from peft import PeftModel

    while module is not None and not isinstance(module, PeftModel) and hasattr(module, "module"):
        module = module.module
    return module if isinstance(module, PeftModel) else None


def check_supported(peft_model: Any) -> None:
    """Refuse adapters the per-tensor export cannot merge (DoRA, embedding or convolution LoRA).

    Raises:
        ValueError: Naming the layer and the fix.
    """
    from peft.tuners.lora import Linear, LoraLayer

    adapter = peft_model.active_adapter
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer):
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
            one, a ``lora_rank`` that contradicts the saved adapter's, or unsupported layers.
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
        if not (path / "adapter_config.json").is_file():
            raise ValueError(
                f"lora_adapter_path={str(path)!r} is not a peft adapter directory (no adapter_config.json); "
                f"point it at a directory written by engine.save_adapter or PeftModel.save_pretrained"
            )
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


class LoRAMixin:
    """Model building, weight export with LoRA merged, adapter switching and adapter export for an engine.

    Attributes read: ``config``, ``module``, ``model_factory``, ``MODEL_TYPE``; the backend supplies
    :meth:`named_full_tensors` and the model type ``load_hf_model`` (``engine/heads.py``).
    """

    config: EngineConfig
    module: torch.nn.Module | None
    model_factory: ModelFactory | None
    MODEL_TYPE: str
    _num_trainable: int = 0

    def build_model(self) -> torch.nn.Module:
        """The model to shard: ``model_factory()`` or the checkpoint, varlen attention, then LoRA."""
        if self.model_factory is None:
            model = self.load_hf_model()  # type: ignore[attr-defined]  (model-type part)
        else:
            model = self.model_factory()
            if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
                raise TypeError(
                    f"the model factory must return a transformers model or PeftModel (an nn.Module with "
                    f".config and the HF forward), got {type(model).__name__}"
                )
            from verl_trainer.engine.heads import attention_for
            from verl_trainer.models.attention import ensure_varlen_attention
            from verl_trainer.models.ulysses_attention import check_ulysses_compatible

            model = ensure_varlen_attention(model, attention_for(self.config))
            sp = self.config.ulysses_sequence_parallel_size
            if sp > 1:
                check_ulysses_compatible(model.config, sp, get_world_size() if is_initialized() else None)
        model = apply_lora(model, self.config, self.MODEL_TYPE)
        self._num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return model

    # ------------------------------------------------------------------------------------- adapters
    @property
    def peft_model(self) -> Any:
        """The engine's ``PeftModel`` (``None`` without adapters)."""
        return find_peft_model(self.module)

    @property
    def has_adapters(self) -> bool:
        """True when the engine's model carries peft adapters."""
        return self.peft_model is not None

    def _require_peft(self, what: str) -> Any:
        peft_model = self.peft_model
        if peft_model is None:
            raise RuntimeError(
                f"{what} needs LoRA adapters, but {type(self).__name__} has none; set "
                f"EngineConfig.lora_rank > 0 (or lora_adapter_path, or a model factory returning a PeftModel)"
            )
        return peft_model

    @contextlib.contextmanager
    def disable_adapters(self) -> Iterator[None]:
        """Inside the block the model computes as the base model (adapters and saved heads bypassed).

        Raises:
            RuntimeError: If the engine has no adapters.
        """
        with self._require_peft("disable_adapters()").disable_adapter():
            yield

    def num_trainable_parameters(self) -> int:
        """Trainable elements of the full (unsharded) model, counted when it was built."""
        return self._num_trainable

    # ------------------------------------------------------------------------------- weight export
    @abstractmethod
    def named_full_tensors(
        self, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Backend part: state-dict ``(name, full_tensor)`` for the names ``keep`` accepts; a collective."""

    def get_per_tensor_param(self, adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full_tensor)`` one at a time; a collective, every rank must iterate to the end.

        Args:
            adapters_only: With adapters: yield only the adapter tensors, under peft's file names
                (``base_model.model.<...>.q_proj.lora_A.weight``; what ``adapter_model.safetensors`` holds).

        Yields:
            Without ``adapters_only``: the base model's HF names and shapes, LoRA merged
            (``W + lora_alpha/r · B·A``, computed per tensor; the engine's weights are not modified), so the
            tensors load into the plain transformers model (rollout weight sync, HF export).

        Raises:
            RuntimeError: ``adapters_only=True`` on an engine without adapters.
        """
        peft_model = self.peft_model
        if adapters_only:
            self._require_peft("get_per_tensor_param(adapters_only=True)")
            adapters = self.named_full_tensors(is_adapter_name)
            yield from adapter_state_dict(adapters, peft_model, peft_model.active_adapter).items()
        elif peft_model is None:
            yield from self.named_full_tensors()
        else:
            adapter = peft_model.active_adapter
            targets = lora_targets(peft_model, adapter)
            yield from merged_hf_tensors(self.named_full_tensors(), targets, adapter)

    def save_adapter(self, path: str | os.PathLike) -> str:
        """Write the adapters as a peft directory (``adapter_config.json`` + ``adapter_model.safetensors``).

        A collective: call it on every rank; rank 0 writes, every rank returns once the files exist.
        ``PeftModel.from_pretrained(base_model, path)`` loads it; so does ``EngineConfig.lora_adapter_path``.

        Returns:
            ``path`` as a string.
        """
        from safetensors.torch import save_file

        peft_model = self._require_peft("save_adapter()")
        tensors = dict(self.get_per_tensor_param(adapters_only=True))
        if get_rank() == 0:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            peft_config = copy.deepcopy(peft_model.peft_config[peft_model.active_adapter])
            peft_config.inference_mode = True
            if not peft_config.base_model_name_or_path and self.config.model_path:
                peft_config.base_model_name_or_path = self.config.model_path
            peft_config.save_pretrained(str(out))
            save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        barrier()
        return str(path)

"""Checkpoint part of the DeepSpeed engine: DeepSpeed's own format, written atomically, read safely.

Layout of a checkpoint directory ``path`` (shared parts from ``engine/checkpoint.py``)::

    path/deepspeed/state/...          DeepSpeed's format: mp_rank_00_model_states.pt (ZeRO-1/2, rank 0) or
                                      zero_pp_rank_{r}_mp_rank_00_model_states.pt (ZeRO-3, every rank), and
                                      zero_pp_rank_{r}_mp_rank_00_optim_states.pt (every rank: its fp32
                                      partition and AdamW state)
    path/deepspeed/latest             the tag ("state"), for DeepSpeed's own tools
    path/deepspeed/zero_to_fp32.py    DeepSpeed's consolidation script (written by DeepSpeed)
    path/extra_state_rank{r}.pt       lr scheduler, RNG states, global_step
    path/meta.json                    global_step, world_size, backend, model_type, zero_stage
    path/huggingface/                 the model's HF config, tokenizer and generation config

Everything is written into a temporary sibling directory and renamed into place when every rank is done.
DeepSpeed itself loads its files with ``torch.load(weights_only=False)``, i.e. it would unpickle whatever
a file holds; :meth:`DeepSpeedCheckpointMixin.load_checkpoint` runs it under
:func:`safe_checkpoint_engine` (DeepSpeed's checkpoint engine reads through :func:`weights_only_load`,
which names a refused file) and :func:`weights_only_torch_load` (every other ``torch.load`` is forced to
``weights_only``), so only tensors, plain data and the few DeepSpeed classes its files contain
(:data:`DEEPSPEED_SAFE_GLOBALS`) are accepted.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from verl_trainer.engine.checkpoint import (
    DEEPSPEED_SUBDIR,
    META_FILE,
    atomic_checkpoint_dir,
    load_extra_state,
    resolve_checkpoint_dir,
    save_extra_state,
    write_meta,
)
from verl_trainer.engine.config import EngineConfig
from verl_trainer.utils.safe_load import refusal, safe_torch_load

if TYPE_CHECKING:
    import deepspeed
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from torch.serialization import MAP_LOCATION

CHECKPOINT_TAG = "state"
_FORCE_SAFE, _FORCE_UNSAFE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"

DEEPSPEED_SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""Plain-data classes DeepSpeed pickles into its optimizer files (found by loading each ZeRO stage's files
with ``weights_only=True``); a DeepSpeed version that adds another fails loudly, naming it."""


def _safe_globals() -> list[Any]:
    found = []
    for qualname in DEEPSPEED_SAFE_GLOBALS:
        module, _, attr = qualname.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):  # moved or gone in this DeepSpeed version
            continue
    return found


def weights_only_load(path: str, map_location: MAP_LOCATION = None) -> Any:
    """``torch.load(path, weights_only=True)`` with DeepSpeed's plain-data classes allowed.

    Raises:
        UnsafeCheckpointError: Naming ``path``, if it holds anything else or is unreadable.
    """
    return safe_torch_load(path, _safe_globals(), map_location=map_location or "cpu")


class _SafeCheckpointEngine:
    """DeepSpeed's checkpoint engine with ``load`` replaced by :func:`weights_only_load` (file named)."""

    def __init__(self, inner: CheckpointEngine) -> None:
        self._inner = inner

    def load(self, path: str, map_location: MAP_LOCATION = None) -> Any:
        """Load one of DeepSpeed's files safely."""
        return weights_only_load(path, map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def safe_checkpoint_engine(ds_engine: deepspeed.DeepSpeedEngine) -> Iterator[None]:
    """Within the block, ``ds_engine`` reads its checkpoint files through :func:`weights_only_load`.

    DeepSpeed reads model and optimizer files through ``ds_engine.checkpoint_engine.load``; swapping it
    makes a refused file an :class:`UnsafeCheckpointError` that names it. Every other ``torch.load`` is
    still forced to ``weights_only`` by :func:`weights_only_torch_load`.
    """
    inner = ds_engine.checkpoint_engine
    ds_engine.checkpoint_engine = _SafeCheckpointEngine(inner)
    try:
        with weights_only_torch_load():
            yield
    finally:
        ds_engine.checkpoint_engine = inner


@contextlib.contextmanager
def weights_only_torch_load() -> Iterator[None]:
    """Every ``torch.load`` inside the block is ``weights_only=True`` (DeepSpeed's classes allowed).

    DeepSpeed passes ``weights_only=False`` explicitly, from its checkpoint engine and from
    ``zero_to_fp32`` (ZeRO-3 module-only loads); torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` overrides that
    per call, so it is set for the block only (and restored after, also on error).
    """
    saved = {k: os.environ.pop(k, None) for k in (_FORCE_SAFE, _FORCE_UNSAFE)}
    os.environ[_FORCE_SAFE] = "1"
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class DeepSpeedCheckpointMixin:
    """``save_checkpoint`` / ``load_checkpoint`` for the DeepSpeed engine.

    Attributes read: ``ds_engine``, ``module``, ``optimizer``, ``lr_scheduler``, ``config``, ``backend``,
    ``MODEL_TYPE``, ``has_adapters`` (LoRA: frozen base weights are not saved; the model path has them).
    """

    has_adapters: bool
    ds_engine: deepspeed.DeepSpeedEngine | None
    module: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None
    config: EngineConfig
    backend: str
    MODEL_TYPE: str

    def save_checkpoint(self, path: str, global_step: int = 0, **kwargs: Any) -> None:
        """Save model, ZeRO optimizer partitions, scheduler and RNG atomically to ``path``; a collective."""
        with atomic_checkpoint_dir(path) as tmp:
            self.ds_engine.save_checkpoint(
                str(tmp / DEEPSPEED_SUBDIR), tag=CHECKPOINT_TAG, client_state={}, save_latest=True,
                exclude_frozen_parameters=self.has_adapters,
            )  # ``latest``: DeepSpeed's ZeRO-3 module-only load ignores the tag and reads it
            save_extra_state(tmp, self.lr_scheduler, global_step)
            meta = {
                "global_step": int(global_step),
                "world_size": dist.get_world_size(),
                "backend": self.backend,
                "model_type": self.MODEL_TYPE,
                "zero_stage": self.config.zero_stage,
                "model_path": self.config.model_path,
            }
            write_meta(tmp, meta, getattr(self.module, "config", None), self.config.model_path)

    def load_checkpoint(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote (same ZeRO stage and world size); a collective.

        An inference-only engine (no optimizer) loads the model weights only.

        Returns:
            ``meta.json``'s content (``global_step``, ``world_size``, ``backend``, ...).

        Raises:
            FileNotFoundError: If there is no checkpoint at ``path``.
            ValueError: If the checkpoint was written with another ZeRO stage.
        """
        directory = resolve_checkpoint_dir(path)
        meta = json.loads((directory / META_FILE).read_text()) if (directory / META_FILE).exists() else {}
        saved_stage = meta.get("zero_stage", self.config.zero_stage)
        if saved_stage != self.config.zero_stage:
            raise ValueError(
                f"checkpoint {str(directory)!r} was written with zero_stage={saved_stage}, this engine "
                f"runs zero_stage={self.config.zero_stage}; load it with the same stage"
            )
        train = self.optimizer is not None
        if not train and self.config.zero_stage == 3:
            self._load_zero3_module_only(directory / DEEPSPEED_SUBDIR)
            payload = load_extra_state(directory, None)
            meta.setdefault("global_step", payload.get("global_step", 0))
            return meta
        with safe_checkpoint_engine(self.ds_engine):
            load_path, _ = self.ds_engine.load_checkpoint(
                str(directory / DEEPSPEED_SUBDIR),
                tag=CHECKPOINT_TAG,
                load_optimizer_states=train,
                load_lr_scheduler_states=False,
                load_module_only=not train,
                load_module_strict=not self.has_adapters,
            )
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {str(directory / DEEPSPEED_SUBDIR)!r}")
        payload = load_extra_state(directory, self.lr_scheduler)
        meta.setdefault("global_step", payload.get("global_step", 0))
        return meta

    def _load_zero3_module_only(self, ds_dir: Path) -> None:
        """Weights of a ZeRO-3 checkpoint into an inference-only ZeRO-3 engine; a collective.

        DeepSpeed's own path fails here (0.19: its module-only ZeRO-3 load ends in
        ``DeepSpeedZeRoOffload._restore_from_bit16_weights``, which does not exist), so: consolidate the
        fp32 weights with DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` and write each
        partitioned parameter through ``GatheredParameters``.
        """
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        assert self.module is not None
        if not (ds_dir / CHECKPOINT_TAG).is_dir():
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {str(ds_dir)!r}")
        try:
            with weights_only_torch_load():
                state = get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag=CHECKPOINT_TAG)
        except pickle.UnpicklingError as exc:  # DeepSpeed's own torch.load: name the directory at least
            raise refusal(ds_dir / CHECKPOINT_TAG, f"a file in it failed to load ({exc})") from None
        missing = [name for name, _ in self.module.named_parameters() if name not in state]
        if missing:
            raise ValueError(f"checkpoint {str(ds_dir)!r} has no weights for {missing[:5]} ...")
        for name, param in self.module.named_parameters():
            with GatheredParameters([param], modifier_rank=0), torch.no_grad():
                if dist.get_rank() == 0:
                    param.copy_(state[name].to(param.dtype))

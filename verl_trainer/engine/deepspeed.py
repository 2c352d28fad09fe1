"""DeepSpeed engines: ZeRO stage 1, 2 or 3 (``deepspeed``, ``deepspeed_stage_{1,2,3}``).

:class:`DeepSpeedEngine` is one backend class (``BaseEngine``'s loop and parts, ``OptimizerMixin``'s LR
schedule, DeepSpeed's checkpoints), registered for both model types. What is DeepSpeed-specific:

* ``deepspeed.initialize`` with a generated config (``engine/deepspeed_config.py``) and the torch optimizer
  built from ``OptimConfig`` (``engine/optimizers.py``); ``gradient_accumulation_steps`` stays 1 and the
  last micro-batch is marked with ``set_gradient_accumulation_boundary``, so no loss is divided by the
  micro-batch count, and gradients are reduced once per step (:meth:`DeepSpeedEngine._grad_sync_context`).
* Every forward goes through ``DeepSpeedEngine.forward`` (:class:`DeepSpeedForward`), Ulysses included.
* ``optimizer_step`` is DeepSpeed's ``step`` (global grad norm, clipping, a non-finite norm zeroes the
  gradients and skips the step; fp16 also adjusts its loss scale); the LR schedule is a torch ``LambdaLR``
  on the same optimizer, stepped by ``lr_scheduler_step`` only.
* The C++ op ``deepspeed.initialize`` JIT-builds is loaded first by ``engine/deepspeed_ops.py``.
* ``named_full_tensors`` gathers one ZeRO-3 parameter at a time (``GatheredParameters``).
* Checkpoints: DeepSpeed's format under ``path/deepspeed/`` plus the shared extra state, ``meta.json`` and
  HF config, written atomically, read with ``weights_only=True`` (``engine/deepspeed_checkpoint.py``).

``import deepspeed`` happens in :meth:`DeepSpeedEngine.initialize`; without the package it raises
``ImportError``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from verl_trainer.engine.base import BaseEngine
from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.engine.deepspeed_checkpoint import DeepSpeedCheckpointMixin
from verl_trainer.engine.deepspeed_config import build_deepspeed_config
from verl_trainer.engine.deepspeed_ops import prepare_deepspeed_ops
from verl_trainer.engine.optim import OptimizerMixin, build_lr_scheduler
from verl_trainer.engine.optimizers import build_optimizer
from verl_trainer.engine.registry import EngineRegistry
from verl_trainer.engine.topology import engine_topology
from verl_trainer.models.hf_files import MODEL_TYPES
from verl_trainer.utils.distributed import is_initialized

if TYPE_CHECKING:
    from types import ModuleType

    import deepspeed
    from transformers.utils import ModelOutput

if importlib.util.find_spec("deepspeed") is None:
    raise ImportError("the deepspeed engine needs deepspeed: pip install 'verl-trainer[deepspeed]'")

DEEPSPEED_BACKENDS = ("deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3")
DEVICES = ["cpu", "cuda"]


def _import_deepspeed(device_type: str) -> ModuleType:
    """Import deepspeed, pinning its accelerator to our device on first import (``DS_ACCELERATOR``).

    Raises:
        RuntimeError: If deepspeed was already imported with an accelerator for another device.
    """
    os.environ.setdefault("DS_ACCELERATOR", device_type)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != device_type:
        raise RuntimeError(
            f"deepspeed's accelerator is {name!r} but this engine runs on {device_type!r}; set "
            f"DS_ACCELERATOR={device_type} (or VERL_ENGINE_DEVICE) before deepspeed is first imported"
        )
    return deepspeed


class DeepSpeedForward:
    """The model the shared forwards (``packed_forward``, the Ulysses forwards) call.

    Calls go through ``DeepSpeedEngine.forward``; ``config`` is the HF model's (the DeepSpeed engine's own
    ``config`` attribute is its DeepSpeed config, which those functions would read instead).

    Args:
        ds_engine: The ``deepspeed.DeepSpeedEngine``.
    """

    def __init__(self, ds_engine: deepspeed.DeepSpeedEngine) -> None:
        self.ds_engine = ds_engine
        self.config = ds_engine.module.config

    def __call__(self, *args: Any, **kwargs: Any) -> ModelOutput:
        """``DeepSpeedEngine.forward(*args, **kwargs)`` (the HF output)."""
        return self.ds_engine(*args, **kwargs)


class DeepSpeedEngine(OptimizerMixin, DeepSpeedCheckpointMixin, BaseEngine):
    """DeepSpeed ZeRO-1/2/3 engine for either model type (``model_type``: its part, ``engine/heads.py``).

    Args:
        config: Engine config; ``zero_stage`` picks the ZeRO stage, ``deepspeed_config`` is merged over
            the generated DeepSpeed config.
        optim_config: Optimizer config; ``None`` builds an inference-only engine.
        backend: ``"deepspeed"`` or an alias ``"deepspeed_stage_N"`` (the registry presets
            ``zero_stage=N`` for those).
        **kwargs: ``model_type``, ``topology``, ``model_factory`` (see ``BaseEngine``) and ``EngineConfig``
            fields to override.

    Raises:
        ValueError: For an unknown backend name.
    """

    # Ulysses: the gathered outputs' gradients are scaled by sp and DeepSpeed (no mpu) averages
    # gradients over all dp x sp ranks, as FSDP does.
    SUPPORTS_SEQUENCE_PARALLEL = True
    CPU_FLOAT16_REFUSAL = "DeepSpeed's CPU accelerator has no float16 support here"

    def __init__(
        self,
        config: EngineConfig,
        optim_config: OptimConfig | None = None,
        *,
        backend: str = "deepspeed",
        **kwargs: Any,
    ) -> None:
        super().__init__(config, optim_config, backend=backend, **kwargs)
        if backend not in DEEPSPEED_BACKENDS:
            raise ValueError(f"DeepSpeedEngine backend must be one of {DEEPSPEED_BACKENDS}, got {backend!r}")
        self.ds_engine: deepspeed.DeepSpeedEngine | None = None
        self._warned_to = False
        self._coalesce = False
        self._coalescing: contextlib.AbstractContextManager | None = None

    # ----------------------------------------------------------------------------------- lifecycle
    def initialize(self) -> None:
        """Hand the HF model and its optimizer to ``deepspeed.initialize``; a collective, idempotent.

        Raises:
            RuntimeError: If no process group is initialised.
        """
        if self.initialized:
            return
        if not is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} ({self.backend}) needs an initialised process group; "
                f"call torch.distributed.init_process_group (or use Trainer / torchrun) first"
            )
        deepspeed = _import_deepspeed(self.device.type)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.config.seed)
        self.topology = engine_topology(self.topology, self.config, self.device.type)
        # The op deepspeed.initialize JIT-builds: announced, checked for a stale build lock (all ranks
        # together, before the model loads), then loaded (engine/deepspeed_ops.py).
        prepare_deepspeed_ops(deepspeed.accelerator.get_accelerator())
        model = self.build_model()  # checkpoint or factory, + LoRA adapters (engine/build.py)
        self.model_config = model.config
        if self.config.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = None
        if self.optim_config is not None:
            optimizer = build_optimizer(model.parameters(), self.optim_config)
        ds_config = build_deepspeed_config(
            self.config, self.optim_config, self.topology.world_size, self.device.type
        )
        self.ds_engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config, dist_init_required=False
        )
        self.module = self.ds_engine.module
        self._coalesce = (
            self.config.zero_stage in (2, 3)
            and optimizer is not None
            and bool(self.config.strategy_kwargs.get("coalesce_grad_reduction", True))
            and hasattr(self.ds_engine, "coalesce_grad_reduction")
            and hasattr(self.ds_engine.optimizer, "_coalesce_grad_reduction")
        )
        # ZeRO steps this same optimizer (its param groups now hold the flat fp32 partitions), so the
        # LambdaLR on it sets the lr DeepSpeed uses, and get_lr / lr_scheduler_step read it there.
        self.optimizer = optimizer
        if optimizer is not None and self.optim_config is not None:
            self.lr_scheduler = build_lr_scheduler(optimizer, self.optim_config)
        self.initialized = True

    def to(
        self, device: str | torch.device, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        """No-op: DeepSpeed places parameters and optimizer state itself.

        ``param_offload`` / ``optimizer_offload`` map to DeepSpeed's own offload (``offload_param``,
        ZeRO-3 only, and ``offload_optimizer``), which keeps them on the host all the time and streams
        them in; the mode contexts therefore have nothing to move. Asking for another device without
        that offload configured warns once and leaves everything where it is (DeepSpeed's flat ZeRO
        buffers cannot be moved from outside).
        """
        target = torch.device(device).type
        if target == self.device.type or self._warned_to:
            return
        offloaded = (not model or self.config.param_offload) and (
            not optimizer or self.config.optimizer_offload
        )
        if not offloaded:
            self._warned_to = True
            warnings.warn(
                f"the deepspeed engine does not move its state to {target!r} on demand (ignored); "
                f"enable param_offload (ZeRO-3) / optimizer_offload for DeepSpeed's own CPU offload",
                stacklevel=2,
            )

    # ------------------------------------------------------------------------------------- compute
    @property
    def forward_model(self) -> DeepSpeedForward:
        """What the shared packed / Ulysses forwards call (through ``DeepSpeedEngine.forward``)."""
        # never the HF module directly: ZeRO-3 then gives wrong gradients from the second micro-batch on
        return DeepSpeedForward(self.ds_engine)

    def _backward(self, loss: torch.Tensor) -> None:
        """``DeepSpeedEngine.backward`` of the loss as is (accumulation steps = 1: never rescaled)."""
        self.ds_engine.backward(loss, scale_wrt_gas=False)

    def _grad_sync_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        """Reduce gradients once per step, after the last micro-batch's backward.

        ZeRO-1 reduces at the gradient-accumulation boundary, which only the last micro-batch sets.
        ZeRO-2/3 reduce inside every backward; where DeepSpeed has ``coalesce_grad_reduction`` (0.19+),
        one such block spans all micro-batches of the step (opened by the first, closed after the last),
        so gradients stay local and are reduced in one pass. That keeps full-size gradients on each rank
        between micro-batches (as FSDP's deferred sync does); ``strategy_kwargs={"coalesce_grad_reduction":
        False}`` trades that memory back for one reduction per micro-batch.
        """
        self.ds_engine.set_gradient_accumulation_boundary(is_last)
        if not self._coalesce:
            return contextlib.nullcontext()
        if self._coalescing is None:  # first micro-batch of the step
            self._coalescing = self.ds_engine.coalesce_grad_reduction()
            self._coalescing.__enter__()
        return self._end_coalescing() if is_last else contextlib.nullcontext()

    @contextlib.contextmanager
    def _end_coalescing(self) -> Iterator[None]:
        """Around the last micro-batch: on exit, leave the coalescing block (its single reduction)."""
        try:
            yield
        finally:
            self._close_coalescing()

    def _close_coalescing(self) -> None:
        if self._coalescing is not None:
            block, self._coalescing = self._coalescing, None
            block.__exit__(None, None, None)

    # ----------------------------------------------------------------------------------- optimizer
    @property
    def loss_scale(self) -> float | None:
        """DeepSpeed's dynamic fp16 loss scale (``None`` unless fp16 is enabled)."""
        ds = getattr(self, "ds_engine", None)
        if ds is None or not ds.fp16_enabled():
            return None
        return float(ds.optimizer.loss_scale)

    def optimizer_zero_grad(self) -> None:
        """Clear the gradients (the ZeRO optimizer's and the module's)."""
        self._require_optimizer()
        self._close_coalescing()  # a step that raised between micro-batches left it open
        self.ds_engine.optimizer.zero_grad(set_to_none=True)
        self.ds_engine.zero_grad()

    def optimizer_step(self) -> float:
        """DeepSpeed's step: grad norm, clip, step; a non-finite norm zeroes the grads and skips.

        Returns:
            The global grad norm before clipping (``inf`` when the step was skipped for a non-finite
            norm; DeepSpeed reports NaN norms as ``inf`` too).
        """
        self._require_optimizer()
        ds = self.ds_engine
        ds.set_gradient_accumulation_boundary(True)
        ds.step()
        norm = ds.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        if not ds.was_step_applied():
            self.skipped_steps += 1
            if math.isfinite(norm):  # DeepSpeed skipped for another reason (fp16 overflow): say so
                norm = float("inf")
        return norm

    # ------------------------------------------------------------------------------- weight export
    def named_full_tensors(
        self, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full_tensor)`` one at a time, in ``state_dict`` order; a collective.

        ZeRO-3 parameters are gathered one by one (every rank must iterate to the end); ZeRO-1/2 keep
        full parameters on every rank. The names are the model's ``state_dict`` keys (tied weights
        included; ``get_per_tensor_param`` maps a LoRA model's to the base model's HF names).

        Args:
            keep: Only names it accepts are gathered and yielded (the same on every rank).
        """
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        assert self.module is not None
        partitioned = self.config.zero_stage == 3
        tensors = dict(self.module.named_parameters(remove_duplicate=False))
        tensors.update(self.module.named_buffers(remove_duplicate=False))
        for name in self.module.state_dict(keep_vars=True):
            if keep is not None and not keep(name):
                continue
            tensor = tensors[name]
            if partitioned and hasattr(tensor, "ds_id"):
                with GatheredParameters([tensor], modifier_rank=None):
                    full = tensor.detach().clone()
            else:
                full = tensor.detach()
            yield name, full


def _register(engine_cls: type) -> None:
    """Register ``engine_cls`` as ``deepspeed`` and the ``deepspeed_stage_N`` aliases (preset stage)."""
    model_types = list(MODEL_TYPES)
    EngineRegistry.register(model_type=model_types, backend="deepspeed", device=DEVICES)(engine_cls)
    for stage in (1, 2, 3):
        EngineRegistry.register(
            model_type=model_types,
            backend=f"deepspeed_stage_{stage}",
            device=DEVICES,
            preset={"zero_stage": stage},
        )(engine_cls)


_register(DeepSpeedEngine)

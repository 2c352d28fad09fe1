"""The engine interface: :class:`BaseEngine` and its mode context :class:`BaseEngineCtx`.

An engine owns one model (and, when trained, its optimizer and LR scheduler) sharded over the
data-parallel ranks. Its public surface has five groups (DESIGN.md §4):

* lifecycle: :meth:`~BaseEngine.initialize`, :meth:`~BaseEngine.to`, :meth:`~BaseEngine.train_mode`,
  :meth:`~BaseEngine.eval_mode`;
* compute: :meth:`~BaseEngine.forward_backward_batch`, :meth:`~BaseEngine.train_batch`,
  :meth:`~BaseEngine.infer_batch`;
* optimizer: :meth:`~BaseEngine.optimizer_zero_grad`, :meth:`~BaseEngine.optimizer_step`,
  :meth:`~BaseEngine.lr_scheduler_step`;
* topology: ``get_data_parallel_size/rank/group``, :meth:`~BaseEngine.is_mp_src_rank_with_outputs`;
* weight export: :meth:`~BaseEngine.get_per_tensor_param`, :meth:`~BaseEngine.save_hf` (an HF directory);

plus :meth:`~BaseEngine.save_checkpoint` / :meth:`~BaseEngine.load_checkpoint`.

Concrete engines are composed from small parts in this package (``topology``, ``compute``,
``heads``, ``optim``, ``offload``, ``checkpoint``) rather than written as one class with flags.
The engine owns no loss: the caller hands ``loss_function(model_output, micro_batch, info)`` in
(contract: ``verl_trainer.engine.batch_info``).

Writing a backend (``fsdp.py`` and ``deepspeed.py`` are the examples)::

    class MyEngine(TopologyMixin, MicroBatchComputeMixin, OptimizerMixin, BaseEngine):
        def initialize(self): ...      # self.topology = engine_topology(...); self.module = wrap(
                                       #     self.load_hf_model()); optimizer / lr_scheduler from optim.py
        def to(self, device, model=True, optimizer=True, grad=True): ...   # offload.py helpers
        forward_model = ...                             # optional: what is called (default: module)
        def _backward(self, loss): ...                  # optional: default loss.backward()
        def _grad_sync_context(self, is_last): ...      # sync grads on the last micro-batch only
        def named_full_tensors(self, keep=None): ...    # with LoRAMixin (lora.py), which adds LoRA and
                                                        # get_per_tensor_param; or get_per_tensor_param
        def save_checkpoint(self, path, global_step=0): ...  # inside checkpoint.atomic_checkpoint_dir
        def load_checkpoint(self, path): ...

    @EngineRegistry.register(model_type="language_model", backend="mine", device=["cpu", "cuda"])
    class MyLanguageModelEngine(LanguageModelMixin, MyEngine): ...   # heads.py: the model type
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.engine.hooks import NO_HOOKS, StepHooks
from verl_trainer.engine.topology import Topology
from verl_trainer.utils.device import get_torch_device

LossFunction = Callable[..., "tuple[torch.Tensor, dict[str, Any]]"]
"""``loss_fn(model_output, micro_batch, info) -> (loss, metrics)`` (see ``engine/batch_info.py``)."""


class BaseEngineCtx:
    """Context manager for a train or eval phase of an engine.

    On enter it loads offloaded parameters onto the device (only when ``param_offload``) and, in train
    mode only, the optimizer state (only when ``optimizer_offload``); it sets ``module.train()`` /
    ``module.eval()``. On exit, also when the block raised, it offloads them again. Eval never moves
    the optimizer.

    Args:
        engine: The engine.
        mode: ``"train"`` or ``"eval"``.

    """

    def __init__(self, engine: BaseEngine, mode: Literal["train", "eval"]) -> None:
        if mode not in ("train", "eval"):
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
        self.engine = engine
        self.mode = mode

    @property
    def _moves_params(self) -> bool:
        return bool(self.engine.config.param_offload)

    @property
    def _moves_optimizer(self) -> bool:
        return self.mode == "train" and bool(self.engine.config.optimizer_offload)

    def __enter__(self) -> BaseEngine:
        engine = self.engine
        if self._moves_params:
            engine.to(engine.device, model=True, optimizer=False, grad=True)
        if self._moves_optimizer:
            engine.to(engine.device, model=False, optimizer=True, grad=False)
        engine.mode = self.mode
        if engine.module is not None:
            engine.module.train(self.mode == "train")
        return engine

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        engine = self.engine
        try:
            if self._moves_params:
                engine.to("cpu", model=True, optimizer=False, grad=True)
            if self._moves_optimizer:
                engine.to("cpu", model=False, optimizer=True, grad=False)
        finally:
            engine.mode = None
        return False  # never swallow the block's exception


class BaseEngine(ABC):
    """Abstract engine. Subclasses are registered with ``EngineRegistry`` and built by ``new``.

    Args:
        config: What to build and how to run it.
        optim_config: Optimizer/scheduler config; ``None`` builds an inference-only engine
            (e.g. a reference policy) without optimizer.
        backend: The registry name the engine was built under (``"fsdp"``, ``"fsdp2"``, ...).
        topology: The run's ``(dp, sp)`` meshes (the Trainer's strategy builds them once and hands them
            to every engine); ``None``: ``initialize`` builds the engine's own.
        model_factory: A zero-argument callable that builds the model (a transformers model or a
            ``PeftModel``) in place of loading ``config.model_path`` (see ``EngineSpec.model``).
        **config_overrides: ``EngineConfig`` fields to override (alias presets such as
            ``zero_stage=3`` arrive here).

    """

    MODEL_TYPE: ClassVar[str] = ""
    SUPPORTS_TENSOR_PARALLEL: ClassVar[bool] = False
    """Whether the backend applies ``tensor_model_parallel_size > 1`` (else refused at construction)."""
    SUPPORTS_PIPELINE_PARALLEL: ClassVar[bool] = False
    """Whether the backend applies ``pipeline_model_parallel_size > 1`` (else refused at construction)."""

    def __init__(
        self,
        config: EngineConfig,
        optim_config: OptimConfig | None = None,
        *,
        backend: str = "",
        topology: Topology | None = None,
        model_factory: Callable[[], torch.nn.Module] | None = None,
        **config_overrides: Any,
    ) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config: EngineConfig = config.replace(**config_overrides) if config_overrides else config
        self.optim_config: OptimConfig | None = optim_config
        self.backend = backend
        self.topology: Topology | None = topology  # None: ``initialize`` builds one of its own
        self.model_factory = model_factory
        self.model_config: Any = None  # the HF config of the loaded model (set by ``load_hf_model``)
        tp = self.config.tensor_model_parallel_size
        if tp > 1 and not self.SUPPORTS_TENSOR_PARALLEL:
            raise ValueError(
                f"tensor_model_parallel_size={tp} is not supported by the {backend or type(self).__name__!r} "
                f"backend; use strategy='fsdp2' or set tensor_model_parallel_size=1"
            )
        pp = self.config.pipeline_model_parallel_size
        if pp > 1 and not self.SUPPORTS_PIPELINE_PARALLEL:
            raise ValueError(
                f"pipeline_model_parallel_size={pp} is not supported by the "
                f"{backend or type(self).__name__!r} backend; use strategy='fsdp2' or set "
                f"pipeline_model_parallel_size=1"
            )
        self.device: torch.device = get_torch_device()
        self.module: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.mode: Literal["train", "eval"] | None = None
        self.initialized = False

    # ----------------------------------------------------------------------------------- lifecycle
    @abstractmethod
    def initialize(self) -> None:
        """Build the model (sharded), the optimizer and the LR scheduler; idempotent."""

    @abstractmethod
    def to(
        self, device: str | torch.device, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        """Move parameters / optimizer state / gradients to ``device`` (offload or load)."""

    def train_mode(self) -> BaseEngineCtx:
        """Context for a training phase (see :class:`BaseEngineCtx`)."""
        return BaseEngineCtx(self, "train")

    def eval_mode(self) -> BaseEngineCtx:
        """Context for an inference phase; never moves the optimizer (see :class:`BaseEngineCtx`)."""
        return BaseEngineCtx(self, "eval")

    # ------------------------------------------------------------------------------------- compute
    @abstractmethod
    def forward_backward_batch(
        self,
        data: TensorDict,
        loss_function: LossFunction | None,
        forward_only: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Run all micro-batches of ``data`` (this rank's share of one optimizer step).

        Args:
            data: Padded schema batch ``[B, T]`` of this DP rank.
            loss_function: ``loss_fn(model_output, micro_batch, info) -> (loss, metrics)``; ``None``
                only with ``forward_only``.
            forward_only: No backward (inference / validation).
            **kwargs: ``calculate_entropy`` (bool), ``temperature`` (float), ``hooks``
                (:class:`~verl_trainer.engine.hooks.StepHooks`: ``on_micro_batches``,
                ``on_before_backward``).

        Returns:
            ``{"loss": float (global), "local_loss": float, "metrics": [per-micro-batch dict],
            "num_micro_batches": int, "model_output": {key: [B, T]} (forward_only, original order)}``.

        """

    def train_batch(
        self, data: TensorDict, loss_function: LossFunction, hooks: StepHooks | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """One optimizer step — the only implementation of one in the project.

        ``hooks.on_before_zero_grad`` → zero grads → ``hooks.on_micro_batches`` → per micro-batch forward,
        ``hooks.on_before_backward``, backward → ``hooks.on_after_backward`` →
        ``hooks.on_before_optimizer_step`` → clip and step (a non-finite grad norm skips the step). The LR
        scheduler is NOT stepped here (PPO runs several ``train_batch`` per trainer step); call
        :meth:`lr_scheduler_step` once per trainer step.

        Args:
            data: This DP rank's batch ``[B, T]`` of one optimizer step.
            loss_function: ``loss_fn(model_output, micro_batch, info) -> (loss, metrics)``.
            hooks: What the caller sees of the step (the Trainer passes its callbacks' dispatch).
            **kwargs: Passed to :meth:`forward_backward_batch` (``calculate_entropy``, ``temperature``).

        Returns:
            ``{"loss", "grad_norm", "lr", "step_skipped", "loss_scale", "loss_scale_overflow", "metrics",
            "num_micro_batches"}``; ``lr`` is the learning rate this step used; ``loss_scale`` the float16
            loss scale after the step (``None`` without loss scaling), ``loss_scale_overflow`` whether the
            step was skipped because the scaled gradients overflowed (the loss itself finite).

        Raises:
            RuntimeError: The engine was built without an optimizer.
        """
        if self.optimizer is None:
            raise RuntimeError(
                f"{type(self).__name__} was built without optim_config, so it cannot train; "
                f"pass an OptimConfig to build a trainable engine"
            )
        hooks = hooks or NO_HOOKS
        hooks.on_before_zero_grad(self.optimizer)
        self.optimizer_zero_grad()
        out = self.forward_backward_batch(data, loss_function, forward_only=False, hooks=hooks, **kwargs)
        hooks.on_after_backward()
        hooks.on_before_optimizer_step(self.optimizer)
        lr = self.get_lr()
        grad_norm = self.optimizer_step()
        finite = math.isfinite(grad_norm)
        loss_scale = self.loss_scale
        return {
            "loss": out["loss"],
            "grad_norm": grad_norm,
            "lr": lr,
            "step_skipped": not finite,
            # float16: the scaled gradients overflowed (the loss is finite): the step is skipped, the
            # scale lowered; the same on every rank (the loss and the grad norm are global)
            "loss_scale_overflow": loss_scale is not None and not finite and math.isfinite(out["loss"]),
            "loss_scale": loss_scale,
            "metrics": out["metrics"],
            "num_micro_batches": out["num_micro_batches"],
        }

    def infer_batch(
        self, data: TensorDict, loss_function: LossFunction | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """Forward only; ``model_output`` holds ``[B, T]`` tensors in the original sample order."""
        with torch.no_grad():
            return self.forward_backward_batch(data, loss_function, forward_only=True, **kwargs)

    # ----------------------------------------------------------------------------------- optimizer
    @abstractmethod
    def optimizer_zero_grad(self) -> None:
        """Clear the gradients."""

    @abstractmethod
    def optimizer_step(self) -> float:
        """Clip, then step; a non-finite grad norm zeroes the grads and skips the step.

        Returns:
            The total grad norm before clipping.

        """

    @property
    def loss_scale(self) -> float | None:
        """The float16 loss scale (``precision="16-mixed"``); ``None`` when the engine does not scale."""
        return None

    @abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule by one step; returns the new learning rate."""

    def get_lr(self) -> float:
        """Return the current learning rate of the first parameter group (0.0 without optimizer)."""
        if self.optimizer is None:
            return 0.0
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------------------------ topology
    @abstractmethod
    def get_data_parallel_size(self) -> int:
        """Return the number of DP ranks (world_size // sp_size)."""

    @abstractmethod
    def get_data_parallel_rank(self) -> int:
        """Return this rank's DP rank."""

    @abstractmethod
    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        """Return the DP process group (``None`` when not distributed)."""

    def is_mp_src_rank_with_outputs(self) -> bool:
        """Tell whether the caller should collect this rank's outputs (every rank without SP/TP/PP)."""
        return True

    # ------------------------------------------------------------------------------- weight export
    @abstractmethod
    def get_per_tensor_param(self, adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full_tensor)`` one at a time; a collective, call it on every rank.

        With LoRA the tensors are the base model's, adapters merged; ``adapters_only=True`` yields the
        adapter tensors under peft's names instead (``engine/lora.py``).
        """

    def get_shareable_params(self) -> dict[str, torch.Tensor] | None:
        """The parameters' own storage under HF names, when a consumer may alias them instead of copying.

        Only where this rank holds every parameter whole, always in the same storage, under the HF name
        (no sharding over more than one rank, no TP, no LoRA merge, no offload); the optimizer updates
        them in place, so an alias (the HF rollout's, ``RolloutConfig.share_weights``) sees every update
        without a copy. Not a collective. ``None`` (the default) where that does not hold: copy
        :meth:`get_per_tensor_param` instead.
        """
        return None

    def save_hf(
        self,
        path: str | os.PathLike,
        tokenizer: Any = "model_path",
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | None = None,
    ) -> str:
        """Write the model as a standard HF directory; a collective, call it on every rank.

        ``config.json``, ``model.safetensors`` (sharded above ``max_shard_size``, with the index),
        ``generation_config.json`` and the tokenizer: ``AutoModelForCausalLM.from_pretrained(path)`` (a
        value model: ``AutoModelForTokenClassification``, with its ``score`` head) loads it. Tensors are
        gathered one at a time (:meth:`get_per_tensor_param`; LoRA merged) and rank 0 holds at most one
        shard; rank 0 writes under a temporary name renamed to ``path`` when complete
        (``verl_trainer/export/hf_dir.py``).

        Args:
            path: The output directory (replaced only if verl-trainer wrote it).
            tokenizer: A tokenizer, a directory to load one from, ``"model_path"`` (the model's own, when
                ``config.model_path`` has one) or ``None`` (none written).
            max_shard_size: Bytes per safetensors file (int or e.g. ``"2GB"``).
            dtype: Save floating-point weights in this dtype (default: the engine's parameter dtype).

        Returns:
            ``str(path)``.
        """
        from verl_trainer.export.hf_dir import save_hf_model
        from verl_trainer.export.sources import generation_config_of, tokenizer_dir

        source = self.config.model_path
        if isinstance(tokenizer, str) and tokenizer == "model_path":
            tokenizer = tokenizer_dir(source)
        return save_hf_model(
            self.get_per_tensor_param(), path, self.model_config, self.MODEL_TYPE, tokenizer=tokenizer,
            generation_config=generation_config_of(source), max_shard_size=max_shard_size, dtype=dtype,
        )

    # --------------------------------------------------------------------------------- checkpoints
    @abstractmethod
    def save_checkpoint(self, path: str, global_step: int = 0, **kwargs: Any) -> None:
        """Save model, optimizer, scheduler and RNG atomically to the directory ``path``."""

    @abstractmethod
    def load_checkpoint(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote; returns its plain metadata (e.g. global_step)."""

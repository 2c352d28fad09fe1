"""The engine interface: :class:`BaseEngine`.

An engine owns one model (and, when trained, its optimizer and LR scheduler) sharded over the
data-parallel ranks; its public surface keeps verl's names (docs/design.md §4). A backend is one class plus
its registration; the rest are parts the engine holds: the model type (``engine/heads.py``), the schedule
(``compute.SEQUENTIAL`` or, with ``pp > 1``, ``engine.pipeline``), LoRA (``engine.lora``), float16 loss
scaling (``engine.grad_scaler``), the mode contexts with their offload moves (``engine.modes``:
:class:`Modes`), the weight stream (``weights.py``) and the HF export
(``hf_export.py``). verl's method names delegate to them. A backend's capabilities are class attributes
(``SUPPORTS_*_PARALLEL``, ``RESHARDABLE_CHECKPOINTS``, ``CPU_FLOAT16_REFUSAL``), read through the registry.

This class holds the one micro-batch loop (:meth:`forward_backward_batch`) and the one optimizer step
(:meth:`train_batch`). The engine owns no loss: the caller hands ``loss_function(model_output,
micro_batch, info)`` in (contract: ``verl_trainer.core_algos.aggregation``). Writing a backend:
docs/architecture.md, "How to add ..." (tested by ``tests/engine/test_backend_recipe.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.core_algos.aggregation import GlobalBatchInfo, compute_global_batch_info
from verl_trainer.data.packing import PackedBatch, pack_batch
from verl_trainer.engine.build import build_model
from verl_trainer.engine.compute import SEQUENTIAL, LossFunction, MicroBatchStep, Schedule
from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.engine.heads import model_type_part
from verl_trainer.engine.hf_export import HFExport
from verl_trainer.engine.hooks import NO_HOOKS, StepHooks
from verl_trainer.engine.lora import LoRAAdapters, require_lora
from verl_trainer.engine.micro_batch import prepare_micro_batches
from verl_trainer.engine.topology import Topology
from verl_trainer.engine.weights import WeightStream
from verl_trainer.models.moe_lora import param_lora_names, refuse_param_lora_backend
from verl_trainer.models.moe_loss import with_router_losses
from verl_trainer.models.moe_routers import TrainingRouters, find_routers, refuse_under_sequence_parallel
from verl_trainer.utils.device import get_torch_device
from verl_trainer.utils.distributed import all_reduce

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase
    from transformers.utils import ModelOutput

    from verl_trainer.engine.pipeline import PipelineParallel
    from verl_trainer.engine.results import BatchResult, StepResult
    from verl_trainer.models.attention import ForwardModel



Mode = Literal["train", "eval"]
"""An engine's phase."""


class Move(Protocol):
    """A backend's ``to``: move parameters / optimizer state / gradients to ``device``."""

    def __call__(self, device: str | torch.device, model: bool = True, optimizer: bool = True,
                 grad: bool = True) -> None:
        """Move what the flags select to ``device``."""


# The modes part lives in this file, not in one of its own: every step enters the mode contexts, and one
# file more on a GRPO step's path would exceed the step budget (tests/test_architecture.py).
class Modes:
    """The mode contexts' part: the phase an engine is in, and what enters and leaves the device around one.

    Args:
        move: The backend's ``to`` (built from ``engine/offload.py``'s helpers).

    Attributes:
        mode: ``"train"`` / ``"eval"`` inside a phase, ``None`` outside (read by backends that move state
            only outside a phase).
    """

    def __init__(self, move: Move) -> None:
        self.move = move
        self.mode: Mode | None = None

    @contextlib.contextmanager
    def phase(self, mode: Mode, config: EngineConfig, module: torch.nn.Module | None,
              device: torch.device) -> Iterator[None]:
        """One phase: load, set the module's flag, run the block, offload again.

        On entering it loads offloaded parameters and gradients onto ``device`` (only with
        ``config.param_offload``) and, in train mode only, the optimizer state (only with
        ``config.optimizer_offload``); it sets ``module.train()`` / ``module.eval()``. On leaving, also when
        the block raised, it moves them back to CPU and clears :attr:`mode`. Eval never moves the optimizer.

        Args:
            mode: ``"train"`` or ``"eval"``.
            config: The engine's config (its offload flags, read on entering).
            module: The engine's model (``None`` before ``initialize``: only the moves and the mode).
            device: The engine's compute device.
        """
        moves_params = bool(config.param_offload)
        moves_optimizer = mode == "train" and bool(config.optimizer_offload)
        if moves_params:
            self.move(device, model=True, optimizer=False, grad=True)
        if moves_optimizer:
            self.move(device, model=False, optimizer=True, grad=False)
        self.mode = mode
        if module is not None:
            module.train(mode == "train")
        try:
            yield
        finally:
            try:
                if moves_params:
                    self.move("cpu", model=True, optimizer=False, grad=True)
                if moves_optimizer:
                    self.move("cpu", model=False, optimizer=True, grad=False)
            finally:
                self.mode = None


class BaseEngine(ABC):
    """Abstract engine. Subclasses are registered with ``EngineRegistry`` and built by ``new``.

    Args:
        config: What to build and how to run it.
        optim_config: Optimizer/scheduler config; ``None`` builds an inference-only engine
            (e.g. a reference policy) without optimizer.
        backend: The registry name the engine was built under (``"fsdp"``, ``"fsdp2"``, ...).
        model_type: ``"language_model"`` or ``"value_model"`` (the registry passes the name it was asked
            for): the model-type part the engine holds (``engine/heads.py``).
        topology: The run's ``(dp, sp)`` meshes (the Trainer's strategy builds them once and hands them
            to every engine); ``None``: ``initialize`` builds the engine's own.
        model_factory: A zero-argument callable that builds the model (a transformers model or a
            ``PeftModel``) in place of loading ``config.model_path`` (see ``EngineSpec.model``).
        **config_overrides: ``EngineConfig`` fields to override (alias presets such as
            ``zero_stage=3`` arrive here).

    """

    SUPPORTS_SEQUENCE_PARALLEL: ClassVar[bool] = False
    """Whether the backend's gradient reduction makes Ulysses exact (the SP ranks' gradients averaged over
    dp x sp, as FSDP and DeepSpeed do); else ``ulysses_sequence_parallel_size > 1`` is refused at the
    first forward."""
    SUPPORTS_TENSOR_PARALLEL: ClassVar[bool] = False
    """Whether the backend applies ``tensor_model_parallel_size > 1`` (else refused at construction)."""
    SUPPORTS_PIPELINE_PARALLEL: ClassVar[bool] = False
    """Whether the backend applies ``pipeline_model_parallel_size > 1`` (else refused at construction)."""
    SUPPORTS_EXPERT_PARALLEL: ClassVar[bool] = False
    """Whether the backend applies ``expert_model_parallel_size > 1`` (else refused at construction)."""
    HF_ROUTERS: ClassVar[bool] = True
    """Whether a MoE model's router features (losses, metrics, replay: ``models/moe_routers.py``, hooks on
    transformers' router modules) apply; ``False`` where the backend runs its library's own router."""
    RESHARDABLE_CHECKPOINTS: ClassVar[bool] = False
    """Whether a checkpoint it wrote loads at another world size (DCP reshards; per-rank partitions do not).
    A resume at another world size is refused otherwise (``training/resume_check.py``)."""
    CPU_FLOAT16_REFUSAL: ClassVar[str | None] = None
    """Why ``precision='16-mixed'`` cannot run on a CPU without native float16 (``None``: torch emulates it,
    it runs); the strategy's precision check says it (``training/strategy.py``)."""

    def __init__(
        self,
        config: EngineConfig,
        optim_config: OptimConfig | None = None,
        *,
        backend: str = "",
        model_type: str = "language_model",
        topology: Topology | None = None,
        model_factory: Callable[[], torch.nn.Module] | None = None,
        **config_overrides: Any,
    ) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config: EngineConfig = config.replace(**config_overrides) if config_overrides else config
        self.optim_config: OptimConfig | None = optim_config
        self.backend = backend
        self.model_type = model_type_part(model_type)
        self.topology: Topology | None = topology  # None: ``initialize`` builds one of its own
        self.model_factory = model_factory
        self.model_config: Any = None  # the HF config of the loaded model (set by ``initialize``)
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
        ep = self.config.expert_model_parallel_size
        if ep > 1 and not self.SUPPORTS_EXPERT_PARALLEL:
            raise ValueError(
                f"expert_model_parallel_size={ep} is not supported by the {backend or type(self).__name__!r} "
                f"backend (its experts are replicated over dp); use strategy='torchtitan' or 'megatron' for "
                f"expert parallelism, or set expert_model_parallel_size=1"
            )
        if self.config.lora_enabled and self.config.target_parameters:  # LoRA on fused experts (docs/moe.md)
            refuse_param_lora_backend(backend or type(self).__name__,
                                      f"target_parameters={self.config.target_parameters}")
        self.device: torch.device = get_torch_device()
        self.module: torch.nn.Module | None = None
        self._moe_routers = False  # set when the model is built (build_model)
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.modes = Modes(self.to)
        self.initialized = False
        self.pipeline: PipelineParallel | None = None  # set by a backend that splits the model (pp > 1)
        self.lora: LoRAAdapters | None = None  # set by build_model for a model with adapters
        self.grad_scaler: torch.amp.GradScaler | None = None  # float16 compute (engine/loss_scale.py)
        self._num_trainable = 0

    @property
    def MODEL_TYPE(self) -> str:  # noqa: N802  (the registry's name, read by checkpoints and exports)
        """The model type's registry name (``"language_model"`` / ``"value_model"``)."""
        return self.model_type.name

    # ----------------------------------------------------------------------------------- lifecycle
    @abstractmethod
    def initialize(self) -> None:
        """Build the model (sharded), the optimizer and the LR scheduler; idempotent."""

    @abstractmethod
    def to(
        self, device: str | torch.device, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        """Move parameters / optimizer state / gradients to ``device`` (offload or load)."""

    @contextlib.contextmanager
    def train_mode(self) -> Iterator[BaseEngine]:
        """Context for a training phase: ``module.train()``, offloaded state loaded (``modes.phase``)."""
        with self.modes.phase("train", self.config, self.module, self.device):
            yield self

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[BaseEngine]:
        """Context for an inference phase: ``module.eval()``, the optimizer never moved (``modes.phase``)."""
        with self.modes.phase("eval", self.config, self.module, self.device):
            yield self

    @property
    def mode(self) -> Mode | None:
        """``"train"`` / ``"eval"`` inside :meth:`train_mode` / :meth:`eval_mode`, ``None`` outside."""
        return self.modes.mode

    # ------------------------------------------------------------------------------------- compute
    @property
    def _router_features(self) -> bool:
        """Whether this engine's forward captures a MoE model's routers.

        True when the model it built has transformers routers (see :attr:`HF_ROUTERS`) and ``config.moe``
        asks for router losses, metrics or replay.
        """
        return self._moe_routers and self.config.moe.needs_router_outputs

    def forward_backward_batch(
        self,
        data: TensorDict,
        loss_function: LossFunction | None,
        forward_only: bool = False,
        calculate_entropy: bool = False,
        temperature: float | None = None,
        hooks: StepHooks | None = None,
    ) -> BatchResult:
        """Run all micro-batches of ``data`` (this rank's share of one optimizer step): the one loop.

        Global denominators (one all-reduce) → micro-batches (``hooks.on_micro_batches``) → the engine's
        :attr:`schedule` runs them (``engine/compute.py``) → the global loss.

        Args:
            data: Padded schema batch ``[B, T]`` of this DP rank.
            loss_function: ``loss_fn(model_output, micro_batch, info) -> (loss, metrics)``; ``None``
                only with ``forward_only``.
            forward_only: No backward (inference / validation); outputs are returned in the original order.
            calculate_entropy: Language model: also compute ``entropy``.
            temperature: Overrides ``config.temperature``.
            hooks: ``on_micro_batches`` sees the planned micro-batches before the first forward;
                ``on_before_backward`` each micro-batch's loss before its backward.

        Returns:
            ``{"loss": float (global), "local_loss": float, "metrics": [per-micro-batch dict],
            "num_micro_batches": int, "model_output": {key: [B, T]} (forward_only, original order)}``.
            ``loss`` is the mean over DP ranks of each rank's sum of partial losses.

        """
        if not self.initialized:
            raise RuntimeError(f"{type(self).__name__} is not initialized; call engine.initialize() first")
        if loss_function is None and not forward_only:
            raise ValueError("forward_backward_batch needs a loss_function unless forward_only=True")
        hooks = hooks or NO_HOOKS
        if loss_function is not None and self._router_features:
            routers = find_routers(self.module)
            if routers:  # a MoE model: its router losses and metrics (models/moe_loss.py)
                loss_function = with_router_losses(loss_function, self.config.moe, routers[0].num_experts)
        info = self.compute_global_batch_info(data)
        micro_batches, batch_idx = self.make_micro_batches(data)
        if hooks.on_micro_batches is not None:
            hooks.on_micro_batches(micro_batches)
        temperature = self.config.temperature if temperature is None else temperature
        step = MicroBatchStep(data, micro_batches, batch_idx, info, loss_function, forward_only,
                              calculate_entropy, temperature, hooks)
        local_loss, metrics, model_output = self.schedule.run(self, step)
        result: BatchResult = {
            "local_loss": float(local_loss),
            "loss": self._global_loss(local_loss),
            "metrics": metrics,
            "num_micro_batches": len(micro_batches),
        }
        if forward_only:
            result["model_output"] = model_output
        return result

    @property
    def schedule(self) -> Schedule:
        """How the loop runs the micro-batches: the pipeline part under PP, else one after the other."""
        return SEQUENTIAL if self.pipeline is None else self.pipeline

    def compute_global_batch_info(self, data: TensorDict) -> GlobalBatchInfo:
        """Global denominators of ``data`` over the DP group (``aggregation.compute_global_batch_info``)."""
        topo = self.topology
        assert topo is not None
        return compute_global_batch_info(data, topo.dp_group, topo.dp_size, topo.dp_rank)

    def make_micro_batches(self, data: TensorDict) -> tuple[list[TensorDict], list[int] | None]:
        """Split ``data`` into micro-batches (fixed or dynamic, as configured).

        Returns:
            ``(micro_batches, batch_idx)``; ``batch_idx`` is the flattened original index of each sample
            in micro-batch order (``-1``: a padding sample added so every DP rank runs the same number
            of micro-batches), or ``None`` when the order is unchanged.

        """
        cfg, topo = self.config, self.topology
        assert topo is not None
        return prepare_micro_batches(
            data,
            dp_group=topo.dp_group,
            same_micro_num_in_dp=True,
            micro_batch_size_per_gpu=cfg.micro_batch_size_per_gpu,
            use_dynamic_bsz=cfg.use_dynamic_bsz,
            max_token_len_per_gpu=cfg.max_token_len_per_gpu,
            sp_size=cfg.ulysses_sequence_parallel_size,
        )

    def forward_micro_batch(
        self, micro_batch: TensorDict, calculate_entropy: bool = False, temperature: float | None = None
    ) -> dict[str, torch.Tensor]:
        """Pack, forward, and unpack one micro-batch (the sequential schedule's forward).

        Returns:
            Model outputs, each ``[b, t]`` aligned with ``micro_batch["input_ids"]`` (0 at padding).

        """
        topo = self.topology
        assert topo is not None
        if topo.sp_size > 1 and not self.SUPPORTS_SEQUENCE_PARALLEL:
            raise NotImplementedError(
                f"ulysses_sequence_parallel_size={topo.sp_size} needs a sequence-parallel part "
                f"in {type(self).__name__}; set ulysses_sequence_parallel_size=1"
            )
        packed = pack_batch(micro_batch, keys=())
        temperature = self.config.temperature if temperature is None else temperature
        model_type = self.model_type
        if topo.sp_size > 1:
            if self._router_features:
                refuse_under_sequence_parallel(find_routers(self.module), topo.sp_size, self.config.moe)
            # Ulysses: every SP rank of the DP group holds this micro-batch and runs 1/sp of the row;
            # the [N] outputs are gathered (their gradient scaled by sp: FSDP averages over dp x sp).
            outputs = model_type.sp_outputs(self.forward_model, packed, topo.sp_group, calculate_entropy,
                                            temperature)
        elif self._router_features:  # a MoE model: its routers hooked for this forward
            with TrainingRouters.around(self.module, self.config.moe, micro_batch) as routers:
                hf_output = self._forward_packed(packed)
            outputs = model_type.outputs(hf_output, packed, calculate_entropy, temperature)
            outputs.update(routers.token_outputs(packed.seq_lens))
        else:
            outputs = model_type.outputs(self._forward_packed(packed), packed, calculate_entropy, temperature)
        return {k: packed.unpack(v) for k, v in outputs.items()}

    def _forward_packed(self, packed: PackedBatch) -> ModelOutput:
        """The HF output of :attr:`forward_model` on one packed row (``logits [1, N, ...]``)."""
        return self.model_type.forward_packed(self.forward_model, packed)

    def _global_loss(self, local_loss: torch.Tensor) -> float:
        """Mean over DP ranks of the per-rank loss sums (each partial loss carries the ×dp factor)."""
        topo = self.topology
        assert topo is not None
        if topo.dp_group is None or topo.dp_size == 1:
            return float(local_loss)
        return float(all_reduce(local_loss, topo.dp_group)) / topo.dp_size

    # ------------------------------------------------------------------------------ backend hooks
    @property
    def forward_model(self) -> ForwardModel:
        """What the packed and Ulysses forwards call: the module, or a backend's forward wrapper."""
        return self.module

    def _backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, as is (times the loss scale under float16 compute)."""
        (loss if self.grad_scaler is None else self.grad_scaler.scale(loss)).backward()

    def _grad_sync_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        """Context around forward+backward of a micro-batch; sync grads only when ``is_last``."""
        return contextlib.nullcontext()

    def train_batch(
        self, data: TensorDict, loss_function: LossFunction, hooks: StepHooks | None = None, **kwargs: Any
    ) -> StepResult:
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
        if hooks.on_before_zero_grad is not None:
            hooks.on_before_zero_grad(self.optimizer)
        self.optimizer_zero_grad()
        out = self.forward_backward_batch(data, loss_function, forward_only=False, hooks=hooks, **kwargs)
        if hooks.on_after_backward is not None:
            hooks.on_after_backward()
        if hooks.on_before_optimizer_step is not None:
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
    ) -> BatchResult:
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
        return None if self.grad_scaler is None else float(self.grad_scaler.get_scale())

    @abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule by one step; returns the new learning rate."""

    def get_lr(self) -> float:
        """Return the current learning rate of the first parameter group (0.0 without optimizer)."""
        if self.optimizer is None:
            return 0.0
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------------------------ topology
    def get_data_parallel_size(self) -> int:
        """Return the number of DP ranks (world_size // (sp_size * tp_size * pp_size))."""
        assert self.topology is not None
        return self.topology.dp_size

    def get_data_parallel_rank(self) -> int:
        """Return this rank's DP rank."""
        assert self.topology is not None
        return self.topology.dp_rank

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        """Return the DP process group (``None`` when not distributed)."""
        assert self.topology is not None
        return self.topology.dp_group

    def is_mp_src_rank_with_outputs(self) -> bool:
        """Whether this rank reports its DP rank's outputs (``Topology.reports_outputs``; none: yes)."""
        return self.topology is None or self.topology.reports_outputs

    # --------------------------------------------------------------------------------------- model
    def build_model(self) -> torch.nn.Module:
        """The model to shard: ``model_factory()`` or the checkpoint, varlen attention, then LoRA.

        Sets :attr:`lora` when the model carries adapters (``engine/build.py``).
        """
        model, self.lora = build_model(self.config, self.model_type, self.model_factory)
        if self.lora is not None:  # 'all-linear' or a saved adapter may adapt fused experts (docs/moe.md)
            refuse_param_lora_backend(self.backend or type(self).__name__, param_lora_names(model))
        self._num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self._moe_routers = self.HF_ROUTERS and bool(find_routers(model))  # a dense model: no router hooks
        return model

    def num_trainable_parameters(self) -> int:
        """Trainable elements of the full (unsharded) model, counted when it was built."""
        return self._num_trainable

    # ------------------------------------------------------------------------------ LoRA (engine.lora)
    @property
    def peft_model(self) -> PeftModel | None:
        """The engine's ``PeftModel`` (``None`` without adapters)."""
        return None if self.lora is None else self.lora.peft_model

    @property
    def has_adapters(self) -> bool:
        """True when the engine's model carries peft adapters."""
        return self.lora is not None

    def disable_adapters(self) -> contextlib.AbstractContextManager:
        """A context in which the model computes as the base model (``LoRAAdapters.disabled``).

        Raises:
            RuntimeError: If the engine has no adapters.
        """
        return require_lora(self.lora, type(self).__name__, "disable_adapters()").disabled()

    def save_adapter(self, path: str | os.PathLike) -> str:
        """Write the adapters as a peft directory (``LoRAAdapters.save``); a collective, rank 0 writes.

        ``PeftModel.from_pretrained(base_model, path)`` loads it; so does ``EngineConfig.lora_adapter_path``.
        Returns ``path`` as a string once the files exist; raises ``RuntimeError`` without adapters.
        """
        lora = require_lora(self.lora, type(self).__name__, "save_adapter()")
        return lora.save(path, dict(self.get_per_tensor_param(adapters_only=True)), self.config.model_path)

    # ------------------------------------------------------------------- weights (engine/weights.py)
    @abstractmethod
    def named_full_tensors(
        self, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Backend part: state-dict ``(name, full_tensor)`` for the names ``keep`` accepts; a collective."""

    def get_per_tensor_param(self, adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full_tensor)`` one at a time (``WeightStream.tensors``); a collective.

        With LoRA the base model's tensors, adapters merged, or with ``adapters_only=True`` the adapters
        under peft's names (``RuntimeError`` without adapters).
        """
        return WeightStream(self.named_full_tensors, self.lora, type(self).__name__).tensors(adapters_only)

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
        tokenizer: PreTrainedTokenizerBase | str | os.PathLike | None = "model_path",
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | None = None,
    ) -> str:
        """Write the model (LoRA merged) as a standard HF directory (``HFExport.save``); a collective.

        ``AutoModelForCausalLM.from_pretrained(path)`` (a value model: ``AutoModelForTokenClassification``)
        loads it. ``tokenizer``: a tokenizer, a directory, ``"model_path"`` (the model's own) or ``None``;
        ``dtype``: of the floating-point weights (default: the parameters'). Returns ``str(path)``.
        """
        export = HFExport(self.config.model_path, self.model_config, self.MODEL_TYPE)
        return export.save(self.get_per_tensor_param(), path, tokenizer, max_shard_size, dtype)

    # --------------------------------------------------------------------------------- checkpoints
    @abstractmethod
    def save_checkpoint(self, path: str, global_step: int = 0, **kwargs: Any) -> None:
        """Save model, optimizer, scheduler and RNG atomically to the directory ``path``."""

    @abstractmethod
    def load_checkpoint(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote; returns its plain metadata (e.g. global_step)."""

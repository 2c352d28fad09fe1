"""Megatron-Core engine (``megatron``): Megatron's ``GPTModel``, tensor parallelism and DDP gradient sync.

:class:`MegatronEngine` is one backend class (``BaseEngine``'s loop and parts, ``OptimizerMixin``'s step
and LR schedule). What Megatron does:

* the model: ``GPTModel`` with Megatron's local layer spec (the TE spec on CUDA where Transformer Engine is
  installed), its attention / MLP projections Megatron's column- and row-parallel layers over the engine's
  TP group, embedding and output layer vocabulary-parallel (``engine/megatron_model.py``);
* the gradient sync: Megatron's ``DistributedDataParallel`` (grad buffers, ``finish_grad_sync`` over dp);
* HF weights in and out: mbridge's mapping (``engine/megatron_bridge.py``).

What the engine adds: the forward on the loop's packed micro-batches (``engine/megatron_forward.py``), the
torch optimizer on Megatron's ``main_grad`` buffers with the global grad norm over dp and tp
(``engine/megatron_grads.py``: Megatron's optimizer allocates on CUDA), per-rank checkpoints
(``engine/megatron_checkpoint.py``: ``dist_checkpointing`` needs CUDA), the CPU stand-ins
(``engine/megatron_cpu.py``) and the refusals (``engine/megatron_refusals.py``). Megatron's global
``parallel_state`` is not initialised: each engine hands Megatron its own process groups, so engines of
different layouts live in one process. Usage, what runs where: docs/megatron.md.

``import megatron.core`` happens at import; without the package this module raises ``ImportError``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import megatron.core  # noqa: F401  (a missing library is an ImportError here: engine/__init__.py)
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from transformers import AutoConfig

from verl_trainer.engine.base import BaseEngine
from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.engine.heads import VocabSlice
from verl_trainer.engine.library_moe import check_moe_options
from verl_trainer.engine.megatron_bridge import hf_tensors, load_hf_weights, make_bridge
from verl_trainer.engine.megatron_checkpoint import MegatronCheckpointMixin
from verl_trainer.engine.megatron_cpu import prepare_device
from verl_trainer.engine.megatron_forward import LogitsOutput, common_shape, packed_logits
from verl_trainer.engine.megatron_grads import attach_main_grads, global_grad_norm
from verl_trainer.engine.megatron_model import (
    MegatronGroups,
    build_gpt_model,
    check_hf_config,
    megatron_groups,
    padded_vocab_size,
)
from verl_trainer.engine.megatron_moe import check_expert_parallel
from verl_trainer.engine.megatron_refusals import check_megatron_request
from verl_trainer.engine.offload import move_optimizer_state
from verl_trainer.engine.optim import OptimizerMixin, build_lr_scheduler
from verl_trainer.engine.optimizers import build_optimizer
from verl_trainer.engine.registry import EngineRegistry
from verl_trainer.engine.topology import engine_topology
from verl_trainer.models.hf_files import MODEL_TYPES, to_dtype
from verl_trainer.utils.distributed import is_initialized

__all__ = ["MegatronEngine"]


@EngineRegistry.register(model_type=list(MODEL_TYPES), backend="megatron", device=["cpu", "cuda"])
class MegatronEngine(OptimizerMixin, MegatronCheckpointMixin, BaseEngine):
    """Megatron-Core engine for a HF Llama / Qwen2 causal LM (``engine/megatron_model.py``).

    Args:
        config: Engine config (``tensor_model_parallel_size``: Megatron's TP over the run's ``(dp, tp)``
            mesh).
        optim_config: Optimizer config; ``None`` builds an inference-only engine (no DDP wrapper).
        backend: ``"megatron"``.
        **kwargs: ``model_type``, ``topology``, ``model_factory`` (see ``BaseEngine``) and ``EngineConfig``
            fields to override.

    Raises:
        ValueError: At construction, for what it does not run (``megatron_refusals.py``): a value model,
            LoRA, Ulysses SP, PP, a model factory, parameter offload, float16 or mixed precision.
    """

    SUPPORTS_TENSOR_PARALLEL = True
    SUPPORTS_EXPERT_PARALLEL = True  # Megatron's EP group inside dp (Qwen3-MoE; engine/megatron_moe.py)
    HF_ROUTERS = False  # the library's own router: no transformers router modules to hook
    CPU_FLOAT16_REFUSAL = "the megatron engine has no float16 loss scaling on Megatron's gradient buffers"

    def __init__(self, config: EngineConfig, optim_config: OptimConfig | None = None, *,
                 backend: str = "megatron", **kwargs: Any) -> None:
        super().__init__(config, optim_config, backend=backend, **kwargs)
        check_megatron_request(self.config, self.model_type.name, self.model_factory, self.device.type)
        check_moe_options(self.config, "megatron")
        if self.config.expert_model_parallel_size > 1:  # before any model loads
            check_expert_parallel(self.config, AutoConfig.from_pretrained(self.config.model_path), None)
        self.gpt_model: torch.nn.Module | None = None
        self.ddp: DistributedDataParallel | None = None
        self.groups: MegatronGroups | None = None
        self.bridge: Any = None
        self._vocab_rows = 0

    # ----------------------------------------------------------------------------------- lifecycle
    def initialize(self) -> None:
        """Build ``GPTModel`` on this rank's TP shard, load the HF weights, wrap DDP, build the optimizer.

        A collective, idempotent.

        Raises:
            RuntimeError: No process group is initialised.
            ValueError: The model is not one the engine builds (``megatron_model.check_hf_config``).
        """
        if self.initialized:
            return
        if not is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} ({self.backend}) needs an initialised process group; "
                f"call torch.distributed.init_process_group (or use Trainer / torchrun) first"
            )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.config.seed)
        topo = self.topology = engine_topology(self.topology, self.config, self.device.type)
        hf_config = AutoConfig.from_pretrained(self.config.model_path)
        check_hf_config(hf_config, topo.tp_size, self.device.type)  # before any weight is read
        check_expert_parallel(self.config, hf_config, topo.dp_size)
        groups = self.groups = megatron_groups(topo, self.config.expert_model_parallel_size)
        prepare_device(self.device.type, self.config.seed, groups.tp_rank)
        dtype = to_dtype(self.config.model_dtype)
        self.bridge = make_bridge(hf_config, groups, dtype, self.device.type,
                                  recompute=self.config.enable_gradient_checkpointing)
        model = self.gpt_model = build_gpt_model(self.bridge, hf_config, groups, self.device)
        load_hf_weights(self.bridge, model, self.config.model_path)
        self.model_config = hf_config
        self._num_trainable = sum(p.numel() * (groups.tp_size if getattr(p, "tensor_model_parallel", False)
                                               else 1) for p in model.parameters())
        vocab, rows = int(hf_config.vocab_size), padded_vocab_size(int(hf_config.vocab_size), groups.tp_size)
        start = groups.tp_rank * (rows // groups.tp_size)
        self._vocab_rows = max(0, min(rows // groups.tp_size, vocab - start))
        if groups.tp_size > 1:
            self.model_type.vocab_slice = VocabSlice(start, groups.tp_group)
        self.module = model
        if self.optim_config is not None:
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=to_dtype(self.config.reduce_dtype) == torch.float32,
                overlap_grad_reduce=False, use_distributed_optimizer=False,
            )
            self.ddp = DistributedDataParallel(model.config, ddp_config, module=model,
                                               pg_collection=groups.collection)
            self.module = self.ddp
            self.optimizer = build_optimizer(model.parameters(), self.optim_config)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, self.optim_config)
        self.initialized = True

    def to(self, device: str | torch.device, model: bool = True, optimizer: bool = True,
           grad: bool = True) -> None:
        """Move the optimizer state to ``device``; parameters and DDP buffers stay on the engine's device.

        ``param_offload`` is refused at construction, so the mode contexts move only the optimizer
        (``optimizer_offload``).

        Raises:
            ValueError: Asked to move parameters or gradients to another device.
        """
        target = torch.device(device)
        if (model or grad) and target.type != self.device.type:
            raise ValueError(f"the megatron engine keeps its parameters and gradient buffers on "
                             f"{self.device.type!r}; it cannot move them to {target.type!r}")
        if optimizer:
            move_optimizer_state(self.optimizer, target)

    # ------------------------------------------------------------------------------------- compute
    def _forward_packed(self, packed: Any) -> LogitsOutput:
        """``GPTModel`` (through DDP when training) on the packed micro-batch's samples as padded rows."""
        groups = self.groups
        assert groups is not None
        pad_to = None
        if groups.ep_size > 1 and self.device.type == "cpu":  # the all-gather dispatcher: equal blocks
            pad_to = common_shape(packed, groups.collection.ep)
        return packed_logits(self.module, packed, self._vocab_rows, pad_to)

    def _grad_sync_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        """Megatron DDP's ``no_sync`` on all but the last micro-batch (the sync is ``finish_grad_sync``)."""
        if self.ddp is None or is_last:
            return contextlib.nullcontext()
        return self.ddp.no_sync()

    # ----------------------------------------------------------------------------------- optimizer
    def optimizer_zero_grad(self) -> None:
        """Zero Megatron's gradient buffers and drop the optimizer's ``.grad`` views of them."""
        optimizer = self._require_optimizer()
        assert self.ddp is not None
        self.ddp.zero_grad_buffer()
        optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        """All-reduce the gradient buffers over dp (Megatron DDP), then clip and step the torch optimizer.

        Returns:
            The global grad norm before clipping (``nan`` / ``inf``: the step was skipped).
        """
        self._require_optimizer()
        assert self.ddp is not None and self.gpt_model is not None
        self.ddp.finish_grad_sync()
        attach_main_grads(self.gpt_model.parameters())
        return super().optimizer_step()

    def _clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """The norm over the (dp, tp) layout, every element counted once (``megatron_grads.py``)."""
        assert self.gpt_model is not None and self.groups is not None
        groups = self.groups
        return global_grad_norm(self.gpt_model.parameters(), max_norm, groups.tp_group, groups.tp_rank,
                                groups.tp_size, ep_group=groups.collection.ep if groups.ep_size > 1 else None)

    # ------------------------------------------------------------------------------- weight export
    def named_full_tensors(
        self, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full tensor)`` one at a time, gathered over TP when reached; a TP collective.

        Args:
            keep: Only HF names it accepts are gathered and yielded (the same on every rank).
        """
        assert self.gpt_model is not None and self.groups is not None
        yield from hf_tensors(self.bridge, self.gpt_model, self.groups, keep)

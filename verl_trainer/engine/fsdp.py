"""FSDP engines: ``fsdp2`` (``fully_shard`` on a DeviceMesh) and ``fsdp`` (FSDP1), one implementation.

:class:`FSDPEngine` is one backend class (``BaseEngine``'s recipe) with the torch-optimizer step and DCP
checkpoints, registered for both model types on cpu, cuda and npu. It adds only what is FSDP-specific:
wrapping, the float16 loss scaler (``engine/loss_scale.py``), gradient-sync control (FSDP2
``set_requires_gradient_sync``, FSDP1 ``no_sync``), FSDP1's grad clipping, parameter offload, the
export of full tensors, and (fsdp2) tensor parallelism under FSDP on a ``(dp, tp)`` mesh or pipeline
parallelism with FSDP within each stage on a ``(pp, dp)`` mesh (the ``engine/pipeline.py`` part, built
only then).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from verl_trainer.engine.base import BaseEngine
from verl_trainer.engine.checkpoint import DCPCheckpointMixin
from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.engine.heads import VocabSlice
from verl_trainer.engine.loss_scale import build_grad_scaler, uses_loss_scaling
from verl_trainer.engine.offload import move_grads, move_module, move_optimizer_state
from verl_trainer.engine.optim import OptimizerMixin, build_lr_scheduler
from verl_trainer.engine.optimizers import build_optimizer
from verl_trainer.engine.parallelize import apply_fsdp1, apply_fsdp2
from verl_trainer.engine.pipeline import PipelineParallel, check_pipeline_model
from verl_trainer.engine.registry import EngineRegistry
from verl_trainer.engine.tensor_parallel import apply_tensor_parallel, vocab_slice_start
from verl_trainer.engine.topology import engine_topology
from verl_trainer.models.hf_files import MODEL_TYPES
from verl_trainer.utils.distributed import is_initialized

FSDP_BACKENDS = ("fsdp", "fsdp2")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Return the unsharded value of a state-dict entry (DTensor or plain); a collective for DTensors."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


@EngineRegistry.register(model_type=list(MODEL_TYPES), backend=list(FSDP_BACKENDS),
                         device=["cpu", "cuda", "npu"])
class FSDPEngine(OptimizerMixin, DCPCheckpointMixin, BaseEngine):
    """FSDP1 / FSDP2 engine for either model type (``model_type``: its part, ``engine/heads.py``).

    Args:
        config: Engine config.
        optim_config: Optimizer config; ``None`` builds an inference-only engine.
        backend: ``"fsdp2"`` (default) or ``"fsdp"`` (FSDP1).
        **kwargs: ``model_type``, ``topology``, ``model_factory`` (see ``BaseEngine``) and ``EngineConfig``
            fields to override.

    """

    SUPPORTS_SEQUENCE_PARALLEL = True  # Ulysses: gathered outputs' grads x sp, FSDP averages over dp x sp
    SUPPORTS_TENSOR_PARALLEL = True  # fsdp2 only (checked below): DTensor TP, then fully_shard over dp
    SUPPORTS_PIPELINE_PARALLEL = True  # fsdp2 only (checked below): pipelining stages, fully_shard over dp

    def __init__(
        self,
        config: EngineConfig,
        optim_config: OptimConfig | None = None,
        *,
        backend: str = "fsdp2",
        **kwargs: Any,
    ) -> None:
        super().__init__(config, optim_config, backend=backend, **kwargs)
        if backend not in FSDP_BACKENDS:
            raise ValueError(f"FSDPEngine backend must be one of {FSDP_BACKENDS}, got {backend!r}")
        if self.config.tensor_model_parallel_size > 1 and backend != "fsdp2":
            raise ValueError(
                f"tensor_model_parallel_size={self.config.tensor_model_parallel_size} needs the 'fsdp2' "
                f"backend (FSDP2 composes with DTensor TP on a (dp, tp) mesh), got {backend!r}; use "
                f"strategy='fsdp2'"
            )
        if self.config.pipeline_model_parallel_size > 1 and backend != "fsdp2":
            raise ValueError(
                f"pipeline_model_parallel_size={self.config.pipeline_model_parallel_size} needs the 'fsdp2' "
                f"backend (torch.distributed.pipelining drives FSDP2 modules), got {backend!r}; use "
                f"strategy='fsdp2'"
            )
        if self.config.param_offload and self.config.fsdp_cpu_offload:
            raise ValueError(
                "param_offload (offload between phases) and fsdp_cpu_offload (FSDP keeps params on "
                "CPU all the time) exclude each other; enable one of them"
            )

    @property
    def is_fsdp1(self) -> bool:
        """True for the FSDP1 wrapper (``backend="fsdp"``)."""
        return self.backend == "fsdp"

    # ----------------------------------------------------------------------------------- lifecycle
    def initialize(self) -> None:
        """Load the HF model, shard it, build AdamW + LR schedule; a collective, idempotent."""
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
        if topo.pp_size > 1 and self.model_factory is None:
            check_pipeline_model(self.config, self.model_type)  # before the weights load
        model = self.build_model()  # checkpoint or factory, + LoRA adapters (engine/build.py)
        self.model_config = model.config
        if self.config.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if topo.pp_size > 1:  # this rank's stage, HF names kept; the loop's schedule from now on
            self.pipeline = PipelineParallel(topo, model)
        if topo.tp_mesh is not None:
            # then FSDP over dp (a 2-D layout); the LM head may now yield this rank's vocabulary slice
            if apply_tensor_parallel(model, topo.tp_mesh):
                start = vocab_slice_start(model.config.vocab_size, topo.tp_size, topo.tp_rank)
                self.model_type.vocab_slice = VocabSlice(start, topo.tp_mesh.get_group())
        mesh = topo.shard_mesh
        if self.is_fsdp1:
            self.module = apply_fsdp1(model, mesh, self.config, self.device)
        else:
            self.module = apply_fsdp2(model, mesh, self.config)
        if self.optim_config is not None:
            self.optimizer = build_optimizer(self.module.parameters(), self.optim_config)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, self.optim_config)
            if uses_loss_scaling(self.config):
                self.grad_scaler = build_grad_scaler(self.device.type, fsdp1=self.is_fsdp1)
        self.initialized = True
        if self.config.param_offload:
            self.to("cpu", model=True, optimizer=False, grad=False)

    def to(
        self, device: str | torch.device, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        """Move parameters / optimizer state / gradients to ``device``.

        Parameters under FSDP's own CPU offload (``fsdp_cpu_offload``) stay where FSDP keeps them.
        """
        if model and not self.config.fsdp_cpu_offload:
            move_module(self.module, device, fsdp1=self.is_fsdp1)
        if grad and not self.config.fsdp_cpu_offload:
            move_grads(self.module, device)
        if optimizer:
            move_optimizer_state(self.optimizer, device)

    # ------------------------------------------------------------------------------------- compute
    def _grad_sync_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        """FSDP2: reduce-scatter only on the last micro-batch; FSDP1: ``no_sync`` on the others."""
        assert self.module is not None
        if self.is_fsdp1:
            return contextlib.nullcontext() if is_last else self.module.no_sync()
        self.module.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()

    def _clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """FSDP1 has its own ``clip_grad_norm_`` (flat parameters); FSDP2 uses the DTensor-aware one."""
        if self.is_fsdp1:
            clip = float("inf") if max_norm is None else float(max_norm)
            return self.module.clip_grad_norm_(clip).detach().cpu()  # type: ignore[union-attr,operator]
        return super()._clip_grad_norm(max_norm)

    # ------------------------------------------------------------------------------- weight export
    def get_shareable_params(self) -> dict[str, torch.Tensor] | None:
        """FSDP2 on one shard rank without TP, PP, LoRA or offload: the local tensors (see ``BaseEngine``).

        There each parameter's local tensor is the whole parameter and what the optimizer updates in
        place; anywhere else ``None`` (a pipeline stage holds only its own layers).
        """
        offload = self.config.param_offload or self.config.fsdp_cpu_offload
        mesh = self.topology.shard_mesh
        sharded = mesh is not None and mesh.size() > 1  # the same answer on every rank
        if self.is_fsdp1 or self.lora is not None or offload or self.topology.tp_mesh is not None \
                or sharded or self.pipeline is not None:
            return None
        params: dict[str, torch.Tensor] = {}
        for name, param in self.module.named_parameters():  # FSDP2 keeps the model's own names
            local = param.to_local() if isinstance(param, DTensor) else param
            params[name] = local.detach()
        return params

    def named_full_tensors(
        self, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full_tensor)`` one at a time (each gathered when reached); a collective.

        The names are the model's state-dict names (HF names without LoRA; ``get_per_tensor_param`` maps
        a LoRA model's to the base model's). Offloaded parameters are loaded for the export and offloaded
        again afterwards.

        Args:
            keep: Only names it accepts are gathered and yielded (the same on every rank).
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self.pipeline is not None:
            yield from self.pipeline.full_tensors(self.module, self.device, keep)
            return
        offloaded = self.config.param_offload and self.mode is None
        if offloaded:
            self.to(self.device, model=True, optimizer=False, grad=False)
        try:
            for name, value in get_model_state_dict(self.module).items():
                if keep is None or keep(name):
                    yield name, full_tensor(value).detach()
        finally:
            if offloaded:
                self.to("cpu", model=True, optimizer=False, grad=False)


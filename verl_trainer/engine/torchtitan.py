"""The ``torchtitan`` engine: torchtitan's own Llama 3 / Qwen3 / Qwen3-MoE, parallelised by torchtitan.

:class:`TorchTitanEngine` is one backend class (``BaseEngine``'s recipe) with the torch-optimizer step and
DCP checkpoints. The model is torchtitan's (``engine/torchtitan_model.py``: built from the checkpoint's HF
config, the HF weights converted by torchtitan's state-dict adapter), sharded by torchtitan's parallelize
function (FSDP2 over dp, TP over ``tensor_model_parallel_size``, EP of a MoE model's experts over
``expert_model_parallel_size`` dp ranks: ``engine/torchtitan_parallel.py``, ``engine/torchtitan_moe.py``);
on CPU the gaps of ``engine/torchtitan_cpu.py`` are filled. Global-denominator losses, micro-batching,
balancing, the optimizer step and the weight stream are ``BaseEngine``'s, as for every backend.

The forward: each packed micro-batch is laid out as right-padded rows (one sample per row, positions from 0)
for torchtitan's model, whose LM head is skipped (its ``_skip_lm_head``, as torchtitan's chunked loss does);
the hidden states of the real tokens are packed back and the LM head runs only at the positions whose
outputs are used (``engine/heads.py: head_positions``). Under TP the head's output is this TP rank's
vocabulary slice and the log-probs are reduced from the slices (``engine/vocab_parallel.py``).

Refused at construction, with the reason: a value model, LoRA, Ulysses SP, pipeline parallelism, an EP size
the model / layout cannot take, and the HF engines' router replay / router losses (see
``docs/torchtitan.md``).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torchtitan  # noqa: F401  (a missing library is an ImportError here: engine/__init__.py)
from torch.distributed.tensor import DTensor
from transformers.modeling_outputs import CausalLMOutput

from verl_trainer.data.packing import PackedBatch, unpack_to_padded
from verl_trainer.engine.base import BaseEngine
from verl_trainer.engine.checkpoint import DCPCheckpointMixin
from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.engine.heads import VocabSlice, head_positions
from verl_trainer.engine.library_moe import check_moe_options
from verl_trainer.engine.offload import move_grads, move_module, move_optimizer_state
from verl_trainer.engine.optim import OptimizerMixin, build_lr_scheduler
from verl_trainer.engine.optimizers import build_optimizer
from verl_trainer.engine.registry import EngineRegistry
from verl_trainer.engine.tensor_parallel import vocab_slice_start
from verl_trainer.engine.topology import engine_topology
from verl_trainer.engine.torchtitan_cpu import inner_attention_config, uses_attention_masks
from verl_trainer.engine.torchtitan_model import check_hf_config, hf_names, titan_model_spec
from verl_trainer.engine.torchtitan_moe import FusedExpertNames, check_expert_parallel, split_fused_experts
from verl_trainer.engine.torchtitan_parallel import (
    parallelism_config,
    parallelize,
    prepare_model_config,
    training_config,
)
from verl_trainer.models.hf_files import MODEL_TYPES, to_dtype
from verl_trainer.utils.distributed import is_initialized

OTHER_BACKENDS = "strategy='fsdp2' (or 'fsdp', 'deepspeed')"


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@EngineRegistry.register(model_type=list(MODEL_TYPES), backend="torchtitan", device=["cpu", "cuda"])
class TorchTitanEngine(OptimizerMixin, DCPCheckpointMixin, BaseEngine):
    """torchtitan engine for a language model (Llama 3, Qwen3, Qwen3-MoE).

    Args:
        config: Engine config.
        optim_config: Optimizer config; ``None`` builds an inference-only engine.
        backend: ``"torchtitan"``.
        **kwargs: ``model_type``, ``topology``, ``model_factory`` (a zero-argument callable returning a
            transformers Llama / Qwen3 causal LM whose config and weights are used) and ``EngineConfig``
            fields to override.

    Raises:
        ValueError: At construction, for a value model, LoRA, Ulysses SP, pipeline parallelism, a
            checkpoint whose model type torchtitan does not build, an unsupported precision, an
            ``expert_model_parallel_size`` the model cannot take, or ``moe`` router replay / losses.
    """

    SUPPORTS_TENSOR_PARALLEL = True  # torchtitan's TP plan on the (dp, tp) mesh, FSDP2 over dp
    SUPPORTS_EXPERT_PARALLEL = True  # torchtitan's EP mesh inside dp (Qwen3 MoE)
    HF_ROUTERS = False  # the library's own router: no transformers router modules to hook

    def __init__(self, config: EngineConfig, optim_config: OptimConfig | None = None, *,
                 backend: str = "torchtitan", **kwargs: Any) -> None:
        super().__init__(config, optim_config, backend=backend, **kwargs)
        cfg = self.config
        if self.model_type.name != "language_model":
            raise ValueError(
                f"strategy='torchtitan' builds language models only, got model_type="
                f"{self.model_type.name!r}: torchtitan's decoders have no scalar value head and their HF "
                f"adapters map only the LM head; build the critic with {OTHER_BACKENDS}"
            )
        if cfg.lora_rank > 0 or cfg.lora_adapter_path:
            raise ValueError(
                f"strategy='torchtitan' has no LoRA (lora_rank={cfg.lora_rank}, lora_adapter_path="
                f"{cfg.lora_adapter_path!r}): the adapters are peft's, on transformers models; use "
                f"{OTHER_BACKENDS}, or set lora_rank=0"
            )
        if cfg.ulysses_sequence_parallel_size > 1:
            raise ValueError(
                f"ulysses_sequence_parallel_size={cfg.ulysses_sequence_parallel_size} is not supported by "
                f"strategy='torchtitan' (Ulysses is the transformers attention hook of the other backends); "
                f"use {OTHER_BACKENDS}, or set ulysses_sequence_parallel_size=1"
            )
        training_config(cfg)  # precision checks, before any model loads
        check_moe_options(cfg, "torchtitan")
        if self.model_factory is None:
            if not cfg.model_path:
                raise ValueError("strategy='torchtitan' needs EngineConfig.model_path (an HF checkpoint "
                                 "directory of a Llama or Qwen3 model) or a model_factory")
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(cfg.model_path)
            check_hf_config(hf_config)
            check_expert_parallel(hf_config, cfg, None)
        self.adapter: Any = None
        self._hf_names: dict[str, str] = {}

    # ----------------------------------------------------------------------------------- lifecycle
    def initialize(self) -> None:
        """Build torchtitan's model from the HF checkpoint, parallelise it, build the optimizer."""
        if self.initialized:
            return
        if not is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} (torchtitan) needs an initialised process group; call "
                f"torch.distributed.init_process_group (or use Trainer / torchrun) first"
            )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.config.seed)
        topo = self.topology = engine_topology(self.topology, self.config, self.device.type)
        hf_model = self._load_hf_model()
        self.model_config = hf_model.config
        check_expert_parallel(hf_model.config, self.config, topo.world_size)
        spec = titan_model_spec(hf_model.config, inner_attention_config(self.device.type), self.device.type)
        prepare_model_config(spec.config, parallelism_config(self.config))
        with torch.random.fork_rng(devices=[]):  # its initialisers draw; the weights are the checkpoint's
            model = spec.config.build()
            model.init_states(buffer_device=torch.device("cpu"))
        hf_state = split_fused_experts(dict(hf_model.state_dict()))  # MoE: one tensor per expert
        model.load_state_dict(spec.adapter.from_hf(hf_state), strict=True)
        dtype = to_dtype(self.config.model_dtype)
        for param in model.parameters():
            param.data = param.data.to(dtype)
        self._num_trainable = sum(p.numel() for p in hf_model.parameters() if p.requires_grad)
        del hf_model
        self.adapter = spec.adapter
        self._hf_names = hf_names(spec.adapter, {k: v.shape for k, v in model.state_dict().items()})
        model._skip_lm_head = True  # the head runs at the used positions only (_forward_packed)
        if self.device.type != "cpu":
            model.to(self.device)
        parallelize(model, spec.parallelize, self.config, topo.world_size, self.device.type,
                    tempfile.gettempdir())
        self.module = model
        vocab = int(spec.config.vocab_size)
        if topo.tp_size > 1 and vocab_slice_start(vocab, topo.tp_size, topo.tp_size - 1) < vocab:
            start = vocab_slice_start(vocab, topo.tp_size, topo.tp_rank)
            self.model_type.vocab_slice = VocabSlice(start, topo.tp_mesh.get_group())
        if self.optim_config is not None:
            self.optimizer = build_optimizer(self.module.parameters(), self.optim_config)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, self.optim_config)
        self.initialized = True
        if self.config.param_offload:
            self.to("cpu", model=True, optimizer=False, grad=False)

    def _load_hf_model(self) -> torch.nn.Module:
        """The HF model whose config and weights are converted: ``model_factory()`` or the checkpoint."""
        if self.model_factory is not None:
            model = self.model_factory()
            if not hasattr(model, "config") or hasattr(model, "peft_config"):
                raise ValueError(
                    f"strategy='torchtitan' needs model_factory to return a transformers Llama / Qwen3 "
                    f"causal LM (no peft adapters), got {type(model).__name__}; use {OTHER_BACKENDS} for "
                    f"others"
                )
            check_hf_config(model.config)
            return model
        from verl_trainer.models.loading import load_causal_lm  # lazy: only without a model_factory

        return load_causal_lm(self.config.model_path, attn_implementation="sdpa", torch_dtype=torch.float32)

    def to(self, device: str | torch.device, model: bool = True, optimizer: bool = True,
           grad: bool = True) -> None:
        """Move parameters / optimizer state / gradients to ``device`` (FSDP's own offload stays)."""
        if model and not self.config.fsdp_cpu_offload:
            move_module(self.module, device)
        if grad and not self.config.fsdp_cpu_offload:
            move_grads(self.module, device)
        if optimizer:
            move_optimizer_state(self.optimizer, device)

    # ------------------------------------------------------------------------------------- compute
    def _grad_sync_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        """Reduce-scatter the gradients on the last micro-batch only (FSDP2)."""
        assert self.module is not None
        self.module.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()

    def _forward_packed(self, packed: PackedBatch) -> CausalLMOutput:
        """Run torchtitan's model on one micro-batch: ``logits [1, K, V]`` (``V / tp``) at the used positions.

        The packed row becomes right-padded rows ``[B, L]`` (``L`` = the longest sample), positions
        ``0 .. L - 1`` per row; the final-norm hidden states of the real tokens are packed back to ``[N, D]``
        and the LM head runs at :func:`~verl_trainer.engine.heads.head_positions` (all ``N`` without an
        output mask).
        """
        module = self.module
        assert module is not None
        width = max(int(packed.max_seqlen), 1)
        tokens = unpack_to_padded(packed.input_ids[0], packed.cu_seqlens, width, pad_value=0)
        positions = torch.arange(width, device=tokens.device).expand_as(tokens)
        masks = module.get_attention_masks(positions) if uses_attention_masks(self.device.type) else None
        hidden = module(tokens, positions, masks)  # [B, L, D]
        if isinstance(hidden, DTensor):
            hidden = hidden.to_local()  # replicated over tp: every TP rank holds the whole
        lengths = packed.seq_lens.to(tokens.device)
        real = torch.arange(width, device=tokens.device)[None, :] < lengths[:, None]
        hidden = hidden[real]  # [N, D], in the packed row's order
        used = head_positions(packed)
        if used is not None:
            hidden = hidden[used.to(hidden.device)]
        logits = module.lm_head(hidden[None])
        if isinstance(logits, DTensor):
            logits = logits.to_local() if self.model_type.vocab_slice is not None else logits.full_tensor()
        return CausalLMOutput(logits=logits)

    # ------------------------------------------------------------------------------- weight export
    def named_full_tensors(
        self, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full_tensor)`` one at a time, converted by torchtitan's adapter; a collective.

        Names and layouts are the HF checkpoint's (Llama's ``q_proj`` / ``k_proj`` permuted back); a tied
        ``lm_head.weight`` is not yielded (the embedding is). Offloaded parameters are loaded for the export
        and offloaded again afterwards.

        Args:
            keep: Only HF names it accepts are gathered and yielded (the same on every rank).
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        offloaded = self.config.param_offload and self.mode is None
        if offloaded:
            self.to(self.device, model=True, optimizer=False, grad=False)
        experts = FusedExpertNames()
        try:
            for name, value in get_model_state_dict(self.module).items():
                hf_name = self._hf_names.get(name)
                if hf_name is None or (keep is not None and not keep(hf_name)):
                    continue
                if FusedExpertNames.hf_name(name) is not None:  # MoE: transformers 5's fused experts
                    yield from experts.add(name, _full(value).detach())
                    continue
                ((hf_name, tensor),) = self.adapter.to_hf({name: _full(value).detach()}).items()
                yield hf_name, tensor
        finally:
            if offloaded:
                self.to("cpu", model=True, optimizer=False, grad=False)

"""The micro-batch loop shared by every engine that runs a HF module on packed micro-batches.

:class:`MicroBatchComputeMixin` implements ``forward_backward_batch`` in the order DESIGN.md §4 fixes:

1. :func:`compute_global_batch_info`: ``batch_num_tokens`` (the loss-mask sum) and ``global_batch_size``
   (real samples) all-reduced over the DP group, before splitting;
2. ``prepare_micro_batches`` (fixed size, or dynamic by token budget; same count on every DP rank);
3. per micro-batch: pack (no padding) → forward → model outputs unpacked to ``[b, t]`` →
   ``loss_fn(model_output, micro_batch, info)`` → ``backward`` as is (never divided by the number of
   micro-batches); gradient sync only on the last micro-batch;
4. forward-only outputs are restored to the original sample order.

The backend supplies :attr:`forward_model` (what is called: the module, or a wrapper such as DeepSpeed's
engine), :meth:`_backward` and :meth:`_grad_sync_context`; the model type supplies
``compute_packed_outputs`` and, under Ulysses SP, ``compute_sp_outputs`` (``engine/heads.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.data import schema
from verl_trainer.data.packing import PackedBatch, pack_batch
from verl_trainer.engine.batch_info import GlobalBatchInfo, local_counts
from verl_trainer.engine.config import EngineConfig
from verl_trainer.engine.hooks import NO_HOOKS, StepHooks
from verl_trainer.engine.topology import Topology
from verl_trainer.micro_batch import prepare_micro_batches, restore_dynamic_batch
from verl_trainer.models.attention import packed_forward
from verl_trainer.utils.distributed import all_reduce


def compute_global_batch_info(
    data: TensorDict, dp_group: dist.ProcessGroup | None, dp_size: int, dp_rank: int
) -> GlobalBatchInfo:
    """Global denominators of one optimizer step (one all-reduce of two numbers over the DP group).

    Args:
        data: This DP rank's whole batch ``[B, T]``, before splitting.
        dp_group: The DP group (``None``: single process).
        dp_size: DP world size.
        dp_rank: This rank's DP rank.

    Returns:
        ``GlobalBatchInfo(dp_size, batch_num_tokens, global_batch_size, dp_rank)``.

    """
    counts = local_counts(data)
    if dp_group is not None and dp_size > 1:
        counts = all_reduce(counts, dp_group)
    return GlobalBatchInfo(
        dp_size=dp_size,
        batch_num_tokens=int(round(float(counts[0]))),
        global_batch_size=int(round(float(counts[1]))),
        dp_rank=dp_rank,
    )


def _restore(values: torch.Tensor, batch_idx: list[int] | None) -> torch.Tensor:
    """Rows in micro-batch order ``[N, T]`` → original order ``[B, T]`` (padding rows dropped)."""
    return values if batch_idx is None else restore_dynamic_batch(values, batch_idx)


def _pad_width(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:]))
    return torch.cat([t, pad], 1)


class MicroBatchComputeMixin:
    """``forward_backward_batch`` over packed micro-batches; backends override the hooks.

    ``SUPPORTS_SEQUENCE_PARALLEL``: a backend whose gradient reduction makes Ulysses exact (the SP ranks'
    gradients averaged over dp x sp, as FSDP and DeepSpeed do) sets it; without it,
    ``ulysses_sequence_parallel_size > 1`` is refused at the first forward.
    """

    SUPPORTS_SEQUENCE_PARALLEL: bool = False
    config: EngineConfig
    topology: Topology
    module: torch.nn.Module | None
    device: torch.device

    # ------------------------------------------------------------------------------ backend hooks
    @property
    def forward_model(self) -> Any:
        """What the packed and Ulysses forwards call: the module, or a backend's forward wrapper."""
        return self.module

    def _forward_packed(self, packed: PackedBatch, model: Any = None) -> Any:
        """Run ``model`` (default :attr:`forward_model`) on one packed row (``logits [1, N, ...]``)."""
        return packed_forward(self.forward_model if model is None else model, packed)

    def _backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, as is."""
        loss.backward()

    def _grad_sync_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        """Context around forward+backward of a micro-batch; sync grads only when ``is_last``."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------------------ the loop
    def compute_global_batch_info(self, data: TensorDict) -> GlobalBatchInfo:
        """Global denominators of ``data`` over the DP group (see :func:`compute_global_batch_info`)."""
        return compute_global_batch_info(
            data, self.topology.dp_group, self.topology.dp_size, self.topology.dp_rank
        )

    def make_micro_batches(self, data: TensorDict) -> tuple[list[TensorDict], list[int] | None]:
        """Split ``data`` into micro-batches (fixed or dynamic, as configured).

        Returns:
            ``(micro_batches, batch_idx)``; ``batch_idx`` is the flattened original index of each sample
            in micro-batch order (``-1``: a padding sample added so every DP rank runs the same number
            of micro-batches), or ``None`` when the order is unchanged.

        """
        cfg = self.config
        return prepare_micro_batches(
            data,
            dp_group=self.topology.dp_group,
            same_micro_num_in_dp=True,
            micro_batch_size_per_gpu=cfg.micro_batch_size_per_gpu,
            use_dynamic_bsz=cfg.use_dynamic_bsz,
            max_token_len_per_gpu=cfg.max_token_len_per_gpu,
            sp_size=cfg.ulysses_sequence_parallel_size,
        )

    def forward_micro_batch(
        self, micro_batch: TensorDict, calculate_entropy: bool = False, temperature: float | None = None
    ) -> dict[str, torch.Tensor]:
        """Pack, forward, and unpack one micro-batch.

        Returns:
            Model outputs, each ``[b, t]`` aligned with ``micro_batch["input_ids"]`` (0 at padding).

        """
        if self.topology.sp_size > 1 and not self.SUPPORTS_SEQUENCE_PARALLEL:
            raise NotImplementedError(
                f"ulysses_sequence_parallel_size={self.topology.sp_size} needs a sequence-parallel part "
                f"in {type(self).__name__}; set ulysses_sequence_parallel_size=1"
            )
        packed = pack_batch(micro_batch, keys=())
        temperature = self.config.temperature if temperature is None else temperature
        if self.topology.sp_size > 1:
            # Ulysses: every SP rank of the DP group holds this micro-batch and runs 1/sp of the row;
            # the [N] outputs are gathered (their gradient scaled by sp: FSDP averages over dp x sp).
            outputs = self.compute_sp_outputs(  # type: ignore[attr-defined]  (model-type part)
                packed, self.topology.sp_group, calculate_entropy, temperature
            )
        else:
            outputs = self.compute_packed_outputs(  # type: ignore[attr-defined]  (model-type part)
                self._forward_packed(packed), packed, calculate_entropy, temperature
            )
        return {k: packed.unpack(v) for k, v in outputs.items()}

    def forward_backward_batch(
        self,
        data: TensorDict,
        loss_function: Any,
        forward_only: bool = False,
        calculate_entropy: bool = False,
        temperature: float | None = None,
        hooks: StepHooks | None = None,
    ) -> dict[str, Any]:
        """Run every micro-batch of this rank's share of one step (see ``BaseEngine``).

        Args:
            data: Padded schema batch ``[B, T]`` of this DP rank.
            loss_function: ``loss_fn(model_output, micro_batch, info) -> (loss, metrics)`` or ``None``
                (forward only).
            forward_only: No backward; outputs are collected and returned in the original order.
            calculate_entropy: Language model: also compute ``entropy``.
            temperature: Overrides ``config.temperature``.
            hooks: ``on_micro_batches`` sees the planned micro-batches before the first forward;
                ``on_before_backward`` each micro-batch's loss before its backward.

        Returns:
            ``{"loss": float, "local_loss": float, "metrics": list[dict], "num_micro_batches": int,
            "model_output": dict[str, Tensor [B, T]]}`` (``model_output`` only when ``forward_only``).
            ``loss`` is the global value: the mean over DP ranks of each rank's sum of partial losses.

        """
        if not getattr(self, "initialized", False):
            raise RuntimeError(f"{type(self).__name__} is not initialized; call engine.initialize() first")
        if loss_function is None and not forward_only:
            raise ValueError("forward_backward_batch needs a loss_function unless forward_only=True")
        info = self.compute_global_batch_info(data)
        micro_batches, batch_idx = self.make_micro_batches(data)
        hooks = hooks or NO_HOOKS
        hooks.on_micro_batches(micro_batches)
        losses: list[torch.Tensor] = []  # summed once at the end: no device sync per micro-batch
        metrics: list[dict[str, Any]] = []
        collected: dict[str, list[torch.Tensor]] = {}
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        with grad_ctx:
            for i, micro_batch in enumerate(micro_batches):
                is_last = i == len(micro_batches) - 1
                micro_batch = micro_batch.to(self.device)
                sync = contextlib.nullcontext() if forward_only else self._grad_sync_context(is_last)
                with sync:
                    outputs = self.forward_micro_batch(micro_batch, calculate_entropy, temperature)
                    if loss_function is not None:
                        loss, mb_metrics = loss_function(outputs, micro_batch, info)
                        if not forward_only:
                            hooks.on_before_backward(loss)
                            self._backward(loss)
                        losses.append(loss.detach().to(torch.float64))
                        metrics.append(dict(mb_metrics or {}))
                if forward_only:
                    for key, value in outputs.items():
                        collected.setdefault(key, []).append(value.detach())
        local_loss = torch.stack(losses).sum().cpu() if losses else torch.zeros((), dtype=torch.float64)
        result: dict[str, Any] = {
            "local_loss": float(local_loss),
            "loss": self._global_loss(local_loss),
            "metrics": metrics,
            "num_micro_batches": len(micro_batches),
        }
        if forward_only:
            width = data[schema.INPUT_IDS].shape[1]
            out_device = data.device if data.device is not None else torch.device("cpu")
            result["model_output"] = {
                k: _restore(torch.cat([_pad_width(v, width) for v in vs]), batch_idx).to(out_device)
                for k, vs in collected.items()
            }
        return result

    def _global_loss(self, local_loss: torch.Tensor) -> float:
        """Mean over DP ranks of the per-rank loss sums (each partial loss carries the ×dp factor)."""
        group, dp = self.topology.dp_group, self.topology.dp_size
        if group is None or dp == 1:
            return float(local_loss)
        return float(all_reduce(local_loss, group)) / dp

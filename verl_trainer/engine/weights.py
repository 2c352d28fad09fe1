"""The weights part of an engine: its full tensors out, one at a time, under the HF names.

``BaseEngine.get_per_tensor_param`` (the rollout's weight sync, ``save_hf``, ``save_adapter``) streams
through :class:`WeightStream`. The backend supplies the gather (``named_full_tensors(keep)``: each
state-dict tensor whole, gathered over the shard ranks when reached; a collective); with LoRA the stream
merges the adapters per tensor or yields the adapters alone (``engine/lora.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from verl_trainer.engine.lora import LoRAAdapters, NamedFullTensors, require_lora

__all__ = ["WeightStream"]


@dataclass(frozen=True)
class WeightStream:
    """An engine's weights as ``(hf_name, full_tensor)`` pairs.

    Attributes:
        named_full_tensors: The backend's gather: ``(state-dict name, full tensor)`` for the names a filter
            accepts (``None``: all); a collective, consumed on every rank.
        lora: The engine's LoRA part, or ``None`` for a model without adapters.
        owner: The engine's class name, for errors.
    """

    named_full_tensors: NamedFullTensors
    lora: LoRAAdapters | None
    owner: str

    def tensors(self, adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full_tensor)`` one at a time; a collective, iterate it on every rank.

        Args:
            adapters_only: Yield the adapter tensors under peft's names instead of the (merged) base model.

        Raises:
            RuntimeError: ``adapters_only=True`` without adapters (when iteration starts).
        """
        if self.lora is None:
            if adapters_only:
                require_lora(self.lora, self.owner, "get_per_tensor_param(adapters_only=True)")
            yield from self.named_full_tensors(None)
        else:
            yield from self.lora.per_tensor_params(self.named_full_tensors, adapters_only)

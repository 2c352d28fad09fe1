"""Model-type parts: how an engine loads its HF model and turns its packed output into model outputs.

* :class:`LanguageModelMixin` (``"language_model"``): ``AutoModelForCausalLM``; outputs ``log_probs``
  and, when asked, ``entropy`` of the next-token distribution.
* :class:`ValueModelMixin` (``"value_model"``): ``AutoModelForTokenClassification(num_labels=1)``; outputs
  ``values``.

Every output follows the schema's next-token convention, aligned with ``input_ids``: position ``t``
reads the model at position ``t - 1`` (``log_probs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])``,
``values[:, t] = V(input_ids[:, :t])``, the state in which token ``t`` is chosen — verl's critic takes
``values[:, -R - 1:-1]`` for the same reason). The first position of every sample and padding hold 0.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from verl_trainer.data.packing import PackedBatch
from verl_trainer.engine.config import EngineConfig, to_dtype
from verl_trainer.models.attention import VARLEN_ATTENTION


def shift_to_targets(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Move per-position values of a packed row one step right, zeroing each sample's first position.

    Args:
        values: ``[N]`` (value at position ``j`` describes the prediction made at ``j``).
        cu_seqlens: ``[B + 1]`` offsets.

    Returns:
        ``[N]`` with ``out[j] = values[j - 1]`` inside a sample and ``0`` at sample starts.

    """
    if values.numel() == 0:
        return values
    out = torch.cat([values.new_zeros(1), values[:-1]])
    starts = cu_seqlens[:-1].to(device=values.device, dtype=torch.long)
    starts = starts[starts < values.numel()]
    return out.index_fill(0, starts, 0.0)


def next_token_log_probs_and_entropy(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of a packed row, from one float32 copy of its logits.

    Args:
        logits: ``[1, N, V]`` in any dtype; converted to float32 once.
        input_ids: ``[1, N]``.
        cu_seqlens: ``[B + 1]`` offsets.
        temperature: Logits are divided by it.
        calculate_entropy: Also return the entropy of each next-token distribution.

    Returns:
        ``(log_probs [N], entropy [N] | None)`` float32, aligned with ``input_ids`` (next-token
        convention; 0 at sample starts).

    """
    logits32 = logits.reshape(-1, logits.shape[-1]).float()
    if temperature != 1.0:
        logits32 = logits32 / temperature
    ids = input_ids.reshape(-1)
    lse = torch.logsumexp(logits32, -1)  # [N]
    targets = torch.roll(ids, -1)  # position j predicts token j + 1
    lp = logits32.gather(-1, targets[:, None]).squeeze(-1) - lse
    log_probs = shift_to_targets(lp, cu_seqlens)
    entropy = None
    if calculate_entropy:
        probs = torch.softmax(logits32, -1)
        ent = lse - (probs * logits32).sum(-1)
        entropy = shift_to_targets(ent, cu_seqlens)
    return log_probs, entropy


class LanguageModelMixin:
    """Causal LM part: loads ``AutoModelForCausalLM``; outputs ``log_probs`` (+ ``entropy``)."""

    MODEL_TYPE: ClassVar[str] = "language_model"
    config: EngineConfig

    def load_hf_model(self) -> torch.nn.Module:
        """Load the HF causal LM from ``config.model_path`` with padding-free attention."""
        from verl_trainer.models.tiny import load_causal_lm

        return load_causal_lm(
            self.config.model_path,
            attn_implementation=VARLEN_ATTENTION,
            torch_dtype=to_dtype(self.config.model_dtype),
        )

    def compute_packed_outputs(
        self,
        hf_output: Any,
        packed: PackedBatch,
        calculate_entropy: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        """``{"log_probs": [N], "entropy": [N]}`` (entropy only when asked) for one packed row."""
        log_probs, entropy = next_token_log_probs_and_entropy(
            hf_output.logits, packed.input_ids, packed.cu_seqlens, temperature, calculate_entropy
        )
        out = {"log_probs": log_probs}
        if entropy is not None:
            out["entropy"] = entropy
        return out


class ValueModelMixin:
    """Value model part: loads a token-classification model with one label; outputs ``values``."""

    MODEL_TYPE: ClassVar[str] = "value_model"
    config: EngineConfig

    def load_hf_model(self) -> torch.nn.Module:
        """Load the value model from ``config.model_path``; a new head is seeded with ``config.seed``."""
        from verl_trainer.models.tiny import load_value_model

        return load_value_model(
            self.config.model_path,
            attn_implementation=VARLEN_ATTENTION,
            torch_dtype=to_dtype(self.config.model_dtype),
            seed=self.config.seed,
        )

    def compute_packed_outputs(
        self,
        hf_output: Any,
        packed: PackedBatch,
        calculate_entropy: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        """``{"values": [N]}`` float32 for one packed row (``calculate_entropy``/``temperature`` unused)."""
        values = hf_output.logits.reshape(-1).float()  # [1, N, 1] -> [N]
        return {"values": shift_to_targets(values, packed.cu_seqlens)}

"""Model types: how an engine loads its HF model and turns its packed output into model outputs.

A model type is an object the engine holds (``engine.model_type``, built by :func:`model_type_part` from
the registry's ``model_type`` name); the engine's micro-batch loop hands it the model to run:

* :class:`LanguageModel` (``"language_model"``): ``AutoModelForCausalLM``; outputs ``log_probs``
  and, when asked, ``entropy`` of the next-token distribution.
* :class:`ValueModel` (``"value_model"``): ``AutoModelForTokenClassification(num_labels=1)``; outputs
  ``values``.

Every output follows the schema's next-token convention, aligned with ``input_ids``: position ``t``
reads the model at position ``t - 1`` (``log_probs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])``,
``values[:, t] = V(input_ids[:, :t])``, the state in which token ``t`` is chosen — verl's critic takes
``values[:, -R - 1:-1]`` for the same reason). The first position of every sample and padding hold 0.

The language model runs its LM head only where an output is used (``PackedBatch.output_mask``: the
``loss_mask`` / ``response_mask`` tokens; HF's ``logits_to_keep`` with the positions), and the
log-softmax in float32 chunks of tokens, so ``[N, V]`` logits never exist; the other positions hold 0.
Under tensor parallelism with a vocabulary-parallel head each TP rank holds ``[K, V / tp]`` logits and the
log-probs / entropy are reduced from the slices (``engine/vocab_parallel.py``).

Top-k distillation (:mod:`verl_trainer.algorithms.distill`) adds two outputs, each ``[N, k]`` at the same
positions (``data/topk_log_probs.py``): with :attr:`LanguageModel.top_k` ``> 0`` (set on the teacher's
engine) ``topk_ids`` and ``topk_log_probs``, the ``k`` most likely next tokens and their log-probs; for a
batch carrying ``teacher_topk_ids`` (:attr:`PackedBatch.gather_ids`) ``gathered_log_probs``, this model's
log-probs of those ids. Neither runs under Ulysses SP, a vocabulary-parallel head or pipeline stages (the
distillation config refuses those layouts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from verl_trainer.data.packing import (
    PackedBatch,
    next_token_log_probs_and_entropy,
    shift_to_targets,
    token_log_probs_and_entropy,
)
from verl_trainer.data.topk_log_probs import gathered_log_probs, topk_log_probs
from verl_trainer.engine.config import EngineConfig
from verl_trainer.engine.vocab_parallel import vocab_parallel_log_probs_and_entropy
from verl_trainer.models.attention import VARLEN_ATTENTION, packed_forward
from verl_trainer.models.hf_files import MODEL_TYPES, to_dtype
from verl_trainer.models.loading import load_causal_lm, load_value_model
from verl_trainer.models.ulysses_attention import ULYSSES_ATTENTION, check_ulysses_compatible
from verl_trainer.models.ulysses_forward import ulysses_packed_log_probs, ulysses_packed_values
from verl_trainer.models.vlm import attach_mrope_positions
from verl_trainer.utils.distributed import get_world_size, is_initialized

if TYPE_CHECKING:
    from transformers.utils import ModelOutput

    from verl_trainer.models.attention import ForwardModel

__all__ = [
    "MODEL_TYPE_PARTS",
    "LanguageModel",
    "ModelType",
    "ValueModel",
    "VocabSlice",
    "attention_for",
    "head_positions",
    "model_type_part",
    "next_token_log_probs_and_entropy",
    "scatter_head_outputs",
    "shift_to_targets",
]


def attention_for(config: EngineConfig) -> str:
    """The attention implementation an engine loads its model with: Ulysses when ``sp > 1``."""
    return ULYSSES_ATTENTION if config.ulysses_sequence_parallel_size > 1 else VARLEN_ATTENTION


def head_positions(packed: PackedBatch) -> torch.Tensor | None:
    """Positions of the packed row whose logits are used.

    Position ``j`` predicts token ``j + 1``; it is kept when token ``j + 1`` belongs to the same sample
    and its output is used (:attr:`PackedBatch.output_mask`).

    Args:
        packed: The packed micro-batch.

    Returns:
        ``[K]`` long, increasing, or ``None`` when every output is used (no ``output_mask``).

    """
    if packed.output_mask is None:
        return None
    used = packed.output_mask.reshape(-1).clone()
    starts = packed.cu_seqlens[:-1].to(device=used.device, dtype=torch.long)
    used[starts[starts < used.numel()]] = False  # a sample's first token has no prediction
    return torch.nonzero(used).reshape(-1) - 1


def scatter_head_outputs(values: torch.Tensor, positions: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Per-target outputs at :func:`head_positions` back onto the packed row, 0 elsewhere.

    Args:
        values: ``[K, ...]``, ``values[i]`` describes the prediction at ``positions[i]`` (of the next token).
        positions: ``[K]`` from :func:`head_positions`.
        num_tokens: ``N``.

    Returns:
        ``[N, ...]`` in the schema's next-token convention (``out[positions[i] + 1] = values[i]``).

    """
    out = values.new_zeros((num_tokens, *values.shape[1:]))
    return out.index_put((positions + 1,), values)


def _checked(model: torch.nn.Module, config: EngineConfig) -> torch.nn.Module:
    """Refuse a model whose heads cannot be split over the SP group (same error on every rank)."""
    sp = config.ulysses_sequence_parallel_size
    if sp > 1:
        world = get_world_size() if is_initialized() else None
        check_ulysses_compatible(model.config, sp, world)
    return model


@dataclass(frozen=True)
class VocabSlice:
    """This TP rank's slice of a vocabulary-parallel LM head: its first token id and the TP group."""

    start: int
    group: dist.ProcessGroup


class ModelType:
    """What differs between model types: the HF class loaded and the outputs computed from its output.

    Subclasses set :attr:`name` and implement :meth:`load`, :meth:`outputs`, :meth:`sp_outputs` and
    :meth:`output_keys`.

    Attributes:
        vocab_slice: Set by a TP engine whose LM head yields this TP rank's slice of the vocabulary (only a
            language model has one).
    """

    name: ClassVar[str] = ""

    def __init__(self) -> None:
        self.vocab_slice: VocabSlice | None = None

    def load(self, config: EngineConfig) -> torch.nn.Module:
        """Load the HF model of ``config.model_path`` with padding-free attention."""
        raise NotImplementedError

    def forward_packed(self, model: ForwardModel, packed: PackedBatch) -> ModelOutput:
        """Run ``model`` on one packed row (the HF output, ``logits [1, N, ...]``)."""
        return packed_forward(model, packed)

    def outputs(
        self, hf_output: ModelOutput, packed: PackedBatch, calculate_entropy: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        """The model outputs ``{key: [N]}`` of one packed row from :meth:`forward_packed`'s output."""
        raise NotImplementedError

    def sp_outputs(
        self,
        model: ForwardModel,
        packed: PackedBatch,
        sp_group: dist.ProcessGroup | None,
        calculate_entropy: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        """The same outputs under Ulysses SP: each SP rank runs 1/sp of the row; ``[N]`` are gathered."""
        raise NotImplementedError

    def output_keys(self, calculate_entropy: bool) -> tuple[str, ...]:
        """The keys :meth:`outputs` returns, in a fixed order (what a last pipeline stage sends)."""
        raise NotImplementedError


class LanguageModel(ModelType):
    """Causal LM: loads ``AutoModelForCausalLM``; outputs ``log_probs`` (+ ``entropy``).

    Attributes:
        top_k: ``> 0``: also output ``topk_ids`` and ``topk_log_probs`` ``[N, top_k]`` (a distillation
            teacher's engine sets it; see the module docstring).
    """

    name: ClassVar[str] = "language_model"

    def __init__(self) -> None:
        super().__init__()
        self.top_k = 0

    def load(self, config: EngineConfig) -> torch.nn.Module:
        """Load the HF causal LM from ``config.model_path`` with padding-free attention."""
        model = load_causal_lm(config.model_path, attn_implementation=attention_for(config),
                               torch_dtype=to_dtype(config.model_dtype))
        return _checked(model, config)

    def forward_packed(self, model: ForwardModel, packed: PackedBatch) -> ModelOutput:
        """Run ``model`` on one packed row; the LM head only at :func:`head_positions` (``None``: all).

        A row with images (a vision-language model) first gets its mrope positions (``models/vlm.py``).
        """
        if packed.vision is not None:
            packed = attach_mrope_positions(model, packed)
        positions = head_positions(packed)
        if positions is None:
            return packed_forward(model, packed)
        return packed_forward(model, packed, logits_to_keep=positions)

    def outputs(
        self, hf_output: ModelOutput, packed: PackedBatch, calculate_entropy: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        """``{"log_probs": [N], "entropy": [N]}`` (entropy only when asked) for one packed row.

        ``hf_output.logits`` is ``[1, K, V]`` at :func:`head_positions` (``[1, N, V]`` without an
        ``output_mask``); outputs are 0 at the positions whose output is not used.
        """
        positions = head_positions(packed)
        if self.vocab_slice is not None and (self.top_k or packed.gather_ids is not None):
            raise NotImplementedError(
                "top-k distillation outputs (topk_ids, gathered_log_probs) need the whole vocabulary on "
                "one rank; set tensor_model_parallel_size=1 on the teacher and the actor, or "
                "algorithm.distill.top_k=0")
        if self.vocab_slice is not None:
            return self._vocab_parallel_outputs(hf_output.logits, packed, positions, calculate_entropy,
                                                temperature)
        if positions is None:
            log_probs, entropy = next_token_log_probs_and_entropy(
                hf_output.logits, packed.input_ids, packed.cu_seqlens, temperature, calculate_entropy
            )
        else:
            targets = packed.input_ids.reshape(-1)[positions + 1]
            log_probs, entropy = token_log_probs_and_entropy(
                hf_output.logits, targets, temperature, calculate_entropy
            )
            n = packed.num_tokens
            log_probs = scatter_head_outputs(log_probs, positions, n)
            entropy = None if entropy is None else scatter_head_outputs(entropy, positions, n)
        out = {"log_probs": log_probs}
        if entropy is not None:
            out["entropy"] = entropy
        out.update(self._topk_outputs(hf_output.logits, packed, positions, temperature))
        return out

    def _topk_outputs(self, logits: torch.Tensor, packed: PackedBatch, positions: torch.Tensor | None,
                      temperature: float) -> dict[str, torch.Tensor]:
        """The top-k distillation outputs, each ``[N, k]`` in the next-token convention.

        ``topk_ids`` / ``topk_log_probs`` when ``top_k > 0``; ``gathered_log_probs`` when the batch has
        ``teacher_topk_ids``.
        """
        out: dict[str, torch.Tensor] = {}
        if not self.top_k and packed.gather_ids is None:
            return out
        n = packed.num_tokens

        def place(values: torch.Tensor) -> torch.Tensor:  # per head position -> the packed row's convention
            if positions is not None:
                return scatter_head_outputs(values, positions, n)
            shifted = torch.cat([values.new_zeros((1, *values.shape[1:])), values[:-1]])
            starts = packed.cu_seqlens[:-1].to(device=values.device, dtype=torch.long)
            return shifted.index_fill(0, starts[starts < n], 0)

        if self.top_k:
            ids, log_probs = topk_log_probs(logits, self.top_k, temperature)
            out["topk_ids"], out["topk_log_probs"] = place(ids), place(log_probs)
        if packed.gather_ids is not None:  # position j predicts token j + 1: the ids stored at j + 1
            wanted = (packed.gather_ids[positions + 1] if positions is not None
                      else torch.roll(packed.gather_ids, -1, dims=0))
            out["gathered_log_probs"] = place(gathered_log_probs(logits, wanted, temperature))
        return out

    def _vocab_parallel_outputs(
        self,
        logits: torch.Tensor,
        packed: PackedBatch,
        positions: torch.Tensor | None,
        calculate_entropy: bool,
        temperature: float,
    ) -> dict[str, torch.Tensor]:
        """:meth:`outputs` from this TP rank's vocabulary slice ``logits [1, K, V / tp]``."""
        assert self.vocab_slice is not None
        ids = packed.input_ids.reshape(-1)
        targets = torch.roll(ids, -1) if positions is None else ids[positions + 1]
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(
            logits, targets, self.vocab_slice.start, self.vocab_slice.group, temperature, calculate_entropy
        )
        n = packed.num_tokens

        def place(v: torch.Tensor) -> torch.Tensor:  # per head position -> the packed row's convention
            if positions is None:
                return shift_to_targets(v, packed.cu_seqlens)
            return scatter_head_outputs(v, positions, n)

        out = {"log_probs": place(log_probs)}
        if entropy is not None:
            out["entropy"] = place(entropy)
        return out

    def sp_outputs(
        self,
        model: ForwardModel,
        packed: PackedBatch,
        sp_group: dist.ProcessGroup | None,
        calculate_entropy: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        """Log-probs (+ entropy) under Ulysses SP (``models/ulysses_forward.py``)."""
        return ulysses_packed_log_probs(model, packed, sp_group, temperature, calculate_entropy)

    def output_keys(self, calculate_entropy: bool) -> tuple[str, ...]:
        """``("log_probs", "entropy")`` or ``("log_probs",)``."""
        return ("log_probs", "entropy") if calculate_entropy else ("log_probs",)


class ValueModel(ModelType):
    """Value model: loads a token-classification model with one label; outputs ``values``."""

    name: ClassVar[str] = "value_model"

    def load(self, config: EngineConfig) -> torch.nn.Module:
        """Load the value model from ``config.model_path``; a new head is seeded with ``config.seed``."""
        model = load_value_model(
            config.model_path,
            attn_implementation=attention_for(config),
            torch_dtype=to_dtype(config.model_dtype),
            seed=config.seed,
        )
        return _checked(model, config)

    def outputs(
        self, hf_output: ModelOutput, packed: PackedBatch, calculate_entropy: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        """``{"values": [N]}`` float32 for one packed row (``calculate_entropy``/``temperature`` unused)."""
        values = hf_output.logits.reshape(-1).float()  # [1, N, 1] -> [N]
        return {"values": shift_to_targets(values, packed.cu_seqlens)}

    def sp_outputs(
        self,
        model: ForwardModel,
        packed: PackedBatch,
        sp_group: dist.ProcessGroup | None,
        calculate_entropy: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        """``{"values": [N]}`` under Ulysses SP (``calculate_entropy``/``temperature`` unused)."""
        return ulysses_packed_values(model, packed, sp_group)

    def output_keys(self, calculate_entropy: bool) -> tuple[str, ...]:
        """``("values",)``."""
        return ("values",)


MODEL_TYPE_PARTS: dict[str, type[ModelType]] = {part.name: part for part in (LanguageModel, ValueModel)}
"""Every model type's class by its registry name (the names: ``models/hf_files.py: MODEL_TYPES``)."""


def model_type_part(name: str) -> ModelType:
    """A new model-type object for ``name``.

    Raises:
        ValueError: For an unknown name, listing the known ones.
    """
    if name not in MODEL_TYPE_PARTS:
        raise ValueError(f"model_type={name!r} is not a model type; choose one of {MODEL_TYPES}")
    return MODEL_TYPE_PARTS[name]()

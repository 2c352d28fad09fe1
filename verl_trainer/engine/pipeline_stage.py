"""One pipeline stage of an HF decoder model, with the HF parameter names kept.

:func:`make_stage` keeps the model object and drops what its stage does not own: stage ``s`` of ``pp`` keeps a
contiguous run of decoder layers (:func:`stage_layers`), the first stage the input embedding, the last the
final norm and the output head (``lm_head`` / ``score``). Kept layers stay under their original index
(``model.layers.5.mlp...``), so state dicts, DCP checkpoints and the HF export use the HF names unchanged;
the dropped norm becomes ``nn.Identity``.

The stage's ``forward`` (replaced on the instance, so FSDP2 hooks still run around ``__call__``) is a
:class:`StageForward`: token ids (first stage) or hidden states ``[1, T, H]`` in, hidden states ``[1, T, H]``
out, or on the last stage what the engine's ``last_stage`` makes of them (the model outputs). Every
micro-batch of a step is padded to the same token count ``T`` (:func:`pad_packed`), so the tensors between
stages have one static shape per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from verl_trainer.data.packing import PackedBatch
from verl_trainer.models.attention import varlen_model_kwargs

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from transformers.utils import ModelOutput

    from verl_trainer.models.attention import ForwardModel


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The decoder layers of ``stage``: contiguous, sizes differing by at most one (earlier stages larger).

    Args:
        num_layers: Decoder layers of the model.
        num_stages: ``pipeline_model_parallel_size``.
        stage: This stage's index.

    Returns:
        The range of layer indices.
    """
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def check_pipeline_compatible(model_config: PretrainedConfig, pp: int, causal_lm: bool = True) -> None:
    """Refuse a model this stage split cannot run exactly (the same on every rank, before sharding).

    Args:
        model_config: The HF config (read before the weights load).
        pp: ``pipeline_model_parallel_size``.
        causal_lm: The model has an LM head (a value model's ``score`` head is never tied).

    Raises:
        ValueError: Fewer decoder layers than stages, tied input / output embeddings (one weight on two
            stages), or decoder layers of different attention types.
    """
    layers = getattr(model_config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < pp:
        raise ValueError(
            f"pipeline_model_parallel_size={pp} needs at least {pp} decoder layers, the model has "
            f"num_hidden_layers={layers}; choose pipeline_model_parallel_size <= {layers}"
        )
    if causal_lm and getattr(model_config, "tie_word_embeddings", False):
        raise ValueError(
            f"pipeline_model_parallel_size={pp} with tie_word_embeddings=True is not supported (the "
            f"embedding lives on the first stage and the LM head on the last); use a model with untied "
            f"embeddings or pipeline_model_parallel_size=1"
        )
    types = getattr(model_config, "layer_types", None)
    if types is not None and len(set(types)) > 1:
        raise ValueError(
            f"pipeline_model_parallel_size={pp} with mixed layer_types {sorted(set(types))} is not "
            f"supported; use pipeline_model_parallel_size=1 for this model"
        )


class OwnedLayers(nn.ModuleList):
    """The decoder layers a stage owns, registered under their index in the whole model.

    Iteration, ``len`` and slicing see only the owned layers, in order (what the HF backbone's loop
    needs); state-dict names keep the original indices.
    """

    def __init__(self, layers: dict[int, nn.Module] | list[nn.Module] | None = None) -> None:
        super().__init__()
        items = layers.items() if isinstance(layers, dict) else enumerate(layers or [])
        for index, layer in items:
            self.add_module(str(index), layer)

    def __getitem__(self, idx: int | slice) -> Any:
        return list(self._modules.values())[idx]


@dataclass
class StageForward:
    """The ``forward`` of a stage model (see the module docstring).

    Attributes:
        model: The stage model (the HF top-level model).
        is_first: This stage embeds token ids.
        is_last: This stage produces the model outputs through :attr:`last_stage`.
        batches: The padded packed micro-batches of the current step (set by the engine).
        last_stage: ``(run, index) -> tuple of [1, T] outputs`` for micro-batch ``index``, where
            ``run(**kwargs)`` runs the HF model class's own forward on the received hidden states (set by
            the engine).
    """

    model: nn.Module
    is_first: bool
    is_last: bool
    batches: list[PackedBatch] = field(default_factory=list)
    last_stage: Callable[[ForwardModel, int], tuple[torch.Tensor, ...]] | None = None

    def __call__(self, x: torch.Tensor, mb: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run micro-batch ``mb`` (a ``[1]`` index) on stage input ``x`` (``[1, T]`` ids or ``[1, T, H]``)."""
        index = int(mb.reshape(-1)[0])
        packed = self.batches[index]
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        kwargs = {"position_ids": packed.position_ids, "attention_mask": None, "use_cache": False,
                  **varlen_model_kwargs(packed.cu_seqlens, packed.max_seqlen)}
        if not self.is_last:
            backbone = getattr(self.model, self.model.base_model_prefix)
            return backbone(**inputs, **kwargs).last_hidden_state
        if self.last_stage is None:
            raise RuntimeError("StageForward.last_stage is not set; the engine sets it for every step")
        return self.last_stage(_LastStageRun(self.model, inputs), index)


class _LastStageRun:
    """The last stage's run: the HF class's own forward (backbone, norm, head) on the received ``x``.

    ``config`` is the model's (``packed_forward`` reads it).

    Args:
        model: The last stage's model.
        inputs: ``{"inputs_embeds": x}`` (or ``{"input_ids": x}`` on a single stage).
    """

    def __init__(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
        self.model, self.inputs, self.config = model, inputs, model.config

    def __call__(self, **extra: Any) -> ModelOutput:
        extra.pop("input_ids", None)
        return type(self.model).forward(self.model, **self.inputs, **extra)


def make_stage(model: nn.Module, stage: int, num_stages: int) -> StageForward:
    """Turn ``model`` into pipeline stage ``stage`` in place (see the module docstring).

    Args:
        model: An HF ``*ForCausalLM`` / ``*ForTokenClassification`` model of a Llama/Qwen2-style decoder
            (``model.<base_model_prefix>`` with ``embed_tokens``, ``layers``, ``norm``).
        stage: This rank's stage.
        num_stages: ``pipeline_model_parallel_size``.

    Returns:
        The stage's :class:`StageForward` (also installed as ``model.forward``).

    Raises:
        ValueError: The model is not of that shape.
    """
    prefix = getattr(model, "base_model_prefix", "")
    backbone = getattr(model, prefix, None) if prefix else None
    missing = [n for n in ("embed_tokens", "layers", "norm") if not hasattr(backbone, n)]
    if backbone is None or missing:
        raise ValueError(
            f"pipeline_model_parallel_size={num_stages} splits Llama/Qwen2-style decoders "
            f"(model.{prefix or '<base_model_prefix>'} with embed_tokens, layers, norm); "
            f"{type(model).__name__} lacks {missing or [prefix]}; use pipeline_model_parallel_size=1"
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and head.weight is getattr(backbone.embed_tokens, "weight", None)
    check_pipeline_compatible(model.config, num_stages, causal_lm=tied)
    owned = stage_layers(len(backbone.layers), num_stages, stage)
    backbone.layers = OwnedLayers({i: backbone.layers[i] for i in owned})
    is_first, is_last = stage == 0, stage == num_stages - 1
    if not is_first:
        backbone.embed_tokens = None
    if not is_last:
        backbone.norm = nn.Identity()
        for name, child in list(model.named_children()):
            if child is not backbone and any(True for _ in child.parameters()):
                setattr(model, name, None)  # the output head (lm_head / score)
    forward = StageForward(model, is_first, is_last)
    model.forward = forward
    return forward


def pad_packed(packed: PackedBatch, total: int) -> PackedBatch:
    """``packed`` with ``total - N`` padding tokens appended as one more segment (positions from 0).

    Attention runs per segment, so the real tokens' outputs do not change; the padding's outputs are
    dropped (``output_mask`` False there). ``unpack`` of the result needs its outputs cut to ``[:N]``.

    Args:
        packed: A packed micro-batch of ``N <= total`` tokens.
        total: The step's common token count.
    """
    n = packed.num_tokens
    if n == total:
        return packed
    if n > total:
        raise ValueError(f"a packed micro-batch of {n} tokens does not fit the step's {total}")
    pad = total - n
    ids = packed.input_ids
    extra_ids = ids.new_zeros((1, pad))
    positions = torch.arange(pad, device=ids.device, dtype=packed.position_ids.dtype).unsqueeze(0)
    cu = packed.cu_seqlens
    mask = packed.output_mask
    return replace(
        packed,
        input_ids=torch.cat([ids, extra_ids], 1),
        position_ids=torch.cat([packed.position_ids, positions], 1),
        cu_seqlens=torch.cat([cu, cu.new_tensor([total])]),
        max_seqlen=max(packed.max_seqlen, pad),
        seq_lens=torch.cat([packed.seq_lens, packed.seq_lens.new_tensor([pad])]),
        output_mask=None if mask is None else torch.cat([mask, mask.new_zeros(pad)]),
    )

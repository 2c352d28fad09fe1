"""Tensor parallelism: split a HF decoder's projections over the ``tp`` mesh with DTensor TP.

Megatron's layout: in every decoder layer ``q/k/v`` and ``gate/up`` are column-parallel (outputs stay local,
so attention runs on ``num_heads / tp`` query and ``num_kv_heads / tp`` key/value heads per rank) and
``o_proj`` / ``down_proj`` row-parallel (one all-reduce). Norms and a value head stay replicated over ``tp``;
their gradients are equal on every TP rank. With untied embeddings the input embedding is split row-wise
over the vocabulary and a causal LM's ``lm_head`` column-wise (``torch.chunk``'s split: ``ceil(V / tp)`` ids
per rank, every rank at least one), so each rank computes the logits of its own token ids only and the
log-probs / entropy are reduced from the slices (``engine/vocab_parallel.py``).

The plan is the model's own ``config.base_model_tp_plan`` when every style in it is one of :data:`TP_STYLES`,
else :data:`DEFAULT_TP_PLAN`. ``"replicated_with_grad_allreduce"`` (transformers' name; Qwen3's per-head
``q_norm`` / ``k_norm``) marks a module applied to each head of a column-parallel output: its weights stay
whole on every TP rank, its input is this rank's heads, and its gradient is summed over tp
(:class:`PerHeadReplicated`). How it composes with FSDP2: docs/internals.md, "Tensor
parallelism (fsdp2)".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle
    from transformers import PretrainedConfig

DEFAULT_TP_PLAN: dict[str, str] = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
"""The Llama / Qwen2-style block plan, relative to the base model (``model.base_model``)."""

TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def tp_plan(model_config: PretrainedConfig) -> dict[str, str]:
    """The TP plan for a model: its ``base_model_tp_plan`` when usable, else :data:`DEFAULT_TP_PLAN`.

    Args:
        model_config: The HF ``PretrainedConfig``.

    Returns:
        ``{module fqn pattern relative to the base model: "colwise" | "rowwise"}``.

    """
    own = dict(getattr(model_config, "base_model_tp_plan", None) or {})
    if own and all(style in TP_STYLES for style in own.values()):
        return own
    return dict(DEFAULT_TP_PLAN)


def check_tp_compatible(model_config: PretrainedConfig, tp: int) -> None:
    """Refuse a model whose heads or MLP width cannot be split over ``tp`` ranks (before sharding).

    Raises:
        ValueError: Naming the size that does not divide and the valid TP sizes.

    """
    if tp == 1:
        return
    heads = int(model_config.num_attention_heads)
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(model_config, "num_key_value_heads", None) or heads),
        "intermediate_size": int(model_config.intermediate_size),
    }
    for name, size in sizes.items():
        if size % tp:
            valid = [d for d in range(1, heads + 1) if all(s % d == 0 for s in sizes.values())]
            raise ValueError(
                f"{name}={size} of {getattr(model_config, 'model_type', 'the model')} is not divisible by "
                f"tensor_model_parallel_size={tp}; choose a TP size from {valid}"
            )


def _per_head_style() -> ParallelStyle:
    """:class:`PerHeadReplicated` (built here: torch's TP classes are imported when TP is used)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class PerHeadReplicated(ParallelStyle):
        """A module on each head of ``[..., heads / tp, head_dim]`` (this rank's heads): weights replicated.

        The input becomes a DTensor sharded on its heads dim, the parameters ``Replicate`` DTensors, the
        output this rank's local tensor again; DTensor sums the parameters' partial gradients over tp.
        """

        def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
            def heads_sharded(_module, inputs, mesh):
                return tuple(DTensor.from_local(x, mesh, (Shard(x.dim() - 2),), run_check=False)
                             if isinstance(x, torch.Tensor) else x for x in inputs)

            def local(_module, output, _mesh):
                return output.to_local() if isinstance(output, DTensor) else output

            # without a partition_fn distribute_module makes every parameter a Replicate DTensor
            return distribute_module(module, device_mesh, input_fn=heads_sharded, output_fn=local)

    return PerHeadReplicated()


def _style(name: str) -> ParallelStyle:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "replicated_with_grad_allreduce":
        return _per_head_style()
    return ColwiseParallel() if name == "colwise" else RowwiseParallel()


def vocab_slice_start(vocab: int, tp: int, tp_rank: int) -> int:
    """First token id of TP rank ``tp_rank``'s vocabulary slice (DTensor ``Shard(0)``: torch.chunk)."""
    return tp_rank * -(-vocab // tp)


def vocab_parallel(model: torch.nn.Module, tp: int) -> bool:
    """Whether the embeddings (and a causal LM's head) are split over the vocabulary at this TP size."""
    config = model.config
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embedding = model.get_input_embeddings()
    every_rank_has_ids = tp > 1 and vocab_slice_start(vocab, tp, tp - 1) < vocab
    return (every_rank_has_ids and not tied
            and isinstance(embedding, torch.nn.Embedding) and embedding.num_embeddings == vocab)


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh) -> bool:
    """Split ``model``'s decoder projections (and its vocabulary) over ``tp_mesh`` in place.

    Call it before ``fully_shard``.

    Args:
        model: A HF causal LM or token-classification model (its ``base_model`` holds ``layers``).
        tp_mesh: The 1-D ``"tp"`` mesh.

    Returns:
        Whether the LM head is vocabulary-parallel (its logits are this rank's slice of the vocabulary,
        from :func:`vocab_slice_start`; compute log-probs with ``vocab_parallel_log_probs_and_entropy``). The
        planned weights are now ``DTensor`` shards (``Shard(0)`` column-wise, ``Shard(1)`` row-wise).

    Raises:
        ValueError: If the heads or the MLP width do not divide by the TP size, or the plan matches no
            module of the model.

    """
    from torch.distributed.tensor.parallel import parallelize_module

    config = model.config
    check_tp_compatible(config, tp_mesh.size())
    base = model.base_model
    plan = tp_plan(config)
    names = {name for name, _ in base.named_modules()}
    for pattern in plan:
        head, _, tail = pattern.partition(".*.")
        if not any(n.startswith(head + ".") and n.endswith("." + tail) for n in names):
            raise ValueError(
                f"TP plan entry {pattern!r} matches no module of {type(base).__name__}; this model needs its "
                f"own base_model_tp_plan (styles {TP_STYLES}) or tensor_model_parallel_size=1"
            )
    parallelize_module(base, tp_mesh, {pattern: _style(style) for pattern, style in plan.items()})
    if not vocab_parallel(model, tp_mesh.size()):
        return False
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    parallelize_module(model.get_input_embeddings(), tp_mesh,
                       RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or head.out_features != model.config.vocab_size:
        return False  # e.g. a value model: its score head stays replicated
    parallelize_module(head, tp_mesh, ColwiseParallel())
    return True

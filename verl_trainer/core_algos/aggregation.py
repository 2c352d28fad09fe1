"""The global denominators of a step (:class:`GlobalBatchInfo`) and :func:`agg_loss`, which divides by them.

Every loss in this project is a *partial* value: the engine calls the loss function once per
micro-batch, on every data-parallel (DP) rank, and back-propagates each result as is. ``agg_loss``
therefore divides by the **global** denominators of the whole optimizer step (all micro-batches, all
DP ranks) and multiplies by ``dp_size``, because DDP/FSDP average gradients over the DP ranks. Summed
over micro-batches and averaged over ranks, the partial values equal the loss of the whole step
computed in one piece, whatever the micro-batching and the dp size.

The contract between the engine and a loss function: the engine computes the step's
:class:`GlobalBatchInfo` (:func:`compute_global_batch_info`, one all-reduce, **before** splitting into
micro-batches), then calls ``loss_fn(model_output, micro_batch, info)`` once per micro-batch and expects
``(loss, metrics)`` back:

* ``model_output``: ``dict[str, Tensor]``, each ``[b, t]`` with the same shape as
  ``micro_batch["input_ids"]`` and aligned with it (docs/design.md §5: next-token convention,
  ``log_probs[:, i] = log p(input_ids[:, i] | input_ids[:, :i])``; position 0 and padding hold 0).
  Keys: ``"log_probs"`` and, when asked, ``"entropy"`` (language model); ``"values"`` (value model).
* ``micro_batch``: the micro-batch ``TensorDict`` (padded ``[b, t]``; see ``verl_trainer.data.schema``).
* ``info``: the :class:`GlobalBatchInfo` of the whole optimizer step.
* ``loss``: a scalar tensor, the micro-batch's *partial* contribution: normalised by the global
  denominators and multiplied by ``dp_size`` (the data-parallel gradient average divides by it again).
  The engine calls ``loss.backward()`` as is — never divided by the micro-batch count.
* ``metrics``: ``dict[str, verl_trainer.metrics`` values that declare their reduction ``]``.

Notation: ``S_i`` is the masked token sum of row ``i`` of ``loss_mat``, ``n_i`` its token count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from verl_trainer.data import schema
from verl_trainer.utils.distributed import all_reduce

if TYPE_CHECKING:
    from tensordict import TensorDict

TOKEN_MEAN = "token-mean"
TOKEN_SUM = "token-sum"
SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"

AGG_MODES: tuple[str, ...] = (
    TOKEN_MEAN,
    TOKEN_SUM,
    SEQ_MEAN_TOKEN_SUM,
    SEQ_MEAN_TOKEN_MEAN,
    SEQ_MEAN_TOKEN_SUM_NORM,
)
"""The valid ``loss_agg_mode`` values."""

Number = int | float | torch.Tensor


@dataclass(frozen=True)
class GlobalBatchInfo:
    """Global denominators of one optimizer step, identical on every rank.

    Attributes:
        dp_size: Data-parallel world size (world_size // sp_size).
        batch_num_tokens: Sum of ``loss_mask`` over the whole step on all DP ranks.
        global_batch_size: Number of real (``is_padding == False``) samples in the step on all DP
            ranks.
        dp_rank: This rank's data-parallel rank.
        global_num_groups: Number of sample groups (distinct ``group_id`` among the real samples, e.g.
            preference pairs) in the step on all DP ranks; ``None`` when the batch has no ``group_id``.
            The denominator of :func:`agg_group_loss`.
    """

    dp_size: int
    batch_num_tokens: int
    global_batch_size: int
    dp_rank: int = 0
    global_num_groups: int | None = None

    @classmethod
    def from_batch(cls, data: TensorDict | Mapping[str, torch.Tensor]) -> GlobalBatchInfo:
        """The denominators of ``data`` alone: one process, one micro-batch (``dp_size = 1``).

        The same definitions the engine all-reduces (:func:`local_counts`), so a loss function called
        without info agrees with the engine on a single-process, single-micro-batch step.
        """
        counts = local_counts(data)
        groups = local_num_groups(data)
        return cls(dp_size=1, batch_num_tokens=int(round(float(counts[0]))),
                   global_batch_size=int(round(float(counts[1]))), global_num_groups=groups)


def loss_mask_of(data: TensorDict | Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Return the ``[B, T]`` mask whose sum is ``batch_num_tokens``.

    ``loss_mask``, else ``response_mask``, else ``attention_mask``.
    """
    for key in (schema.LOSS_MASK, schema.RESPONSE_MASK, schema.ATTENTION_MASK):
        if key in data.keys():
            return data[key]
    raise KeyError(f"the batch has none of {schema.LOSS_MASK!r}, {schema.RESPONSE_MASK!r}, "
                   f"{schema.ATTENTION_MASK!r}; cannot count its loss tokens")


def local_counts(data: TensorDict | Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[2]`` float64 CPU: (loss-mask tokens, real samples) of this rank's batch.

    Real samples are those with ``is_padding == False`` — every row when the tag is absent. A real
    sample whose loss mask is all zero counts: ``seq-mean-*`` modes average over the step's samples
    (docs/design.md §5: rows with no token contribute 0 to the numerator, 1 to the denominator).
    """
    mask = loss_mask_of(data)
    num_tokens = mask.to(torch.float64).sum().cpu()
    num_samples = torch.tensor(float(schema.num_real(data)), dtype=torch.float64)
    return torch.stack([num_tokens, num_samples])


def local_num_groups(data: TensorDict | Mapping[str, torch.Tensor]) -> int | None:
    """Distinct ``group_id`` values among this rank's real samples; ``None`` without a ``group_id`` field.

    A group is counted on the rank that holds it; a group split over ranks would count once per rank,
    which is why balancing and micro-batching keep a group's samples together (docs/preference.md).
    """
    if schema.GROUP_ID not in data.keys():
        return None
    ids = data[schema.GROUP_ID]
    if schema.IS_PADDING in data.keys():
        ids = ids[~data[schema.IS_PADDING].to(torch.bool)]
    return int(torch.unique(ids).numel())


def compute_global_batch_info(
    data: TensorDict | Mapping[str, torch.Tensor], dp_group: dist.ProcessGroup | None, dp_size: int,
    dp_rank: int,
) -> GlobalBatchInfo:
    """Global denominators of one optimizer step (one all-reduce of two numbers over the DP group).

    Args:
        data: This DP rank's whole batch ``[B, T]``, before splitting.
        dp_group: The DP group (``None``: single process).
        dp_size: DP world size.
        dp_rank: This rank's DP rank.

    Returns:
        ``GlobalBatchInfo(dp_size, batch_num_tokens, global_batch_size, dp_rank, global_num_groups)``;
        ``global_num_groups`` only when ``data`` has a ``group_id`` field (then the all-reduce carries a
        third number; every rank of a step has the same fields).

    """
    counts = local_counts(data)
    groups = local_num_groups(data)
    if groups is not None:
        counts = torch.cat([counts, torch.tensor([float(groups)], dtype=torch.float64)])
    if dp_group is not None and dp_size > 1:
        counts = all_reduce(counts, dp_group)
    return GlobalBatchInfo(
        dp_size=dp_size,
        batch_num_tokens=int(round(float(counts[0]))),
        global_batch_size=int(round(float(counts[1]))),
        dp_rank=dp_rank,
        global_num_groups=None if groups is None else int(round(float(counts[2]))),
    )


def agg_group_loss(group_losses: torch.Tensor, global_num_groups: int | None,
                   dp_size: int = 1) -> torch.Tensor:
    """This micro-batch's partial loss of per-group terms: ``sum_g l_g / global_num_groups * dp``.

    The group-mean aggregation (one loss term per group of samples, e.g. a DPO pair): summed over the
    micro-batches and averaged over the DP ranks, the partial values equal the mean of ``l_g`` over every
    group of the step, whatever the dp size and micro-batching (each group lies whole in one micro-batch).

    Args:
        group_losses: ``[g]`` the loss of each group in this micro-batch (``g`` may be 0).
        global_num_groups: Groups of the whole step on all DP ranks
            (:attr:`GlobalBatchInfo.global_num_groups`); ``None`` with ``dp_size == 1``: the local count.
        dp_size: Data-parallel size.

    Returns:
        A scalar tensor (0 for a step without groups).

    Raises:
        ValueError: ``dp_size > 1`` without ``global_num_groups``.
    """
    if global_num_groups is None:
        if dp_size > 1:
            raise ValueError(
                f"agg_group_loss with dp_size={dp_size} needs global_num_groups, the groups of the whole "
                "step on all DP ranks (GlobalBatchInfo.global_num_groups: give the batch a 'group_id' "
                "field); a local count would make the loss depend on how the batch is split."
            )
        global_num_groups = group_losses.numel()
    return _safe_div(group_losses.sum(), global_num_groups) * dp_size


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is true; masked positions never contribute (not even NaN).

    Args:
        values: ``[B, T]`` (any shape).
        mask: Same shape as ``values``; bool or 0/1.
        dim: Reduce this dimension only; ``None`` reduces everything.

    Returns:
        A scalar, or ``values`` reduced over ``dim``.

    """
    selected = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is true; 0 where there are none.

    Args:
        values: ``[B, T]`` (any shape).
        mask: Same shape as ``values``; bool or 0/1.
        dim: Reduce this dimension only; ``None`` reduces everything.

    Returns:
        A scalar, or ``values`` averaged over ``dim``.

    """
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    total = masked_sum(values, mask, dim)
    return total / count.clamp_min(1).to(total.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten ``values`` with the mean and unbiased variance of the masked positions (as verl).

    Args:
        values: ``[B, T]``.
        mask: ``[B, T]``, bool or 0/1.
        shift_mean: If False, the mean is added back (only the scale is normalised).

    Returns:
        ``(values - mean) / sqrt(var + 1e-8)`` at every position, ``[B, T]``.

    Raises:
        ValueError: If fewer than two positions are masked in (the unbiased variance is undefined).

    """
    count = mask.bool().sum()
    if int(count) < 2:
        raise ValueError(
            f"masked_whiten needs at least 2 masked-in positions to estimate a variance, got {int(count)}; "
            "whiten a larger batch or use an estimator without whitening."
        )
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask) * (count / (count - 1)).to(values.dtype)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def global_batch_kwargs(
    global_batch_info: Any = None, loss_scale_factor: float | None = None
) -> dict[str, Any]:
    """Build the keyword arguments :func:`agg_loss` takes from a step's global batch info.

    Args:
        global_batch_info: A :class:`GlobalBatchInfo`, a mapping with
            the same keys (verl's ``config.global_batch_info`` dict), or ``None`` (one process, the
            denominators of the batch at hand).
        loss_scale_factor: The constant of ``seq-mean-token-sum-norm`` (from the loss config).

    Returns:
        ``{"dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor"}``.

    """
    if global_batch_info is None:
        info: Mapping[str, Any] = {}
    elif isinstance(global_batch_info, Mapping):
        info = global_batch_info
    else:
        keys = ("dp_size", "batch_num_tokens", "global_batch_size")
        info = {k: getattr(global_batch_info, k, None) for k in keys}
    factor = info.get("loss_scale_factor", None) if loss_scale_factor is None else loss_scale_factor
    return {
        "dp_size": info.get("dp_size", 1) or 1,
        "batch_num_tokens": info.get("batch_num_tokens", None),
        "global_batch_size": info.get("global_batch_size", None),
        "loss_scale_factor": factor,
    }


def _denominator(given: Number | None, local: torch.Tensor, dp_size: int, name: str, mode: str) -> Number:
    if given is None:
        if dp_size > 1:
            raise ValueError(
                f"loss_agg_mode={mode!r} with dp_size={dp_size}: {name} is required, the global count of "
                f"the step (all micro-batches on all DP ranks); got {name}=None. Pass the engine's "
                "GlobalBatchInfo (or global_batch_kwargs(info)) to agg_loss: a local denominator would make "
                "the loss depend on how the batch is split."
            )
        return local
    return given


def _safe_div(numerator: torch.Tensor, denominator: Number) -> torch.Tensor:
    """``numerator / denominator``, with an empty step (denominator 0) giving 0 instead of NaN."""
    if isinstance(denominator, torch.Tensor):
        return numerator / denominator.to(numerator.dtype).clamp_min(1)
    return numerator / max(denominator, 1)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Number | None = None,
    global_batch_size: Number | None = None,
    loss_scale_factor: Number | None = None,
) -> torch.Tensor:
    """Aggregate a token-loss matrix into this micro-batch's partial (globally normalised) loss.

    Modes (``S_i`` masked token sum of row ``i``, ``n_i`` its token count, ``dp = dp_size``):

    * ``token-mean``: ``sum_i S_i / batch_num_tokens * dp``
    * ``token-sum``: ``sum_i S_i * dp``
    * ``seq-mean-token-sum``: ``sum_i S_i / global_batch_size * dp``
    * ``seq-mean-token-mean``: ``sum_i (S_i / n_i) / global_batch_size * dp`` (rows with ``n_i = 0``
      contribute 0)
    * ``seq-mean-token-sum-norm``: ``seq-mean-token-sum / loss_scale_factor`` (Dr.GRPO)

    With ``dp_size == 1`` a missing denominator falls back to the batch at hand (``loss_mask.sum()``
    tokens, or the number of rows with at least one token), which is verl's local behaviour.

    Deviation from verl 0.9.1: verl defaults ``loss_scale_factor`` to ``loss_mask.shape[-1]``, the padded
    width of the current (micro-)batch, so the loss changes with micro-batching and padding; here that
    fallback applies only to a one-piece call (``dp_size == 1`` and no ``global_batch_size``: the whole
    batch is at hand). With global denominators a missing ``loss_scale_factor`` in
    ``seq-mean-token-sum-norm`` is a ``ValueError`` (Dr.GRPO uses a constant, the maximum response
    length). A denominator of 0 (a step without tokens) yields 0, not NaN.

    Args:
        loss_mat: Per-token losses, ``[b, t]``.
        loss_mask: ``[b, t]``, bool or 0/1; 1 = the token counts.
        loss_agg_mode: One of :data:`AGG_MODES`.
        dp_size: Data-parallel size (the gradient average divides by it again).
        batch_num_tokens: ``loss_mask`` summed over the whole step on all DP ranks (``token-mean``).
        global_batch_size: Number of real samples in the whole step on all DP ranks (``seq-mean-*``).
        loss_scale_factor: The constant divisor of ``seq-mean-token-sum-norm``.

    Returns:
        A scalar tensor: this micro-batch's partial loss.

    Raises:
        ValueError: Unknown mode; ``dp_size > 1`` without the needed global denominator;
            ``seq-mean-token-sum-norm`` with global denominators but without ``loss_scale_factor``.

    """
    if not isinstance(dp_size, int) or isinstance(dp_size, bool) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    mask = loss_mask.bool()
    row_sums = masked_sum(loss_mat, mask, dim=-1)  # [b]
    if loss_agg_mode == TOKEN_MEAN:
        denom = _denominator(batch_num_tokens, mask.sum(), dp_size, "batch_num_tokens", loss_agg_mode)
        return _safe_div(row_sums.sum(), denom) * dp_size
    if loss_agg_mode == TOKEN_SUM:
        return row_sums.sum() * dp_size
    if loss_agg_mode in (SEQ_MEAN_TOKEN_SUM, SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM_NORM):
        row_counts = mask.sum(dim=-1)  # [b]
        denom = _denominator(global_batch_size, (row_counts > 0).sum(), dp_size, "global_batch_size",
                             loss_agg_mode)
        if loss_agg_mode == SEQ_MEAN_TOKEN_SUM_NORM and loss_scale_factor is None:
            if dp_size > 1 or global_batch_size is not None:
                raise ValueError(
                    "loss_agg_mode='seq-mean-token-sum-norm' (Dr.GRPO) with global denominators needs a "
                    "constant loss_scale_factor, e.g. the maximum response length; got None. verl's "
                    "fallback, the padded width of the current micro-batch, changes with micro-batching, "
                    "so it is used only for a one-piece call (dp_size=1, no global_batch_size)."
                )
            loss_scale_factor = loss_mask.shape[-1]  # a one-piece call: verl's padded-width fallback
        if loss_agg_mode == SEQ_MEAN_TOKEN_MEAN:
            row_sums = row_sums / row_counts.clamp_min(1).to(row_sums.dtype)
        loss = _safe_div(row_sums.sum(), denom) * dp_size
        if loss_agg_mode == SEQ_MEAN_TOKEN_SUM_NORM:
            loss = loss / loss_scale_factor
        return loss
    raise ValueError(
        f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(AGG_MODES)}. "
        "Set loss_agg_mode to one of these."
    )


ALL_TOKENS_SEQ_MEAN = "all-tokens-seq-mean-token-mean"
"""The aggregation kind of the router losses (mixture-of-experts): a per-token term averaged over every real
token of its sequence (prompt and response: the router sees them all), then over the step's real sequences
— ``sum_i (S_i / n_i) / global_batch_size × dp`` with ``n_i`` the sequence's tokens
(:func:`agg_all_tokens_loss`). Its one denominator is ``global_batch_size``, so it is exact under any dp
size and micro-batching, as each sequence lies whole in one micro-batch."""


def all_tokens_mask(data: TensorDict | Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[B, T]`` bool: every real token (``attention_mask``) of the real samples (no ``is_padding`` row)."""
    mask = data[schema.ATTENTION_MASK].bool()
    if schema.IS_PADDING in data.keys():
        mask = mask & ~data[schema.IS_PADDING].to(torch.bool)[:, None]
    return mask


def agg_all_tokens_loss(token_terms: torch.Tensor, data: TensorDict | Mapping[str, torch.Tensor],
                        info: GlobalBatchInfo | None = None) -> torch.Tensor:
    """This micro-batch's partial :data:`ALL_TOKENS_SEQ_MEAN` loss of ``token_terms`` ``[b, t]``.

    ``= agg_loss(token_terms, all_tokens_mask(data), "seq-mean-token-mean", dp, global_batch_size)``;
    without ``info``: one process, one micro-batch (the batch's own real samples).

    Raises:
        ValueError: ``info.dp_size > 1`` without ``global_batch_size`` (as :func:`agg_loss`).
    """
    info = info or GlobalBatchInfo.from_batch(data)
    return agg_loss(token_terms, all_tokens_mask(data), SEQ_MEAN_TOKEN_MEAN, dp_size=info.dp_size,
                    global_batch_size=info.global_batch_size)

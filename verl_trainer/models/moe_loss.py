"""Router losses and router metrics of a mixture-of-experts model, added to any loss function.

The engine's packed forward returns per-token router outputs for a MoE model
(``models/moe_routers.py: router_token_outputs``); :func:`with_router_losses` wraps a loss function so that
each micro-batch's loss gains

    aux_loss_coeff · agg(aux terms) + z_loss_coeff · agg(z terms)

with ``agg`` the :data:`~verl_trainer.core_algos.aggregation.ALL_TOKENS_SEQ_MEAN` kind (global
denominators: the same under any dp size and micro-batching), and logs the router metrics with declared
reductions (docs/moe.md, docs/metrics.md):

* ``moe/aux_loss``, ``moe/z_loss`` (``SUM``: partial values, like the loss), before their coefficients;
* ``moe/layer{l}/expert{e}/tokens`` (``SUM``: the step's real tokens routed to the expert, prompt and
  response, logged as the local count × dp); ``moe/layer{l}/load_imbalance`` and ``moe/load_imbalance``
  derived from those global totals (``metrics/derived.py``);
* ``moe/router_entropy`` (``MEAN``: the token mean over the step's real tokens).

HF models route every token to exactly ``k`` experts (no capacity factor), so no token is ever dropped and
no dropped-token metric is logged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from verl_trainer.core_algos.aggregation import GlobalBatchInfo, agg_all_tokens_loss, all_tokens_mask
from verl_trainer.metrics import Metric
from verl_trainer.metrics.derived import expert_tokens_name
from verl_trainer.models.moe_config import MoEConfig
from verl_trainer.models.moe_routers import (
    AUX_LOSS_TERMS,
    ROUTED_EXPERTS,
    ROUTER_ENTROPY,
    ROUTER_OUTPUT_KEYS,
    Z_LOSS_TERMS,
)

if TYPE_CHECKING:
    from tensordict import TensorDict

LossFn = Callable[..., "tuple[torch.Tensor, dict[str, Any]]"]


def router_metrics(router_out: dict[str, torch.Tensor], micro_batch: TensorDict, dp_size: int,
                   num_experts: int) -> dict[str, Metric]:
    """The router metrics of one micro-batch (module docstring) from its router outputs ``[b, t, ...]``."""
    mask = all_tokens_mask(micro_batch)
    routed = router_out[ROUTED_EXPERTS][mask]                                    # [n, L, k]
    counts = torch.nn.functional.one_hot(routed, num_experts).sum(dim=(0, 2))    # [L, E]
    metrics = {expert_tokens_name(layer, e): Metric.sum(counts[layer, e].to(torch.float64) * dp_size)
               for layer in range(counts.shape[0]) for e in range(num_experts)}
    metrics["moe/router_entropy"] = Metric.token_mean(router_out[ROUTER_ENTROPY].detach(), mask)
    return metrics


def with_router_losses(loss_fn: LossFn, moe: MoEConfig, num_experts: int) -> LossFn:
    """``loss_fn`` plus the router losses and metrics of a MoE model's forward (module docstring).

    The wrapped function takes ``(model_output, micro_batch, info)``; ``loss_fn`` sees ``model_output``
    without the router keys. A forward without router outputs (a dense model) passes through unchanged.
    """

    def loss_with_router_losses(model_output: dict[str, torch.Tensor], micro_batch: TensorDict,
                                info: GlobalBatchInfo | None = None, *args: Any, **kwargs: Any):  # noqa: ANN202
        router_out = {k: v for k, v in model_output.items() if k in ROUTER_OUTPUT_KEYS}
        rest = {k: v for k, v in model_output.items() if k not in ROUTER_OUTPUT_KEYS}
        loss, metrics = loss_fn(rest, micro_batch, info, *args, **kwargs)
        if not router_out:
            return loss, metrics
        metrics = dict(metrics or {})
        info = info or GlobalBatchInfo.from_batch(micro_batch)
        for coeff, key, name in ((moe.aux_loss_coeff, AUX_LOSS_TERMS, "moe/aux_loss"),
                                 (moe.z_loss_coeff, Z_LOSS_TERMS, "moe/z_loss")):
            if coeff > 0:
                term = agg_all_tokens_loss(router_out[key], micro_batch, info)
                loss = loss + coeff * term
                metrics[name] = Metric.sum(term.detach())
        if moe.router_metrics:
            metrics.update(router_metrics(router_out, micro_batch, info.dp_size, num_experts))
        return loss, metrics

    return loss_with_router_losses

"""Which ``loss_agg_mode`` each policy loss is correct in, checked when the loss config is built.

A loss whose importance ratio is one number per sequence — GSPO (``gspo``), GSPO-token (``gspo_token``) and
GMPO (``geo_mean`` / ``gmpo``) — is that paper's objective only when every sequence counts once:
``seq-mean-token-mean``, ``(1/G) sum_i (1/|y_i|) sum_t l_{i,t}``. Each of them puts the same sequence-level
quantity on every token of a sequence, so any mode that sums over tokens weights sequence ``i`` by its
length instead: ``token-mean`` by ``|y_i| / N``, ``token-sum`` by ``|y_i|``, ``seq-mean-token-sum`` by
``|y_i| / G``, ``seq-mean-token-sum-norm`` by ``|y_i| / (G L)`` — a long sequence's ratio and advantage
count hundreds of times more than a short one's, silently (TRL issue #3823 is this bug). verl and the
functions themselves aggregate these losses ``seq-mean-token-mean`` whatever mode they are handed; the
config refuses the other modes so that a YAML ``loss_agg_mode`` is never silently ignored.

Every other built-in loss has a per-token ratio (or none) and is correct in every mode; the mode is then
the usual choice between GRPO's per-sequence and DAPO's per-token weighting.
"""

from __future__ import annotations

from collections.abc import Callable

from verl_trainer.core_algos.aggregation import SEQ_MEAN_TOKEN_MEAN
from verl_trainer.core_algos.policy_losses import (
    compute_policy_loss_geo_mean,
    compute_policy_loss_gspo,
)
from verl_trainer.core_algos.ratio_losses import compute_policy_loss_gspo_token

_SEQUENCE_RATIO = ("its importance ratio is one number per sequence, so every other mode weights a sequence "
                   "by its length (TRL issue #3823)")
_SEQUENCE_LOSS = ("its loss is one geometric-mean ratio per sequence, so every other mode weights a sequence "
                  "by its length")

AGG_RULES: dict[Callable, tuple[tuple[str, ...], str]] = {
    compute_policy_loss_gspo: ((SEQ_MEAN_TOKEN_MEAN,), _SEQUENCE_RATIO),
    compute_policy_loss_gspo_token: ((SEQ_MEAN_TOKEN_MEAN,), _SEQUENCE_RATIO),
    compute_policy_loss_geo_mean: ((SEQ_MEAN_TOKEN_MEAN,), _SEQUENCE_LOSS),
}
"""Policy loss function -> (the modes it is correct in, why). Losses not listed accept every mode."""


def valid_agg_modes(loss_fn: Callable) -> tuple[str, ...] | None:
    """The aggregation modes ``loss_fn`` is correct in; ``None``: every mode."""
    rule = AGG_RULES.get(loss_fn)
    return None if rule is None else rule[0]


def check_policy_loss_agg(policy_loss: str, loss_fn: Callable, loss_agg_mode: str, owner: str) -> None:
    """Refuse ``loss_agg_mode`` for a policy loss that is wrong in it (see the module docstring).

    Args:
        policy_loss: The configured name (for the message).
        loss_fn: The resolved policy loss function.
        loss_agg_mode: The configured mode.
        owner: The config's name, e.g. ``"PPOLossConfig"``.

    Raises:
        ValueError: Naming the loss, the mode, why it is wrong and the mode to set.
    """
    rule = AGG_RULES.get(loss_fn)
    if rule is None or loss_agg_mode in rule[0]:
        return
    modes, why = rule
    raise ValueError(
        f"{owner}.policy_loss={policy_loss!r} with loss_agg_mode={loss_agg_mode!r}: {why}. Set "
        f"loss_agg_mode={modes[0]!r} (algorithm.actor.loss.loss_agg_mode), or use a token-level loss "
        "('vanilla', 'cispo', 'sapo', ...) for per-token aggregation."
    )

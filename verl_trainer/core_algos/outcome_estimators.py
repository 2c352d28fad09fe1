"""Outcome advantage estimators over prompt groups: OPO, GPG, pass@k (two forms), REINFORCE++-baseline.

Each reads one score per response, ``r_i = sum_t token_level_rewards[i, t]``, and the group ids
(``index``: the responses of one prompt share one), and puts the response's advantage on every token of
its ``response_mask`` (0 elsewhere). Registered under verl's names (``pass_at_k`` is new), nameable from
YAML as ``algorithm.adv_estimator``. Every estimator that reads a statistic of the whole batch gets it
over the whole DP batch: REINFORCE++-baseline through ``whitens_returns`` (the recipe re-whitens), GPG
through ``dp_group`` (one all-reduce); the rest are per group, and groups are whole on a rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl_trainer.core_algos.advantages import _group_inverse, _group_stats, register_adv_est
from verl_trainer.core_algos.aggregation import masked_whiten
from verl_trainer.core_algos.policy_losses import config_get
from verl_trainer.utils.distributed import all_reduce

Index = Sequence[Any] | np.ndarray | torch.Tensor


def _on_tokens(adv: torch.Tensor, token_level_rewards: torch.Tensor,
               response_mask: torch.Tensor) -> torch.Tensor:
    dtype = token_level_rewards.dtype
    return adv.to(dtype).unsqueeze(-1) * response_mask.to(dtype)


def _centred(scores: torch.Tensor, index: Index) -> torch.Tensor:
    """``r_i - mean of its group`` (a group of one keeps ``r_i``: mean 0, as verl), float64 ``[B]``."""
    counts, means, _ = _group_stats(scores, index)
    return scores.to(torch.float64) - torch.where(counts > 1, means, torch.zeros_like(means))


@register_adv_est("opo")
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585).

    The baseline that minimises the gradient variance when each response's gradient norm grows with its
    length: the length-weighted group mean, ``b = sum_j |y_j| r_j / sum_j |y_j|`` over the group, ``A_i =
    r_i - b`` (``|y_j|``: the response's mask sum). A group of one gets ``b = 0`` (verl's ``opo``).

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        index: Group id per sample, ``[B]``.
        epsilon: Unused (verl's signature).
        config: Unused.
        **kwargs: Ignored.

    Returns:
        ``(advantages, advantages)``, ``[B, T]``.
    """
    del epsilon, config, kwargs
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).to(torch.float64)
        lengths = response_mask.sum(dim=-1).to(torch.float64)
        inv = _group_inverse(index, scores.device)
        counts = torch.bincount(inv).to(torch.float64)[inv]
        weighted = torch.bincount(inv, weights=lengths * scores)[inv]
        total = torch.bincount(inv, weights=lengths)[inv]
        baseline = torch.where((counts > 1) & (total > 0), weighted / total.clamp_min(1e-30),
                               torch.zeros_like(scores))
        adv = _on_tokens(scores - baseline, token_level_rewards, response_mask)
    return adv, adv


@register_adv_est("gpg")
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Any = None,
    dp_group: dist.ProcessGroup | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong RL Baseline", arXiv:2504.02546) advantages.

    ``A_i = alpha (r_i - mean of its group) / f_norm`` with ``alpha = B / M``: ``B`` responses in the batch,
    ``M`` of them with a non-zero score (at least 1) — verl's ``gpg``, which rescales the gradient for the
    responses that carry no signal. ``B`` and ``M`` count the **whole** DP batch (one all-reduce over
    ``dp_group``; the recipes pass it), so the advantages do not depend on the dp size. A group of one has
    mean 0. Pair with ``policy_loss: gpg``.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        index: Group id per sample, ``[B]``.
        epsilon: Unused (verl's signature).
        f_norm: The divisor (verl: 1).
        alpha: Ignored: verl recomputes it as ``B / M`` (kept for its signature).
        config: Unused.
        dp_group: The DP group over which ``B`` and ``M`` are counted (``None``: this batch).
        **kwargs: Ignored.

    Returns:
        ``(advantages, advantages)``, ``[B, T]``.
    """
    del epsilon, alpha, config, kwargs
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        counts = torch.tensor([float(scores.numel()), float(torch.count_nonzero(scores))],
                              dtype=torch.float64)
        counts = all_reduce(counts, dp_group)
        scale = float(counts[0]) / max(float(counts[1]), 1.0)
        adv = _on_tokens(scale * _centred(scores, index) / f_norm, token_level_rewards, response_mask)
    return adv, adv


@register_adv_est("reinforce_plus_plus_baseline", whitens_returns=True)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): the group-mean baseline, then batch whitening.

    ``g_i = r_i - mean of its group`` (a group of one: ``r_i``) on every response token, then
    ``A = whiten(g)`` over every masked token of the batch (mean and unbiased std). Declared
    ``whitens_returns``: the recipes redo the whitening over the whole DP batch. Deviation from verl,
    which returns the whitened values twice: ``returns`` are ``g`` before whitening.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        index: Group id per sample, ``[B]``.
        epsilon: Unused (verl's signature).
        config: Unused.
        **kwargs: Ignored.

    Returns:
        ``(advantages, returns)``, ``[B, T]``.

    Raises:
        ValueError: Fewer than two masked tokens in the batch (no variance to whiten by).
    """
    del epsilon, config, kwargs
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        returns = _on_tokens(_centred(scores, index), token_level_rewards, response_mask)
        advantages = masked_whiten(returns, response_mask) * response_mask.to(returns.dtype)
    return advantages, returns


def _binary(scores: torch.Tensor, name: str) -> torch.Tensor:
    ok = (scores == 0) | (scores == 1)
    if not bool(ok.all()):
        bad = scores[~ok][:4].tolist()
        raise ValueError(f"{name} needs binary rewards (0 or 1 per response: pass@k counts correct ones); "
                         f"got {bad}. Use a 0/1 reward (e.g. reward.name=math) or another estimator (grpo).")
    return scores.to(torch.int64)


@register_adv_est("pass_at_k")
def compute_pass_at_k_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantages in closed form (Chen et al. 2025, "Pass@k Training ...", arXiv:2508.10751, Sec. 4).

    For a group of ``N`` responses with ``N_neg`` wrong ones (binary rewards), the pass@k of a random
    ``k``-subset has mean ``R = 1 - C(N_neg, k) / C(N, k)`` and std ``s = sqrt(R (1 - R))``. A correct
    response's advantage is ``(1 - R) / s``; a wrong one's ``(1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1))
    / s`` (the expected pass@k of the subsets holding it, minus ``R``). ``s = 0`` (all right or all wrong)
    gives 0. ``k = 1`` is GRPO with the population std. ``k`` is ``config.pass_k`` (``algorithm.pass_k``).

    Args:
        token_level_rewards: ``[B, T]``; each response's sum must be 0 or 1.
        response_mask: ``[B, T]``.
        index: Group id per sample, ``[B]``.
        epsilon: Unused.
        config: ``pass_k`` (int >= 1, at most the smallest group).
        **kwargs: Ignored.

    Returns:
        ``(advantages, advantages)``, ``[B, T]``.

    Raises:
        ValueError: Non-binary rewards, no or a bad ``pass_k``, a group smaller than ``k``.
    """
    del epsilon, kwargs
    k = config_get(config, "pass_k", None)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"pass_at_k needs config.pass_k, an int >= 1 (algorithm.pass_k); got {k!r}")
    with torch.no_grad():
        correct = _binary(token_level_rewards.sum(dim=-1), "pass_at_k")
        inv = _group_inverse(index, correct.device)
        sizes = torch.bincount(inv).tolist()
        wrong = (torch.bincount(inv) - torch.bincount(inv, weights=correct).to(torch.int64)).tolist()
        pos, neg = [], []
        for n, n_neg in zip(sizes, wrong):
            if n < k:
                raise ValueError(f"pass_at_k with pass_k={k}: a group has {n} responses; set "
                                 "algorithm.pass_k <= rollout.n (and keep whole groups)")
            mean = 1.0 - math.comb(n_neg, k) / math.comb(n, k)
            std = math.sqrt(mean * (1.0 - mean))
            pos.append((1.0 - mean) / std if std > 0 else 0.0)
            neg_hit = 1.0 - math.comb(n_neg - 1, k - 1) / math.comb(n - 1, k - 1) if n_neg > 0 else 0.0
            neg.append((neg_hit - mean) / std if std > 0 else 0.0)
        adv = torch.where(correct.bool(), torch.tensor(pos, dtype=torch.float64)[inv],
                          torch.tensor(neg, dtype=torch.float64)[inv])
        adv = _on_tokens(adv, token_level_rewards, response_mask)
    return adv, adv


@register_adv_est("grpo_passk")
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verl's ``grpo_passk`` (Tang et al. 2025, arXiv:2503.19595): only each group's best response learns.

    The best response of a group gets ``r_max - r_second`` (divided by the group's unbiased std + epsilon
    with ``norm_adv_by_std_in_grpo``), every other response 0; ties go to the first in batch order.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        index: Group id per sample, ``[B]``.
        epsilon: Added to the std.
        norm_adv_by_std_in_grpo: Divide by the group's std.
        config: Unused.
        **kwargs: Ignored.

    Returns:
        ``(advantages, advantages)``, ``[B, T]``.

    Raises:
        ValueError: A group of one response.
    """
    del config, kwargs
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).to(torch.float64)
        inv = _group_inverse(index, scores.device)
        _, _, stds = _group_stats(scores, index)
        adv = torch.zeros_like(scores)
        for g in range(int(inv.max()) + 1 if inv.numel() else 0):
            members = torch.nonzero(inv == g).flatten()
            if members.numel() < 2:
                raise ValueError("grpo_passk needs at least 2 responses per group (rollout.n >= 2); a group "
                                 f"has {members.numel()}")
            order = torch.sort(scores[members], descending=True, stable=True).indices
            best = members[order[0]]
            gap = scores[best] - scores[members[order[1]]]
            adv[best] = gap / (stds[best] + epsilon) if norm_adv_by_std_in_grpo else gap
        adv = _on_tokens(adv, token_level_rewards, response_mask)
    return adv, adv

"""The advantage-estimator registry and the built-in estimators (GAE, GRPO, RLOO, REINFORCE++, ReMax).

Signatures, argument order and results follow verl 0.9.1. Every estimator returns
``(advantages, returns)``, both ``[B, T]``. Tensors may be response-only (verl's layout) or the full
``[B, T]`` layout of this project (prompt and response aligned with ``input_ids``, the response marked by
``response_mask``): the recursions skip positions outside the mask. One deviation throughout: positions
outside ``response_mask`` hold 0 in the outputs (the schema's rule for padding); verl leaves whatever the
recursion carried there. Inside the mask the values are verl's.

Whitening (GAE, REINFORCE++) uses the statistics of the batch handed in; for results that do not depend
on the dp size, call the estimator on the whole (gathered) batch, as verl's driver does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import torch

from verl_trainer.core_algos.aggregation import masked_whiten
from verl_trainer.core_algos.policy_losses import config_get
from verl_trainer.utils.registry import (
    Registry,
    UnknownKeyError,
    is_object_path,
    keys_repr,
    load_object,
    rebound,
)

ADV_ESTIMATOR_REGISTRY: Registry[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = Registry(
    "advantage estimator"
)
_BUILTIN_REGISTRY = ADV_ESTIMATOR_REGISTRY
_WHITENS: dict[Callable, str] = {}  # estimator -> what its advantages whiten over the batch handed in


class AdvantageEstimator(str, Enum):
    """Names of the built-in advantage estimators (a plain string works everywhere too)."""

    GAE = "gae"
    GRPO = "grpo"
    GRPO_VECTORIZED = "grpo_vectorized"
    RLOO = "rloo"
    RLOO_VECTORIZED = "rloo_vectorized"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REMAX = "remax"


def _name(name_or_enum: str | Enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def _registry() -> MutableMapping[Any, Callable[..., tuple[torch.Tensor, torch.Tensor]]]:
    """The registry in force (built-in, or a mapping code bound in its place, as verl allows).

    Code may rebind ``ADV_ESTIMATOR_REGISTRY`` of this module or of ``verl_trainer.core_algos``.
    """
    return rebound(_BUILTIN_REGISTRY, "ADV_ESTIMATOR_REGISTRY", __name__, __package__)


def register_adv_est(
    name_or_enum: str | AdvantageEstimator, *, whitens_returns: bool = False, whitens_advantages: bool = False
) -> Callable[[Callable], Callable]:
    """Register an advantage estimator under a name or enum (decorator).

    Registering the same function again is a no-op; another function under a taken name raises
    ``ValueError`` (verl's rule). The decorated function is returned unchanged.

    Args:
        name_or_enum: The name configs select it by (``algorithm.adv_estimator``).
        whitens_returns: Its advantages are its returns whitened over the batch handed in (REINFORCE++).
        whitens_advantages: Its advantages are ``returns - values`` whitened over the batch handed in (GAE).

    A recipe that runs a whitening estimator per rank redoes the whitening over the whole DP batch, so the
    result does not depend on the dp size (:attr:`Estimator.whitens`).
    """
    name = _name(name_or_enum)
    if whitens_returns and whitens_advantages:
        raise ValueError(f"advantage estimator {name!r}: give whitens_returns or whitens_advantages, "
                         "not both")

    def deco(fn: Callable) -> Callable:
        if whitens_returns or whitens_advantages:
            _WHITENS[fn] = "returns" if whitens_returns else "advantages"
        registry = _registry()
        if name in registry and registry[name] is not fn:
            raise ValueError(
                f"advantage estimator {name!r} is already registered (by {registry[name]!r}); "
                "choose another name or remove the earlier registration."
            )
        registry[name] = fn
        return fn

    return deco


def get_adv_estimator_fn(
    name_or_enum: str | AdvantageEstimator,
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Return the estimator registered under a name or enum (case-sensitive), or one defined elsewhere.

    ``"module:name"`` / ``"path/to/file.py:name"`` name a function by where it is defined
    (``utils.registry.load_object``).

    Raises:
        UnknownKeyError: (a ``ValueError`` and a ``KeyError``) for an unknown name, listing the registered
            ones. The message starts with verl's words (``Unknown advantage estimator simply: <name>``),
            which code written against verl matches on.
        ValueError: A module, file or attribute that does not exist, or an object that is not callable.
    """
    name = _name(name_or_enum)
    if is_object_path(name):
        fn = load_object(name, "advantage estimator")
        if not callable(fn):
            raise ValueError(f"advantage estimator {name!r} is a {type(fn).__name__}, not a callable")
        return fn
    registry = _registry()
    if name not in registry:
        raise UnknownKeyError(
            f"Unknown advantage estimator simply: {name}; registered: {keys_repr(registry)}. "
            "Use one of these or register your own with register_adv_est."
        )
    return registry[name]


ESTIMATOR_INPUTS = ("values", "index", "reward_baselines")
"""The batch inputs an estimator may read besides the rewards and the response mask: the critic's values,
the group ids (``uid``), the reward of a baseline rollout (ReMax's greedy response)."""


@dataclass(frozen=True)
class Estimator:
    """A registered estimator resolved once by name: what it reads and how a recipe calls it.

    Attributes:
        name: Its registered name.
        fn: The registered function (verl's signature).
        inputs: What it reads of :data:`ESTIMATOR_INPUTS`, from its parameter names.
        whitens: ``"returns"`` / ``"advantages"`` (its advantages are its returns / ``returns - values``
            whitened over the batch handed in; ``register_adv_est``), else ``None``.
        keywords: The keywords it takes by name; ``None``: any (it has ``**kwargs``).
    """

    name: str
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    inputs: frozenset[str]
    whitens: str | None
    keywords: frozenset[str] | None

    def __call__(self, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                 **available: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Call the estimator with the rewards, the mask and those of ``available`` it takes.

        Args:
            token_level_rewards: ``[B, T]``.
            response_mask: ``[B, T]``.
            **available: What the recipe can give (``index`` ``[B]``, ``values`` ``[B, T]``,
                ``reward_baselines`` ``[B]``, ``gamma``, ``lam``, ``config``, ``norm_adv_by_std_in_grpo``).

        Returns:
            ``(advantages, returns)``, ``[B, T]``.
        """
        kwargs = {k: v for k, v in available.items() if self.keywords is None or k in self.keywords}
        return self.fn(token_level_rewards=token_level_rewards, response_mask=response_mask, **kwargs)


def resolve_estimator(name_or_enum: str | AdvantageEstimator) -> Estimator:
    """The estimator registered under ``name_or_enum``, with what it reads (:class:`Estimator`).

    The registry holds plain functions (verl's contract); their parameter names say what they need, so a
    recipe can accept every registered estimator whose inputs it provides, and refuse the rest by name.

    Raises:
        UnknownKeyError: For an unknown name (see :func:`get_adv_estimator_fn`).
    """
    fn = get_adv_estimator_fn(name_or_enum)
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return Estimator(_name(name_or_enum), fn, frozenset(n for n in ESTIMATOR_INPUTS if n in params),
                     _WHITENS.get(fn), None if var_kw else frozenset(params))


def estimator_inputs(name_or_enum: str | AdvantageEstimator) -> frozenset[str]:
    """What the estimator registered under ``name_or_enum`` reads (``ESTIMATOR_INPUTS``).

    See :func:`resolve_estimator`.
    """
    return resolve_estimator(name_or_enum).inputs


def _group_inverse(index: Sequence[Any] | np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Map group ids (uids: ints, strings, a tensor) to 0..G-1, ``[B]`` long."""
    ids = index.detach().cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
    _, inverse = np.unique(ids, return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)


def _group_stats(scores: torch.Tensor, index: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group mean and unbiased group std (float64), each ``[B]``."""
    inv = _group_inverse(index, scores.device)
    x = scores.to(torch.float64)
    counts = torch.bincount(inv).to(torch.float64)
    means = torch.bincount(inv, weights=x) / counts
    sq_dev = torch.bincount(inv, weights=(x - means[inv]) ** 2)
    stds = torch.sqrt(sq_dev / (counts - 1).clamp_min(1))
    return counts[inv], means[inv], stds[inv]


@register_adv_est(AdvantageEstimator.GAE, whitens_advantages=True)
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float | torch.Tensor,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016) over the masked tokens, then whitened.

    ``delta_t = r_t + gamma V_next - V_t``, ``A_t = delta_t + gamma lam A_next``, where "next" is the
    next position inside ``response_mask`` (positions outside it are skipped, their values and rewards
    ignored) and the value after the last response token is 0. ``returns = A + V`` (before whitening);
    ``advantages`` are whitened over the mask.

    Args:
        token_level_rewards: ``[B, T]``.
        values: Critic values, ``[B, T]``.
        response_mask: ``[B, T]``.
        gamma: Discount factor.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, ``[B, T]``, 0 outside the mask.

    """
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        next_value = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * lam * last_gae
            m = mask[:, t]
            next_value = values[:, t] * m + (1 - m) * next_value
            last_gae = gae * m + (1 - m) * last_gae
            advantages[:, t] = last_gae
        returns = (advantages + values) * mask
        advantages = masked_whiten(advantages, response_mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.GRPO_VECTORIZED)  # verl's name of its batched version: ours is batched
@register_adv_est(AdvantageEstimator.GRPO)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | np.ndarray | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: each response's score minus its group mean, divided by the group std.

    The score is the sum of the token rewards. A group of one has mean 0 and std 1 (verl). With
    ``norm_adv_by_std_in_grpo=False`` the division is skipped (Dr.GRPO, arXiv:2503.20783). The std is the
    unbiased one (``torch.std``), as in verl.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        index: Group id (uid) per sample, ``[B]``: numpy array, list or tensor.
        epsilon: Added to the std.
        norm_adv_by_std_in_grpo: Divide by the group std (GRPO) or not (Dr.GRPO).
        config: Unused (verl's signature).

    Returns:
        ``(advantages, advantages)``: the per-response scalar on every masked token, ``[B, T]``.

    """
    del config
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        counts, means, stds = _group_stats(scores, index)
        single = counts == 1
        means = torch.where(single, torch.zeros_like(means), means)
        stds = torch.where(single, torch.ones_like(stds), stds)
        adv = scores.to(torch.float64) - means
        if norm_adv_by_std_in_grpo:
            adv = adv / (stds + epsilon)
        adv = adv.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask.to(token_level_rewards.dtype)
    return adv, adv


@register_adv_est(AdvantageEstimator.RLOO_VECTORIZED)
@register_adv_est(AdvantageEstimator.RLOO)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | np.ndarray | torch.Tensor,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): the score minus the mean score of the *other* responses of its group.

    ``A_i = r_i - (sum_group r - r_i) / (n - 1) = n / (n - 1) (r_i - mean)``; a group of one keeps its raw
    score (no baseline), as verl's ``rloo``.

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
        scores = token_level_rewards.sum(dim=-1)
        counts, means, _ = _group_stats(scores, index)
        x = scores.to(torch.float64)
        adv = torch.where(counts > 1, (x - means) * counts / (counts - 1).clamp_min(1), x)
        adv = adv.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask.to(token_level_rewards.dtype)
    return adv, adv


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS, whitens_returns=True)
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted returns, whitened over the batch.

    ``G_t = r_t + gamma G_{t+1}`` within a response (the running return restarts outside the mask), then
    ``advantages = whiten(G)`` over the mask.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        config: Needs ``gamma`` (attribute or key).
        **kwargs: Ignored.

    Returns:
        ``(advantages, returns)``, ``[B, T]``, 0 outside the mask.

    Raises:
        ValueError: ``config`` has no ``gamma``.

    """
    del kwargs
    gamma = config_get(config, "gamma", None)
    if gamma is None:
        raise ValueError(
            "reinforce_plus_plus needs config.gamma (the discount factor), e.g. config={'gamma': 1.0}"
        )
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[-1])):
            running = token_level_rewards[:, t] + gamma * running
            returns[:, t] = running
            running = running * mask[:, t]  # restart outside the response (after EOS)
        returns = returns * mask
        advantages = masked_whiten(returns, response_mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.REMAX)
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): returns minus the reward of the greedy response.

    ``returns_t = sum_{s >= t} r_s`` (masked), ``advantages = returns - baseline`` on the masked tokens.

    Args:
        token_level_rewards: ``[B, T]``.
        reward_baselines: Reward of the greedy decoding of each prompt, ``[B]``.
        response_mask: ``[B, T]``.
        config: Unused.
        **kwargs: Ignored.

    Returns:
        ``(advantages, returns)``, ``[B, T]``.

    """
    del config, kwargs
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = (returns - reward_baselines.unsqueeze(-1) * mask) * mask
        returns = returns * mask
    return advantages, returns


compute_grpo_vectorized_outcome_advantage = compute_grpo_outcome_advantage
"""verl's name of its batched GRPO estimator; :func:`compute_grpo_outcome_advantage` is batched already."""
compute_rloo_vectorized_outcome_advantage = compute_rloo_outcome_advantage
"""verl's name of its batched RLOO estimator; :func:`compute_rloo_outcome_advantage` is batched already."""

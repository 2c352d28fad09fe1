"""Checks of the rollout placement settings (``algorithm.rollout.placement``, ``rollout_ranks``, ...).

:func:`check_placement` runs when the rollout config is built (before any model loads);
:func:`check_pool_world` when the world size is known (at launch, on every rank alike, before the split).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PLACEMENTS", "POOL_BACKENDS", "check_placement", "check_pool_algorithm", "check_pool_world"]

PLACEMENTS = ("colocated", "separate")
POOL_BACKENDS = ("hf", "vllm")
"""Rollout backends a rollout rank serves (``name``; ``auto`` is refused: the rollout ranks and the trainer
ranks must agree on one backend when the config is built)."""


def check_placement(config: Any) -> None:
    """Check ``placement``, ``rollout_ranks``, ``weight_sync_bucket_mb``, ``weight_sync_timeout_s``.

    Args:
        config: A :class:`~verl_trainer.rollout.config.RolloutConfig`.

    Raises:
        ValueError: Naming the setting, its value, the valid choices and the fix.
    """
    if config.placement not in PLACEMENTS:
        raise ValueError(f"rollout placement={config.placement!r} is unknown; choose one of {PLACEMENTS} "
                         "(colocated: each training process generates; separate: rollout_ranks processes do)")
    ranks = config.rollout_ranks
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"rollout rollout_ranks={ranks!r} must be an int >= 1 (processes that generate "
                         "with placement=separate)")
    if not config.weight_sync_bucket_mb > 0:
        raise ValueError(f"rollout weight_sync_bucket_mb={config.weight_sync_bucket_mb} must be > 0 (MiB per "
                         "broadcast bucket)")
    if not config.weight_sync_timeout_s > 0:
        raise ValueError(f"rollout weight_sync_timeout_s={config.weight_sync_timeout_s} must be > 0 (seconds "
                         "a rollout rank may stay silent before the run fails naming it)")
    if config.placement != "separate":
        return
    if config.name not in POOL_BACKENDS:
        raise ValueError(
            f"rollout placement='separate' with name={config.name!r}: the pool's ranks run the backends "
            f"{POOL_BACKENDS} (each rollout rank builds one engine and loads the broadcast weight versions "
            "into it); set algorithm.rollout.name to one of them, or placement=colocated"
        )
    if config.partial_rollout:
        raise ValueError("rollout placement='separate' with partial_rollout=true: chunked generation under "
                         "the newest weights is built for the colocated rollout only; set partial_rollout="
                         "false, or placement=colocated")
    if config.multi_turn.enable:
        raise ValueError("rollout placement='separate' with multi_turn.enable=true: the pool's ranks sample "
                         "single-turn responses only (tools and environments run in the training process); "
                         "set placement=colocated for multi-turn rollouts")


def check_pool_world(config: Any, world_size: int) -> int:
    """The trainer ranks of a separate placement in a world of ``world_size`` processes.

    Args:
        config: The rollout config (``placement="separate"``).
        world_size: ``devices x num_nodes``.

    Returns:
        ``T = world_size - rollout_ranks``, the trainer ranks.

    Raises:
        ValueError: No trainer rank is left, or ``T`` is not a multiple of ``rollout_ranks`` (each rollout
            rank serves ``T / rollout_ranks`` trainer ranks: trainer rank ``r`` is served by rollout rank
            ``r mod rollout_ranks``).
    """
    ranks = config.rollout_ranks
    trainers = world_size - ranks
    if trainers < 1:
        raise ValueError(f"rollout placement='separate' with rollout_ranks={ranks} needs devices x num_nodes "
                         f"> {ranks} (got {world_size}): raise devices, or lower rollout_ranks")
    if trainers % ranks:
        raise ValueError(
            f"rollout placement='separate': the {trainers} trainer ranks (devices x num_nodes={world_size} "
            f"- rollout_ranks={ranks}) must be a multiple of rollout_ranks={ranks} (each rollout rank serves "
            f"the same number of trainer ranks' prompt groups); choose devices so that devices - "
            f"rollout_ranks divides by rollout_ranks (e.g. devices={2 * ranks} or {3 * ranks})"
        )
    return trainers


def check_pool_algorithm(placement: str, router_replay: str, reads_baselines: bool) -> None:
    """Refuse, at config build, the algorithm settings a separate pool does not run.

    Args:
        placement: ``rollout.placement``.
        router_replay: ``actor.engine.moe.router_replay``.
        reads_baselines: The advantage estimator reads ``reward_baselines`` (ReMax's greedy baseline).

    Raises:
        ValueError: Naming the setting and the fix.
    """
    if placement != "separate":
        return
    if router_replay == "rollout":
        raise ValueError("actor.engine.moe.router_replay=rollout with rollout.placement=separate: the pool's "
                         "ranks do not record the rollout's experts; use router_replay=old_policy, or "
                         "placement=colocated")
    if reads_baselines:
        raise ValueError("rollout.placement=separate with an estimator that reads reward_baselines (ReMax): "
                         "its greedy baseline responses sample on the training rank; use placement=colocated")

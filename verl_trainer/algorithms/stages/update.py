"""The RL step's update: old log-probs (or their reuse), mini-batches, engine updates.

:class:`Updater` runs, on the batch the guard let through::

    old log-probs by the actor engine (+ the reference's for the KL loss), unless the batch has them
      (PPO's KL in the reward) or the step is one actor update (``actor.reuse_log_probs_on_policy``:
      the update's own detached log-probs are the old ones, ``actor/old_log_probs_reused``)
    → [on_before_update: the module's hook, between :meth:`Updater.prepare` and :meth:`Updater.update`]
    → ``ppo_epochs`` × mini-batches: the critic part's updates, then the actor's (``engine.train_batch``;
      a policy loss that selects tokens over the whole step first prepares each mini-batch:
      ``PPOLoss.prepare``, a collective over the DP group, and the old log-probs are then never reused)

The mini-batches (:func:`count_mini_batches`, :func:`split_mini_batches`) agree over the DP ranks: every
rank runs the same number of engine steps (a rank short of samples gets padding samples that train
nothing).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_trainer.algorithms.config import ActorConfig
from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.data import schema
from verl_trainer.engine.base import BaseEngine
from verl_trainer.metrics import Metric, Reduction
from verl_trainer.models.router_replay import keep_old_policy_routing
from verl_trainer.utils.distributed import all_reduce

__all__ = ["ActorDuePart", "CriticPart", "Updater", "count_mini_batches", "run_updates", "split_mini_batches",
           "with_on_policy_old_log_probs"]


def count_mini_batches(batch: TensorDict, mini_batch_size: int | None,
                       group: dist.ProcessGroup | None = None) -> int:
    """Number of mini-batches of the step: ``ceil(global real samples / mini_batch_size)`` (a collective).

    Args:
        batch: This rank's tensor-only batch ``[B_r, T]``.
        mini_batch_size: Samples per mini-batch over all DP ranks; ``None``: one mini-batch.
        group: The DP group.

    Raises:
        ValueError: ``mini_batch_size < 1``.
    """
    if mini_batch_size is not None and mini_batch_size < 1:
        raise ValueError(f"mini_batch_size must be >= 1 or None, got {mini_batch_size}")
    local = torch.tensor([float(schema.num_real(batch))], dtype=torch.float64)
    global_real = int(all_reduce(local, group)[0])
    return 1 if mini_batch_size is None else max(1, math.ceil(global_real / mini_batch_size))


def split_mini_batches(batch: TensorDict, count: int) -> list[TensorDict]:
    """Split this rank's step batch into the step's ``count`` mini-batches (no communication).

    ``count`` is the step's :func:`count_mini_batches` (the same on every rank); each rank splits its own
    rows into that many contiguous, nearly equal parts. A rank with fewer rows than parts first gets
    ``is_padding`` samples (one token, zero loss mask), so every part is non-empty and every rank runs
    the same number of engine steps.

    Args:
        batch: This rank's tensor-only batch ``[B_r, T]``.
        count: Mini-batches of the step (>= 1).

    Returns:
        The mini-batches of this rank, in order.
    """
    rows = batch.batch_size[0]
    if rows < count:
        batch = schema.append_padding(batch, count - rows)
        rows = count
    return [batch[idx] for idx in torch.tensor_split(torch.arange(rows), count)]


def _mean_over_updates(metrics: list[dict[str, Any]], num_updates: int) -> list[dict[str, Any]]:
    """Divide SUM metrics (partial losses) by the number of updates: the step logs their mean."""
    if num_updates <= 1:
        return metrics
    return [
        {k: v.scale(1 / num_updates) if isinstance(v, Metric) and v.reduction is Reduction.SUM else v
         for k, v in mb.items()}
        for mb in metrics
    ]


def with_on_policy_old_log_probs(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an actor loss so each micro-batch's ``old_log_probs`` are its own log-probs, detached.

    Exact only when the weights that produce ``model_output`` are those the samples' old log-probs would
    be recomputed with: one optimizer update per step (see ``ActorConfig.reuse_log_probs_on_policy``).

    Args:
        loss_fn: ``loss_fn(model_output, micro_batch, info)``; ``model_output["log_probs"]`` is ``[b, t]``.

    Returns:
        The wrapped loss function.
    """

    def loss(model_output: Mapping[str, torch.Tensor], micro_batch: TensorDict, info: Any) -> Any:
        micro_batch = micro_batch.clone(recurse=False)
        micro_batch[schema.OLD_LOG_PROBS] = model_output["log_probs"].detach()
        return loss_fn(model_output, micro_batch, info)

    return loss



def run_updates(engine: BaseEngine, name: str, loss_fn: Callable[..., Any], mini_batches: list[TensorDict],
                epochs: int, hooks: Any = None, **kwargs: Any) -> dict[str, Any]:
    """``epochs`` passes of ``engine.train_batch`` (one optimizer step each) over the mini-batches.

    Args:
        engine: The engine trained (its ``train_mode``).
        name: Its name, the metrics' prefix.
        loss_fn: ``loss_fn(model_output, micro_batch, info)``.
        mini_batches: This rank's mini-batches of the step (:func:`split_mini_batches`).
        epochs: Passes over them.
        hooks: The trainer's step hooks (``on_micro_batches`` and the like), passed to ``train_batch``.
        **kwargs: Passed to ``train_batch`` (``calculate_entropy``).

    Returns:
        Step outputs: ``{name}_micro_batches`` (loss metrics, SUMs averaged over the updates),
        ``{name}/grad_norm`` (mean over the updates), ``{name}/lr``; with float16 loss scaling also
        ``{name}/loss_scale`` (after the last update), ``{name}/loss_scale_overflows`` and
        ``{name}/skipped_updates`` (counts of this step's updates).
    """
    metrics: list[dict[str, Any]] = []
    grad_norms: list[float] = []
    lr = 0.0
    loss_scale: float | None = None
    skipped = overflows = 0
    with engine.train_mode():
        for _ in range(epochs):
            for mini_batch in mini_batches:
                out = engine.train_batch(mini_batch, loss_fn, hooks=hooks, **kwargs)
                metrics.extend(out["metrics"])
                grad_norms.append(float(out["grad_norm"]))
                lr = float(out["lr"])
                loss_scale = out.get("loss_scale")  # after this update (None without loss scaling)
                skipped += int(out["step_skipped"])
                overflows += int(out.get("loss_scale_overflow", False))
    num_updates = epochs * len(mini_batches)
    outputs = {
        f"{name}_micro_batches": _mean_over_updates(metrics, num_updates),
        f"{name}/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
        f"{name}/lr": lr,
    }
    if loss_scale is not None:
        outputs.update({f"{name}/loss_scale": loss_scale,
                        f"{name}/loss_scale_overflows": overflows, f"{name}/skipped_updates": skipped})
    return outputs


def compute_log_probs(engines: Mapping[str, BaseEngine], batch: TensorDict, actor: bool, reference: bool,
                      ref_in_actor: bool) -> None:
    """``old_log_probs`` (with ``actor``) and the reference's ``ref_log_prob`` (``reference``), ``[B, T]``.

    ``ref_in_actor``: the reference is the LoRA actor with its adapters disabled (no ``ref`` engine).
    """
    if actor:
        engine = engines["actor"]
        with engine.eval_mode():
            output = engine.infer_batch(batch)["model_output"]
            batch[schema.OLD_LOG_PROBS] = output["log_probs"]
            if schema.ROUTED_EXPERTS in output:  # a MoE model's routing (router replay: old_policy)
                keep_old_policy_routing(engine.config.moe, output, batch)
    if reference:
        ref = engines["actor" if ref_in_actor else "ref"]
        with ref.eval_mode(), ref.disable_adapters() if ref_in_actor else contextlib.nullcontext():
            batch[schema.REF_LOG_PROB] = ref.infer_batch(batch)["model_output"]["log_probs"]


ActorDuePart = Callable[[int], bool]
"""``due(step) -> bool``: whether the actor trains at trainer step ``step`` (0-based ``global_step``)."""
CriticPart = Callable[[list[TensorDict]], dict[str, Any]]
"""``critic(mini_batches) -> outputs``: the critic's updates over the step's mini-batches; step outputs."""


@dataclass
class UpdatePlan:
    """What :meth:`Updater.prepare` decided for the step: mini-batches and the actor's loss."""

    num_mini_batches: int
    """Mini-batches of the step over the DP group (the same on every rank)."""
    actor_loss: Callable[..., Any]
    """The actor's loss (wrapped to read its own log-probs as the old ones when they are reused)."""
    actor_due: bool
    """Whether the actor trains this step (the actor-due part's verdict)."""


class Updater:
    """The engine updates of an RL step (see the module docstring).

    Args:
        engines: The module's engines by name (``actor``; ``ref`` with a separate reference).
        actor: ``algorithm.actor`` (``ppo_epochs``, ``ppo_mini_batch_size``, ``calculate_entropy``,
            ``reuse_log_probs_on_policy``).
        actor_loss: The policy loss (:func:`~verl_trainer.core_algos.losses.ppo_loss`).
        mini_batch_samples: Samples per mini-batch over all DP ranks (``None``: one mini-batch).
        reference: Whether reference log-probs are computed (the KL loss); ``ref_in_actor``: from the actor
            with its LoRA adapters disabled.
        actor_due: The actor-due part (PPO: not during the critic warm-up); ``None``: every step.
        critic: The critic part, run before the actor's updates (``None``: no critic).
        hooks: The trainer's step hooks, passed to ``engine.train_batch`` (``None``: none).
        dp_group: The DP process group.
    """

    def __init__(self, engines: Mapping[str, BaseEngine], actor: ActorConfig, actor_loss: Callable[..., Any],
                 mini_batch_samples: int | None, reference: bool, ref_in_actor: bool,
                 actor_due: ActorDuePart | None = None, critic: CriticPart | None = None,
                 hooks: Any = None, dp_group: dist.ProcessGroup | None = None) -> None:
        self.engines = engines
        self.actor = actor
        self.actor_loss = actor_loss
        self.mini_batch_samples = mini_batch_samples
        self.reference = reference
        self.ref_in_actor = ref_in_actor
        self.actor_due = actor_due
        self.critic = critic
        self.hooks = hooks
        self.dp_group = dp_group
        self._prepares = bool(getattr(actor_loss, "needs_prepare", False))

    def prepare(self, data: TensorDict, step: int, metrics: StepMetrics) -> UpdatePlan:
        """Count the mini-batches (a collective), ask the actor-due part, add the old and reference log-probs.

        The old log-probs are reused from the update itself when the step is one actor update
        (``actor.reuse_log_probs_on_policy``, ``ppo_epochs == 1``, one mini-batch, the actor due);
        ``actor/old_log_probs_reused`` says which.

        Args:
            data: The tensor-only batch the guard let through (log-probs are added in place).
            step: The trainer's ``global_step`` before this step (0-based), for the actor-due part.
            metrics: The step's outputs.
        """
        num_mini = count_mini_batches(data, self.mini_batch_samples, self.dp_group)  # once per step
        actor_due = self.actor_due is None or self.actor_due(step)
        loss = self.actor_loss
        if schema.OLD_LOG_PROBS not in data.keys():  # PPO with KL in the reward computed them already
            cfg = self.actor
            one_update = cfg.ppo_epochs == 1 and num_mini == 1
            # a loss that selects tokens over the whole step reads the old log-probs before the update
            reuse = cfg.reuse_log_probs_on_policy and one_update and actor_due and not self._prepares
            compute_log_probs(self.engines, data, not reuse, self.reference, self.ref_in_actor)
            metrics["actor/old_log_probs_reused"] = float(reuse)
            loss = with_on_policy_old_log_probs(loss) if reuse else loss
        return UpdatePlan(num_mini, loss, actor_due)

    def update(self, data: TensorDict, plan: UpdatePlan, metrics: StepMetrics) -> dict[str, Any]:
        """The critic part's updates, then the actor's (when due), over the step's mini-batches.

        Returns:
            The engines' outputs (also added to ``metrics``): see :func:`run_updates`.
        """
        mini_batches = split_mini_batches(data, plan.num_mini_batches)
        outputs = dict(self.critic(mini_batches)) if self.critic is not None else {}
        if plan.actor_due:
            if self._prepares:  # clip-cov / KL-cov: the token selection over each whole mini-batch
                mini_batches = [self.actor_loss.prepare(mb, self.dp_group) for mb in mini_batches]
            outputs.update(run_updates(self.engines["actor"], "actor", plan.actor_loss, mini_batches,
                                       self.actor.ppo_epochs, self.hooks,
                                       calculate_entropy=self.actor.calculate_entropy))
        metrics.update(outputs)
        return outputs

"""The RL step shared by PPO and GRPO, as a :class:`~verl_trainer.module.TrainingModule`.

One ``training_step`` on each rank's prompt batch (SPMD; DESIGN.md §2)::

    rollout (n samples per prompt, groups whole on this rank) → rewards (+ overlong shaping)
      [ReMax: + one greedy response per prompt, scored alike → reward_baselines; greedy_baseline.py]
      → advantages                                  [subclass: GRPO per group; PPO critic values + GAE]
      → on_rollout_end → tensor_only → select_samples [GRPO: DAPO dynamic sampling]
      → old log-probs recomputed by the actor engine (+ reference log-probs for the KL loss); skipped
        when the step makes one actor update: the update's own detached log-probs are the old ones
        (``actor.reuse_log_probs_on_policy``)
      → on_before_update (SequenceBalancing may re-partition; padding samples train nothing)
      → ppo_epochs × mini-batches: critic updates, then actor updates (``engine.train_batch``)
      → weight sync to the rollout copy (on every rank: it is a collective)

Logged (reductions declared, so the values are those of the whole step on one process):
``reward/{mean,min,max,accuracy,zero_std_group_frac}``, ``response_length/{mean,min,max,clip_ratio}``,
``critic/advantages/{mean,min,max}``, the loss metrics (``actor/pg_loss``, ``actor/pg_clipfrac``,
``actor/ppo_kl``, ``actor/kl_loss``, ``critic/vf_loss``, ... averaged over the step's updates),
``reward/errors``, ``reward/timeouts`` (failed reward calls, ``reward.on_error``), ``non_finite/*``,
``reward/baseline_mean`` and ``timing/baseline_rollout_s`` (ReMax's greedy responses),
``actor/grad_norm``, ``actor/lr``, ``actor/old_log_probs_reused`` (1: no separate old-log-prob forward),
the train/inference mismatch of the old log-probs and the rollout's (``rollout_corr/*``,
``training/rollout_probs_diff_*``; with ``rollout_correction`` on, the policy loss is importance-weighted),
``timing/*``; with ``rollout.max_staleness=1`` (:mod:`verl_trainer.algorithms.one_step_off`) the rollout of
the next step runs while this one trains, and ``rollout/staleness``, ``timing/idle_s`` are logged;
validation: ``val/reward/*``, ``val/response_length/*``; with ``val_rollout.n > 1``
``val/pass@k``, ``val/maj@k``, ``val/mean@k``, ``val/best@k``, ``val/worst@k`` overall and per data source;
multi-turn: ``agent/*`` and ``val/agent/*`` (``verl_trainer.rollout.agent_loop.agent_rewards_and_metrics``).

Sampling is seeded per response from ``(rollout.seed, global step, the prompt's dataset index, sample
index)``, so the responses of a step do not depend on the dp size (:mod:`verl_trainer.rollout.base`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.algorithms.config import RLConfig, check_mini_batch_divides
from verl_trainer.algorithms.dapo import overlong_penalty
from verl_trainer.algorithms.distributed import count_mini_batches, drop_samples, split_mini_batches
from verl_trainer.algorithms.generations import GenerationLog
from verl_trainer.algorithms.greedy_baseline import (
    attach_reward_baselines,
    baseline_metrics,
    generate_greedy_baseline,
    reads_reward_baselines,
)
from verl_trainer.algorithms.non_finite import NonFiniteGuard, check_reward_failures
from verl_trainer.algorithms.one_step_off import OneStepOffRollout, check_async_rollout
from verl_trainer.algorithms.reward_model import REWARD_MODEL_ENGINE, RewardModel, split_reward_models
from verl_trainer.core_algos.advantages import estimator_inputs
from verl_trainer.core_algos.balancing import required_batch_multiple
from verl_trainer.core_algos.losses import ppo_loss
from verl_trainer.data import schema
from verl_trainer.data.schema import non_tensor_lists
from verl_trainer.engine.config import EngineConfig
from verl_trainer.evaluate.validation import batch_prompt_samples, validation_metrics
from verl_trainer.metrics import Metric, Reduction, sample_stats
from verl_trainer.module import EngineSpec, StepOutput, TrainingModule
from verl_trainer.rewards import RewardFunctions, score_batch, token_level_scores
from verl_trainer.rewards.trl_kwargs import trl_run_kwargs
from verl_trainer.rollout import AGENT_INFO, RESPONSE_TEXT, BaseRollout, build_rollout
from verl_trainer.rollout.agent_loop import agent_rewards_and_metrics
from verl_trainer.rollout.divergence import DivergenceError
from verl_trainer.utils.distributed import all_reduce

__all__ = ["RLModule", "response_length_metrics"]


def response_length_metrics(batch: TensorDict, max_len: int,
                            prefix: str = "response_length") -> dict[str, Metric]:
    """Mean/min/max response length and the fraction cut at ``max_len`` (real samples only)."""
    lens = batch[schema.RESPONSE_LEN].to(torch.float32)[schema.real_mask(batch)]
    count = lens.numel()
    clipped = (lens >= max_len).float().mean() if count else torch.zeros(())
    return {**sample_stats(lens, prefix), f"{prefix}/clip_ratio": Metric.mean(clipped, weight=count)}


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


class RLModule(TrainingModule):
    """Base of :class:`~verl_trainer.algorithms.PPO` and :class:`~verl_trainer.algorithms.GRPO`.

    Subclasses implement :meth:`compute_advantages` and may override :meth:`extra_engines`,
    :meth:`select_samples`, :meth:`update_critic` and :meth:`actor_update_due`.

    Args:
        config: See :class:`~verl_trainer.algorithms.config.RLConfig`.
    """

    config: RLConfig

    def __init__(self, config: RLConfig) -> None:
        super().__init__()
        config = dataclasses.replace(config, reward=split_reward_models(config.reward))  # TRL style RM path
        self.config = config
        self.actor_loss = ppo_loss(config.actor.loss, config.rollout_correction)
        # fails here for an unknown reward or one with neither verl's nor TRL's signature
        self.reward_fn = RewardFunctions(config.reward.name, config.reward.weights, config.reward.on_error,
                                         config.reward.timeout_s)
        self.reward_model = RewardModel(config.reward.model) if config.reward.model.enable else None
        self.rollout: BaseRollout | None = None
        self._rollout_stale = False
        self.one_step_off = OneStepOffRollout(self) if config.rollout.max_staleness else None
        """With ``rollout.max_staleness=1``: the next step's generation on a background thread."""
        estimator = getattr(config, "adv_estimator", None)  # one that normalises within a prompt's group
        group_estimator = estimator is not None and "index" in estimator_inputs(estimator)
        self.non_finite = NonFiniteGuard(config.non_finite, group_estimator)
        self.val_generations = GenerationLog(config.val_rollout.log_generations)
        self.train_generations = GenerationLog(config.log_train_generations, stage="train")
        self.group_estimator = group_estimator
        self.greedy_baseline = reads_reward_baselines(estimator)
        """The estimator reads ``reward_baselines`` (ReMax): every step also decodes each prompt greedily
        (:mod:`verl_trainer.algorithms.greedy_baseline`)."""

    @property
    def hparams(self) -> dict[str, Any]:
        """The config as plain data."""
        return dataclasses.asdict(self.config)

    # ---------------------------------------------------------------------------------------- engines
    @property
    def uses_reference(self) -> bool:
        """Whether a reference engine is built (the KL loss is on)."""
        return self.config.actor.loss.use_kl_loss

    def _policy_engine(self, engine: EngineConfig) -> EngineConfig:
        """Model path defaulted to the policy's; log-probs at the rollout's sampling temperature."""
        return engine.replace(model_path=engine.model_path or self.config.model_path,
                              temperature=self.config.rollout.temperature)

    def extra_engines(self) -> dict[str, EngineSpec]:
        """Engines besides the actor and the reference (PPO: the critic)."""
        return {}

    def configure_engines(self) -> dict[str, EngineSpec]:
        """``actor`` (trained), the subclass's engines, ``ref`` (inference only) with a KL term.

        No ``ref`` engine when the reference is the LoRA actor with its adapters disabled
        (``config.ref_in_actor``).
        """
        if not self.config.model_path:
            raise ValueError(
                f"{type(self).__name__}: config.model_path is empty; set algorithm.model_path to the initial "
                "policy's checkpoint directory"
            )
        actor = self.config.actor
        specs = {"actor": EngineSpec("language_model", self._policy_engine(actor.engine), actor.optim)}
        specs.update(self.extra_engines())
        if self.uses_reference and not self.config.ref_in_actor:
            specs["ref"] = EngineSpec("language_model", self._policy_engine(self.config.ref.engine), None)
        if self.reward_model is not None:
            specs[REWARD_MODEL_ENGINE] = self.reward_model.engine_spec()
        return specs

    def check_data(self, datamodule: Any) -> None:
        """``actor.ppo_mini_batch_size`` must divide the datamodule's ``train_batch_size`` (both in prompts).

        A datamodule without ``config.train_batch_size`` is not checked.

        Raises:
            ValueError: From :func:`~verl_trainer.algorithms.config.check_mini_batch_divides`.
        """
        size = getattr(getattr(datamodule, "config", None), "train_batch_size", None)
        if isinstance(size, int):
            check_mini_batch_divides(self.config.actor.ppo_mini_batch_size, size)

    def setup(self, stage: str) -> None:
        """Build the rollout copy of the policy (once; it lives as long as the module)."""
        if self.rollout is None:
            self.rollout = build_rollout(self.config.rollout, self.config.model_path)
            if self.one_step_off is not None:
                check_async_rollout(self.rollout)
            self._rollout_stale = True  # the actor may not be model_path's weights (e.g. saved LoRA adapters)

    # ------------------------------------------------------------------------------------- the step
    def compute_advantages(self, batch: TensorDict, scores: torch.Tensor, metrics: dict[str, Any]) -> None:
        """Write ``advantages`` (and ``returns``, ``values``) ``[B, T]`` into ``batch``; add metrics."""
        raise NotImplementedError

    def select_samples(self, batch: TensorDict, scores: torch.Tensor,
                       metrics: dict[str, Any]) -> tuple[TensorDict, bool]:
        """Choose the samples to train on; ``False`` skips the update (on every rank alike)."""
        return batch, True

    def actor_update_due(self) -> bool:
        """Whether the actor trains this step (PPO: not during the critic warm-up)."""
        return True

    def update_critic(self, mini_batches: list[TensorDict]) -> dict[str, Any]:
        """Critic updates of the step (PPO); returns step outputs."""
        return {}

    def _unique_uids(self, prompt_batch: TensorDict) -> TensorDict:
        """Give this step's prompts uids unique over the DP ranks (a repeated prompt is a new group)."""
        b = prompt_batch.batch_size[0]
        rank = self.topology.dp_rank if self.topology is not None else 0
        prompt_batch[schema.UID] = rank * b + torch.arange(b, dtype=torch.long)
        return prompt_batch

    def score(self, batch: TensorDict, metrics: dict[str, Any]) -> torch.Tensor:
        """Rewards of a rollout batch: writes ``token_level_scores``/``token_level_rewards``; adds metrics.

        Returns:
            ``[B]`` the (shaped) rewards the advantages are computed from.
        """
        scores = self.sequence_rewards(batch, metrics)
        metrics.update(response_length_metrics(batch, self.config.rollout.max_new_tokens))
        rewards = token_level_scores(scores, batch[schema.RESPONSE_MASK])
        batch[schema.TOKEN_LEVEL_SCORES] = rewards
        batch[schema.TOKEN_LEVEL_REWARDS] = rewards.clone()
        return scores

    def sequence_rewards(self, batch: TensorDict, metrics: dict[str, Any], what: str = "rewards"
                         ) -> torch.Tensor:
        """``[B]`` rewards of a rollout batch: every part of the reward, checked (a collective).

        The reward functions and the reward model (failed calls under ``reward.on_error``, non-finite
        scores under ``non_finite.policy``: dropped samples become padding with score 0), the multi-turn
        environment's reward, DAPO's overlong shaping. ``what`` names the values in messages and in
        ``non_finite/{what}`` (``baseline_rewards`` for ReMax's greedy responses).
        """
        check = lambda b, s, info: self._check_rewards(b, s, info, metrics, what)  # noqa: E731
        trl_kwargs = trl_run_kwargs(self.trainer, metrics) if self.reward_fn.takes_trl_kwargs else None
        scores, reward_metrics = score_batch(batch, self.reward_fn, on_scores=check, raise_on_error=False,
                                             trl_kwargs=trl_kwargs)
        metrics.update(reward_metrics)
        if AGENT_INFO in batch.keys():  # multi-turn: the environment's and the tools' trajectory reward
            agent_rewards, agent_metrics = agent_rewards_and_metrics(batch)
            scores = scores + self.config.rollout.multi_turn.reward_weight * agent_rewards.to(scores)
            metrics.update(agent_metrics)
        buffer = self.config.reward.overlong_buffer
        if buffer.enable:
            max_len = self.config.rollout.max_new_tokens
            penalty = overlong_penalty(batch[schema.RESPONSE_LEN], max_len, buffer.len, buffer.penalty_factor)
            scores = scores + penalty
            metrics["reward/overlong_penalty"] = Metric.mean(penalty.mean(), weight=penalty.numel())
        return scores

    def generate_baseline(self, prompt_batch: TensorDict, step: int, prompt_index: torch.Tensor
                          ) -> TensorDict | None:
        """ReMax's greedy response to each prompt, ``[B]``; ``None`` when the estimator reads no baselines.

        Call it right after the samples' rollout, so both use the same weights
        (:mod:`~verl_trainer.algorithms.greedy_baseline`).
        """
        if not self.greedy_baseline:
            return None
        return generate_greedy_baseline(self.rollout, prompt_batch, step, prompt_index)

    def score_baseline(self, batch: TensorDict, baseline: TensorDict, metrics: dict[str, Any]) -> None:
        """Score the greedy responses as samples and write ``reward_baselines`` ``[B * n]`` into ``batch``.

        A collective (reward model, failure and non-finite counts). Samples whose greedy response was
        dropped (a dropping failure policy) are dropped too: they have no baseline.
        """
        scoring: dict[str, Any] = {}
        dropped_before = self.non_finite.dropped
        scores = self.sequence_rewards(baseline, scoring, what="baseline_rewards")
        orphans = attach_reward_baselines(batch, baseline, scores)
        if self.non_finite.dropped > dropped_before:  # the same on every rank (counts over the DP group)
            self.non_finite.dropped += drop_samples(batch, orphans, False, self._dp_group)[1]
        metrics.update(baseline_metrics(baseline, scores, scoring))

    @property
    def _step(self) -> int:
        """The step being run (1-based), for messages."""
        return (self.trainer.global_step if self.trainer is not None else 0) + 1

    @property
    def _dp_group(self) -> Any:
        """The run's DP group (``None``: one process, or before the engines exist)."""
        return self.topology.dp_group if self.topology is not None else None

    @property
    def _dp_size(self) -> int:
        """The run's DP size (1 before the engines exist)."""
        return self.topology.dp_size if self.topology is not None else 1

    def _check_rewards(self, batch: TensorDict, scores: torch.Tensor, info: dict[str, torch.Tensor],
                       metrics: dict[str, Any], what: str = "rewards") -> None:
        """Failed reward calls (``reward.on_error``), then non-finite rewards (``non_finite.policy``).

        Each: an error on every rank, or the samples (groups) dropped with their scores set to 0.
        """
        self._add_model_scores(batch, scores, info, metrics, "reward")
        self.non_finite.dropped += check_reward_failures(
            self.reward_fn, batch, scores, info, self._step, self._dp_group, metrics, self.group_estimator)
        dropped = self.non_finite.check_samples(batch, scores, what, self._step, self._dp_group, metrics)
        scores[dropped] = 0.0

    def _add_model_scores(self, batch: TensorDict, scores: torch.Tensor, info: dict[str, torch.Tensor],
                          metrics: dict[str, Any], prefix: str) -> None:
        """Add the reward model's weighted score (a collective); its own is logged as ``{prefix}/model``."""
        if self.reward_model is None:
            return
        data = non_tensor_lists(batch, ("columns", RESPONSE_TEXT))
        prompts = [c.get("prompt") for c in data["columns"]]
        model_scores, truncated = self.reward_model.score(self.engines[REWARD_MODEL_ENGINE], prompts,
                                                          data[RESPONSE_TEXT])
        scores += self.reward_model.config.weight * model_scores
        info["model"] = model_scores
        count = all_reduce(torch.tensor(float(truncated)), self._dp_group)
        metrics[f"{prefix}/model/truncated"] = float(count)

    def _check_advantages(self, batch: TensorDict, metrics: dict[str, Any]) -> None:
        """Non-finite advantages: an error, or their samples dropped; padding rows' values set to 0."""
        adv = batch[schema.ADVANTAGES]
        self.non_finite.check_samples(batch, adv, "advantages", self._step, self._dp_group, metrics)
        if not self.non_finite.dropped:
            return
        real = schema.real_mask(batch).unsqueeze(-1)
        for key in (schema.ADVANTAGES, schema.RETURNS, schema.VALUES, schema.TOKEN_LEVEL_REWARDS,
                    schema.TOKEN_LEVEL_SCORES):
            if key in batch.keys():  # a masked NaN still poisons a loss (NaN * 0 = NaN)
                batch[key] = torch.where(real, batch[key], torch.zeros((), dtype=batch[key].dtype))

    def _updates_skipped(self, metrics: dict[str, Any]) -> tuple[bool, bool]:
        """Whether an engine skipped an update of this step, and whether all skips were loss-scale overflows.

        A skip is a non-finite grad norm; float16 overflows are expected with ``precision="16-mixed"``
        (not an error).
        """
        skipped, overflow_only = False, True
        for name in ("critic", "actor"):
            if f"{name}/grad_norm" in metrics:
                overflows = metrics.get(f"{name}/loss_scale_overflows", 0)
                only = overflows > 0 and overflows == metrics.get(f"{name}/skipped_updates", 0)
                engine_skipped = self.non_finite.check_update(
                    name, float(metrics[f"{name}/grad_norm"]), metrics.get(f"{name}_micro_batches", []),
                    self._step, loss_scale_overflow=only)
                skipped |= engine_skipped
                overflow_only &= only or not engine_skipped
        return skipped, skipped and overflow_only

    def compute_log_probs(self, batch: TensorDict, actor: bool = True) -> None:
        """``old_log_probs`` (unless ``actor=False``) and the reference's ``ref_log_prob``, ``[B, T]``."""
        if actor:
            engine = self.engines["actor"]
            with engine.eval_mode():
                batch[schema.OLD_LOG_PROBS] = engine.infer_batch(batch)["model_output"]["log_probs"]
        if self.uses_reference:
            in_actor = self.config.ref_in_actor  # the actor with its LoRA adapters disabled
            ref = self.engines["actor" if in_actor else "ref"]
            with ref.eval_mode(), ref.disable_adapters() if in_actor else contextlib.nullcontext():
                batch[schema.REF_LOG_PROB] = ref.infer_batch(batch)["model_output"]["log_probs"]

    def run_updates(self, name: str, loss_fn: Callable[..., Any], mini_batches: list[TensorDict],
                    epochs: int, **kwargs: Any) -> dict[str, Any]:
        """``epochs`` passes of ``engine.train_batch`` (one optimizer step each) over the mini-batches.

        Returns:
            Step outputs: ``{name}_micro_batches`` (loss metrics, SUMs averaged over the updates),
            ``{name}/grad_norm`` (mean over the updates), ``{name}/lr``; with float16 loss scaling also
            ``{name}/loss_scale`` (after the last update), ``{name}/loss_scale_overflows`` and
            ``{name}/skipped_updates`` (counts of this step's updates).
        """
        engine = self.engines[name]
        metrics: list[dict[str, Any]] = []
        grad_norms: list[float] = []
        lr = 0.0
        loss_scale: float | None = None
        skipped = overflows = 0
        hooks = self.trainer.step_hooks if self.trainer is not None else None
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

    @property
    def mini_batch_samples(self) -> int | None:
        """Samples per mini-batch over all DP ranks: ``ppo_mini_batch_size × rollout.n`` (``None``: one)."""
        size = self.config.actor.ppo_mini_batch_size
        return None if size is None else size * self.config.rollout.n

    @property
    def required_batch_multiple(self) -> int:
        """``lcm(dp, actor mini-batch × n)`` samples (the critic shares the actor's mini-batches)."""
        return required_batch_multiple(self._dp_size, self.config.actor.ppo_mini_batch_size, None,
                                       self.config.rollout.n)

    def single_actor_update(self, num_mini_batches: int) -> bool:
        """Whether this step's actor update may reuse its own log-probs as the old ones.

        True when ``actor.reuse_log_probs_on_policy`` is set, the actor trains this step, and the step is
        one optimizer update (``ppo_epochs == 1`` and one mini-batch over the DP group).
        """
        cfg = self.config.actor
        on_policy = cfg.reuse_log_probs_on_policy and cfg.ppo_epochs == 1 and self.actor_update_due()
        return on_policy and num_mini_batches == 1

    def sync_rollout(self) -> None:
        """The actor's weights into the rollout (a collective: call on every rank).

        Where the actor holds its parameters whole on this rank (``engine.get_shareable_params()``) and
        ``rollout.share_weights`` is on, the rollout aliases them (no copy; a no-op after the first
        call); else every tensor is streamed into the rollout's copy (always with ``max_staleness >= 1``:
        the rollout generates while the actor trains).
        """
        actor = self.engines["actor"]
        share = self.config.rollout.share_weights and not self.config.rollout.max_staleness
        with actor.eval_mode():
            shareable = actor.get_shareable_params() if share else None
            if shareable is not None:
                self.rollout.share_weights(shareable)
            else:
                self.rollout.update_weights(actor.get_per_tensor_param())
        if self.topology is not None:  # SP / TP ranks of one DP rank sample the same responses
            self.rollout.data_rank = self.topology.dp_rank
        self._rollout_stale = False

    def training_step(self, batch: TensorDict, batch_idx: int) -> StepOutput:
        """One RL step on this rank's prompt batch (see the module docstring)."""
        if self._rollout_stale and self.one_step_off is None:
            self.sync_rollout()
        trainer = self.trainer
        t0 = time.perf_counter()
        metrics: dict[str, Any] = {}
        self.non_finite.dropped = 0
        prompt_index = batch[schema.UID].clone()  # dataset indices: the sampling seeds, at any dp size
        if self.one_step_off is not None:  # read ahead one step: generated while the step before trained
            rollout_batch, baseline = self.one_step_off.rollout_batch(batch, prompt_index, metrics)
        else:
            try:
                batch = self._unique_uids(batch)
                step = trainer.global_step
                rollout_batch = self.rollout.generate(batch, step=step, prompt_index=prompt_index)
                t_baseline = time.perf_counter()
                baseline = self.generate_baseline(batch, step, prompt_index)
            except DivergenceError as exc:  # the update before this step made the weights non-finite
                raise DivergenceError(f"step {trainer.global_step + 1} (its rollout): {exc}") from None
            if baseline is not None:
                metrics["timing/baseline_rollout_s"] = time.perf_counter() - t_baseline
        t_rollout = time.perf_counter() - t0
        scores = self.score(rollout_batch, metrics)
        self.train_generations.record(rollout_batch, scores, 0, trainer)  # log_train_generations
        if baseline is not None:  # ReMax: the greedy responses' rewards, as reward_baselines
            self.score_baseline(rollout_batch, baseline, metrics)
        self.compute_advantages(rollout_batch, scores, metrics)
        self._check_advantages(rollout_batch, metrics)
        trainer.call_hook("on_rollout_end", rollout_batch)
        data, do_update = self.select_samples(schema.tensor_only(rollout_batch), scores, metrics)
        all_dropped = False
        if self.non_finite.dropped:  # every rank knows; nothing left to train on anywhere: skip
            left = all_reduce(torch.tensor(float(schema.num_real(data))), self._dp_group)
            all_dropped = float(left) == 0.0
            do_update = do_update and not all_dropped
        t1 = time.perf_counter()
        if do_update:
            actor_cfg = self.config.actor
            num_mini = count_mini_batches(data, self.mini_batch_samples, self._dp_group)  # once per step
            actor_loss = self.actor_loss
            if schema.OLD_LOG_PROBS not in data.keys():  # PPO with KL in the reward computed them already
                reuse = self.single_actor_update(num_mini)
                self.compute_log_probs(data, actor=not reuse)
                metrics["actor/old_log_probs_reused"] = float(reuse)
                actor_loss = with_on_policy_old_log_probs(actor_loss) if reuse else actor_loss
            data = trainer.call_hook("on_before_update", data)  # a callback may return a new batch
            mini_batches = split_mini_batches(data, num_mini)
            metrics.update(self.update_critic(mini_batches))
            if self.actor_update_due():
                metrics.update(self.run_updates("actor", actor_loss, mini_batches, actor_cfg.ppo_epochs,
                                                calculate_entropy=actor_cfg.calculate_entropy))
                if self.one_step_off is None:  # one step off: synced at the next step's start
                    self.sync_rollout()
        engine_skipped, overflow_only = self._updates_skipped(metrics) if do_update else (False, False)
        # a float16 overflow skip is reported (update_skipped) but is no sign of a broken run
        self.non_finite.end_step(all_dropped or (engine_skipped and not overflow_only), self._step)
        metrics["actor/update_skipped"] = 0.0 if do_update and not engine_skipped else 1.0
        if self.one_step_off is None:
            metrics["timing/rollout_s"] = t_rollout
        metrics["timing/update_s"] = time.perf_counter() - t1
        metrics["timing/step_s"] = time.perf_counter() - t0
        return metrics

    # ------------------------------------------------------------------------------------ validation
    def validation_step(self, batch: TensorDict, batch_idx: int) -> StepOutput:
        """Rollout on validation prompts (greedy by default) and their rewards: ``val/reward/*``.

        With ``val_rollout.n > 1`` (or ``val_rollout.k`` set) also ``val/pass@k``, ``val/maj@k``,
        ``val/mean@k``, ``val/best@k``, ``val/worst@k`` and the same per source, ``val/<data_source>/pass@k``
        (:mod:`verl_trainer.evaluate.validation`). Multi-turn: ``val/agent/*`` (turns, tool calls, errors,
        timeouts, correct tool use, tool-token share; the environment's reward is logged, not added).
        Non-finite rewards: ``val/non_finite/rewards`` (a count over the whole validation), then
        ``algorithm.non_finite.policy`` (``NonFiniteGuard.check_validation``).
        """
        if self.one_step_off is not None:
            self.one_step_off.before_validation()
        elif self._rollout_stale:
            self.sync_rollout()
        v = self.config.val_rollout
        step = self.trainer.global_step if self.trainer is not None else None
        rollout_batch = self.rollout.generate(batch, step=step, stream=1, n=v.n, do_sample=v.do_sample,
                                              temperature=v.temperature, top_p=v.top_p)
        metrics: dict[str, Any] = {}

        def check(b: TensorDict, s: torch.Tensor, info: dict[str, torch.Tensor]) -> None:
            self._add_model_scores(b, s, info, metrics, "val/reward")
            check_reward_failures(self.reward_fn, b, s, info, self._step, self._dp_group, metrics,
                                  prefix="val/reward")
            # NaN/inf rewards: val/non_finite/*, then algorithm.non_finite.policy as in training
            self.non_finite.check_validation(b, s, self._step - 1, self._dp_group, metrics)

        scores, reward_metrics, info = score_batch(rollout_batch, self.reward_fn, prefix="val/reward",
                                                   on_scores=check, return_info=True, raise_on_error=False)
        metrics.update(reward_metrics)
        if AGENT_INFO in rollout_batch.keys():  # multi-turn: val/agent/turns, tool calls, correct tool use...
            metrics.update(agent_rewards_and_metrics(rollout_batch, prefix="val/agent")[1])
        if v.n == 1:
            metrics.pop("val/reward/zero_std_group_frac", None)
        if v.ks:  # pass@k, maj@k, ... over the n samples of each prompt, overall and per data_source
            prompts = batch_prompt_samples(rollout_batch, scores, info, v.correct_threshold)
            metrics.update(validation_metrics(prompts, v.ks, prefix="val"))
        metrics.update(response_length_metrics(rollout_batch, self.config.rollout.max_new_tokens,
                                               prefix="val/response_length"))
        self.val_generations.record(rollout_batch, scores, batch_idx, self.trainer)  # log_generations
        return metrics

    # ----------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The rollout's call counter and the count of steps skipped in a row for non-finite values.

        The counter seeds the sampling, so a resumed run samples as the original.
        """
        return {"rollout_generate_calls": self.rollout.num_generate_calls if self.rollout else 0,
                "non_finite_skipped_in_a_row": self.non_finite.skipped_in_a_row}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the counter; the rollout copy is re-synced from the restored actor before its next use."""
        if self.rollout is not None:
            self.rollout._calls = int(state_dict.get("rollout_generate_calls", 0))
        self.non_finite.skipped_in_a_row = int(state_dict.get("non_finite_skipped_in_a_row", 0))
        self._rollout_stale = True

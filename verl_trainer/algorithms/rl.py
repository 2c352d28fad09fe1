"""The RL step shared by PPO and GRPO, as a :class:`~verl_trainer.module.TrainingModule`.

One ``training_step`` on each rank's prompt batch (SPMD) is a straight line over the stages of
:mod:`verl_trainer.algorithms.stages`, each built once the engines exist and handed what it uses::

    rollout → score → advantages → on_rollout_end → select → guard
      → [old log-probs → on_before_update → critic and actor updates → weight sync] → guard.finish

Features are parts of a stage (see :mod:`verl_trainer.algorithms.stages`); a recipe plugs its own through
:meth:`RLModule.advantage_parts` (the estimator and the sample selection), :meth:`RLModule.score_parts` and
:meth:`RLModule.update_parts` (the critic and when the actor trains) (``docs/architecture.md``, "How to add").
A subclass's override of :meth:`RLModule.compute_advantages`, :meth:`RLModule.select_samples`,
:meth:`RLModule.update_critic` or :meth:`RLModule.actor_update_due` is plugged in as that part.

Logged (reductions declared, so the values are those of the whole step on one process): the reward,
response-length and advantage statistics, the engines' loss metrics, ``non_finite/*``, ``timing/*`` and
the features' own, each declared where its stage or part computes it; validation ``val/*``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

from tensordict import TensorDict

from verl_trainer.algorithms.async_rollout import AsyncRollout, check_async_rollout
from verl_trainer.algorithms.config import RLConfig, check_mini_batch_divides
from verl_trainer.algorithms.generations import GenerationLog, TrainGenerations
from verl_trainer.algorithms.greedy_baseline import GreedyBaseline, reads_reward_baselines
from verl_trainer.algorithms.reward_model import (
    REWARD_MODEL_ENGINE,
    RewardModel,
    RewardModelScores,
    split_reward_models,
)
from verl_trainer.algorithms.rollout_queue_state import gather_queue_states, own_queue_state
from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.algorithms.stages.guard import NonFiniteGuard, StepGuard
from verl_trainer.algorithms.stages.rollout import RolloutStage, WeightSync
from verl_trainer.algorithms.stages.signal import (
    Advantages,
    ComputePart,
    ScorePart,
    Scorer,
    SelectPart,
    keep_all,
    response_length_metrics,
)
from verl_trainer.algorithms.stages.update import (
    ActorDuePart,
    CriticPart,
    Updater,
    compute_log_probs,
    run_updates,
    with_on_policy_old_log_probs,
)
from verl_trainer.core_algos.advantages import estimator_inputs
from verl_trainer.core_algos.balancing import required_batch_multiple
from verl_trainer.core_algos.losses import ppo_loss
from verl_trainer.engine.config import EngineConfig
from verl_trainer.evaluate.validation import batch_prompt_samples, validation_metrics
from verl_trainer.models.router_replay import record_rollout_routing
from verl_trainer.module import EngineSpec, StepOutput, TrainingModule
from verl_trainer.rewards import RewardFunctions
from verl_trainer.rewards.trl_kwargs import trl_run_kwargs
from verl_trainer.rollout import AGENT_INFO, BaseRollout, build_rollout
from verl_trainer.rollout.agent_loop import agent_rewards_and_metrics
from verl_trainer.rollout_pool.config import check_pool_world
from verl_trainer.rollout_pool.stage import pool_rollout, validation_samples

__all__ = ["ActorDueOverride", "RLModule", "response_length_metrics", "with_on_policy_old_log_probs"]


class ActorDueOverride:
    """The updater's actor-due part from a subclass's ``actor_update_due()`` override (which takes no step).

    Args:
        due: The bound override.
    """

    def __init__(self, due: Callable[[], bool]) -> None:
        self.due = due

    def __call__(self, step: int) -> bool:
        """The override's verdict (it reads the step itself)."""
        return self.due()


@dataclasses.dataclass
class RLStages:
    """The stages of one RL module, built once its engines exist (:mod:`verl_trainer.algorithms.stages`)."""

    rollout: RolloutStage | AsyncRollout
    scorer: Scorer
    advantages: Advantages
    guard: StepGuard
    updater: Updater


class RLModule(TrainingModule):
    """Base of :class:`~verl_trainer.algorithms.PPO` and :class:`~verl_trainer.algorithms.GRPO`.

    Subclasses implement :meth:`compute_advantages` (or :meth:`advantage_parts`) and may override
    :meth:`extra_engines`, :meth:`select_samples`, :meth:`score_parts`, :meth:`update_critic` and
    :meth:`actor_update_due` (or :meth:`update_parts`); an override is plugged into its stage as a part.

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
        estimator = getattr(config, "adv_estimator", None)  # one that normalises within a prompt's group
        self.group_estimator = estimator is not None and "index" in estimator_inputs(estimator)
        self.guard = StepGuard(config.non_finite, self.reward_fn, self.group_estimator)
        """Kept for the module's life: it counts the steps skipped in a row (saved in checkpoints)."""
        self.val_generations = GenerationLog(config.val_rollout.log_generations)
        self.train_generations = GenerationLog(config.log_train_generations, stage="train")
        self.greedy_baseline = reads_reward_baselines(estimator)
        """The estimator reads ``reward_baselines`` (ReMax): every step also decodes each prompt greedily
        (:mod:`verl_trainer.algorithms.greedy_baseline`)."""
        self._stages: RLStages | None = None
        self._saved_queue: dict[str, Any] | None = None
        """This rank's queued groups from a checkpoint, until the asynchronous rollout is built."""

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

    def training_world_size(self, world_size: int) -> int:
        """``world_size`` less the rollout ranks of a separate placement (``rollout.placement``).

        Raises:
            ValueError: From :func:`~verl_trainer.rollout_pool.config.check_pool_world`.
        """
        if self.config.rollout.placement != "separate":
            return world_size
        return check_pool_world(self.config.rollout, world_size)

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
        """Build the rollout copy of the policy (once; it lives as long as the module).

        Raises:
            ValueError: ``rollout.max_staleness >= 1`` with a backend that cannot generate off the training
                thread (:func:`~verl_trainer.algorithms.async_rollout.check_async_rollout`).
        """
        if self.rollout is None:
            self.rollout = build_rollout(self.config.rollout, self.config.model_path)
            record_rollout_routing(self.rollout, self.config.actor.engine.moe)
            if self.config.rollout.max_staleness:
                check_async_rollout(self.rollout)
        if self.async_rollout is not None:  # a stopped fit's read-ahead groups: dropped, not left running
            self.async_rollout.close()
        self._stages = None  # built again from this run's engines and trainer

    # -------------------------------------------------------------------------- the recipe's parts
    def compute_advantages(self, batch: TensorDict, scores: Any, metrics: StepMetrics) -> None:
        """Write ``advantages`` (and ``returns``, ``values``) ``[B, T]`` into ``batch``; add metrics."""
        raise NotImplementedError

    def select_samples(self, batch: TensorDict, scores: Any,
                       metrics: StepMetrics) -> tuple[TensorDict, bool]:
        """Choose the samples to train on; ``False`` skips the update (on every rank alike)."""
        return batch, True

    def actor_update_due(self) -> bool:
        """Whether the actor trains this step (PPO: not during the critic warm-up)."""
        return True

    def update_critic(self, mini_batches: list[TensorDict]) -> dict[str, Any]:
        """Critic updates of the step (PPO); returns step outputs."""
        return {}

    def score_parts(self) -> list[ScorePart]:
        """Parts the scorer runs after a training batch is scored (engines exist when it is called)."""
        return []

    def overridden(self, name: str, base: type) -> bool:
        """Whether this module's class overrides method ``name`` below ``base`` (a user's subclass)."""
        return getattr(type(self), name) is not getattr(base, name)

    def advantage_parts(self) -> tuple[ComputePart, SelectPart]:
        """The advantages stage's estimator and selection parts (default: this module's methods)."""
        select = self.select_samples if self.overridden("select_samples", RLModule) else keep_all
        return self.compute_advantages, select

    def update_parts(self) -> tuple[ActorDuePart | None, CriticPart | None]:
        """The updater's actor-due and critic parts (default: this module's overrides; ``None``: none)."""
        due = self.overridden("actor_update_due", RLModule)
        critic = self.update_critic if self.overridden("update_critic", RLModule) else None
        return ActorDueOverride(self.actor_update_due) if due else None, critic

    def run_updates(self, name: str, loss_fn: Callable[..., Any], mini_batches: list[TensorDict],
                    epochs: int, **kwargs: Any) -> dict[str, Any]:
        """Engine ``name``'s updates over the mini-batches (:func:`.stages.update.run_updates`)."""
        hooks = self.trainer.step_hooks if self.trainer is not None else None
        return run_updates(self.engines[name], name, loss_fn, mini_batches, epochs, hooks, **kwargs)

    def compute_log_probs(self, batch: TensorDict, actor: bool = True) -> None:
        """``old_log_probs`` (unless ``actor=False``) and the reference's ``ref_log_prob``, ``[B, T]``."""
        compute_log_probs(self.engines, batch, actor, self.uses_reference, self.config.ref_in_actor)

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

    # ----------------------------------------------------------------------------------- the stages
    @property
    def stages(self) -> RLStages:
        """The step's stages, built on first use from the engines, the rollout and the trainer."""
        if self._stages is None:
            self._stages = self._build_stages()
        return self._stages

    def _build_stages(self) -> RLStages:
        cfg, group = self.config, self._dp_group
        rank = self.topology.dp_rank if self.topology is not None else None
        baseline = [GreedyBaseline()] if self.greedy_baseline else []
        weights = WeightSync(self.engines["actor"], self.rollout, cfg.rollout, rank)
        rollout: RolloutStage | AsyncRollout = RolloutStage(self.rollout, weights, rank or 0, baseline)
        if cfg.rollout.placement == "separate":  # generated by the rollout ranks (verl_trainer.rollout_pool)
            rollout = pool_rollout(rollout, self.trainer.peek_next_batches, cfg.rollout.max_staleness, group,
                                   rank or 0, self._dp_size, serving=self.trainer.state == "fit")
            self._restore_queue(rollout)  # a resume: the checkpoint's queued groups, as colocated
        elif cfg.rollout.max_staleness:  # read ahead k steps: generated while the steps before train
            rollout = AsyncRollout(rollout, self.trainer.peek_next_batches, cfg.rollout.max_staleness,
                                   group, rank or 0)
            self._restore_queue(rollout)
        self.guard.dp_group = group
        logs = [TrainGenerations(self.train_generations, self.trainer)] if cfg.log_train_generations else []
        model = (RewardModelScores(self.reward_model, self.engines[REWARD_MODEL_ENGINE], group)
                 if self.reward_model is not None else None)
        trl = functools.partial(trl_run_kwargs, self.trainer) if self.reward_fn.takes_trl_kwargs else None
        scorer = Scorer(self.reward_fn, self.guard, cfg.rollout, cfg.reward.overlong_buffer, model, trl,
                        [*logs, *baseline, *self.score_parts()])
        updater = Updater(self.engines, cfg.actor, self.actor_loss, self.mini_batch_samples,
                          self.uses_reference, cfg.ref_in_actor, *self.update_parts(),
                          self.trainer.step_hooks if self.trainer is not None else None, group)
        return RLStages(rollout, scorer, Advantages(*self.advantage_parts()), self.guard, updater)

    # ------------------------------------------------------------------------------------- the step
    def training_step(self, batch: TensorDict, batch_idx: int) -> StepOutput:
        """One RL step on this rank's prompt batch (see the module docstring)."""
        stages, step, metrics, outputs = self.stages, self.trainer.global_step, {}, {}
        start = time.perf_counter()
        samples = stages.rollout.generate(batch, step, metrics)
        scores = stages.scorer.score(samples, step + 1, metrics)
        stages.advantages.compute(samples, scores, metrics)
        self.trainer.call_hook("on_rollout_end", samples)
        data, trainable = stages.advantages.select(samples, scores, metrics)
        trainable = stages.guard.check(data, trainable, step + 1, metrics)
        update_start = time.perf_counter()
        if trainable:  # every rank alike (the guard's and the selection's verdicts are collective)
            plan = stages.updater.prepare(data, step, metrics)  # old log-probs, mini-batch count
            data = self.trainer.call_hook("on_before_update", data)  # a callback may return a new batch
            outputs = stages.updater.update(data, plan, metrics)
            stages.rollout.after_update(outputs)  # the weight sync (one step off: at the next step's start)
        stages.guard.finish(outputs, trainable, step + 1, metrics)
        metrics["timing/update_s"] = time.perf_counter() - update_start
        metrics["timing/step_s"] = time.perf_counter() - start
        return metrics

    def sync_rollout(self) -> None:
        """The actor's weights into the rollout now (a collective: call on every rank).

        Asynchronous rollout: after the queued groups finish (they keep their versions).
        """
        if self.async_rollout is not None:
            self.async_rollout.before_validation(self.trainer.global_step)
            return
        self.stages.rollout.weights.sync()

    @property
    def async_rollout(self) -> AsyncRollout | None:
        """The asynchronous rollout (``rollout.max_staleness >= 1``), once built; else ``None``."""
        rollout = self._stages.rollout if self._stages is not None else None
        return rollout if isinstance(rollout, AsyncRollout) else None

    @property
    def non_finite(self) -> NonFiniteGuard:
        """The guard's non-finite policy and counters."""
        return self.guard.non_finite

    # ------------------------------------------------------------------------------------ validation
    def validation_step(self, batch: TensorDict, batch_idx: int) -> StepOutput:
        """Rollout on validation prompts (greedy by default) and their rewards: ``val/reward/*``.

        With ``val_rollout.n > 1`` (or ``val_rollout.k`` set) also ``val/pass@k``, ``val/maj@k``,
        ``val/mean@k``, ``val/best@k``, ``val/worst@k`` and the same per source, ``val/<data_source>/pass@k``
        (:mod:`verl_trainer.evaluate.validation`). Multi-turn: ``val/agent/*`` (the environment's reward is
        logged, not added). Failed calls and non-finite rewards: ``val/reward/errors``,
        ``val/non_finite/rewards``, then the training policies (:meth:`StepGuard.validation_rewards`).
        """
        v, metrics = self.config.val_rollout, {}
        step = self.trainer.global_step if self.trainer is not None else None
        samples = validation_samples(self.stages.rollout, self.rollout, batch, step, n=v.n,  # pool or here
                                     do_sample=v.do_sample, temperature=v.temperature, top_p=v.top_p)
        scored = self.stages.scorer.validate(samples, self._step, metrics)
        if AGENT_INFO in samples.keys():  # multi-turn: val/agent/turns, tool calls, correct tool use...
            metrics.update(agent_rewards_and_metrics(samples, prefix="val/agent")[1])
        if v.n == 1:
            metrics.pop("val/reward/zero_std_group_frac", None)
        if v.ks:  # pass@k, maj@k, ... over the n samples of each prompt, overall and per data_source
            prompts = batch_prompt_samples(samples, scored.scores, scored.info, v.correct_threshold)
            metrics.update(validation_metrics(prompts, v.ks, prefix="val"))
        metrics.update(response_length_metrics(samples, self.config.rollout.max_new_tokens,
                                               prefix="val/response_length"))
        self.val_generations.record(samples, scored.scores, batch_idx, self.trainer)  # log_generations
        return metrics

    # ---------------------------------------------------------------------------------- the run's DP
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

    # ----------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The rollout's call counter and the count of steps skipped in a row for non-finite values.

        The counter seeds the sampling, so a resumed run samples as the original. With the asynchronous
        rollout also ``async_rollout_queues``: every rank's queued groups (:meth:`AsyncRollout.state_dict`
        waits for them), gathered over the world — a collective, as the checkpoint's ``make_state`` is.
        """
        state = {"rollout_generate_calls": self.rollout.num_generate_calls if self.rollout else 0,
                 "non_finite_skipped_in_a_row": self.guard.non_finite.skipped_in_a_row}
        if self.async_rollout is not None:  # every rank's queued samples (a collective: rollout_queue_state)
            state["async_rollout_queues"] = gather_queue_states(self.async_rollout.state_dict())
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the counter and this rank's queued groups; the rollout is re-synced before its next use."""
        if self.rollout is not None:
            self.rollout._calls = int(state_dict.get("rollout_generate_calls", 0))
        self.guard.non_finite.skipped_in_a_row = int(state_dict.get("non_finite_skipped_in_a_row", 0))
        self._saved_queue = own_queue_state(state_dict.get("async_rollout_queues"))
        if self._stages is not None:
            self._stages.rollout.weights.stale = True
            self._restore_queue(self.async_rollout)

    def _restore_queue(self, rollout: AsyncRollout | None) -> None:
        """Queue the checkpoint's generated groups (a resume) in ``rollout``, once it exists."""
        if self._saved_queue is not None and rollout is not None:
            rollout.load_state_dict(self._saved_queue)
            self._saved_queue = None

"""Typed configs of the RL algorithms (PPO, GRPO, Dr.GRPO, DAPO options).

Names follow verl's (``actor_rollout_ref.actor.ppo_mini_batch_size``, ``algorithm.adv_estimator``,
``critic.cliprange_value``, ``reward_model.overlong_buffer``), grouped the way a recipe YAML reads::

    algorithm:
      adv_estimator: grpo
      norm_adv_by_std_in_grpo: true
      actor: {engine: {...}, optim: {lr: 1e-3}, loss: {clip_ratio: 0.2}, ppo_mini_batch_size: 32}
      rollout: {n: 8, max_new_tokens: 4}
      reward: {name: math, overlong_buffer: {enable: false}}

Every config validates itself on construction (``ValueError`` naming the field, the value and the fix),
so a YAML file or a ``key=value`` override that makes no sense fails before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_trainer.algorithms.non_finite import NonFiniteConfig
from verl_trainer.core_algos import validate_kl_penalty
from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.losses import PPOLossConfig, ValueLossConfig
from verl_trainer.rollout.config import RolloutConfig

__all__ = [
    "ActorConfig",
    "CriticConfig",
    "GRPOConfig",
    "OverlongBufferConfig",
    "PPOConfig",
    "RLConfig",
    "RefConfig",
    "RewardConfig",
    "ValidationRolloutConfig",
]

GROUP_ESTIMATORS = ("grpo", "rloo")
"""Advantage estimators that normalise within a prompt's group (computed on the rank holding it)."""


@dataclass
class ActorConfig:
    """The trained policy.

    Attributes:
        engine: Engine settings (micro-batching, offload, ...); ``model_path`` and ``temperature`` are
            filled in from the algorithm config and the rollout.
        optim: Optimizer and LR schedule.
        loss: Policy loss (clip ratios incl. DAPO's clip-higher ``clip_ratio_high``, ``loss_agg_mode``,
            KL loss to the reference, entropy bonus).
        ppo_mini_batch_size: Prompts per optimizer step over all DP ranks (each brings ``rollout.n``
            samples); ``None``: the whole step batch is one mini-batch.
        ppo_epochs: Passes over the step batch.
        calculate_entropy: Compute the policy entropy during the update (logged as ``actor/entropy``;
            needed when ``loss.entropy_coeff != 0``).
        reuse_log_probs_on_policy: When the step makes exactly one actor update (``ppo_epochs=1`` and one
            mini-batch), skip the separate forward that recomputes the old log-probs and use the
            update's own log-probs, detached: the weights are the same, so the ratio is exactly 1 and
            the loss and gradient are those of the recomputed version (to round-off; ``actor/ppo_kl``
            and ``actor/pg_clipfrac`` are 0). Saves one forward over the step batch. ``false``: always
            recompute (verl's behaviour).
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    loss: PPOLossConfig = field(default_factory=PPOLossConfig)
    ppo_mini_batch_size: int | None = None
    ppo_epochs: int = 1
    calculate_entropy: bool = False
    reuse_log_probs_on_policy: bool = True

    def __post_init__(self) -> None:
        if self.ppo_mini_batch_size is not None and self.ppo_mini_batch_size < 1:
            raise ValueError(
                f"actor.ppo_mini_batch_size={self.ppo_mini_batch_size} must be >= 1 (prompts per optimizer "
                "step) or null (the whole batch)"
            )
        if self.ppo_epochs < 1:
            raise ValueError(f"actor.ppo_epochs={self.ppo_epochs} must be >= 1")
        if self.loss.entropy_coeff != 0 and not self.calculate_entropy:
            raise ValueError(
                f"actor.loss.entropy_coeff={self.loss.entropy_coeff} needs the entropy: set "
                "actor.calculate_entropy=true (or entropy_coeff=0)"
            )


@dataclass
class CriticConfig:
    """The value model of PPO (its head is new; the backbone starts from the actor's checkpoint).

    Attributes:
        engine: Engine settings; ``model_path`` is the actor's unless set here.
        optim: Optimizer (critics usually take a larger learning rate than the actor).
        loss: Clipped value loss (``cliprange_value``) and its aggregation.
        warmup_steps: Trainer steps at the start that update only the critic (verl's
            ``trainer.critic_warmup``).
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"critic.warmup_steps={self.warmup_steps} must be >= 0")


@dataclass
class RefConfig:
    """The frozen reference policy, used only with a KL term (``actor.loss.use_kl_loss``, PPO's KL in reward).

    Attributes:
        engine: Engine settings of the inference-only reference engine; ``model_path`` is the actor's
            initial checkpoint unless set here.
        in_actor: The reference is the actor's engine with its LoRA adapters disabled (the base model; no
            second engine, no second copy of the weights) — verl's "ref in actor". ``null`` (default): on
            when the actor trains LoRA adapters (``actor.engine.lora_rank > 0`` or ``lora_adapter_path``).
            ``true`` needs LoRA on the actor.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    in_actor: bool | None = None


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: a linear penalty for responses near the length limit.

    With ``L = rollout.max_new_tokens`` and buffer ``len``, a response of ``l`` tokens gets
    ``min(0, (L - len - l) / len) * penalty_factor`` added to its reward: 0 up to ``L - len`` tokens,
    falling linearly to ``-penalty_factor`` at ``L``.

    Attributes:
        enable: Apply the penalty.
        len: Buffer length in tokens (``0 < len <= max_new_tokens``).
        penalty_factor: Penalty at the full length.
    """

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.enable and self.len < 1:
            raise ValueError(f"reward.overlong_buffer.len={self.len} must be >= 1 when enable=true")
        if self.penalty_factor < 0:
            raise ValueError(f"reward.overlong_buffer.penalty_factor={self.penalty_factor} must be >= 0")


@dataclass
class RewardConfig:
    """How responses are scored.

    Attributes:
        name: A reward in :mod:`verl_trainer.rewards` (``math``, ``math_exact``, ``format``) or
            ``"module:function"`` / ``"path.py:function"`` with verl's or TRL's signature
            (:mod:`verl_trainer.rewards.signature`), or (in a config built in Python) the function
            itself; or a list of them, whose scores are summed with ``weights`` (TRL's ``reward_funcs``).
        weights: One weight per function in ``name`` (TRL's ``reward_weights``); ``None``: 1.0 each.
        overlong_buffer: DAPO's overlong reward shaping.
    """

    name: Any = "math"
    weights: list[float] | None = None
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)

    def __post_init__(self) -> None:
        single = isinstance(self.name, str) or callable(self.name)
        names = [self.name] if single else list(self.name or [])
        if not names or not all(callable(n) or (isinstance(n, str) and n) for n in names):
            raise ValueError(f"algorithm.reward.name={self.name!r}: give a reward name, 'module:function', "
                             "'file.py:function', a function (Python configs), or a list of them")
        if self.weights is not None and len(self.weights) != len(names):
            raise ValueError(f"algorithm.reward.weights={list(self.weights)} has {len(self.weights)} entries "
                             f"for {len(names)} reward functions {names}; give one weight per function")


@dataclass
class ValidationRolloutConfig:
    """Sampling of validation rollouts (verl's ``val_kwargs``): greedy, one response, by default.

    Attributes:
        n: Responses per validation prompt.
        do_sample: Sample (``True``) or decode greedily.
        temperature: Sampling temperature when ``do_sample``.
        top_p: Nucleus mass when ``do_sample``.
    """

    n: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class RLConfig:
    """What every RL algorithm here shares: the policy, its rollout, the reward, the reference.

    Attributes:
        model_path: Checkpoint of the initial policy (HF directory). The recipes fill it in from the
            model they prepare when it is left empty.
        actor: The trained policy.
        rollout: Sampling (``n`` responses per prompt, ``max_new_tokens``, ...).
        ref: Reference policy for the KL loss.
        reward: Reward function and shaping.
        val_rollout: Sampling of validation rollouts.
        non_finite: NaN/inf rewards, advantages and losses: ``policy`` (``error`` | ``drop_samples``) and
            ``max_consecutive_skipped_steps`` (:mod:`verl_trainer.algorithms.non_finite`).
    """

    model_path: str = ""
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    val_rollout: ValidationRolloutConfig = field(default_factory=ValidationRolloutConfig)
    non_finite: NonFiniteConfig = field(default_factory=NonFiniteConfig)

    @property
    def ref_in_actor(self) -> bool:
        """Whether the reference is the actor with its adapters disabled (see ``RefConfig.in_actor``)."""
        return self.actor.engine.lora_enabled if self.ref.in_actor is None else self.ref.in_actor

    def __post_init__(self) -> None:
        if self.ref.in_actor and not self.actor.engine.lora_enabled:
            raise ValueError(
                "ref.in_actor=true makes the reference the actor with its LoRA adapters disabled, but the "
                "actor has no adapters; set actor.engine.lora_rank > 0, or ref.in_actor=false (a separate "
                "reference engine)"
            )
        buffer = self.reward.overlong_buffer
        if buffer.enable and buffer.len > self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer.len={buffer.len} exceeds rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens}; the buffer is the last part of the allowed length"
            )


@dataclass
class GRPOConfig(RLConfig):
    """GRPO (and Dr.GRPO, DAPO): group-relative advantages over ``rollout.n`` samples per prompt.

    Dr.GRPO is this config with ``norm_adv_by_std_in_grpo=False`` and
    ``actor.loss.loss_agg_mode=seq-mean-token-sum-norm`` with a constant ``loss_scale_factor``
    (see :class:`~verl_trainer.algorithms.DrGRPO`). DAPO is clip-higher (``actor.loss.clip_ratio_high``),
    ``token-mean``, ``dynamic_sampling`` and ``reward.overlong_buffer``.

    Attributes:
        rollout: As in :class:`RLConfig`, with ``n=8`` samples per prompt by default.
        adv_estimator: ``grpo`` or ``rloo`` (group estimators from the advantage registry).
        norm_adv_by_std_in_grpo: Divide by the group's reward std (GRPO) or not (Dr.GRPO).
        dynamic_sampling: DAPO: drop the groups whose rewards are all equal (no learning signal) before
            the update.
    """

    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(n=8))
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    dynamic_sampling: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.adv_estimator not in GROUP_ESTIMATORS:
            raise ValueError(
                f"algorithm.adv_estimator={self.adv_estimator!r}: GRPO uses a group estimator, one of "
                f"{GROUP_ESTIMATORS}; for 'gae' use PPO (recipes/ppo.py)"
            )
        if self.rollout.n < 2:
            raise ValueError(
                f"rollout.n={self.rollout.n}: group-relative advantages need >= 2 samples per prompt; set "
                "algorithm.rollout.n=8 (for example)"
            )


@dataclass
class PPOConfig(RLConfig):
    """PPO: actor + critic (+ reference), GAE advantages whitened over the global batch.

    Attributes:
        critic: The value model.
        adv_estimator: ``gae``.
        gamma: Discount factor.
        lam: GAE lambda.
        use_kl_in_reward: Subtract ``kl_coef * KL(pi_old || pi_ref)`` per token from the rewards before
            GAE (classic RLHF PPO; builds the reference engine). A fixed coefficient.
        kl_coef: The KL coefficient in the reward.
        kl_penalty: KL estimator (``kl``, ``abs``, ``mse``, ``low_var_kl``, ...).
    """

    critic: CriticConfig = field(default_factory=CriticConfig)
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_in_reward: bool = False
    kl_coef: float = 0.001
    kl_penalty: str = "kl"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.adv_estimator != "gae":
            raise ValueError(
                f"algorithm.adv_estimator={self.adv_estimator!r}: PPO here uses the critic with 'gae'; for "
                "group estimators (grpo, rloo) use GRPO (recipes/grpo.py)"
            )
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"algorithm.gamma={self.gamma} and lam={self.lam} must be in [0, 1]")
        try:
            validate_kl_penalty(self.kl_penalty)
        except ValueError as err:
            raise ValueError(f"algorithm.kl_penalty: {err}") from None

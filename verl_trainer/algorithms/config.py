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
from verl_trainer.algorithms.rollout_lora import resolve_lora_sync
from verl_trainer.core_algos import RolloutCorrectionConfig, validate_kl_penalty
from verl_trainer.core_algos.advantages import ADV_ESTIMATOR_REGISTRY, estimator_inputs
from verl_trainer.core_algos.losses import PPOLossConfig, ValueLossConfig
from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.evaluate.samples import default_ks
from verl_trainer.models.moe_config import check_router_replay_rollout
from verl_trainer.rewards.failures import DEFAULT_TIMEOUT_S, check_on_error, check_timeout
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.rollout_pool.config import check_pool_algorithm

__all__ = [
    "ActorConfig",
    "CriticConfig",
    "GRPOConfig",
    "OverlongBufferConfig",
    "PPOConfig",
    "RLConfig",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "ValidationRolloutConfig",
    "check_mini_batch_divides",
]


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
            samples); ``None`` or ``>= data.train_batch_size``: the whole step batch is one mini-batch.
            A smaller value must divide ``data.train_batch_size`` (checked before any model loads:
            :func:`check_mini_batch_divides`).
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


def check_mini_batch_divides(ppo_mini_batch_size: int | None, train_batch_size: int) -> None:
    """Refuse a PPO mini-batch size (prompts) smaller than the step's batch (prompts) that does not divide it.

    Both are global prompt counts (``actor.ppo_mini_batch_size``, ``data.train_batch_size``). A step of
    ``B`` prompts is split into ``ceil(B / m)`` mini-batches; unless ``m`` divides ``B`` they are not all of
    ``m`` prompts (``B=4, m=3``: two mini-batches of 2 prompts), so no optimizer step sees the number of
    samples asked for. ``m >= B`` is one mini-batch, the whole step batch, as ``null`` (the recipe
    configs set ``m = B`` for one on-policy update per step, and a smaller ``data.train_batch_size``
    keeps that meaning).

    Raises:
        ValueError: Naming both values and the sizes that would fit.
    """
    if ppo_mini_batch_size is None or ppo_mini_batch_size >= train_batch_size \
            or train_batch_size % ppo_mini_batch_size == 0:
        return
    divisors = [d for d in range(1, train_batch_size + 1) if train_batch_size % d == 0]
    shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
    raise ValueError(
        f"algorithm.actor.ppo_mini_batch_size={ppo_mini_batch_size} does not divide "
        f"data.train_batch_size={train_batch_size} (both in prompts per step): the step's "
        f"{train_batch_size} prompts cannot be split into mini-batches of {ppo_mini_batch_size}. Set "
        f"algorithm.actor.ppo_mini_batch_size to a divisor of {train_batch_size} ({shown}; null: the whole "
        f"batch), or data.train_batch_size to a multiple of {ppo_mini_batch_size}"
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
class RewardModelConfig:
    """``algorithm.reward.model``: a frozen neural reward model (verl's ``reward_model.*``).

    An ``AutoModelForSequenceClassification`` checkpoint with one label, run as an inference-only engine
    (sharded like the actor, micro-batched by ``engine``, offloadable between uses with
    ``engine.param_offload``); its score is the head at a sequence's last token. Its own tokenizer (and chat
    template, for chat prompts) turns prompt + response text into its input.

    Attributes:
        enable: Score with the model (verl's ``reward_model.enable``).
        path: Its directory or cached hub id (verl's ``reward_model.model.path``).
        weight: Its score's weight in the sum with ``algorithm.reward.name``'s functions.
        engine: Micro-batching (``micro_batch_size_per_gpu``, ``use_dynamic_bsz``, ``max_token_len_per_gpu``)
            and ``param_offload``; ``model_path`` is :attr:`path`.
        max_length: Longest input in the reward model's tokens; a longer one keeps its last ``max_length``
            (counted as ``reward/model/truncated``).
    """

    enable: bool = False
    path: str = ""
    weight: float = 1.0
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(micro_batch_size_per_gpu=8))
    max_length: int = 2048

    def __post_init__(self) -> None:
        if self.enable and not self.path:
            raise ValueError("algorithm.reward.model.enable=true needs algorithm.reward.model.path (verl: "
                             "reward_model.model.path): the AutoModelForSequenceClassification directory")
        if self.max_length < 2:
            raise ValueError(f"algorithm.reward.model.max_length={self.max_length} must be >= 2")


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
        on_error: A reward call that raises, times out or returns a non-number: ``error`` (stop, naming the
            function, the data source and the sample), ``drop`` (train without the sample; its group with
            GRPO/RLOO) or ``zero`` (it scores 0). Counted per step as ``reward/errors``, ``reward/timeouts``
            (:mod:`verl_trainer.rewards.failures`). Non-finite scores are ``algorithm.non_finite``'s.
        timeout_s: The longest one reward-function call may take, in seconds (a verl-style call scores one
            sample, a TRL-style call the batch); a call past it is a time-out handled by ``on_error``. Calls
            run on a daemon thread (:class:`~verl_trainer.rewards.RewardFunctions`), so a function's own
            ``signal``-based limits must be off; ``null``: no limit, called on the calling thread.
        model: A neural reward model whose weighted score is added (``name: none`` for the model alone). A
            reward model's directory among ``name`` (TRL's style, with its weight in ``weights``) sets it too.
    """

    name: Any = "math"
    weights: list[float] | None = None
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    on_error: str = "error"
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    model: RewardModelConfig = field(default_factory=RewardModelConfig)

    def __post_init__(self) -> None:
        single = isinstance(self.name, str) or callable(self.name)
        names = [self.name] if single else list(self.name or [])
        if not names or not all(callable(n) or (isinstance(n, str) and n) for n in names):
            raise ValueError(f"algorithm.reward.name={self.name!r}: give a reward name, 'module:function', "
                             "'file.py:function', a function (Python configs), or a list of them")
        check_on_error(self.on_error)
        check_timeout(self.timeout_s)
        if self.weights is not None and len(self.weights) != len(names):
            raise ValueError(f"algorithm.reward.weights={list(self.weights)} has {len(self.weights)} entries "
                             f"for {len(names)} reward functions {names}; give one weight per function")


def check_generation_count(key: str, value: object) -> None:
    """Raise a ValueError naming ``key`` unless ``value`` (samples shown each time) is an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key}={value!r} must be an int >= 0 (samples shown each time; 0: none)")


@dataclass
class ValidationRolloutConfig:
    """Sampling of validation rollouts (verl's ``val_kwargs``): greedy, one response, by default.

    Attributes:
        n: Responses per validation prompt (``> 1`` needs ``do_sample``).
        do_sample: Sample (``True``) or decode greedily.
        temperature: Sampling temperature when ``do_sample``.
        top_p: Nucleus mass when ``do_sample``.
        k: The budgets of ``val/pass@k``, ``val/maj@k``, ``val/mean@k``, ``val/best@k``, ``val/worst@k``
            (each ``<= n``); ``None``: ``1, 2, 4, ..., n`` when ``n > 1``, none when ``n == 1``.
        correct_threshold: A sample whose reward reports no ``acc`` counts as correct (pass@k, maj@k)
            when its score is at least this.
        log_generations: Samples of each validation to show (verl's ``trainer.log_val_generations``, TRL's
            ``log_completions``): printed, written to ``<default_root_dir>/generations/val_step_<step>.jsonl``
            and logged as the ``val/generations`` table where wandb logs
            (:mod:`verl_trainer.algorithms.generations`); ``0``: none.
    """

    n: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    k: list[int] | None = None
    correct_threshold: float = 1.0
    log_generations: int = 0

    def __post_init__(self) -> None:
        check_generation_count("algorithm.val_rollout.log_generations", self.log_generations)
        if self.n < 1:
            raise ValueError(f"algorithm.val_rollout.n={self.n} must be >= 1 (responses per prompt)")
        if self.n > 1 and not self.do_sample:
            raise ValueError(f"algorithm.val_rollout.n={self.n} with do_sample=false draws {self.n} "
                             "identical greedy responses per prompt; set "
                             "algorithm.val_rollout.do_sample=true or n=1")
        for k in self.k or []:
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.n:
                raise ValueError(f"algorithm.val_rollout.k={list(self.k or [])} holds {k!r}; every k must be "
                                 f"an int in [1, n={self.n}]; raise algorithm.val_rollout.n or drop it")

    @property
    def ks(self) -> list[int]:
        """The budgets reported (see :attr:`k`)."""
        if self.k:
            return sorted(set(self.k))
        return default_ks(self.n) if self.n > 1 else []


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
        rollout_correction: Truncated / masked importance sampling of the rollout -> trainer ratio in the
            policy loss (``level``: null = off, ``token``, ``sequence``; ``mode``: ``truncate`` = TIS,
            ``mask`` = MIS; ``threshold``, ``threshold_lower``), verl's ``algorithm.rollout_correction``
            (:mod:`verl_trainer.core_algos.rollout_correction`). The mismatch metrics (``rollout_corr/*``)
            are logged whether it is on or off.
        log_train_generations: Samples of each training step to show (TRL's ``log_completions`` /
            ``num_completions_to_print``): printed, written to
            ``<default_root_dir>/generations/train_step_<step>.jsonl`` and logged as the
            ``train/generations`` table where wandb logs (:mod:`verl_trainer.algorithms.generations`);
            ``0``: none. Validation's are ``val_rollout.log_generations``.
    """

    model_path: str = ""
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    val_rollout: ValidationRolloutConfig = field(default_factory=ValidationRolloutConfig)
    non_finite: NonFiniteConfig = field(default_factory=NonFiniteConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    log_train_generations: int = 0

    @property
    def ref_in_actor(self) -> bool:
        """Whether the reference is the actor with its adapters disabled (see ``RefConfig.in_actor``)."""
        return self.actor.engine.lora_enabled if self.ref.in_actor is None else self.ref.in_actor

    def __post_init__(self) -> None:
        check_generation_count("algorithm.log_train_generations", self.log_train_generations)
        if self.ref.in_actor and not self.actor.engine.lora_enabled:
            raise ValueError(
                "ref.in_actor=true makes the reference the actor with its LoRA adapters disabled, but the "
                "actor has no adapters; set actor.engine.lora_rank > 0, or ref.in_actor=false (a separate "
                "reference engine)"
            )
        if self.rollout.max_staleness and self.rollout_correction.level is None:
            raise ValueError(
                f"rollout.max_staleness={self.rollout.max_staleness} trains on responses sampled by the "
                "weights of up to that many steps before, so the loss needs the importance correction "
                "between those and the trainer's: set algorithm.rollout_correction.level=token (truncated "
                "IS, threshold 2) or sequence, or max_staleness=0"
            )
        resolve_lora_sync(self.rollout, self.actor.engine)
        check_router_replay_rollout(self.actor.engine.moe, self.rollout.name, self.rollout.multi_turn.enable,
                                    bool(self.rollout.max_staleness))
        estimator = getattr(self, "adv_estimator", None)  # read only with a pool: the estimator's own check
        check_pool_algorithm(self.rollout.placement, self.actor.engine.moe.router_replay,  # names a bad one
                             estimator is not None and self.rollout.placement == "separate"
                             and "reward_baselines" in estimator_inputs(estimator))
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
        adv_estimator: Any registered estimator that reads no critic values (``grpo``, ``rloo``,
            ``reinforce_plus_plus``, ``remax``, or one of your own; ``estimator_inputs``). One that reads
            ``reward_baselines`` (ReMax) gets each prompt's greedy response decoded and scored every step
            (:mod:`verl_trainer.algorithms.greedy_baseline`); it may run with ``rollout.n=1``.
        gamma: Discount factor of estimators that discount (REINFORCE++; verl's ``algorithm.gamma``).
        norm_adv_by_std_in_grpo: Divide by the group's reward std (GRPO) or not (Dr.GRPO).
        pass_k: The ``k`` of ``adv_estimator: pass_at_k`` (1 <= k <= ``rollout.n``); only with it.
        dynamic_sampling: DAPO: drop the groups whose rewards are all equal (no learning signal) before
            the update.
    """

    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(n=8))
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    dynamic_sampling: bool = False
    pass_k: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        needs = self._estimator_inputs()
        self._check_pass_k()
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"algorithm.gamma={self.gamma} must be in [0, 1]")
        if "index" in needs and self.rollout.n < 2:
            raise ValueError(
                f"rollout.n={self.rollout.n}: group-relative advantages need >= 2 samples per prompt; set "
                "algorithm.rollout.n=8 (for example)"
            )

    def _check_pass_k(self) -> None:
        """``pass_k`` is set exactly when ``adv_estimator`` is ``pass_at_k``, and fits the group size."""
        if self.adv_estimator != "pass_at_k":
            if self.pass_k is not None:
                raise ValueError(f"algorithm.pass_k={self.pass_k} is read only by adv_estimator=pass_at_k "
                                 f"(adv_estimator is {self.adv_estimator!r}); set "
                                 "algorithm.adv_estimator=pass_at_k or remove algorithm.pass_k")
            return
        k = self.pass_k
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.rollout.n:
            raise ValueError(f"adv_estimator=pass_at_k needs algorithm.pass_k, an int in [1, rollout.n="
                             f"{self.rollout.n}]; got {k!r}. Set e.g. "
                             f"algorithm.pass_k={min(4, self.rollout.n)}")

    def _estimator_inputs(self) -> frozenset[str]:
        """What ``adv_estimator`` reads; refuses one GRPO cannot feed (a critic's values)."""
        try:
            needs = estimator_inputs(self.adv_estimator)
        except (KeyError, ValueError) as exc:  # unknown name; a module, file or attribute that is not there
            raise ValueError(f"algorithm.adv_estimator={self.adv_estimator!r}: {exc}") from None
        feeds = {"index", "reward_baselines"}  # the group ids; the greedy responses' rewards (ReMax)
        usable = [name for name in ADV_ESTIMATOR_REGISTRY if estimator_inputs(name) <= feeds]
        if "values" in needs:
            raise ValueError(
                f"algorithm.adv_estimator={self.adv_estimator!r} reads a critic's values and GRPO has no "
                f"critic; use PPO (recipes/ppo.py), or one of {usable}"
            )
        return needs


@dataclass
class PPOConfig(RLConfig):
    """PPO: actor + critic (+ reference), GAE advantages whitened over the global batch.

    Attributes:
        critic: The value model.
        adv_estimator: Any registered estimator that reads the critic's ``values`` (``gae``, or one of your
            own; it may read the group ids too, then ``rollout.n >= 2``) and no baseline rollout.
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
        self._check_estimator()
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"algorithm.gamma={self.gamma} and lam={self.lam} must be in [0, 1]")
        try:
            validate_kl_penalty(self.kl_penalty)
        except ValueError as err:
            raise ValueError(f"algorithm.kl_penalty: {err}") from None

    def _check_estimator(self) -> None:
        """Refuses an ``adv_estimator`` PPO cannot feed or that would leave the critic unused."""
        try:
            needs = estimator_inputs(self.adv_estimator)
        except (KeyError, ValueError) as exc:  # unknown name; a module, file or attribute that is not there
            raise ValueError(f"algorithm.adv_estimator={self.adv_estimator!r}: {exc}") from None
        usable = [name for name in ADV_ESTIMATOR_REGISTRY if "values" in estimator_inputs(name)
                  and estimator_inputs(name) <= {"values", "index"}]
        if "values" not in needs:
            raise ValueError(
                f"algorithm.adv_estimator={self.adv_estimator!r} reads no critic values, so PPO's critic "
                f"would train for nothing; use GRPO (recipes/grpo.py) for it, or one of {usable} here"
            )
        if not needs <= {"values", "index"}:
            raise ValueError(
                f"algorithm.adv_estimator={self.adv_estimator!r} reads "
                f"{sorted(needs - {'values', 'index'})}, which the PPO recipe does not produce; use one of "
                f"{usable}"
            )
        if "index" in needs and self.rollout.n < 2:
            raise ValueError(
                f"algorithm.adv_estimator={self.adv_estimator!r} reads group ids and rollout.n="
                f"{self.rollout.n}: set algorithm.rollout.n >= 2"
            )

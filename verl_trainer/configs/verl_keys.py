"""verl's override keys, accepted by the recipes as aliases of ours (same semantics).

A verl user can keep their command line::

    python recipes/grpo.py actor_rollout_ref.actor.ppo_mini_batch_size=16 data.max_response_length=256 \
        trainer.n_gpus_per_node=8 trainer.save_freq=50 trainer.project_name=my_project

:func:`translate_overrides` rewrites each ``verl.key=value`` override into ours (``VERL_KEYS``: verl key →
our key, and a value conversion where verl spells a value differently, e.g. ``trainer.test_freq=-1`` →
``trainer.val_check_interval=null``). The recipe prints each translation once. A verl key with no
equivalent here fails with a message that says what to use instead (``UNSUPPORTED``); a key that maps to a
section the recipe does not have (``critic.*`` outside PPO) fails naming the recipe. The table of every
alias is ``docs/verl_keys.md`` (a test keeps the two in step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from verl_trainer.configs.schema_keys import MISSING, default_at

__all__ = ["UNSUPPORTED", "VERL_KEYS", "Alias", "translate_overrides"]


@dataclass(frozen=True)
class Alias:
    """One verl key and ours.

    Attributes:
        ours: Our dotted key.
        convert: verl's value (as written on the command line) → ours; ``None``: the same.
        note: What differs, for the docs table.
    """

    ours: str
    convert: Callable[[str], str] | None = None
    note: str = ""


def _minus_one_is_null(value: str) -> str:
    return "null" if value.strip() in ("-1", "null", "None") else value


def _resume_mode(value: str) -> str:
    modes = {"auto": "last", "disable": "null"}
    if value not in modes:
        raise ValueError(f"trainer.resume_mode={value!r}: verl's 'auto' is trainer.ckpt_path=last and "
                         "'disable' is trainer.ckpt_path=null; for 'resume_path' give "
                         "trainer.resume_from_path=<step dir>")
    return modes[value]


def _loggers(value: str) -> str:
    if value.strip() == "console":
        return "false"
    if not value.strip().startswith("["):
        return value  # ours: true, false, csv, wandb
    names = [v.strip().strip("'\"") for v in value.strip().strip("[]").split(",") if v.strip()]
    kept = [n for n in names if n != "console"]  # the progress bar is the console output here
    return "[" + ",".join(kept) + "]"


def _device(value: str) -> str:
    return {"cuda": "gpu", "npu": "npu", "cpu": "cpu"}.get(value, value)


def _must_be_true(key: str, why: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value.strip().lower() not in ("true", "1"):
            raise ValueError(f"{key}={value}: {why}")
        return "true"
    return check


_ACTOR = "actor_rollout_ref.actor"
_ROLLOUT = "actor_rollout_ref.rollout"
_REF = "actor_rollout_ref.ref"
_MODEL = "actor_rollout_ref.model"

VERL_KEYS: dict[str, Alias] = {
    # trainer
    "trainer.n_gpus_per_node": Alias("trainer.devices"),
    "trainer.nnodes": Alias("trainer.num_nodes"),
    "trainer.device": Alias("trainer.accelerator", _device, "cuda → gpu"),
    "trainer.total_training_steps": Alias("trainer.max_steps"),
    "trainer.total_epochs": Alias("trainer.max_epochs"),
    "trainer.save_freq": Alias("trainer.checkpoint.every_n_train_steps", _minus_one_is_null,
                               "-1 → null (only at the end)"),
    "trainer.max_actor_ckpt_to_keep": Alias("trainer.checkpoint.keep_last_k", _minus_one_is_null,
                                            "-1/null → all"),
    "trainer.default_local_dir": Alias("trainer.checkpoint.dirpath"),
    "trainer.test_freq": Alias("trainer.val_check_interval", _minus_one_is_null,
                               "-1 → null (no validation in fit)"),
    "trainer.val_before_train": Alias("trainer.validate_before_fit"),
    "trainer.resume_mode": Alias("trainer.ckpt_path", _resume_mode, "auto → last, disable → null"),
    "trainer.resume_from_path": Alias("trainer.ckpt_path"),
    "trainer.logger": Alias("trainer.logger", _loggers, "'console' dropped (the progress bar)"),
    "trainer.project_name": Alias("trainer.project_name", None, "the wandb project"),
    "trainer.experiment_name": Alias("trainer.experiment_name", None, "the wandb run name"),
    "trainer.critic_warmup": Alias("algorithm.critic.warmup_steps", None, "PPO"),
    # data
    "data.max_response_length": Alias("algorithm.rollout.max_new_tokens"),
    # model
    f"{_MODEL}.path": Alias("model.path"),
    f"{_MODEL}.enable_gradient_checkpointing": Alias("algorithm.actor.engine.enable_gradient_checkpointing"),
    f"{_MODEL}.lora_rank": Alias("algorithm.actor.engine.lora_rank"),
    f"{_MODEL}.lora_alpha": Alias("algorithm.actor.engine.lora_alpha"),
    f"{_MODEL}.target_modules": Alias("algorithm.actor.engine.target_modules"),
    f"{_MODEL}.use_remove_padding": Alias(
        "", _must_be_true(f"{_MODEL}.use_remove_padding",
                          "padding-free (packed) micro-batches are always on here; remove the key"),
        "always on; only true is accepted"),
    # actor
    f"{_ACTOR}.strategy": Alias("trainer.strategy"),
    f"{_ACTOR}.ppo_mini_batch_size": Alias("algorithm.actor.ppo_mini_batch_size"),
    f"{_ACTOR}.ppo_micro_batch_size_per_gpu": Alias("algorithm.actor.engine.micro_batch_size_per_gpu"),
    f"{_ACTOR}.use_dynamic_bsz": Alias("algorithm.actor.engine.use_dynamic_bsz"),
    f"{_ACTOR}.ppo_max_token_len_per_gpu": Alias("algorithm.actor.engine.max_token_len_per_gpu"),
    f"{_ACTOR}.ppo_epochs": Alias("algorithm.actor.ppo_epochs"),
    f"{_ACTOR}.clip_ratio": Alias("algorithm.actor.loss.clip_ratio"),
    f"{_ACTOR}.clip_ratio_low": Alias("algorithm.actor.loss.clip_ratio_low"),
    f"{_ACTOR}.clip_ratio_high": Alias("algorithm.actor.loss.clip_ratio_high"),
    f"{_ACTOR}.clip_ratio_c": Alias("algorithm.actor.loss.clip_ratio_c"),
    f"{_ACTOR}.loss_agg_mode": Alias("algorithm.actor.loss.loss_agg_mode"),
    f"{_ACTOR}.entropy_coeff": Alias("algorithm.actor.loss.entropy_coeff"),
    f"{_ACTOR}.use_kl_loss": Alias("algorithm.actor.loss.use_kl_loss"),
    f"{_ACTOR}.kl_loss_coef": Alias("algorithm.actor.loss.kl_loss_coef"),
    f"{_ACTOR}.kl_loss_type": Alias("algorithm.actor.loss.kl_loss_type"),
    f"{_ACTOR}.policy_loss.loss_mode": Alias("algorithm.actor.loss.policy_loss"),
    f"{_ACTOR}.grad_clip": Alias("algorithm.actor.optim.clip_grad"),
    f"{_ACTOR}.optim.lr": Alias("algorithm.actor.optim.lr"),
    f"{_ACTOR}.optim.weight_decay": Alias("algorithm.actor.optim.weight_decay"),
    f"{_ACTOR}.optim.lr_warmup_steps": Alias("algorithm.actor.optim.warmup_steps"),
    f"{_ACTOR}.optim.min_lr_ratio": Alias("algorithm.actor.optim.min_lr_ratio"),
    f"{_ACTOR}.optim.total_training_steps": Alias("algorithm.actor.optim.total_training_steps"),
    f"{_ACTOR}.optim.warmup_style": Alias("algorithm.actor.optim.lr_scheduler"),
    f"{_ACTOR}.ulysses_sequence_parallel_size":
        Alias("algorithm.actor.engine.ulysses_sequence_parallel_size"),
    f"{_ACTOR}.fsdp_config.param_offload": Alias("algorithm.actor.engine.param_offload"),
    f"{_ACTOR}.fsdp_config.optimizer_offload": Alias("algorithm.actor.engine.optimizer_offload"),
    f"{_ACTOR}.fsdp_config.reshard_after_forward": Alias("algorithm.actor.engine.reshard_after_forward"),
    # rollout
    f"{_ROLLOUT}.name": Alias("algorithm.rollout.name"),
    f"{_ROLLOUT}.n": Alias("algorithm.rollout.n"),
    f"{_ROLLOUT}.temperature": Alias("algorithm.rollout.temperature"),
    f"{_ROLLOUT}.top_p": Alias("algorithm.rollout.top_p"),
    f"{_ROLLOUT}.top_k": Alias("algorithm.rollout.top_k"),
    f"{_ROLLOUT}.response_length": Alias("algorithm.rollout.max_new_tokens"),
    f"{_ROLLOUT}.gpu_memory_utilization": Alias("algorithm.rollout.gpu_memory_utilization"),
    f"{_ROLLOUT}.tensor_model_parallel_size": Alias("algorithm.rollout.tensor_parallel_size"),
    f"{_ROLLOUT}.enforce_eager": Alias("algorithm.rollout.enforce_eager"),
    f"{_ROLLOUT}.val_kwargs.n": Alias("algorithm.val_rollout.n"),
    f"{_ROLLOUT}.val_kwargs.do_sample": Alias("algorithm.val_rollout.do_sample"),
    f"{_ROLLOUT}.val_kwargs.temperature": Alias("algorithm.val_rollout.temperature"),
    f"{_ROLLOUT}.val_kwargs.top_p": Alias("algorithm.val_rollout.top_p"),
    # reference
    f"{_REF}.log_prob_micro_batch_size_per_gpu": Alias("algorithm.ref.engine.micro_batch_size_per_gpu"),
    f"{_REF}.fsdp_config.param_offload": Alias("algorithm.ref.engine.param_offload"),
    # algorithm (verl's names that differ; adv_estimator, gamma, lam, ... are the same keys)
    "algorithm.kl_ctrl.kl_coef": Alias("algorithm.kl_coef"),
    # critic (PPO)
    "critic.model.path": Alias("algorithm.critic.engine.model_path"),
    "critic.optim.lr": Alias("algorithm.critic.optim.lr"),
    "critic.ppo_micro_batch_size_per_gpu": Alias("algorithm.critic.engine.micro_batch_size_per_gpu"),
    "critic.use_dynamic_bsz": Alias("algorithm.critic.engine.use_dynamic_bsz"),
    "critic.ppo_max_token_len_per_gpu": Alias("algorithm.critic.engine.max_token_len_per_gpu"),
    "critic.cliprange_value": Alias("algorithm.critic.loss.cliprange_value"),
    "critic.grad_clip": Alias("algorithm.critic.optim.clip_grad"),
    # reward: custom_reward_function.path and .name combine into one key (see translate_overrides)
    "custom_reward_function.path": Alias("algorithm.reward.name", None, "with .name: 'path:name'"),
    "custom_reward_function.name": Alias("algorithm.reward.name", None, "default compute_score"),
}
"""verl key → our key (see :class:`Alias`)."""

UNSUPPORTED: dict[str, str] = {
    f"{_ROLLOUT}.log_prob_micro_batch_size_per_gpu":
        f"one micro-batch size serves training and log-probs here: set {_ACTOR}.ppo_micro_batch_size_per_gpu",
    "reward_model.enable": "model-based rewards are not built in; use a reward function "
                           "(algorithm.reward.name=path.py:fn)",
    "trainer.balance_batch": "sequence balancing is a callback here: trainer.sequence_balancing=true",
}
"""verl keys with no equivalent here, and what to use instead."""


def _has_key(schema: type, dotted: str) -> bool:
    return default_at(schema, dotted) is not MISSING


def translate_overrides(schema: type, overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """Rewrite verl override keys into this recipe's.

    Args:
        schema: The recipe's config dataclass (a target it lacks is an error).
        overrides: ``key=value`` strings; ours pass through unchanged.

    Returns:
        ``(overrides, notes)``: the rewritten overrides, in order, and one ``"verl_key=v -> our_key=v'"``
        line per translation.

    Raises:
        ValueError: A verl key with no equivalent (the message says what to use), a value verl allows but
            this project cannot map, or a target this recipe does not have.
    """
    out: list[str] = []
    notes: list[str] = []
    reward_path = reward_name = None
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.strip()
        same = key in VERL_KEYS and VERL_KEYS[key].ours == key  # one key, verl's values converted
        known = key in VERL_KEYS or key in UNSUPPORTED
        if not sep or (_has_key(schema, key) and not same) or not known:
            out.append(override)  # ours, or unknown: load_config names the valid keys
            continue
        if key in UNSUPPORTED:
            raise ValueError(f"verl's {key} has no equivalent here: {UNSUPPORTED[key]}")
        if key == "custom_reward_function.path":
            reward_path = value
            continue
        if key == "custom_reward_function.name":
            reward_name = value
            continue
        alias = VERL_KEYS[key]
        converted = alias.convert(value) if alias.convert else value
        if not alias.ours:  # accepted, nothing to set (checked by convert)
            notes.append(f"{key}={value} -> (nothing to set: {alias.note})")
            continue
        if not _has_key(schema, alias.ours):
            raise ValueError(f"verl's {key} maps to {alias.ours}, which {schema.__name__} does not have "
                             f"(it belongs to another recipe)")
        out.append(f"{alias.ours}={converted}")
        if (alias.ours, converted) != (key, value):
            notes.append(f"{key}={value} -> {alias.ours}={converted}")
    if reward_name is not None and reward_path is None:
        raise ValueError("custom_reward_function.name needs custom_reward_function.path (the file)")
    if reward_path is not None:
        target = f"{reward_path}:{reward_name or 'compute_score'}"
        out.append(f"algorithm.reward.name={target}")
        notes.append(f"custom_reward_function.path/name -> algorithm.reward.name={target}")
    return out, notes

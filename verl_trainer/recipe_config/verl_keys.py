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

from verl_trainer.recipe_config.schema_keys import MISSING, default_at

__all__ = ["NO_OPS", "UNSUPPORTED", "VERL_KEYS", "Alias", "NoOp", "translate_overrides"]


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


RESUME_PATH = "resume_path"
"""verl's ``trainer.resume_mode`` that takes the checkpoint from ``trainer.resume_from_path``."""


def _null_is_empty(value: str) -> str:
    return "{}" if value.strip() in ("null", "None", "~") else value


def _resume_mode(value: str) -> str:
    modes = {"auto": "last", "disable": "null"}
    if value not in modes:
        raise ValueError(f"trainer.resume_mode={value!r} is not one of verl's modes: 'auto' "
                         "(trainer.ckpt_path=last), 'disable' (trainer.ckpt_path=null), 'resume_path' (with "
                         "trainer.resume_from_path=<step dir>)")
    return modes[value]


def _loggers(value: str) -> str:
    if value.strip() == "console":
        return "false"
    if not value.strip().startswith("["):
        return value  # ours: true, false, csv, wandb
    if not value.strip().endswith("]"):
        raise ValueError(f"trainer.logger={value}: the list is not closed (YAML: no ']' after "
                         f"{value.strip()!r}); write e.g. trainer.logger=[csv,wandb]")
    names = [v.strip().strip("'\"") for v in value.strip().strip("[]").split(",") if v.strip()]
    kept = [n for n in names if n != "console"]  # the progress bar is the console output here
    return "[" + ",".join(kept) + "]"


def _is_threshold(value: str) -> str:
    if "_" in value:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold={value}: verl's "
                         "'lower_upper' (IcePop) is masked importance sampling here: "
                         "algorithm.rollout_correction.mode=mask threshold_lower=<lower> threshold=<upper>")
    return value


def _accept_any(value: str) -> str:
    return value


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
_CORR = "algorithm.rollout_correction"

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
    "trainer.log_val_generations": Alias("algorithm.val_rollout.log_generations", None,
                                         "console, generations/val_step_<step>.jsonl, wandb table"),
    "trainer.resume_mode": Alias("trainer.ckpt_path", _resume_mode,
                                 "auto → last, disable → null, resume_path → trainer.resume_from_path"),
    "trainer.resume_from_path": Alias("trainer.ckpt_path"),
    "trainer.logger": Alias("trainer.logger", _loggers, "'console' dropped (the progress bar)"),
    "trainer.project_name": Alias("trainer.project_name", None, "the wandb project / mlflow experiment"),
    "trainer.experiment_name": Alias("trainer.experiment_name", None, "the wandb / mlflow run name"),
    "trainer.critic_warmup": Alias("algorithm.critic.warmup_steps", None, "PPO"),
    "trainer.balance_batch": Alias("trainer.sequence_balancing", None,
                                   "the SequenceBalancing callback; off by default here (verl: on)"),
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
    f"{_ACTOR}.entropy_coeff": Alias("algorithm.actor.loss.entropy_coeff", None,
                                     "non-zero: also algorithm.actor.calculate_entropy=true"),
    f"{_ACTOR}.loss_scale_factor": Alias("algorithm.actor.loss.loss_scale_factor"),
    f"{_ACTOR}.use_kl_loss": Alias("algorithm.actor.loss.use_kl_loss"),
    f"{_ACTOR}.kl_loss_coef": Alias("algorithm.actor.loss.kl_loss_coef"),
    f"{_ACTOR}.kl_loss_type": Alias("algorithm.actor.loss.kl_loss_type"),
    f"{_ACTOR}.policy_loss.loss_mode": Alias("algorithm.actor.loss.policy_loss"),
    f"{_ACTOR}.policy_loss.clip_cov_ratio": Alias("algorithm.actor.loss.clip_cov_ratio"),
    f"{_ACTOR}.policy_loss.clip_cov_lb": Alias("algorithm.actor.loss.clip_cov_lb"),
    f"{_ACTOR}.policy_loss.clip_cov_ub": Alias("algorithm.actor.loss.clip_cov_ub"),
    f"{_ACTOR}.policy_loss.kl_cov_ratio": Alias("algorithm.actor.loss.kl_cov_ratio"),
    f"{_ACTOR}.policy_loss.ppo_kl_coef": Alias("algorithm.actor.loss.ppo_kl_coef"),
    f"{_ACTOR}.tau_pos": Alias("algorithm.actor.loss.tau_pos"),
    f"{_ACTOR}.tau_neg": Alias("algorithm.actor.loss.tau_neg"),
    f"{_ACTOR}.grad_clip": Alias("algorithm.actor.optim.clip_grad"),
    f"{_ACTOR}.optim.lr": Alias("algorithm.actor.optim.lr"),
    f"{_ACTOR}.optim.weight_decay": Alias("algorithm.actor.optim.weight_decay"),
    f"{_ACTOR}.optim.lr_warmup_steps": Alias("algorithm.actor.optim.warmup_steps"),
    f"{_ACTOR}.optim.min_lr_ratio": Alias("algorithm.actor.optim.min_lr_ratio"),
    f"{_ACTOR}.optim.total_training_steps": Alias("algorithm.actor.optim.total_training_steps"),
    f"{_ACTOR}.optim.warmup_style": Alias("algorithm.actor.optim.lr_scheduler"),
    f"{_ACTOR}.optim.optimizer": Alias("algorithm.actor.optim.optimizer", None,
                                       "AdamW (default), Adam, SGD, any torch.optim class, module:Class"),
    f"{_ACTOR}.optim.optimizer_impl": Alias("algorithm.actor.optim.optimizer_impl"),
    f"{_ACTOR}.optim.override_optimizer_config": Alias("algorithm.actor.optim.override_optimizer_config",
                                                       _null_is_empty, "null → {}"),
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
    f"{_ROLLOUT}.free_cache_engine": Alias("algorithm.rollout.free_cache_engine"),
    f"{_ROLLOUT}.max_model_len": Alias("algorithm.rollout.max_model_len"),
    f"{_ROLLOUT}.multi_turn.enable": Alias("algorithm.rollout.multi_turn.enable"),
    f"{_ROLLOUT}.multi_turn.max_assistant_turns": Alias("algorithm.rollout.multi_turn.max_turns"),
    f"{_ROLLOUT}.multi_turn.format": Alias("algorithm.rollout.multi_turn.tool_call_format"),
    f"{_ROLLOUT}.multi_turn.tool_config_path": Alias("algorithm.rollout.multi_turn.tool_config_path", None,
                                                     "verl's tool YAML (class_name, config, tool_schema)"),
    f"{_ROLLOUT}.multi_turn.max_tool_response_length": Alias(
        "algorithm.rollout.multi_turn.max_tool_response_length"),
    f"{_ROLLOUT}.val_kwargs.n": Alias("algorithm.val_rollout.n"),
    f"{_ROLLOUT}.val_kwargs.do_sample": Alias("algorithm.val_rollout.do_sample"),
    f"{_ROLLOUT}.val_kwargs.temperature": Alias("algorithm.val_rollout.temperature"),
    f"{_ROLLOUT}.val_kwargs.top_p": Alias("algorithm.val_rollout.top_p"),
    # reference
    f"{_REF}.log_prob_micro_batch_size_per_gpu": Alias("algorithm.ref.engine.micro_batch_size_per_gpu"),
    f"{_REF}.fsdp_config.param_offload": Alias("algorithm.ref.engine.param_offload"),
    f"{_ROLLOUT}.calculate_log_probs": Alias("", _accept_any,
                                             "always on: every rollout returns rollout_log_probs"),
    # algorithm (verl's names that differ; adv_estimator, gamma, lam, ... are the same keys)
    "algorithm.kl_ctrl.kl_coef": Alias("algorithm.kl_coef"),
    "algorithm.filter_groups.enable": Alias("algorithm.dynamic_sampling", None,
                                            "DAPO: groups with equal rewards are dropped"),
    # DAPO's reward shaping (verl: reward_model.overlong_buffer.*)
    "reward_model.overlong_buffer.enable": Alias("algorithm.reward.overlong_buffer.enable"),
    "reward_model.overlong_buffer.len": Alias("algorithm.reward.overlong_buffer.len"),
    "reward_model.overlong_buffer.penalty_factor": Alias("algorithm.reward.overlong_buffer.penalty_factor"),
    # rollout correction: verl's current keys, verl 0.6's, and TRL's (GRPOConfig) vllm_importance_sampling_*
    f"{_CORR}.rollout_is": Alias(f"{_CORR}.level", None, "token / sequence / null; TIS (mode=truncate)"),
    f"{_CORR}.rollout_is_threshold": Alias(f"{_CORR}.threshold", _is_threshold,
                                           "a number; 'lower_upper' → mode=mask (see the error)"),
    "algorithm.rollout_is_level": Alias(f"{_CORR}.level", None, "verl 0.6 ('geometric' not built)"),
    "algorithm.rollout_is_mode": Alias(f"{_CORR}.mode", None, "verl 0.6: truncate / mask"),
    "algorithm.rollout_is_threshold": Alias(f"{_CORR}.threshold", None, "verl 0.6"),
    "algorithm.rollout_is_threshold_lower": Alias(f"{_CORR}.threshold_lower", None,
                                                  "verl 0.6; null = no lower bound here (verl: 1/upper)"),
    "vllm_importance_sampling_mode": Alias(f"{_CORR}.level", None,
                                           "TRL: token_truncate / token_mask / sequence_truncate / "
                                           "sequence_mask (with vllm_importance_sampling_correction)"),
    "vllm_importance_sampling_cap": Alias(f"{_CORR}.threshold", None, "TRL"),
    "vllm_importance_sampling_correction": Alias(
        f"{_CORR}.level", None, "TRL: false → null; true needs vllm_importance_sampling_mode"),
    # critic (PPO)
    "critic.model.path": Alias("algorithm.critic.engine.model_path"),
    "critic.optim.lr": Alias("algorithm.critic.optim.lr"),
    "critic.optim.optimizer": Alias("algorithm.critic.optim.optimizer"),
    "critic.optim.optimizer_impl": Alias("algorithm.critic.optim.optimizer_impl"),
    "critic.optim.override_optimizer_config": Alias("algorithm.critic.optim.override_optimizer_config",
                                                    _null_is_empty, "null → {}"),
    "critic.ppo_micro_batch_size_per_gpu": Alias("algorithm.critic.engine.micro_batch_size_per_gpu"),
    "critic.use_dynamic_bsz": Alias("algorithm.critic.engine.use_dynamic_bsz"),
    "critic.ppo_max_token_len_per_gpu": Alias("algorithm.critic.engine.max_token_len_per_gpu"),
    "critic.cliprange_value": Alias("algorithm.critic.loss.cliprange_value"),
    "critic.grad_clip": Alias("algorithm.critic.optim.clip_grad"),
    # reward: custom_reward_function.path and .name combine into one key (see translate_overrides)
    "custom_reward_function.path": Alias("algorithm.reward.name", None, "with .name: 'path:name'"),
    "custom_reward_function.name": Alias("algorithm.reward.name", None, "default compute_score"),
    "reward_model.enable": Alias("algorithm.reward.model.enable", None,
                                 "its score is added to algorithm.reward.name's (none: the model alone)"),
    "reward_model.model.path": Alias("algorithm.reward.model.path"),
    "reward_model.micro_batch_size_per_gpu": Alias("algorithm.reward.model.engine.micro_batch_size_per_gpu"),
    "reward_model.use_dynamic_bsz": Alias("algorithm.reward.model.engine.use_dynamic_bsz"),
    "reward_model.forward_max_token_len_per_gpu": Alias(
        "algorithm.reward.model.engine.max_token_len_per_gpu"),
    "reward_model.model.fsdp_config.param_offload": Alias("algorithm.reward.model.engine.param_offload"),
}
"""verl key → our key (see :class:`Alias`)."""

UNSUPPORTED: dict[str, str] = {
    f"{_CORR}.rollout_rs": "verl's rejection sampling (token_k1, seq_mean_k3, ...) is not built; masked "
                           "importance sampling is algorithm.rollout_correction.mode=mask (weight 0 outside "
                           "the bounds)",
    "algorithm.rollout_is": "verl 0.6's switch: set algorithm.rollout_correction.level=token (or sequence); "
                            "null = off (the mismatch metrics are logged either way)",
}
"""verl keys with no equivalent here, and what to use instead."""


@dataclass(frozen=True)
class NoOp:
    """A verl key that has nothing to set here, at the values that mean "off" in verl's scripts.

    Attributes:
        values: The accepted values (lower-cased); ``None``: any value.
        why: Why there is nothing to set (printed as a note; with another value, the error's reason).
    """

    values: frozenset[str] | None
    why: str


NO_OPS: dict[str, NoOp] = {
    "trainer.critic_warmup": NoOp(frozenset({"0"}), "this recipe has no critic"),
    "algorithm.use_kl_in_reward": NoOp(frozenset({"false"}), "this recipe has no KL penalty in the reward "
                                       "(the KL is a loss term: actor.use_kl_loss)"),
    "reward_model.enable": NoOp(frozenset({"false"}), "a recipe without rewards (SFT); in the RL recipes it "
                                "is algorithm.reward.model.enable"),
    "reward_model.reward_manager": NoOp(frozenset({"naive", "dapo"}), "one reward manager is built in "
                                        "(DAPO's overlong buffer: reward_model.overlong_buffer.*)"),
    f"{_ROLLOUT}.log_prob_micro_batch_size_per_gpu": NoOp(
        None, f"one micro-batch size serves training and log-probs here "
              f"({_ACTOR}.ppo_micro_batch_size_per_gpu)"),
}
"""verl keys its scripts write that have nothing to set here; accepted with a note when the recipe has no
key of that name (``trainer.critic_warmup`` is a real alias in PPO)."""


VERL_ONLY_SECTIONS = ("actor_rollout_ref", "critic", "reward_model", "custom_reward_function", "ray_init",
                      "global_profiler")
"""Top-level sections only verl has: an unmapped key there gets a verl-specific message."""


def listed(problems: Sequence[str]) -> str:
    """One message for every problem (each on its own line when there are several)."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems)


_FOLLOWERS: dict[str, tuple[tuple[str, str], ...]] = {
    "algorithm.actor.loss.entropy_coeff": (
        ("algorithm.actor.calculate_entropy=true", "the entropy is computed"),),
    "algorithm.actor.engine.ulysses_sequence_parallel_size": (
        ("algorithm.ref.engine.ulysses_sequence_parallel_size=", "the reference inherits it, as in verl"),),
}
"""Our keys that verl sets along with one of its keys: ``"key=value"`` (a non-zero value turns it on) or
``"key="`` (the same value)."""


def _nonzero(value: str) -> bool:
    try:
        return float(value) != 0.0
    except ValueError:
        return True  # load_config names the bad value


def _has_key(schema: type, dotted: str) -> bool:
    return default_at(schema, dotted) is not MISSING


def translate_overrides(schema: type, overrides: Sequence[str],
                        problems: list[str] | None = None) -> tuple[list[str], list[str]]:
    """Rewrite verl override keys into this recipe's.

    Args:
        schema: The recipe's config dataclass (a target it lacks is an error).
        overrides: ``key=value`` strings; ours pass through unchanged.
        problems: When given, every problem is appended here (and its override left out) instead of raised.

    Returns:
        ``(overrides, notes)``: the rewritten overrides, in order, and one ``"verl_key=v -> our_key=v'"``
        line per translation.

    Raises:
        ValueError: Every verl key with no equivalent (the message says what to use), value verl allows but
            this project cannot map, or target this recipe does not have — all in one message. A no-op key
            (:data:`NO_OPS`) at its "off" value is accepted with a note.
    """
    out: list[str] = []
    notes: list[str] = []
    collect, problems = problems is not None, problems if problems is not None else []
    reward_path = reward_name = None
    resume_path_mode = resume_from = False
    trl_correction = trl_mode = None
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.strip()
        if sep and key in NO_OPS and not _has_key(schema, key) and not (
                key in VERL_KEYS and _has_key(schema, VERL_KEYS[key].ours)):
            no_op = NO_OPS[key]
            if no_op.values is None or value.strip().lower() in no_op.values:
                notes.append(f"{key}={value} -> (nothing to set: {no_op.why})")
                continue
            if key not in VERL_KEYS and key not in UNSUPPORTED:  # those say more below
                problems.append(f"verl's {key}={value} cannot be honoured: {no_op.why}; remove the key")
                continue
        same = key in VERL_KEYS and VERL_KEYS[key].ours == key  # one key, verl's values converted
        known = key in VERL_KEYS or key in UNSUPPORTED
        if sep and not known and key.split(".")[0] in VERL_ONLY_SECTIONS:
            problems.append(f"verl's {key} is not mapped here (the verl keys accepted are listed in "
                            "docs/verl_keys.md; --print-config shows this recipe's own keys)")
            continue
        if not sep or (_has_key(schema, key) and not same) or not known:
            out.append(override)  # ours, or unknown: load_config names the valid keys
            continue
        if key in UNSUPPORTED:
            problems.append(f"verl's {key} has no equivalent here: {UNSUPPORTED[key]}")
            continue
        if key == "trainer.resume_mode" and value.strip() == RESUME_PATH:
            resume_path_mode = True  # the checkpoint comes from trainer.resume_from_path
            notes.append(f"{key}={value} -> trainer.ckpt_path=<trainer.resume_from_path>")
            continue
        resume_from = resume_from or key == "trainer.resume_from_path"
        if key == "custom_reward_function.path":
            reward_path = value
            continue
        if key == "custom_reward_function.name":
            reward_name = value
            continue
        if key == "vllm_importance_sampling_correction":
            trl_correction = value.strip().lower() in ("true", "1")
            continue
        if key == "vllm_importance_sampling_mode":
            trl_mode = value
            continue
        alias = VERL_KEYS[key]
        try:
            converted = alias.convert(value) if alias.convert else value
        except ValueError as err:
            problems.append(str(err))
            continue
        if not alias.ours:  # accepted, nothing to set (checked by convert)
            notes.append(f"{key}={value} -> (nothing to set: {alias.note})")
            continue
        if not _has_key(schema, alias.ours):
            problems.append(f"verl's {key} maps to {alias.ours}, which {schema.__name__} does not have "
                            f"(it belongs to another recipe)")
            continue
        out.append(f"{alias.ours}={converted}")
        if (alias.ours, converted) != (key, value):
            notes.append(f"{key}={value} -> {alias.ours}={converted}")
        for extra, why in _FOLLOWERS.get(alias.ours, ()):  # what verl sets with the same one key
            if _has_key(schema, extra.partition("=")[0]) and (extra.endswith("=") or _nonzero(converted)):
                follow = extra + converted if extra.endswith("=") else extra
                out.append(follow)
                notes.append(f"{key}={value} -> {follow} ({why})")
    if resume_path_mode and not resume_from:
        problems.append("trainer.resume_mode=resume_path needs trainer.resume_from_path=<step dir> (the "
                        "checkpoint to resume), or use trainer.resume_mode=auto for the newest one")
    if reward_name is not None and reward_path is None:
        problems.append("custom_reward_function.name needs custom_reward_function.path (the file)")
    if problems and not collect:
        raise ValueError(listed(problems))
    if reward_path is not None:
        target = f"{reward_path}:{reward_name or 'compute_score'}"
        out.append(f"algorithm.reward.name={target}")
        notes.append(f"custom_reward_function.path/name -> algorithm.reward.name={target}")
    if trl_correction is not None or trl_mode is not None:
        out.append(_trl_correction(trl_correction, trl_mode))
        notes.append(f"vllm_importance_sampling_correction/mode -> {out[-1]}")
    return out, notes


def _trl_correction(enabled: bool | None, mode: str | None) -> str:
    """TRL's switch and mode as one override of ``algorithm.rollout_correction.level``."""
    if enabled is False:
        return f"{_CORR}.level=null"
    if mode is None:
        raise ValueError("vllm_importance_sampling_correction=true: give vllm_importance_sampling_mode too "
                         "(token_truncate, token_mask, sequence_truncate or sequence_mask); its default "
                         "differs between TRL versions")
    return f"{_CORR}.level={mode}"

"""On-policy distillation: the student samples, a frozen teacher scores every sampled token.

:class:`DistillGRPO` is GRPO (any estimator it takes) with one more engine and one scorer part
(``docs/architecture.md``, "A feature of the RL step"):

* the ``teacher`` engine: inference only, any registered backend, sharded on the run's topology like the
  reference, its own ``model_path`` (``algorithm.distill.teacher``); its tokenizer is checked equal to the
  student's (:func:`check_same_tokenizer`) when the engines are configured, before any model loads;
* :class:`TeacherSignal`, run after the verifiable reward: the teacher's log-probs of the sampled tokens
  (the full sequences, kept at the response positions) become batch fields — ``teacher_log_probs``
  ``[B, T]`` and with ``top_k`` ``teacher_topk_ids`` / ``teacher_topk_log_probs`` ``[B, T, k]`` — so the
  loss is a pure function of the batch (like ``old_log_probs`` / ``ref_log_prob``). In ``reward`` mode each
  response token's reward becomes ``reward_weight * verifiable - coef * estimator(s, t)`` (the estimator
  reads the sampler's ``rollout_log_probs``), fed to the advantage estimator; in ``loss`` mode the verifiable
  reward is weighted and the actor loss gets the term (:class:`~verl_trainer.core_algos.distill.DistillLoss`).

Logged (token means over the response tokens, the student being the sampler): ``distill/reverse_kl``
(``k1``, the per-token estimate of ``KL(student || teacher)``), ``distill/reverse_kl_k3``,
``distill/teacher_log_prob``, ``distill/student_log_prob``; per response ``distill/seq_reverse_kl`` (the
summed ``k1``); in reward mode ``distill/kl_reward`` (each response's summed dense reward); the loss terms'
``actor/distill_*`` (:mod:`verl_trainer.core_algos.distill`).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from verl_trainer.algorithms.distill_config import DistillConfig, DistillGRPOConfig
from verl_trainer.algorithms.grpo import GRPO
from verl_trainer.algorithms.stages import StepMetrics
from verl_trainer.algorithms.stages.signal import ScorePart, Scorer
from verl_trainer.core_algos.distill import DistillLoss, reverse_kl
from verl_trainer.data import schema
from verl_trainer.engine.base import BaseEngine
from verl_trainer.engine.config import EngineConfig
from verl_trainer.engine.heads import LanguageModel
from verl_trainer.metrics import Metric
from verl_trainer.models.loading import load_tokenizer
from verl_trainer.models.source import resolve_model_path
from verl_trainer.module import EngineSpec

__all__ = ["TEACHER_ENGINE", "DistillGRPO", "TeacherSignal", "check_same_tokenizer"]

TEACHER_ENGINE = "teacher"
"""The teacher's engine name in ``module.engines``."""


def _tokenizer_differences(student: Any, teacher: Any) -> list[str]:
    """What differs between two tokenizers' vocabularies and special tokens (empty: the same)."""
    problems = []
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        only_s = sorted(set(s_vocab) - set(t_vocab))[:3]
        only_t = sorted(set(t_vocab) - set(s_vocab))[:3]
        moved = sorted(k for k in set(s_vocab) & set(t_vocab) if s_vocab[k] != t_vocab[k])[:3]
        problems.append(f"vocabularies differ ({len(s_vocab)} vs {len(t_vocab)} tokens; only the student's: "
                        f"{only_s}, only the teacher's: {only_t}, other ids: {moved})")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(student, attr, None) != getattr(teacher, attr, None):
            problems.append(f"{attr} {getattr(student, attr, None)} vs {getattr(teacher, attr, None)}")
    if sorted(student.all_special_tokens) != sorted(teacher.all_special_tokens):
        problems.append(f"special tokens {sorted(student.all_special_tokens)} vs "
                        f"{sorted(teacher.all_special_tokens)}")
    return problems


def check_same_tokenizer(student_path: str, teacher_path: str, top_k: int = 0) -> None:
    """Refuse a teacher whose token ids do not mean the student's (it scores the student's token ids).

    Compares the two tokenizers' vocabularies (token -> id), their bos / eos / pad / unk ids and special
    tokens; with ``top_k > 0`` also the models' ``vocab_size`` (the teacher's top-k ids index the student's
    logits). Loads only the tokenizers and configs.

    Raises:
        ValueError: Naming both paths, what differs and the fix.
    """
    problems = _tokenizer_differences(load_tokenizer(student_path), load_tokenizer(teacher_path))
    if top_k and not problems:
        from transformers import AutoConfig  # lazy: transformers is heavy, loaded only when a run uses it

        s_size = AutoConfig.from_pretrained(resolve_model_path(student_path)).vocab_size
        t_size = AutoConfig.from_pretrained(resolve_model_path(teacher_path)).vocab_size
        if s_size != t_size:
            problems.append(f"model vocab_size {s_size} vs {t_size} (top_k reads the student's logits at the "
                            "teacher's ids)")
    if problems:
        raise ValueError(
            f"algorithm.distill.teacher.model_path={teacher_path!r} does not share the student's tokenizer "
            f"(algorithm.model_path={student_path!r}): {'; '.join(problems)}. The teacher scores the "
            "student's token ids, so both must use one tokenizer: choose a teacher of the student's model "
            "family" + (", or algorithm.distill.top_k=0" if top_k else ""))


def _response_sums(values: torch.Tensor, batch: TensorDict, prefix: str) -> Metric:
    """The mean over real responses of each response's sum of ``values`` ``[B, T]`` (0 off the response)."""
    real = schema.real_mask(batch)
    sums = values.sum(-1)[real]
    return Metric.mean(sums.mean() if sums.numel() else torch.zeros(()), weight=sums.numel())


class TeacherSignal(ScorePart):
    """Scorer part: the teacher's log-probs of the sampled tokens into the batch (module docstring).

    Args:
        teacher: The teacher engine (inference only; a language model).
        config: ``algorithm.distill``.

    Raises:
        TypeError: The engine is not a language model.
    """

    def __init__(self, teacher: BaseEngine, config: DistillConfig) -> None:
        if not isinstance(teacher.model_type, LanguageModel):
            raise TypeError(f"the distillation teacher must be a language model, got "
                            f"{type(teacher.model_type).__name__}")
        self.teacher = teacher
        self.config = config
        teacher.model_type.top_k = config.top_k  # the teacher's engine also returns its top-k (0: not)

    def after_score(self, scorer: Scorer, batch: TensorDict, scores: torch.Tensor, step: int,
                    metrics: StepMetrics) -> None:
        """Write the teacher's fields; in reward mode, the dense reward into ``token_level_rewards``."""
        cfg = self.config
        with self.teacher.eval_mode():
            out = self.teacher.infer_batch(schema.tensor_only(batch))["model_output"]
        mask = batch[schema.RESPONSE_MASK].to(torch.float32)
        teacher = out["log_probs"].to(torch.float32) * mask
        batch[schema.TEACHER_LOG_PROBS] = teacher
        if cfg.top_k:
            batch[schema.TEACHER_TOPK_IDS] = out["topk_ids"]
            batch[schema.TEACHER_TOPK_LOG_PROBS] = out["topk_log_probs"].to(torch.float32)
        if schema.ROLLOUT_LOG_PROBS not in batch.keys():
            raise KeyError(f"distillation needs the sampler's {schema.ROLLOUT_LOG_PROBS!r} ([B, T]); every "
                           "built-in rollout writes them (a custom rollout must too)")
        student = batch[schema.ROLLOUT_LOG_PROBS].to(torch.float32) * mask
        k1 = reverse_kl(student, teacher, "k1") * mask
        metrics["distill/reverse_kl"] = Metric.token_mean(k1, mask)
        metrics["distill/reverse_kl_k3"] = Metric.token_mean(reverse_kl(student, teacher, "k3") * mask, mask)
        metrics["distill/teacher_log_prob"] = Metric.token_mean(teacher, mask)
        metrics["distill/student_log_prob"] = Metric.token_mean(student, mask)
        metrics["distill/seq_reverse_kl"] = _response_sums(k1, batch, "distill/seq_reverse_kl")
        rewards = batch[schema.TOKEN_LEVEL_REWARDS]
        if cfg.reward_weight != 1.0:
            rewards = cfg.reward_weight * rewards
        if cfg.mode == "reward":
            dense = -cfg.coef * reverse_kl(student, teacher, cfg.kl_estimator) * mask
            rewards = rewards + dense.to(rewards.dtype)
            metrics["distill/kl_reward"] = _response_sums(dense, batch, "distill/kl_reward")
        batch[schema.TOKEN_LEVEL_REWARDS] = rewards


class DistillGRPO(GRPO):
    """GRPO toward a teacher (module docstring).

    Args:
        config: See :class:`~verl_trainer.algorithms.distill_config.DistillGRPOConfig`.

    Raises:
        TypeError: ``config`` is not a :class:`DistillGRPOConfig`.
        ValueError: ``algorithm.distill.teacher.model_path`` is empty.
    """

    config: DistillGRPOConfig

    def __init__(self, config: DistillGRPOConfig) -> None:
        if not isinstance(config, DistillGRPOConfig):
            raise TypeError(f"{type(self).__name__} needs a DistillGRPOConfig, got {type(config).__name__}")
        if not config.distill.teacher.model_path:
            raise ValueError("algorithm.distill.teacher.model_path is empty; set it to the teacher's HF "
                             "directory (its tokenizer must be the student's)")
        super().__init__(config)
        terms = config.distill.loss_terms(config.actor.loss)
        if terms is not None:
            self.actor_loss = DistillLoss(terms, self.actor_loss)

    def _teacher_engine(self) -> EngineConfig:
        """The teacher's engine config: its model, log-probs at the rollout's sampling temperature."""
        teacher = self.config.distill.teacher
        return teacher.engine.replace(model_path=teacher.model_path,
                                      temperature=self.config.rollout.temperature)

    def extra_engines(self) -> dict[str, EngineSpec]:
        """The inference-only ``teacher`` engine (no optimizer)."""
        return {**super().extra_engines(),
                TEACHER_ENGINE: EngineSpec("language_model", self._teacher_engine(), None)}

    def configure_engines(self) -> dict[str, EngineSpec]:
        """GRPO's engines and the teacher's, after the tokenizer check (:func:`check_same_tokenizer`).

        A student checkpoint that does not exist yet (a recipe's warm start, written after its checks) is
        checked when ``fit`` configures the engines, before any model loads.
        """
        specs = super().configure_engines()  # refuses an empty model_path first
        try:
            resolve_model_path(self.config.model_path)
        except (OSError, ValueError):
            return specs
        check_same_tokenizer(self.config.model_path, self.config.distill.teacher.model_path,
                             self.config.distill.top_k)
        return specs

    def score_parts(self) -> list[ScorePart]:
        """GRPO's parts, then :class:`TeacherSignal`."""
        return [*super().score_parts(), TeacherSignal(self.engines[TEACHER_ENGINE], self.config.distill)]

"""Evaluation people report: unbiased pass@k, maj@k, mean@k, best@k / worst@k, overall and per data source.

* :mod:`~verl_trainer.evaluate.estimators`: the per-prompt estimators (exact expectations over k-subsets);
* :mod:`~verl_trainer.evaluate.samples`: a prompt's scored samples, and their mean over prompts
  (overall and per ``data_source``);
* :mod:`~verl_trainer.evaluate.run`: ``python -m verl_trainer.evaluate MODEL_OR_CHECKPOINT
  data.val_files=... eval.n=N "eval.k=[1,..]" eval.output=FILE.json`` (table, JSON, wandb).

Validation during training reports the same numbers (``val/pass@k``, ``val/<data_source>/pass@k``, ...)
when ``algorithm.val_rollout.n > 1`` (``verl_trainer.algorithms.rl``).
"""

from verl_trainer.evaluate.estimators import best_at_k, maj_at_k, mean_at_k, pass_at_k, worst_at_k
from verl_trainer.evaluate.samples import (
    ESTIMATORS,
    PromptSamples,
    default_ks,
    metric_names,
    normalize_answer,
    prompt_samples,
    summarize,
)

__all__ = [
    "ESTIMATORS",
    "PromptSamples",
    "best_at_k",
    "default_ks",
    "maj_at_k",
    "mean_at_k",
    "metric_names",
    "normalize_answer",
    "pass_at_k",
    "prompt_samples",
    "summarize",
    "worst_at_k",
]

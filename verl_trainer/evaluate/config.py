"""The config schema of ``python -m verl_trainer.evaluate`` (OmegaConf structured config, ``key=value``).

Sections::

    model:   the HF model directory, cached hub id or checkpoint to evaluate (the first argument)
    data:    DataConfig — data.val_files (the prompts), data.max_prompt_length, data.val_batch_size ...
    reward:  RewardConfig — reward.name (default: default_compute_score), reward.weights
    eval:    EvalConfig — eval.n, eval.k, eval.output, eval.rollout.* (sampling), eval.logger ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_trainer.algorithms.config import RewardConfig
from verl_trainer.algorithms.data import DataConfig
from verl_trainer.evaluate.samples import default_ks
from verl_trainer.rollout.config import RolloutConfig
from verl_trainer.training.loggers import validate_logger_spec

__all__ = ["EvalConfig", "EvaluateConfig"]


@dataclass
class EvalConfig:
    """How the model is sampled and what is reported.

    Attributes:
        n: Samples per prompt.
        k: The budgets of the "@k" numbers (each ``<= n``); ``None``: ``1, 2, 4, ..., n``.
        output: The JSON file to write (``metrics``, ``per_source``, ``prompts``); ``None``: none.
        rollout: Sampling and backend (``name``: ``hf`` | ``vllm`` | ``auto``; ``temperature``, ``top_p``,
            ``top_k``, ``max_new_tokens``, ``do_sample``, ``seed``, ``device``, ``dtype``,
            ``generation_batch_size``). Its ``n`` is :attr:`n`'s (leave it at 1).
        correct_threshold: A sample whose reward reports no ``acc`` is correct when its score is at least
            this.
        logger: ``"wandb"`` (offline without an API key), ``"csv"``, a list, or ``None``: where the
            numbers are logged (``eval/pass@1``, ``eval/<data_source>/pass@1``, ...).
        root_dir: Where the loggers write.
        project_name: The wandb project (default ``verl-trainer``).
        experiment_name: The wandb run name.
    """

    n: int = 1
    k: list[int] | None = None
    output: str | None = None
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(name="auto"))
    correct_threshold: float = 1.0
    logger: list[str] | None = field(default_factory=lambda: ["wandb"])
    root_dir: str = "outputs/eval"
    project_name: str | None = None
    experiment_name: str | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"eval.n={self.n} must be >= 1 (samples per prompt)")
        for k in self.k or []:
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.n:
                raise ValueError(f"eval.k={list(self.k or [])} holds {k!r}; every k must be an int in "
                                 f"[1, eval.n={self.n}]; raise eval.n or drop it")
        if self.k is not None and not self.k:
            raise ValueError("eval.k=[] is empty; give the budgets, e.g. eval.k=[1,4], or null for 1,2,4..n")
        if self.rollout.n not in (1, self.n):
            raise ValueError(f"eval.rollout.n={self.rollout.n} differs from eval.n={self.n}; the samples per "
                             "prompt are eval.n (leave eval.rollout.n at 1)")
        if self.n > 1 and not self.rollout.do_sample:
            raise ValueError(f"eval.n={self.n} with eval.rollout.do_sample=false draws {self.n} identical "
                             "greedy responses per prompt; set eval.rollout.do_sample=true or eval.n=1")
        validate_logger_spec(self.logger)

    @property
    def ks(self) -> list[int]:
        """The budgets: :attr:`k`, or ``1, 2, 4, ..., n``."""
        return sorted(set(self.k)) if self.k else default_ks(self.n)


@dataclass
class EvaluateConfig:
    """``python -m verl_trainer.evaluate MODEL_OR_CHECKPOINT key=value ...``.

    Attributes:
        model: An HF model directory, a hub id in the local HF cache, or a checkpoint (a ``step_*``
            directory, a checkpoints directory — its newest step — or ``step_*/engines/actor``), converted
            to HF on the fly.
        data: ``val_files`` are the prompts (verl's columns); ``val_batch_size`` prompts per generate
            call (``None``: all); ``max_prompt_length``, ``truncation``, ``prompt_key``, ``chat_template``
            as in training. ``train_files`` is not used.
        reward: The reward functions (default :func:`verl_trainer.rewards.default_compute_score`).
        eval: Sampling and reporting.
    """

    model: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=lambda: RewardConfig(name="default_compute_score"))
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("give the model to evaluate: python -m verl_trainer.evaluate "
                             "MODEL_OR_CHECKPOINT data.val_files=... (an HF directory, a cached hub id or a "
                             "checkpoint)")
        if not self.data.val_files:
            raise ValueError("data.val_files is empty; point it at the prompts to evaluate on (.parquet or "
                             ".jsonl with verl's columns)")
        if self.reward.model.enable:
            raise ValueError("reward.model.enable=true: the evaluate command scores with reward functions "
                             "only; a reward model runs as an engine in training: validate with the recipe "
                             "(algorithm.val_rollout.n=N) instead, or set reward.model.enable=false")
        if self.reward.on_error == "drop":
            raise ValueError("reward.on_error=drop: evaluation keeps all eval.n samples of every prompt "
                             "(pass@k needs them); use error (stop at a failed call) or zero (score it 0)")
        if self.reward.overlong_buffer.enable:
            raise ValueError("reward.overlong_buffer shapes training rewards; evaluation reports the reward "
                             "itself: set reward.overlong_buffer.enable=false")

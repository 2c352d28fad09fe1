"""The config schemas of the recipes (``recipes/*.py``), which ``configs/*.yaml`` map onto.

Top-level sections, the same in every recipe::

    trainer:     TrainerConfig    the Trainer's arguments (TrainerArgs: its defaults) + recipe switches
    model:       ModelConfig      the initial checkpoint (a local HF directory or a cached hub id)
    task:        TaskConfig       the synthetic arithmetic task, written when its files are missing
    data:        DataConfig       files and global batch sizes
    warm_start:  WarmStartConfig  RL recipes: a short SFT before RL (optional)
    algorithm:   the module's own config (SFTConfig, GRPOConfig, PPOConfig)

Load one with :func:`verl_trainer.recipe_config.load_config` (YAML + ``key=value`` overrides; unknown keys are
errors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_trainer.algorithms.config import GRPOConfig, PPOConfig
from verl_trainer.algorithms.data import DataConfig
from verl_trainer.algorithms.preference import PreferenceConfig
from verl_trainer.algorithms.sft import SFTConfig
from verl_trainer.callbacks import ModelCheckpoint, ProgressBar
from verl_trainer.callbacks.sequence_balancing import SequenceBalancing
from verl_trainer.data.tasks import ArithmeticTaskConfig
from verl_trainer.engine.checkpoint_dirs import STATE_FILE
from verl_trainer.engine.config import DTYPES, EngineConfig, OptimConfig, to_dtype
from verl_trainer.recipe_config.callbacks import build_callbacks, check_callback_specs
from verl_trainer.training.arguments import TrainerArgs
from verl_trainer.training.loggers import WANDB_PROJECT, MLFlowLogger, make_wandb_logger

if TYPE_CHECKING:
    import torch

    from verl_trainer.callbacks import Callback
    from verl_trainer.trainer import Trainer

NAMED_LOGGERS = frozenset({"wandb", "mlflow"})
"""Loggers that ``trainer.project_name`` / ``experiment_name`` name (verl: wandb and mlflow)."""

__all__ = [
    "CheckpointConfig",
    "DEMO_MODEL_PATH",
    "DPORecipeConfig",
    "GRPORecipeConfig",
    "ModelConfig",
    "PPORecipeConfig",
    "SFTRecipeConfig",
    "TaskConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "WarmStartConfig",
]


@dataclass
class CheckpointConfig:
    """``trainer.checkpoint``: the recipe's ``ModelCheckpoint`` (Lightning's argument names).

    Used when ``trainer.enable_checkpointing`` is true. Checkpoints go to ``dirpath`` (default
    ``<trainer.default_root_dir>/checkpoints``) as ``step_000050/``...; ``trainer.ckpt_path=last`` resumes
    from the newest.

    Attributes:
        every_n_train_steps: Save after every N-th step (``null``: only at the end of training).
        keep_last_k: Keep this run's newest K checkpoints (``null``: all).
        save_on_train_end: Also save after the last step.
        dirpath: Checkpoint directory (``null``: ``<default_root_dir>/checkpoints``).
    """

    every_n_train_steps: int | None = None
    keep_last_k: int | None = 1
    save_on_train_end: bool = True
    dirpath: str | None = None

    def __post_init__(self) -> None:
        for name in ("every_n_train_steps", "keep_last_k"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"trainer.checkpoint.{name}={value!r} must be an int >= 1 or null")


@dataclass
class TrainerConfig(TrainerArgs):
    """The ``trainer:`` section: the Trainer's own arguments plus what the recipe adds.

    The Trainer's arguments and their defaults are :class:`~verl_trainer.training.arguments.TrainerArgs`
    (Lightning's names), written once.

    Attributes:
        sequence_balancing: Add the ``SequenceBalancing`` callback (re-partitions each update batch over
            the DP ranks by workload).
        validate_before_fit: Validate once before training (the "before" number; skipped on a resume).
        export_hf: Export the trained policy as an HF directory to ``<default_root_dir>/hf`` at the end
            (``engine.save_hf``: config, safetensors, generation config, tokenizer).
        export_dtype: The dtype of that export's weights: ``auto`` (``bfloat16`` for a ``bf16-*``
            precision, whose fp32 master weights would export at twice the size; else as stored),
            ``float32``, ``bfloat16`` or ``float16`` (``fp32`` / ``bf16`` / ``fp16`` too).
        checkpoint: Periodic checkpoints (with ``enable_checkpointing``).
        ckpt_path: Resume: ``last`` (the newest checkpoint in the checkpoint directory; a fresh start with a
            warning when there is none) or a ``step_*`` checkpoint directory; ``null``: a fresh run.
        project_name: The wandb project / MLflow experiment (verl's ``trainer.project_name``; default
            ``verl-trainer``); accepted and noted as unused when ``logger`` has neither.
        experiment_name: The wandb / MLflow run name (verl's ``trainer.experiment_name``); the same.
        callbacks: More callbacks, by name: a built-in's class name, ``"package.module:Name"`` or
            ``"path/to/file.py:Name"``, alone or as ``{name: ..., init_args: {...}}``
            (:mod:`verl_trainer.recipe_config.callbacks`); checked when the config is built, added after the
            recipe's own.
    """

    sequence_balancing: bool = False
    validate_before_fit: bool = True
    export_hf: bool = True
    export_dtype: str = "auto"
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ckpt_path: str | None = None
    project_name: str | None = None
    experiment_name: str | None = None
    callbacks: list[Any] = field(default_factory=list)

    def build(self, callbacks: Sequence[Callback] = (), **overrides: Any) -> Trainer:
        """The :class:`~verl_trainer.Trainer` these settings describe (``overrides`` win).

        A recipe's ``ProgressBar`` is left out when ``enable_progress_bar`` is false; with checkpointing on,
        a ``ModelCheckpoint`` built from :attr:`checkpoint` is added.
        """
        from verl_trainer import Trainer  # lazy: 23 more modules only when used

        show_bar = overrides.get("enable_progress_bar", self.enable_progress_bar)
        callbacks = [cb for cb in callbacks if show_bar or not isinstance(cb, ProgressBar)]
        callbacks += build_callbacks(self.callbacks)
        if self.sequence_balancing:
            callbacks.append(SequenceBalancing())
        kwargs: dict[str, Any] = {**self.trainer_kwargs(), "callbacks": callbacks, **overrides}
        kwargs["logger"] = self._named_wandb(kwargs["logger"])
        if kwargs["enable_checkpointing"] and not any(isinstance(cb, ModelCheckpoint) for cb in callbacks):
            ck = self.checkpoint
            callbacks.append(ModelCheckpoint(
                dirpath=ck.dirpath, every_n_train_steps=ck.every_n_train_steps, keep_last_k=ck.keep_last_k,
                save_on_train_end=ck.save_on_train_end,
            ))
        return Trainer(**kwargs)

    def _named_wandb(self, logger: Any) -> Any:
        """``"wandb"`` / ``"mlflow"`` in ``logger`` as loggers named by ``project_name``.

        As in verl: the wandb project and run name, the MLflow experiment and run name.
        """
        if self.project_name is None and self.experiment_name is None:
            return logger

        items = logger if isinstance(logger, (list, tuple)) else [logger]
        if not NAMED_LOGGERS & {i for i in items if isinstance(i, str)}:
            return logger  # nothing to name (see unused_settings; the warm start logs nowhere)
        root, project = str(self.default_root_dir or "."), self.project_name or WANDB_PROJECT
        named = {"wandb": lambda: make_wandb_logger(root, project=project, name=self.experiment_name),
                 "mlflow": lambda: MLFlowLogger(project, run_name=self.experiment_name, save_dir=root)}
        return [named[item]() if isinstance(item, str) and item in named else item for item in items]

    def unused_settings(self) -> list[str]:
        """Notes on settings accepted but not used, for the recipe to print.

        verl's ``trainer.project_name`` / ``experiment_name`` name the wandb / mlflow run; with a logger list
        without wandb (verl's ``trainer.logger=['console']``) there is none to name.
        """
        items = self.logger if isinstance(self.logger, (list, tuple)) else [self.logger]
        named = [f"trainer.{k}={getattr(self, k)}" for k in ("project_name", "experiment_name")
                 if getattr(self, k)]
        if named and not NAMED_LOGGERS & {i for i in items if isinstance(i, str)}:
            return [f"{' '.join(named)} not used: they name the wandb / mlflow run and trainer.logger="
                    f"{self.logger!r} has neither (add wandb or mlflow to trainer.logger to log there)"]
        return []

    def export_torch_dtype(self) -> torch.dtype | None:
        """``export_dtype`` as a ``torch.dtype`` for ``engine.save_hf(dtype=)`` (``None``: as stored)."""
        if self.export_dtype == "auto":
            return to_dtype("bfloat16") if str(self.precision).startswith("bf16") else None
        return to_dtype(self.export_dtype)

    def __post_init__(self) -> None:
        if self.export_dtype != "auto" and self.export_dtype not in DTYPES:
            raise ValueError(f"trainer.export_dtype={self.export_dtype!r}; choose auto or one of "
                             f"{', '.join(sorted(DTYPES))}")

        if self.ckpt_path not in (None, "last") and not (Path(self.ckpt_path) / STATE_FILE).is_file():
            raise ValueError(
                f"trainer.ckpt_path={self.ckpt_path!r} is not a complete checkpoint directory (no "
                f"{STATE_FILE}); give 'last' (the newest checkpoint of the checkpoint directory), a step_* "
                f"directory, or null"
            )
        check_callback_specs(self.callbacks)

    @property
    def validates_before_fit(self) -> bool:
        """``validate_before_fit``, except on a resume (the "before" number is the fresh run's)."""
        return self.validate_before_fit and self.ckpt_path is None


@dataclass
class TinyModelConfig:
    """The tiny model made when ``model.path`` holds no checkpoint (``make_tiny_model`` arguments)."""

    arch: str = "qwen2"
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    seed: int = 0


DEMO_MODEL_PATH = "outputs/models/tiny"
"""The demo's own model path: the only place a recipe ever makes a (random, tiny) model."""


@dataclass
class ModelConfig:
    """The initial checkpoint.

    Attributes:
        path: A local HF model directory, or a hub id already in the local HF cache
            (``Qwen/Qwen2.5-0.5B-Instruct`` after ``hf download``); nothing is downloaded, and a path that
            is neither fails before any work (``verl_trainer.models.source``).
        make_tiny_if_missing: The demo configs only (``configs/grpo.yaml``, ``dapo.yaml``,
            ``grpo_lora.yaml``, ``remax.yaml``, ``grpo_moe.yaml``): when ``path`` is :data:`DEMO_MODEL_PATH`,
            write a randomly initialised tiny model (and the character tokenizer) there when it is missing or
            was made with other ``tiny`` settings. Never at any other path.
        tiny: Its shape.
    """

    path: str = DEMO_MODEL_PATH
    make_tiny_if_missing: bool = False
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class TaskConfig:
    """The synthetic arithmetic task (``verl_trainer.data.tasks``).

    Attributes:
        write_if_missing: Write ``train``/``val``/``sft_train``/``sft_val`` ``.jsonl`` files into ``dir``
            when ``dir/train.jsonl`` is missing.
        dir: Their directory.
        arithmetic: What problems (operands, operations, held-out fraction, sizes, seed).
    """

    write_if_missing: bool = True
    dir: str = "outputs/data/arithmetic"
    arithmetic: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)


@dataclass
class WarmStartConfig:
    """A short SFT of the initial model before RL, so that the reward has signal from step one.

    Attributes:
        enable: ``auto`` (the demo configs): only with the demo's own model and data, otherwise off with a
            printed note; ``true``: run it (refused where it would not do what it says: with
            ``algorithm.model_path``, or before RL on your own data with the demo's ``train_files``);
            ``false``: off. See :mod:`verl_trainer.recipe_config.demo_scope`. Reused when ``output`` already
            holds a warm start made with the same settings.
        output: Where the warm-started checkpoint is written; the RL policy starts from it.
        train_files: SFT file (``prompt``, ``response``).
        batch_size: Examples per step over all DP ranks.
        max_steps: SFT steps (keep it short: the point is the answer format, not the answers).
        optim: Optimizer.
        engine: Engine settings.
    """

    enable: bool | str = False
    output: str = "outputs/models/warm_start"
    train_files: str = ""
    batch_size: int = 64
    max_steps: int = 40
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3, weight_decay=0.0))
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(micro_batch_size_per_gpu=64))

    def __post_init__(self) -> None:
        if isinstance(self.enable, str) and self.enable.lower() in ("true", "false"):
            self.enable = self.enable.lower() == "true"
        if self.enable not in (True, False, "auto"):
            raise ValueError(f"warm_start.enable={self.enable!r}; choose true, false or auto (only with the "
                             "demo's own model and data)")


@dataclass
class SFTRecipeConfig:
    """``recipes/sft.py``; ``export_dir`` (default ``<default_root_dir>/hf``) gets the fine-tuned model."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: SFTConfig = field(default_factory=lambda: SFTConfig(model_path=""))
    export_dir: str | None = None


@dataclass
class GRPORecipeConfig:
    """``recipes/grpo.py`` and ``recipes/dr_grpo.py``."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    algorithm: GRPOConfig = field(default_factory=GRPOConfig)


@dataclass
class PPORecipeConfig:
    """``recipes/ppo.py``."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    algorithm: PPOConfig = field(default_factory=PPOConfig)


@dataclass
class DPORecipeConfig:
    """``recipes/dpo.py``: preference optimisation; ``export_dir`` gets the trained model.

    ``algorithm.loss.loss_type``: sigmoid, ipo, robust, simpo, orpo or kto; ``export_dir`` default
    ``<default_root_dir>/hf``.
    """

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: PreferenceConfig = field(default_factory=PreferenceConfig)
    export_dir: str | None = None

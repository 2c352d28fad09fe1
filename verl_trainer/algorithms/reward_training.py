"""Reward-model training (Bradley–Terry) as a ``TrainingModule``: ``recipes/rm.py``.

One trained ``value_model`` engine (``"reward_model"``): the model is a token classifier with one label and
no bias on its head (:func:`load_trainable_reward_model`), the layout of a ``*ForSequenceClassification``
head, so the same weights load as either class. A step::

    on_before_update (SequenceBalancing: whole pairs per rank; ids made unique over the DP group first)
    -> reward_model.train_batch(batch, RewardModelLoss)   (pairs whole in each micro-batch)

The loss and its metrics: :mod:`verl_trainer.core_algos.reward_modeling`; the data:
:mod:`verl_trainer.data.reward_pairs`. Validation logs the same metrics under ``val/`` (``val/rm/accuracy``,
...). :func:`save_reward_model` writes a ``*ForSequenceClassification`` directory that
``algorithm.reward.model.path`` loads unchanged.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_trainer.algorithms.data import DataConfig, _DataModule
from verl_trainer.algorithms.non_finite import NonFiniteConfig
from verl_trainer.algorithms.preference_data import unique_group_ids
from verl_trainer.algorithms.stages.guard import NonFiniteGuard
from verl_trainer.core_algos.reward_modeling import RewardLossConfig, RewardModelLoss
from verl_trainer.data.reward_pairs import RewardPairDataset
from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.models.hf_files import to_dtype
from verl_trainer.module import EngineSpec, StepOutput, TrainingModule
from verl_trainer.utils.distributed import barrier, get_rank

__all__ = ["REWARD_ENGINE", "RewardModelDataModule", "RewardModelModule", "RewardModelTrainingConfig",
           "load_trainable_reward_model", "save_reward_model"]

REWARD_ENGINE = "reward_model"
"""The trained engine's name in ``module.engines``."""


@dataclass
class RewardModelTrainingConfig:
    """What reward-model training trains and how.

    Attributes:
        model_path: The initial model: a causal LM (its backbone; a new score head seeded with
            ``engine.seed``) or a ``*ForSequenceClassification`` checkpoint with one label (its head kept).
        engine: The engine's settings (micro-batching, ...).
        optim: Optimizer and LR schedule.
        loss: :class:`~verl_trainer.core_algos.reward_modeling.RewardLossConfig`
            (``center_rewards_coefficient``).
        non_finite: A non-finite loss / gradient: stop (``error``) or skip the step.
    """

    model_path: str = ""
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: RewardLossConfig = field(default_factory=RewardLossConfig)
    non_finite: NonFiniteConfig = field(default_factory=NonFiniteConfig)

    def __post_init__(self) -> None:
        if self.engine.lora_rank:
            raise ValueError(f"algorithm.engine.lora_rank={self.engine.lora_rank}: reward-model training "
                             "trains the whole model and its head; set algorithm.engine.lora_rank=0")


def load_trainable_reward_model(path: str, seed: int = 0, torch_dtype: torch.dtype = torch.float32,
                                attn_implementation: str | None = None) -> torch.nn.Module:
    """A trainable reward model: ``AutoModelForTokenClassification`` with one label and a bias-free head.

    A ``*ForSequenceClassification`` checkpoint keeps its head; from a causal LM the head is new, drawn
    from ``seed`` (the global RNG untouched). Head dropout is 0.

    Raises:
        ValueError: A sequence classifier with ``num_labels != 1``.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path)
    classifier = any(str(a).endswith("ForSequenceClassification") for a in config.architectures or [])
    if classifier and config.num_labels != 1:
        raise ValueError(f"{path!r} has num_labels={config.num_labels}; a reward model has one label")
    config.num_labels = 1
    config.token_classification_bias = False
    config.classifier_dropout = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=torch_dtype, attn_implementation=attn_implementation)
    return model.train().requires_grad_(True)


def save_reward_model(engine: Any, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> str:
    """Write the engine's model as a ``*ForSequenceClassification`` HF directory (a collective).

    The engine saves its token classifier (``save_hf``); its weights are a sequence classifier's (the same
    backbone names and a bias-free ``score``), so rank 0 rewrites ``config.json``'s architecture and sets
    ``pad_token_id`` (the last real token of a padded batch) from the tokenizer when the config has none.
    """
    engine.save_hf(out_dir, dtype=dtype)
    if get_rank() == 0:
        path = Path(out_dir) / "config.json"
        config = json.loads(path.read_text())
        config["architectures"] = [a.replace("ForTokenClassification", "ForSequenceClassification")
                                   for a in config.get("architectures") or []]
        if config.get("pad_token_id") is None:
            tok_config = Path(out_dir) / "tokenizer_config.json"
            from transformers import AutoTokenizer

            if tok_config.exists():
                tok = AutoTokenizer.from_pretrained(out_dir)
                pad = tok.pad_token_id
                config["pad_token_id"] = pad if pad is not None else tok.eos_token_id
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    barrier()
    return str(out_dir)


class RewardModelModule(TrainingModule):
    """Bradley–Terry reward-model training (see the module docstring).

    Args:
        config: See :class:`RewardModelTrainingConfig`.
    """

    def __init__(self, config: RewardModelTrainingConfig) -> None:
        super().__init__()
        self.config = config
        self.loss_fn = RewardModelLoss(config.loss)
        self.non_finite = NonFiniteGuard(config.non_finite, group_estimator=False)

    def configure_engines(self) -> dict[str, EngineSpec]:
        """``reward_model``: a trained ``value_model`` engine built by :func:`load_trainable_reward_model`."""
        cfg = self.config
        if not cfg.model_path:
            raise ValueError("RewardModelModule: config.model_path is empty; set algorithm.model_path")
        engine = cfg.engine.replace(model_path=cfg.model_path)
        build = functools.partial(load_trainable_reward_model, cfg.model_path, engine.seed,
                                  to_dtype(engine.model_dtype))
        return {REWARD_ENGINE: EngineSpec("value_model", engine, cfg.optim, model=build)}

    def training_step(self, batch: Any, batch_idx: int) -> StepOutput:
        """One optimizer step on this rank's pairs."""
        batch = unique_group_ids(batch, self.topology)
        if self.trainer is not None:
            batch = self.trainer.call_hook("on_before_update", batch)
        engine = self.engines[REWARD_ENGINE]
        with engine.train_mode():
            out = engine.train_batch(batch, self.loss_fn, hooks=self.step_hooks)
        step = (self.trainer.global_step if self.trainer is not None else 0) + 1
        return self.non_finite.single_update(REWARD_ENGINE, out, step)

    def validation_step(self, batch: Any, batch_idx: int) -> StepOutput:
        """The loss and the pair metrics of one validation batch, as ``val/<name>``."""
        engine = self.engines[REWARD_ENGINE]
        with engine.eval_mode():
            out = engine.infer_batch(batch, self.loss_fn)
        renamed = [{f"val/{k}": v for k, v in m.items() if k != "rm/loss"} for m in out["metrics"]]
        return {"val/loss": out["loss"], "micro_batches": renamed}

    def state_dict(self) -> dict[str, Any]:
        """The count of steps skipped in a row for a non-finite loss (plain data)."""
        return {"non_finite_skipped_in_a_row": self.non_finite.skipped_in_a_row}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.non_finite.skipped_in_a_row = int(state_dict.get("non_finite_skipped_in_a_row", 0))


class RewardModelDataModule(_DataModule):
    """Reward-model pairs (:class:`~verl_trainer.data.reward_pairs.RewardPairDataset`) for ``Trainer.fit``.

    ``data.train_batch_size``: pairs per step over all DP ranks; ``data.max_length``: the longest prompt +
    completion + score token. The tokenizer is the reward model's.
    """

    def __init__(self, config: DataConfig, tokenizer: Any, sp_size: int = 1, train_dataset: Any = None,
                 val_dataset: Any = None) -> None:
        super().__init__(config, tokenizer, sp_size, train_dataset, val_dataset)

    def _dataset(self, source: Any) -> RewardPairDataset:
        return RewardPairDataset(source, self.tokenizer, self.config.max_length)

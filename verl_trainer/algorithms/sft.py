"""SFT: supervised fine-tuning as a :class:`~verl_trainer.module.TrainingModule`.

One engine (``"actor"``, a language model) trained with :func:`~verl_trainer.core_algos.losses.sft_loss` on
the response tokens (``loss_mask``) of (prompt, response) pairs::

    rows = [{"prompt": "3+4=", "response": "7"}, ...]
    dataset = SFTDataset(rows, tokenizer)                  # verl_trainer.data.sft
    data = DataLoader(dataset, batch_size=4, shuffle=True, collate_fn=dataset.collate)
    Trainer(strategy="fsdp2", devices=2, max_steps=100).fit(SFT(SFTConfig(model_path)), data)

Logged per step: ``sft/loss`` (reduced from the per-micro-batch partial losses), ``train/grad_norm``,
``train/lr``, ``train/update_skipped`` (1: a non-finite loss or gradient skipped the optimizer step; with
``non_finite.policy=error``, the default, it stops the run instead); per validation: ``val/loss`` (mean
over validation batches); per test: ``test/loss``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDict

from verl_trainer.algorithms.non_finite import NonFiniteConfig
from verl_trainer.algorithms.stages.guard import NonFiniteGuard
from verl_trainer.core_algos.losses import SFTLossConfig, sft_loss
from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.module import EngineSpec, StepOutput, TrainingModule

__all__ = ["SFT", "SFTConfig"]


@dataclass
class SFTConfig:
    """What SFT trains and how.

    Attributes:
        model_path: Directory of the HF model to fine-tune.
        engine: Engine settings (micro-batching, offload, ...); ``model_path`` is filled in and the
            dtypes come from the Trainer's precision.
        optim: Optimizer and LR schedule.
        loss: Loss aggregation.
        non_finite: A non-finite loss / gradient: ``policy`` ``error`` (stop) or ``drop_samples`` (the
            step is skipped), and ``max_consecutive_skipped_steps``
            (:mod:`verl_trainer.algorithms.non_finite`).
    """

    model_path: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: SFTLossConfig = field(default_factory=SFTLossConfig)
    non_finite: NonFiniteConfig = field(default_factory=NonFiniteConfig)


class SFT(TrainingModule):
    """Supervised fine-tuning of one causal LM.

    Args:
        config: See :class:`SFTConfig`.
    """

    def __init__(self, config: SFTConfig) -> None:
        super().__init__()
        self.config = config
        self.loss_fn = sft_loss(config.loss)
        self.non_finite = NonFiniteGuard(config.non_finite, group_estimator=False)

    def configure_engines(self) -> dict[str, EngineSpec]:
        """One trainable language-model engine, ``"actor"``."""
        engine = self.config.engine.replace(model_path=self.config.model_path)
        return {"actor": EngineSpec("language_model", engine, self.config.optim)}

    def training_step(self, batch: TensorDict, batch_idx: int) -> StepOutput:
        """One optimizer step on this rank's batch ``[B, T]``."""
        if self.trainer is not None:
            batch = self.trainer.call_hook("on_before_update", batch)
        actor = self.engines["actor"]
        with actor.train_mode():
            out = actor.train_batch(batch, self.loss_fn, hooks=self.step_hooks)
        step = (self.trainer.global_step if self.trainer is not None else 0) + 1
        return self.non_finite.single_update("actor", out, step)

    def state_dict(self) -> dict[str, Any]:
        """The count of steps skipped in a row for a non-finite loss (plain data)."""
        return {"non_finite_skipped_in_a_row": self.non_finite.skipped_in_a_row}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.non_finite.skipped_in_a_row = int(state_dict.get("non_finite_skipped_in_a_row", 0))

    def validation_step(self, batch: TensorDict, batch_idx: int) -> StepOutput:
        """The loss of one validation batch (global over the DP ranks)."""
        actor = self.engines["actor"]
        with actor.eval_mode():
            out = actor.infer_batch(batch, self.loss_fn)
        return {"val/loss": out["loss"]}

    def test_step(self, batch: TensorDict, batch_idx: int) -> StepOutput:
        """The loss of one test batch (global over the DP ranks), logged as ``test/loss``."""
        return {"test/loss": self.validation_step(batch, batch_idx)["val/loss"]}

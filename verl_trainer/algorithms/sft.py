"""SFT: supervised fine-tuning as a :class:`~verl_trainer.module.TrainingModule`.

One engine (``"actor"``, a language model) trained with :func:`~verl_trainer.losses.sft_loss` on the
response tokens (``loss_mask``) of (prompt, response) pairs::

    rows = [{"prompt": "3+4=", "response": "7"}, ...]
    dataset = SFTDataset(rows, tokenizer)                  # verl_trainer.data.sft
    data = DataLoader(dataset, batch_size=4, shuffle=True, collate_fn=dataset.collate)
    Trainer(strategy="fsdp2", devices=2, max_steps=100).fit(SFT(SFTConfig(model_path)), data)

Logged per step: ``sft/loss`` (reduced from the per-micro-batch partial losses), ``train/grad_norm``,
``train/lr``; per validation: ``val/loss`` (mean over validation batches).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDict

from verl_trainer.engine.config import EngineConfig, OptimConfig
from verl_trainer.losses import SFTLossConfig, sft_loss
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
    """

    model_path: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: SFTLossConfig = field(default_factory=SFTLossConfig)


class SFT(TrainingModule):
    """Supervised fine-tuning of one causal LM.

    Args:
        config: See :class:`SFTConfig`.
    """

    def __init__(self, config: SFTConfig) -> None:
        super().__init__()
        self.config = config
        self.loss_fn = sft_loss(config.loss)

    @property
    def hparams(self) -> dict[str, Any]:
        """The config as plain data."""
        return dataclasses.asdict(self.config)

    def configure_engines(self) -> dict[str, EngineSpec]:
        """One trainable language-model engine, ``"actor"``."""
        engine = self.config.engine.replace(model_path=self.config.model_path)
        return {"actor": EngineSpec("language_model", engine, self.config.optim)}

    def training_step(self, batch: TensorDict, batch_idx: int) -> StepOutput:
        """One optimizer step on this rank's batch ``[B, T]``."""
        if self.trainer is not None:
            batch = self.trainer.call_before_update(batch)
        actor = self.engines["actor"]
        with actor.train_mode():
            out = actor.train_batch(batch, self.loss_fn, hooks=self.step_hooks)
        return {"micro_batches": out["metrics"], "train/grad_norm": out["grad_norm"], "train/lr": out["lr"]}

    def validation_step(self, batch: TensorDict, batch_idx: int) -> StepOutput:
        """The loss of one validation batch (global over the DP ranks)."""
        actor = self.engines["actor"]
        with actor.eval_mode():
            out = actor.infer_batch(batch, self.loss_fn)
        return {"val/loss": out["loss"]}

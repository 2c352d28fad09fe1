"""The callback base class: Lightning's hook names plus the RL points of one step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

    from verl_trainer.module import StepOutput, TrainingModule
    from verl_trainer.trainer import Trainer


class Callback:
    """Base class for trainer callbacks; override the hooks you need.

    Every hook receives the :class:`~verl_trainer.Trainer` and the
    :class:`~verl_trainer.module.TrainingModule` (whose declared contract — ``actor``, ``hidden_size``,
    ``required_batch_multiple`` — is what a callback may ask of it). Hook names follow Lightning
    (``on_fit_start``, ``on_train_batch_start``, ...). RL additions: ``on_rollout_end`` (after
    generation and rewards), ``on_before_update`` (may return a new batch, e.g. re-partitioned across
    data-parallel ranks) and ``on_micro_batches`` (sees the planned micro-batches of one engine step).
    """

    @property
    def state_key(self) -> str:
        """Key under which this callback's state is stored in a checkpoint."""
        return type(self).__qualname__

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Called when fit or validate begins, before anything runs."""

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Called when fit or validate ends."""

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the very beginning of fit."""

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the very end of fit."""

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when the training loop begins."""

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when the training loop ends."""

    def on_train_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int
    ) -> None:
        """Called before a training step."""

    def on_rollout_end(self, trainer: Trainer, module: TrainingModule, batch: TensorDict) -> None:
        """Called after rollout, rewards and advantages are computed for a batch."""

    def on_before_update(
        self, trainer: Trainer, module: TrainingModule, batch: TensorDict
    ) -> TensorDict | None:
        """Called before the engine update; return a new batch to replace it, or ``None``."""

    def on_micro_batches(
        self, trainer: Trainer, module: TrainingModule, micro_batches: list[TensorDict]
    ) -> None:
        """Called with the micro-batches planned for one engine step."""

    def on_before_backward(self, trainer: Trainer, module: TrainingModule, loss: torch.Tensor) -> None:
        """Called before ``loss.backward()``."""

    def on_after_backward(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called after ``loss.backward()`` and before the optimizer step."""

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: Any) -> None:
        """Called before ``optimizer.step()``."""

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: StepOutput | None, batch: Any, batch_idx: int
    ) -> None:
        """Called after a training step with its outputs (metrics)."""

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when validation begins."""

    def on_validation_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int
    ) -> None:
        """Called before a validation batch."""

    def on_validation_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: StepOutput | None, batch: Any, batch_idx: int
    ) -> None:
        """Called after a validation batch."""

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when validation ends."""

    def on_save_checkpoint(
        self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]
    ) -> None:
        """Called when a checkpoint is assembled; may add entries to ``checkpoint``."""

    def on_load_checkpoint(
        self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]
    ) -> None:
        """Called when a checkpoint is restored."""

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        """Called when fit raises."""

    def state_dict(self) -> dict[str, Any]:
        """State to save in a checkpoint (plain data only)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state returned by :meth:`state_dict`."""


HOOK_NAMES: frozenset[str] = frozenset(
    name for name in vars(Callback) if name.startswith("on_") or name in ("setup", "teardown")
)
"""Every hook the Trainer dispatches (``Trainer.call_hook`` rejects other names)."""

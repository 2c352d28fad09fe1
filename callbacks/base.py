"""The callback base class: Lightning's hook names plus the RL points of one step.

Every Lightning callback hook has a moment in this loop and is dispatched (``HOOK_NAMES``; the order is
in ``verl_trainer/training/fit_loop.py``). :func:`unknown_hooks` finds methods a callback defines that look
like hooks but are never called (a typo, or a LightningModule-only hook); the Trainer warns about them at
fit start. :func:`check_callback` rejects Lightning's own callback instances, naming ours.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from verl_trainer.callbacks.contract import CallbackModule, CallbackTrainer

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict


class Callback:
    """Base class for trainer callbacks; override the hooks you need.

    Every hook receives the :class:`~verl_trainer.Trainer` and the
    :class:`~verl_trainer.module.TrainingModule`, typed as what a callback may use of them
    (:class:`~verl_trainer.callbacks.contract.CallbackTrainer`,
    :class:`~verl_trainer.callbacks.contract.CallbackModule`: of the module its declared contract —
    ``actor``, ``hidden_size``, ``required_batch_multiple``). Hook names follow Lightning
    (``on_fit_start``, ``on_train_batch_start``, ...). RL additions: ``on_rollout_end`` (after
    generation and rewards), ``on_before_update`` (may return a new batch, e.g. re-partitioned across
    data-parallel ranks) and ``on_micro_batches`` (sees the planned micro-batches of one engine step).
    """

    @property
    def state_key(self) -> str:
        """Key under which this callback's state is stored in a checkpoint."""
        return type(self).__qualname__

    def setup(self, trainer: CallbackTrainer, module: CallbackModule, stage: str) -> None:
        """Called when fit or validate begins, before anything runs."""

    def rollout_rank_mirrors(self) -> dict[str, Callable[[dict[str, Any]], None]]:
        """Kind -> handler of the calls a separate rollout pool's ranks make on trainer rank 0's word.

        With ``placement=separate`` a rollout rank runs no hook; it runs these handlers when this callback's
        trainer-side hooks post their kind (:mod:`verl_trainer.rollout_pool.mirror`). Default: none.
        """
        return {}

    def teardown(self, trainer: CallbackTrainer, module: CallbackModule, stage: str) -> None:
        """Called when fit or validate ends."""

    def on_fit_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called at the very beginning of fit."""

    def on_fit_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called at the very end of fit."""

    def on_train_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called when the training loop begins."""

    def on_train_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called when the training loop ends."""

    def on_sanity_check_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called before the sanity validation (``num_sanity_val_steps``) at the start of fit."""

    def on_sanity_check_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called after the sanity validation (its metrics are discarded)."""

    def on_train_epoch_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called when a training epoch begins (also when a resumed run enters one mid-way)."""

    def on_train_epoch_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called when a training epoch ends (its data is exhausted, limited, or fit stops)."""

    def on_train_batch_start(
        self, trainer: CallbackTrainer, module: CallbackModule, batch: Any, batch_idx: int
    ) -> None:
        """Called before a training step (with ``accumulate_grad_batches`` > 1: the joined batch)."""

    def on_rollout_end(self, trainer: CallbackTrainer, module: CallbackModule, batch: TensorDict) -> None:
        """Called after rollout, rewards and advantages are computed for a batch."""

    def on_before_update(
        self, trainer: CallbackTrainer, module: CallbackModule, batch: TensorDict
    ) -> TensorDict | None:
        """Called before the engine update; return a new batch to replace it, or ``None``."""

    def on_micro_batches(
        self, trainer: CallbackTrainer, module: CallbackModule, micro_batches: list[TensorDict]
    ) -> None:
        """Called with the micro-batches planned for one engine step."""

    def on_before_zero_grad(self, trainer: CallbackTrainer, module: CallbackModule, optimizer: Any) -> None:
        """Called before an engine's optimizer clears the gradients (the start of each optimizer step)."""

    def on_before_backward(
        self, trainer: CallbackTrainer, module: CallbackModule, loss: torch.Tensor
    ) -> None:
        """Called before ``loss.backward()``."""

    def on_after_backward(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called after ``loss.backward()`` and before the optimizer step."""

    def on_before_optimizer_step(
        self, trainer: CallbackTrainer, module: CallbackModule, optimizer: Any
    ) -> None:
        """Called before ``optimizer.step()``."""

    def on_train_batch_end(
        self, trainer: CallbackTrainer, module: CallbackModule, outputs: Mapping[str, Any] | None, batch: Any,
        batch_idx: int,
    ) -> None:
        """Called after a training step with its outputs (metrics)."""

    def on_validation_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called when validation begins."""

    def on_validation_epoch_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called after ``on_validation_start``, before the first validation batch."""

    def on_validation_epoch_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called after the last validation batch, once its metrics are reduced (``callback_metrics``)."""

    def on_validation_batch_start(
        self, trainer: CallbackTrainer, module: CallbackModule, batch: Any, batch_idx: int
    ) -> None:
        """Called before a validation batch."""

    def on_validation_batch_end(
        self, trainer: CallbackTrainer, module: CallbackModule, outputs: Mapping[str, Any] | None, batch: Any,
        batch_idx: int,
    ) -> None:
        """Called after a validation batch."""

    def on_validation_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called when validation ends."""

    def on_test_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called when ``test`` begins."""

    def on_test_epoch_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called before the first test batch."""

    def on_test_batch_start(
        self, trainer: CallbackTrainer, module: CallbackModule, batch: Any, batch_idx: int
    ) -> None:
        """Called before a test batch."""

    def on_test_batch_end(
        self, trainer: CallbackTrainer, module: CallbackModule, outputs: Mapping[str, Any] | None, batch: Any,
        batch_idx: int,
    ) -> None:
        """Called after a test batch."""

    def on_test_epoch_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called after the last test batch, once its metrics are reduced."""

    def on_test_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called when ``test`` ends."""

    def on_predict_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called when ``predict`` begins."""

    def on_predict_epoch_start(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called before the first predict batch."""

    def on_predict_batch_start(
        self, trainer: CallbackTrainer, module: CallbackModule, batch: Any, batch_idx: int
    ) -> None:
        """Called before a predict batch."""

    def on_predict_batch_end(
        self, trainer: CallbackTrainer, module: CallbackModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Called after a predict batch with ``predict_step``'s output."""

    def on_predict_epoch_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called after the last predict batch."""

    def on_predict_end(self, trainer: CallbackTrainer, module: CallbackModule) -> None:
        """Called when ``predict`` ends."""

    def on_save_checkpoint(
        self, trainer: CallbackTrainer, module: CallbackModule, checkpoint: dict[str, Any]
    ) -> None:
        """Called when a checkpoint is assembled; may add entries to ``checkpoint``."""

    def on_load_checkpoint(
        self, trainer: CallbackTrainer, module: CallbackModule, checkpoint: dict[str, Any]
    ) -> None:
        """Called when a checkpoint is restored."""

    def on_exception(
        self, trainer: CallbackTrainer, module: CallbackModule, exception: BaseException
    ) -> None:
        """Called when fit / validate / test / predict raises."""

    def state_dict(self) -> dict[str, Any]:
        """State to save in a checkpoint (plain data only)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state returned by :meth:`state_dict`."""


HOOK_NAMES: frozenset[str] = frozenset(
    name for name in vars(Callback) if name.startswith("on_") or name in ("setup", "teardown")
)
"""Every hook the Trainer dispatches (``Trainer.call_hook`` rejects other names)."""


_OURS = {  # Lightning callback class → ours
    "EarlyStopping": "EarlyStopping", "ModelCheckpoint": "ModelCheckpoint", "Timer": "Timer",
    "LearningRateMonitor": "LearningRateMonitor", "ThroughputMonitor": "ThroughputMonitor",
    "TQDMProgressBar": "ProgressBar", "RichProgressBar": "ProgressBar", "ProgressBar": "ProgressBar",
}


def check_callback(callback: Any) -> None:
    """Raise unless ``callback`` is a :class:`Callback`; Lightning's own get the name of ours.

    Raises:
        TypeError: Not a ``verl_trainer.callbacks.Callback``.
    """
    if isinstance(callback, Callback):
        return
    cls = type(callback)
    if cls.__module__.split(".")[0] in ("lightning", "pytorch_lightning"):
        ours = next((_OURS[c.__name__] for c in cls.__mro__ if c.__name__ in _OURS), None)
        use = (_arguments_compared(cls, ours) if ours else
               "port it to verl_trainer.callbacks.Callback (the same hook names and signatures)")
        raise TypeError(
            f"{cls.__module__}.{cls.__name__} is a Lightning callback, which drives a Lightning trainer's "
            f"state; {use}"
        )
    raise TypeError(f"callbacks must be verl_trainer.callbacks.Callback instances, got {cls.__name__}")


def _arguments_compared(lightning_cls: type, ours: str) -> str:
    """``use verl_trainer.callbacks.<ours>``, with the arguments it takes and Lightning's it does not."""
    import inspect

    import verl_trainer.callbacks as callbacks  # lazy: cycle with callbacks

    def names(cls: type) -> list[str]:
        params = inspect.signature(cls.__init__).parameters.values()
        skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        return [p.name for p in params if p.name != "self" and p.kind not in skip]

    mine = names(getattr(callbacks, ours))
    theirs = [n for n in names(lightning_cls) if n not in mine]
    missing = f"; Lightning's {', '.join(theirs)} are not among them" if theirs else " (all of Lightning's)"
    return f"use verl_trainer.callbacks.{ours}, which takes {', '.join(mine) or 'no arguments'}{missing}"


def unknown_hooks(callback: Callback) -> list[str]:
    """Methods of ``callback``'s class named like hooks (``on_*``) that the Trainer never calls."""
    names = {n for c in type(callback).__mro__ if c not in (Callback, object) for n in vars(c)}
    return sorted(n for n in names if n.startswith("on_") and n not in HOOK_NAMES and callable(
        getattr(callback, n, None)))

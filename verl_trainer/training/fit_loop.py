"""The fit loop of :class:`verl_trainer.Trainer`: an object that owns the run's progress.

Hook order of ``fit`` (pinned by ``tests/trainer/test_hooks.py``; validation, test and predict loops are in
``training/evaluation.py``)::

    setup(stage) → [on_load_checkpoint] → on_fit_start → [on_sanity_check_start → validation of
    num_sanity_val_steps batches → on_sanity_check_end] → on_train_start
    per epoch: on_train_epoch_start → steps → on_train_epoch_end
    per step:  on_train_batch_start → training_step (the module dispatches on_rollout_end,
               on_before_update, on_before_backward per micro-batch, on_after_backward,
               on_before_optimizer_step) → LR schedulers step → global_step += 1 → the step's outputs
               reduced (over ``MetricReduction``'s group) → on_train_batch_end → metrics logged →
               [validation: on_validation_start → on_validation_epoch_start →
               (on_validation_batch_start → validation_step → on_validation_batch_end)* →
               on_validation_epoch_end → on_validation_end]
    (inside train_batch, before the micro-batches: on_before_zero_grad)
    on_train_end → on_fit_end → teardown(stage)

``on_save_checkpoint`` runs inside a checkpoint save (``ModelCheckpoint`` saves in
``on_train_batch_end``, in ``on_validation_end`` when validation runs that step, and in
``on_train_end``). ``on_exception`` runs when the stage raises, before ``teardown``.

``accumulate_grad_batches=K`` joins K consecutive loader batches into the batch of one optimizer step
(``data/schema.py: concat_batches``) before ``training_step``, so the loss and gradient equal one step on a
K-times larger batch (docs/lightning.md, "accumulate_grad_batches and the global denominators");
``global_step`` counts optimizer steps.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from verl_trainer.callbacks.base import HOOK_NAMES, Callback, unknown_hooks
from verl_trainer.data.schema import concat_batches
from verl_trainer.data.sharded_loader import ShardedLoader
from verl_trainer.module import TrainingModule
from verl_trainer.training.evaluation import EvaluationLoop
from verl_trainer.training.logging import MetricLogging
from verl_trainer.training.progress import Progress
from verl_trainer.utils.distributed import broadcast_object

__all__ = ["FitLimits", "FitLoop"]


@dataclass(frozen=True)
class FitLimits:
    """When fit stops and validates (the Trainer's checked arguments of the same names)."""

    max_steps: int
    max_epochs: int | None
    min_steps: int | None
    min_epochs: int | None
    max_time: timedelta | None
    accumulate_grad_batches: int
    val_check_interval: int | float | None
    check_val_every_n_epoch: int | None
    limit_train_batches: int | float | None


class FitLoop:
    """Runs training steps until a limit or a stop request, advancing :class:`Progress`.

    Args:
        module: The module being trained (its engines built).
        progress: The run's progress; ``progress.train_loader`` is the training data.
        limits: When to stop and validate.
        call_hook: The callbacks' dispatch, ``call_hook(name, *args)``.
        logging: The run's metric state (reduced after every step, logged on rank 0).
        evaluation: The validation loop over the same progress (and its validation data, if any).
        metric_group: The group step outputs are reduced over (``None``: the world).
        callbacks: The callbacks, for the warning about methods that are no hooks.
        is_global_zero: Whether this is rank 0 (it warns).
        dp_rank: This rank's data-parallel rank (named in an error about empty data).

    Invariants: ``progress.global_step`` grows by one per optimizer step; the loader position moves by
    every loader batch taken, so a checkpoint saved in any hook resumes at the next unseen batch.
    """

    def __init__(self, module: TrainingModule, progress: Progress, limits: FitLimits,
                 call_hook: Callable[..., object], logging: MetricLogging, evaluation: EvaluationLoop,
                 metric_group: dist.ProcessGroup | None, callbacks: Sequence[Callback], is_global_zero: bool,
                 dp_rank: int) -> None:
        self.module, self.progress, self.limits = module, progress, limits
        self.call_hook, self.logging, self.evaluation = call_hook, logging, evaluation
        self.metric_group, self.callbacks = metric_group, callbacks
        self.is_global_zero, self.dp_rank = is_global_zero, dp_rank
        self._started = time.monotonic()

    @property
    def loader(self) -> ShardedLoader:
        """The training data (set before the loop is built)."""
        assert self.progress.train_loader is not None, "FitLoop needs progress.train_loader"
        return self.progress.train_loader

    def flush(self, force: bool = False) -> None:
        """Log the pending values at the current step on rank 0 when due (see ``Trainer.flush_metrics``)."""
        step = self.progress.global_step
        self.logging.flush(step, force, last_step=step == self.limits.max_steps)

    # ------------------------------------------------------------------------------ stop conditions
    def _max_epochs_reached(self) -> bool:
        return self.limits.max_epochs is not None and self.loader.epoch >= self.limits.max_epochs

    def _stop_allowed(self) -> bool:
        """A stop request (``should_stop``, ``max_time``) is honoured after ``min_steps`` / ``min_epochs``."""
        steps_ok = self.limits.min_steps is None or self.progress.global_step >= self.limits.min_steps
        epochs_ok = self.limits.min_epochs is None or self.loader.epoch >= self.limits.min_epochs
        return steps_ok and epochs_ok

    def done(self) -> bool:
        """Whether fit has reached ``max_steps`` / ``max_epochs`` or a stop request it may honour."""
        reached = 0 < self.limits.max_steps <= self.progress.global_step
        return (self.progress.should_stop and self._stop_allowed()) or reached or self._max_epochs_reached()

    def _check_time(self) -> None:
        """Request a stop when ``max_time`` has passed (rank 0's clock decides for all ranks: a broadcast)."""
        budget = self.limits.max_time
        if budget is None:
            return
        if broadcast_object(time.monotonic() - self._started >= budget.total_seconds()):
            self.progress.should_stop = True

    # ------------------------------------------------------------------------------ validation schedule
    def validation_due(self) -> bool:
        """Whether fit validates after the current step.

        An int ``val_check_interval``: every N trainer steps. A float: every ``max(1, int(f * B))`` loader
        batches of an epoch of ``B`` (after ``limit_train_batches``), in the epochs
        ``check_val_every_n_epoch`` selects. No interval but ``check_val_every_n_epoch=N`` (or
        ``fast_dev_run``): at the end of every N-th epoch.

        Raises:
            ValueError: A fractional interval over a stream of unknown length.
        """
        progress, loader = self.progress, self.progress.train_loader
        if (progress.stage != "fit" or self.evaluation.val_loader is None or progress.sanity_checking
                or loader is None):
            return False
        interval, every_epoch = self.limits.val_check_interval, self.limits.check_val_every_n_epoch
        if isinstance(interval, int):
            return progress.global_step % interval == 0
        total = loader.limited_len() if interval is not None else 0
        if every_epoch is not None and (loader.epoch + 1) % every_epoch:
            return False
        if interval is None:
            return every_epoch is not None and loader.exhausted()
        if total is None:
            raise ValueError(
                f"val_check_interval={interval} is a fraction of an epoch, but the training data is a stream "
                "of unknown length; use an int val_check_interval (trainer steps) or limit_train_batches=N"
            )
        every = max(1, int(interval * total)) if total else 1
        done = loader.batches
        crossed = done // every > (done - self.limits.accumulate_grad_batches) // every  # a step may cross it
        return loader.exhausted() or crossed

    # ------------------------------------------------------------------------------ batches
    def _step_batches(self) -> Iterator[tuple[Any, int]]:
        """Yield ``(batch, batch_idx)`` per optimizer step: ``accumulate_grad_batches`` loader batches joined.

        ``batch_idx`` is the index of the step's last loader batch in the epoch; the loader position
        advances by every batch taken. The last step of an epoch may join fewer batches (as in Lightning).
        """
        loader, group = self.loader, []
        for batch in loader.epoch_batches():
            group.append(batch)
            loader.advance()
            if len(group) == self.limits.accumulate_grad_batches or loader.exhausted():
                yield (group[0] if len(group) == 1 else concat_batches(group)), loader.batches - 1
                group = []
        if group:
            yield concat_batches(group), loader.batches - 1

    def peek_next_batch(self) -> Any | None:
        """The batch of the next optimizer step, read ahead without consuming it (``None``: none known).

        ``None`` when this step is the last one (``max_steps``, or the last epoch of ``max_epochs``) or the
        data is a stream (an iterable dataset cannot be read twice). A stop requested later
        (``should_stop``, ``max_time``) leaves the read-ahead batch unused. The loader position is not
        moved, so a checkpoint saved now resumes at that batch. The one-step-off rollout uses it to
        generate the next step's responses while this step trains
        (:mod:`verl_trainer.algorithms.async_rollout`).
        """
        loader, limits = self.progress.train_loader, self.limits
        if not isinstance(loader, ShardedLoader) or 0 < limits.max_steps <= self.progress.global_step + 1:
            return None
        if loader.exhausted() and limits.max_epochs is not None and loader.epoch + 1 >= limits.max_epochs:
            return None
        group = loader.peek(limits.accumulate_grad_batches)
        if not group:
            return None
        return group[0] if len(group) == 1 else concat_batches(group)

    def peek_next_batches(self, count: int) -> list[Any]:
        """The batches of up to ``count`` next optimizer steps, read ahead without consuming them.

        As :meth:`peek_next_batch` (the first element is its batch), further: never past ``max_steps``, nor
        past the end of the current epoch (the next epoch's first step where this one is consumed). The
        asynchronous rollout at staleness ``k`` reads ``k`` steps ahead
        (:mod:`verl_trainer.algorithms.async_rollout`).
        """
        loader, limits, acc = self.progress.train_loader, self.limits, self.limits.accumulate_grad_batches
        if not isinstance(loader, ShardedLoader) or 0 < limits.max_steps <= self.progress.global_step + 1:
            return []
        if loader.exhausted() and limits.max_epochs is not None and loader.epoch + 1 >= limits.max_epochs:
            return []
        if limits.max_steps > 0:
            count = min(count, limits.max_steps - self.progress.global_step - 1)
        wanted = count * acc if not loader.exhausted() else acc
        batches = loader.peek(wanted)
        groups = [batches[i: i + acc] for i in range(0, len(batches), acc)]
        return [g[0] if len(g) == 1 else concat_batches(g) for g in groups]

    # ------------------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Train until ``max_steps`` / ``max_epochs`` / ``max_time`` / ``should_stop`` (the hook order above).

        Raises:
            ValueError: An epoch of the training data yields no batch on this rank, or a fractional
                ``val_check_interval`` over a stream of unknown length (before any step).
        """
        module, loader, progress = self.module, self.loader, self.progress
        if isinstance(self.limits.val_check_interval, float) and self.evaluation.val_loader is not None:
            self.validation_due()  # a fraction of a stream of unknown length fails here, before any step
        self._started = time.monotonic()
        self.logging.setup(self.is_global_zero, module.hparams)
        self.call_hook("on_fit_start")
        self._warn_unknown_hooks()
        self.evaluation.sanity_check()
        self.call_hook("on_train_start")
        trainable = [e for e in module.engines.values() if getattr(e, "optimizer", None) is not None]
        while not self.done():
            self.call_hook("on_train_epoch_start")
            for batch, batch_idx in self._step_batches():
                self.call_hook("on_train_batch_start", batch, batch_idx)
                outputs = module.training_step(batch, batch_idx)
                for engine in trainable:
                    engine.lr_scheduler_step()
                progress.global_step += 1
                self.logging.add(outputs)  # the step's outputs with what was logged during it, reduced
                self.logging.reduce(self.metric_group)  # over micro-batches and ranks, for the callbacks
                self.call_hook("on_train_batch_end", outputs, batch, batch_idx)
                self.flush()
                if self.validation_due():
                    self.evaluation.validate()
                self._check_time()
                if self.done():
                    break
            if loader.batches == 0:
                raise ValueError(
                    f"the training data yields no batch on dp rank {self.dp_rank} (limit_train_batches="
                    f"{self.limits.limit_train_batches!r})"
                )
            finished = loader.exhausted()
            self.call_hook("on_train_epoch_end")
            self.flush()
            if finished:
                loader.next_epoch()
        self.call_hook("on_train_end")
        self.call_hook("on_fit_end")
        self.flush(force=True)

    def _warn_unknown_hooks(self) -> None:
        if not self.is_global_zero:
            return
        for cb in self.callbacks:
            names = unknown_hooks(cb)
            if names:
                warnings.warn(
                    f"{type(cb).__name__} defines {', '.join(names)}, which the Trainer never calls (not a "
                    f"callback hook: a typo, or a LightningModule-only hook); callback hooks: "
                    f"{', '.join(sorted(HOOK_NAMES))}",
                    stacklevel=3,
                )

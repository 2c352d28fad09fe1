"""When ``fit`` validates: the validation schedule of ``val_check_interval`` / ``check_val_every_n_epoch``."""

from __future__ import annotations

from typing import Any

__all__ = ["validation_due"]


def validation_due(trainer: Any) -> bool:
    """Whether ``fit`` validates after the trainer's current step.

    An int ``val_check_interval``: every N trainer steps. A float: every ``max(1, int(f * B))`` loader
    batches of an epoch of ``B`` (after ``limit_train_batches``), in the epochs ``check_val_every_n_epoch``
    selects. No interval but ``check_val_every_n_epoch=N`` (or ``fast_dev_run``): at the end of every N-th
    epoch.

    Raises:
        ValueError: A fractional interval over a stream of unknown length.
    """
    loader = trainer.train_loader
    if trainer.state != "fit" or trainer.val_loader is None or trainer.sanity_checking or loader is None:
        return False
    interval, every_epoch = trainer.val_check_interval, trainer.check_val_every_n_epoch
    if isinstance(interval, int):
        return trainer.global_step % interval == 0
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
    crossed = done // every > (done - trainer.accumulate_grad_batches) // every  # one step may cross it
    return loader.exhausted() or crossed

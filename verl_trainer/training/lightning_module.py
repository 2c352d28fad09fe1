"""What a LightningModule user brings that a :class:`~verl_trainer.module.TrainingModule` does differently.

:func:`check_lightning_habits` refuses, before any process starts, what would otherwise be silently
ignored: ``configure_optimizers()`` (here every engine carries its optimizer and LR schedule:
``EngineSpec(..., optim=OptimConfig(...))`` in ``configure_engines``) and Lightning hooks defined on the
module (here hooks run on callbacks). :class:`LightningAttributes` gives the Trainer Lightning's read-only
attributes (``current_epoch``, ``log_dir``, ``estimated_stepping_batches``).
"""

from __future__ import annotations

import math
from typing import Any

from verl_trainer.callbacks.base import HOOK_NAMES

__all__ = ["LightningAttributes", "check_lightning_habits"]

MODULE_METHODS = ("setup",)
"""Hook names that :class:`~verl_trainer.module.TrainingModule` itself defines and the Trainer calls."""


def check_lightning_habits(module: Any) -> None:
    """Refuse a module's ``configure_optimizers`` and Lightning hooks, which nothing here would call.

    Raises:
        TypeError: Naming each method and what to do instead.
    """
    name = type(module).__name__
    problems = []
    if callable(getattr(module, "configure_optimizers", None)):
        problems.append(
            "configure_optimizers(): not called here; each engine carries its optimizer and LR schedule: "
            "return EngineSpec('language_model', EngineConfig(...), OptimConfig(lr=..., lr_scheduler="
            "'cosine', warmup_steps=..., optimizer='sgd' (or 'adam', any torch.optim class, 'module:Class'), "
            "override_optimizer_config={'momentum': 0.9})) from configure_engines() "
            "(verl_trainer.engine.config)"
        )
    hooks = sorted(h for h in HOOK_NAMES - set(MODULE_METHODS) if callable(getattr(module, h, None)))
    if hooks:
        problems.append(
            f"{', '.join(hooks)}: hooks are called on callbacks here, not on the module; move them to a "
            "verl_trainer.callbacks.Callback subclass (same names; they get (trainer, module, ...)) and "
            "pass it in Trainer(callbacks=[...])"
        )
    if problems:
        raise TypeError(f"{name} defines what a LightningModule would, which this Trainer does not call:\n  "
                        + "\n  ".join(problems))


class LightningAttributes:
    """Lightning's read-only Trainer attributes (a mixin of :class:`~verl_trainer.Trainer`)."""

    @property
    def current_epoch(self) -> int:
        """The training epoch the fit is in (0-based; 0 before ``fit``)."""
        loader = getattr(self, "train_loader", None)
        return int(loader.epoch) if loader is not None else 0

    @property
    def log_dir(self) -> str:
        """The first logger's directory (Lightning's ``trainer.log_dir``), else ``default_root_dir``."""
        for logger in getattr(self, "loggers", []):
            directory = getattr(logger, "log_dir", None)
            if directory:
                return str(directory)
        return str(self.default_root_dir)  # type: ignore[attr-defined]

    @property
    def estimated_stepping_batches(self) -> int:
        """Optimizer steps ``fit`` will run: ``max_steps``, or the epochs' steps if fewer (Lightning's).

        Raises:
            RuntimeError: With only ``max_epochs``, before ``fit`` has the training data (its length sets it),
                or for a stream of unknown length.
        """
        max_steps, max_epochs = self.max_steps, self.max_epochs  # type: ignore[attr-defined]
        loader = getattr(self, "train_loader", None)
        per_epoch = loader.limited_len() if loader is not None else None
        if per_epoch is None:
            if max_steps != -1:
                return max_steps
            raise RuntimeError("trainer.estimated_stepping_batches with max_epochs alone is known once fit "
                               "has the training data (read it in a hook), and not for a stream of unknown "
                               "length; set max_steps to know it before")
        steps = max_epochs * math.ceil(per_epoch / self.accumulate_grad_batches) \
            if max_epochs is not None else math.inf  # type: ignore[attr-defined]
        return int(min(steps, max_steps if max_steps != -1 else math.inf))

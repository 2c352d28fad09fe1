"""Lightning compatibility: Lightning's names with no meaning here, its habits, attributes and data arguments.

* ``Trainer(...)`` takes Lightning's names where the concept exists (``training/arguments.py``).
  :data:`UNSUPPORTED_ARGS` lists Lightning arguments that have no meaning in this trainer, each with what
  to use instead; :func:`reject_unknown_args` turns them (and misspellings) into one clear ``TypeError``.
* :func:`check_lightning_habits` refuses, before any process starts, what a LightningModule brings that
  would otherwise be silently ignored: ``configure_optimizers()`` (here every engine carries its optimizer
  and LR schedule: ``EngineSpec(..., optim=OptimConfig(...))`` in ``configure_engines``) and Lightning
  hooks defined on the module (here hooks run on callbacks). :class:`LightningAttributes` gives the
  Trainer Lightning's read-only attributes (``current_epoch``, ``log_dir``, ``estimated_stepping_batches``).
* ``fit(module, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None)`` and
  ``validate/test/predict(module, dataloaders=None, ..., datamodule=None)`` keep Lightning's names and
  positional order. A datamodule passed where the loaders go is taken as the datamodule (as Lightning does,
  so ``fit(module, data)`` works either way); loaders (a ``DataLoader`` or a map-style ``Dataset`` of
  ready batches) are wrapped in :class:`Loaders`, whose ``*_dataloader()`` methods :func:`stage_loader`
  calls to shard each kind of data by data-parallel rank.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from verl_trainer.callbacks.base import HOOK_NAMES
from verl_trainer.data.sharded_loader import ShardedLoader, as_dataloader, make_sharded_loader

if TYPE_CHECKING:
    from verl_trainer.module import TrainingModule

__all__ = [
    "HARMLESS_VALUES",
    "LightningAttributes",
    "Loaders",
    "UNSUPPORTED_ARGS",
    "check_lightning_habits",
    "fit_data",
    "is_datamodule",
    "reject_unknown_args",
    "stage_data",
    "stage_loader",
]

UNSUPPORTED_ARGS: dict[str, str] = {
    "overfit_batches": "pass a datamodule over the few samples to overfit and set limit_train_batches",
    "enable_model_summary": "remove it: no model summary is printed (the engines' models are HF models: "
                            "print(module.actor.module) after fit starts)",
    "benchmark": "set torch.backends.cudnn.benchmark yourself (LLM layers use no cuDNN convolutions)",
    "inference_mode": "remove it: validate / test / predict always run under torch.no_grad",
    "use_distributed_sampler": "remove it: the Trainer always re-shards the data over the data-parallel "
                               "ranks with a resumable sampler (verl_trainer.data.sharded_loader)",
    "profiler": "profile with torch.profiler inside a Callback (e.g. on_train_batch_start / _end)",
    "detect_anomaly": "call torch.autograd.set_detect_anomaly(True) in your script",
    "barebones": "use enable_progress_bar=False, enable_checkpointing=False, logger=False",
    "plugins": "use strategy= (an EngineRegistry backend or a Strategy) and precision=",
    "sync_batchnorm": "remove it: the supported models have no batch norm",
    "reload_dataloaders_every_n_epochs": "remove it: the loaders are built once per fit; the data order "
                                         "changes every epoch (seeded)",
    "model_registry": "remove it: export with ModelCheckpoint(save_hf=True) or engine.save_hf(path)",
}
"""Lightning ``Trainer`` arguments with no meaning here → what to use instead."""

HARMLESS_VALUES: dict[str, tuple[Any, ...]] = {
    "enable_model_summary": (True, False, None),
    "benchmark": (None, False),
    "inference_mode": (True, False),
    "use_distributed_sampler": (True,),
    "detect_anomaly": (False,),
    "sync_batchnorm": (False,),
    "barebones": (False,),
    "reload_dataloaders_every_n_epochs": (0,),
    "profiler": (None,),
    "plugins": (None,),
    "overfit_batches": (0, 0.0),
    "model_registry": (None,),
}
"""Values of :data:`UNSUPPORTED_ARGS` that are accepted because they ask for what happens here anyway
(Lightning's defaults, and ``enable_model_summary`` / ``inference_mode`` at any value: no summary is
printed, evaluation runs without gradients either way); any other value is refused with the fix."""


def _is_harmless(name: str, value: Any) -> bool:
    return any(value is v or (type(value) is type(v) and value == v) for v in HARMLESS_VALUES.get(name, ()))


def reject_unknown_args(kwargs: Mapping[str, Any], known: Iterable[str]) -> None:
    """Raise one ``TypeError`` for keyword arguments the Trainer does not take.

    Lightning arguments at a value that asks for what happens here anyway (:data:`HARMLESS_VALUES`) are
    accepted and ignored.

    Raises:
        TypeError: Naming each argument, with what to use instead (Lightning names) or the closest names.
    """
    kwargs = {name: value for name, value in kwargs.items() if not _is_harmless(name, value)}
    if not kwargs:
        return
    known = sorted(known)
    lines = []
    for name, value in kwargs.items():
        if name in HARMLESS_VALUES:
            accepted = " or ".join(repr(v) for v in HARMLESS_VALUES[name])
            lines.append(f"{name}={value!r}: Lightning's argument is accepted here only as {accepted} (what "
                         f"happens here anyway); {UNSUPPORTED_ARGS[name]}")
        elif name in UNSUPPORTED_ARGS:
            lines.append(f"{name}: Lightning's argument has no meaning here; {UNSUPPORTED_ARGS[name]}")
        else:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"arguments: {', '.join(known)}"
            lines.append(f"{name}: not a Trainer argument; {hint}")
    raise TypeError("Trainer() got unsupported keyword argument(s):\n  " + "\n  ".join(lines))


MODULE_METHODS = ("setup",)
"""Hook names that :class:`~verl_trainer.module.TrainingModule` itself defines and the Trainer calls."""


def check_lightning_habits(module: object) -> None:
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


KINDS = ("train", "val", "test", "predict")


def is_datamodule(obj: Any) -> bool:
    """Whether ``obj`` has one of the ``{train,val,test,predict}_dataloader()`` methods."""
    return any(callable(getattr(obj, f"{k}_dataloader", None)) for k in KINDS)


class Loaders:
    """A datamodule made of the loaders given to ``fit`` (``None`` where none was given)."""

    def __init__(self, train: Any = None, val: Any = None) -> None:
        self.train, self.val = train, val

    def train_dataloader(self) -> Any:
        """The training loader given to ``fit``."""
        return self.train

    def val_dataloader(self) -> Any:
        """The validation loader given to ``fit`` (``None``: no validation)."""
        return self.val


def fit_data(train_dataloaders: Any, val_dataloaders: Any, datamodule: Any) -> Any:
    """``fit``'s data as one object: the datamodule, or :class:`Loaders` of the loaders given.

    Raises:
        ValueError: Both a datamodule and loaders, or ``val_dataloaders`` without training data.
    """
    if train_dataloaders is not None and is_datamodule(train_dataloaders) and val_dataloaders is None \
            and datamodule is None:
        return train_dataloaders  # fit(module, datamodule) positionally, as in Lightning
    if datamodule is not None and (train_dataloaders is not None or val_dataloaders is not None):
        raise ValueError("fit got a datamodule and train_dataloaders / val_dataloaders; pass the loaders "
                         "or the datamodule, not both")
    if datamodule is not None:
        return datamodule
    if val_dataloaders is not None and train_dataloaders is None:
        raise ValueError("fit got val_dataloaders but no training data; pass train_dataloaders= too (or a "
                         "datamodule)")
    if val_dataloaders is None:
        return train_dataloaders  # a loader or dataset alone is the training data (None: the module's)
    if is_datamodule(train_dataloaders) or is_datamodule(val_dataloaders):
        raise ValueError("fit got a datamodule as train_dataloaders and val_dataloaders too; pass "
                         "datamodule=... alone (its val_dataloader() is the validation data)")
    return Loaders(train_dataloaders, val_dataloaders)


def stage_data(stage: str, dataloaders: Any, datamodule: Any) -> Any:
    """The data of ``validate``, ``test``, ``predict``: ``dataloaders`` (or a datamodule) or ``datamodule``.

    Raises:
        ValueError: If both are given.
    """
    if dataloaders is not None and datamodule is not None:
        raise ValueError(f"{stage} got dataloaders and a datamodule; pass one of them")
    return datamodule if dataloaders is None else dataloaders


def stage_loader(kind: str, datamodule: Any, module: TrainingModule, direct: bool, dp_rank: int,
                 dp_size: int, seed: int, limit: int | float | None) -> ShardedLoader | None:
    """This rank's shard of the ``kind`` data (``train`` / ``val`` / ``test`` / ``predict``), or ``None``.

    The data is ``datamodule.{kind}_dataloader()``, else (``direct``) the datamodule itself when it is a
    loader or dataset passed in its place, else ``module.{kind}_dataloader()`` when no datamodule is given.
    Validation and test data tag the sampler's padding rows; ``limit`` is ``limit_{kind}_batches``.
    """
    method = f"{kind}_dataloader"
    source = None
    if datamodule is not None:
        if callable(getattr(datamodule, method, None)):
            source = getattr(datamodule, method)()
        elif direct and not is_datamodule(datamodule):
            source = datamodule
    elif callable(getattr(module, method, None)):
        source = getattr(module, method)()
    if source is None:
        return None
    loader = as_dataloader(source, f"{kind} data")
    tag_padding = kind in ("val", "test")
    return make_sharded_loader(loader, dp_rank, dp_size, seed, tag_padding=tag_padding, limit=limit)

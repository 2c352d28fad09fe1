"""Lightning's data arguments of ``fit`` / ``validate`` / ``test`` / ``predict``, as one data object.

``fit(module, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None)`` and
``validate/test/predict(module, dataloaders=None, ..., datamodule=None)`` keep Lightning's names and
positional order. A datamodule passed where the loaders go is taken as the datamodule (as Lightning does,
so ``fit(module, data)`` works either way); loaders (a ``DataLoader`` or a map-style ``Dataset`` of ready
batches) are wrapped in :class:`Loaders`, whose ``*_dataloader()`` methods the loops call.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Loaders", "fit_data", "is_datamodule", "stage_data"]

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

"""Lightning's data arguments of ``fit`` / ``validate`` / ``test`` / ``predict``, as one data object.

``fit(module, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None)`` and
``validate/test/predict(module, dataloaders=None, ..., datamodule=None)`` keep Lightning's names and
positional order. A datamodule passed where the loaders go is taken as the datamodule (as Lightning does,
so ``fit(module, data)`` works either way); loaders (a ``DataLoader`` or a map-style ``Dataset`` of ready
batches) are wrapped in :class:`Loaders`, whose ``*_dataloader()`` methods :func:`stage_loader` calls to
shard each kind of data by data-parallel rank.
"""

from __future__ import annotations

from typing import Any

from verl_trainer.data.sharded_loader import ShardedLoader, as_dataloader, make_sharded_loader

__all__ = ["Loaders", "fit_data", "is_datamodule", "stage_data", "stage_loader"]

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


def stage_loader(kind: str, datamodule: Any, module: Any, direct: bool, dp_rank: int, dp_size: int, seed: int,
                 limit: int | float | None) -> ShardedLoader | None:
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

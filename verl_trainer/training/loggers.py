"""Loggers of the Trainer: Lightning's CSV, wandb, TensorBoard and MLflow loggers, on global rank 0 only.

``Trainer(logger=...)`` accepts ``True`` (a ``CSVLogger``, Lightning's fallback), ``False`` / ``None``,
``"csv"`` (``<default_root_dir>/lightning_logs/version_N/``), ``"wandb"`` (``<default_root_dir>/wandb/``;
offline when no API key is configured and ``WANDB_MODE`` is unset), ``"tensorboard"``, ``"mlflow"`` (a local
SQLite store ``sqlite:///<default_root_dir>/mlflow.db``, or ``MLFLOW_TRACKING_URI``), a Lightning ``Logger``,
or a list of these. A missing optional package is a ``ValueError`` naming what to install. String specs are
built at ``fit`` time on global rank 0 only (other ranks log nothing); ``module.hparams`` are logged once per
run. User guide: docs/lightning.md, "Trainer arguments".
"""

from __future__ import annotations

import importlib.util
import netrc
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from lightning.fabric.loggers import Logger
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

__all__ = [
    "LOGGER_NAMES", "LoggerSpec", "MLFlowLogger", "TensorBoardLogger", "build_loggers",
    "validate_logger_spec", "wandb_api_key_available",
]

LOGGER_NAMES = ("csv", "wandb", "tensorboard", "mlflow")
WANDB_PROJECT = "verl-trainer"

LoggerSpec: TypeAlias = "bool | str | Logger | Sequence[str | Logger] | None"
"""What ``Trainer(logger=...)`` accepts (see the module docstring)."""


def _is_logger(obj: Any) -> bool:
    from lightning.fabric.loggers import Logger as FabricLogger
    from lightning.pytorch.loggers import Logger

    return isinstance(obj, (Logger, FabricLogger))


def _as_list(spec: Any) -> list[Any]:
    if spec is None or spec is False:
        return []
    if spec is True:
        return ["csv"]
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence):
        return [spec]
    return list(spec)


def validate_logger_spec(spec: Any) -> None:
    """Check a ``Trainer(logger=...)`` value without building anything.

    Raises:
        ValueError: For an unknown logger name.
        TypeError: For a value that is neither a name, a bool, a Logger nor a list of those.
    """
    for item in _as_list(spec):
        if isinstance(item, str) and item in _REQUIRES:
            _REQUIRES[item]()
        if isinstance(item, str):
            if item not in LOGGER_NAMES:
                raise ValueError(
                    f"unknown logger {item!r}; choose one of {LOGGER_NAMES}, True (CSV), False, a Lightning "
                    f"Logger instance or a list of these"
                )
        elif item is True or item is False or item is None:
            raise TypeError("a logger list may hold names and Logger instances, not booleans or None")
        elif not _is_logger(item):
            raise TypeError(
                f"logger must be one of {LOGGER_NAMES}, True, False, a Lightning Logger or a list of these, "
                f"got {type(item).__name__}"
            )


def wandb_api_key_available() -> bool:
    """Whether wandb could log online: ``WANDB_API_KEY`` is set or ``~/.netrc`` has ``api.wandb.ai``."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
        return bool(Path(path).is_file() and netrc.netrc(path).authenticators("api.wandb.ai"))
    except (netrc.NetrcParseError, OSError):
        return False


def make_wandb_logger(root_dir: str, **kwargs: Any) -> WandbLogger:
    """``WandbLogger`` writing under ``root_dir``; offline when no API key is configured."""
    from lightning.pytorch.loggers import WandbLogger

    offline = kwargs.pop("offline", None)
    if offline is None:
        offline = "WANDB_MODE" not in os.environ and not wandb_api_key_available()
    kwargs.setdefault("project", WANDB_PROJECT)
    Path(root_dir).mkdir(parents=True, exist_ok=True)
    return WandbLogger(save_dir=root_dir, offline=offline, **kwargs)


def _require_tensorboard() -> None:
    if not any(importlib.util.find_spec(name) for name in ("tensorboard", "tensorboardX")):
        raise ValueError(
            "logger='tensorboard' needs the tensorboard package, which is not installed; run `pip install "
            "tensorboard` (or tensorboardX; the extra: `pip install verl-trainer[tensorboard]`), or use "
            "logger='csv' / 'wandb'"
        )


def TensorBoardLogger(save_dir: str, name: str | None = "lightning_logs", version: int | str | None = None,  # noqa: N802
                      **kwargs: Any) -> Logger:
    """Lightning's ``TensorBoardLogger`` with its arguments, after checking that tensorboard is installed.

    Raises:
        ValueError: Neither ``tensorboard`` nor ``tensorboardX`` is installed (names the package).
    """
    _require_tensorboard()
    from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger

    return LightningTensorBoardLogger(save_dir=save_dir, name=name, version=version, **kwargs)


MLFLOW_DB = "mlflow.db"
"""The default MLflow store's file under the run directory (``sqlite:///<default_root_dir>/mlflow.db``)."""
SQL_STORE_PACKAGES = ("sqlalchemy", "alembic")
"""What mlflow's SQLite store needs beyond ``mlflow-skinny`` (full ``mlflow`` has them)."""


def default_mlflow_uri(save_dir: str | os.PathLike) -> str:
    """The tracking URI of the default store: a SQLite file under ``save_dir`` (absolute)."""
    return f"sqlite:///{Path(save_dir).resolve() / MLFLOW_DB}"


def _require_mlflow(tracking_uri: str | None = None) -> None:
    """Check that mlflow, and for a SQLite store its database packages, are installed.

    Args:
        tracking_uri: The store that will be used; ``None``: ``MLFLOW_TRACKING_URI`` when set, else the
            default SQLite store.
    """
    if importlib.util.find_spec("mlflow") is None:
        raise ValueError(
            "logger='mlflow' needs the mlflow package, which is not installed; run `pip install "
            "verl-trainer[mlflow]` (the tracking client mlflow-skinny with its SQLite store) or `pip install "
            "mlflow`, or use logger='csv' / 'wandb'"
        )
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_mlflow_uri(".")
    missing = [name for name in SQL_STORE_PACKAGES if importlib.util.find_spec(name) is None]
    if uri.startswith("sqlite:") and missing:
        raise ValueError(
            f"logger='mlflow' writes to the SQLite store {uri}, which needs {' and '.join(missing)} (not "
            f"installed; mlflow-skinny alone has no SQL store); run `pip install verl-trainer[mlflow]` (or "
            f"`pip install {' '.join(missing)}`), or set MLFLOW_TRACKING_URI to a server (http://...)"
        )


def MLFlowLogger(experiment_name: str = WANDB_PROJECT, run_name: str | None = None,  # noqa: N802
                 tracking_uri: str | None = None, save_dir: str = ".", **kwargs: Any) -> Logger:
    """Lightning's ``MLFlowLogger`` writing to a local SQLite store unless ``tracking_uri`` names another.

    Args:
        experiment_name: The MLflow experiment (verl: ``trainer.project_name``).
        run_name: The run's name (verl: ``trainer.experiment_name``).
        tracking_uri: Where runs are stored; ``None``: ``MLFLOW_TRACKING_URI`` when set, else
            ``sqlite:///<save_dir>/mlflow.db``. Any process reads them back with
            ``mlflow.MlflowClient(tracking_uri)`` or ``mlflow ui --backend-store-uri <tracking_uri>``.
            A ``file:`` store (mlflow 3 deprecates it) is written as asked; reading it back needs
            ``MLFLOW_ALLOW_FILE_STORE=true`` in the reading process too.
        save_dir: The directory of the default store; a new experiment's artifacts go to
            ``<save_dir>/mlartifacts`` (not the working directory).
        kwargs: Lightning's other ``MLFlowLogger`` arguments (``tags``, ``log_model``, ``prefix``,
            ``artifact_location``, ...).

    Raises:
        ValueError: mlflow, or for the SQLite store sqlalchemy / alembic, is not installed (names the extra).
    """
    if tracking_uri is None:
        tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or default_mlflow_uri(save_dir)
    _require_mlflow(tracking_uri)
    from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger

    if tracking_uri.startswith("file:"):  # the user's choice; mlflow 3 refuses it unless told
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    if tracking_uri.startswith("sqlite:"):
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("artifact_location", (Path(save_dir).resolve() / "mlartifacts").as_uri())
    return LightningMLFlowLogger(experiment_name=experiment_name, run_name=run_name,
                                 tracking_uri=tracking_uri, **kwargs)


_REQUIRES = {"tensorboard": _require_tensorboard, "mlflow": _require_mlflow}
"""Logger names whose package is optional: the check that names what to install."""


def make_csv_logger(root_dir: str) -> CSVLogger:
    """``CSVLogger`` under ``root_dir/lightning_logs/version_N``."""
    from lightning.pytorch.loggers import CSVLogger

    return CSVLogger(save_dir=root_dir, name="lightning_logs")


def build_loggers(spec: LoggerSpec, root_dir: str) -> list[Logger]:
    """Build the loggers of ``spec`` (call on global rank 0 only)."""
    loggers = []
    for item in _as_list(spec):
        if item == "csv":
            loggers.append(make_csv_logger(root_dir))
        elif item == "wandb":
            loggers.append(make_wandb_logger(root_dir))
        elif item == "tensorboard":
            loggers.append(TensorBoardLogger(root_dir))
        elif item == "mlflow":
            loggers.append(MLFlowLogger(save_dir=root_dir))
        else:
            loggers.append(item)
    return loggers


def plain_hparams(hparams: Any) -> dict[str, Any]:
    """``hparams`` as a flat-enough dict of plain values for ``log_hyperparams``."""
    import dataclasses

    if dataclasses.is_dataclass(hparams) and not isinstance(hparams, type):
        hparams = dataclasses.asdict(hparams)
    if not isinstance(hparams, dict):
        raise TypeError(f"module.hparams must be a dict or a dataclass, got {type(hparams).__name__}")

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, (str, int, float, bool)) or value is None:
            return value
        return str(value)

    return plain(hparams)

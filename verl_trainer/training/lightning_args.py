"""Lightning's Trainer arguments: checking their values, and what to use for those with no meaning here.

``Trainer(...)`` takes Lightning's names where the concept exists (``training/args.py: TrainerArgs``).
The checks live here, one each, so the Trainer's constructor and the recipes' configs reject a bad value
the same way, before any process starts. :data:`UNSUPPORTED_ARGS` lists Lightning arguments that have no
meaning in this trainer, each with what to use instead; :func:`reject_unknown_args` turns them (and
misspellings) into one clear ``TypeError``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from verl_trainer.utils.durations import parse_max_time

__all__ = [
    "HARMLESS_VALUES",
    "UNSUPPORTED_ARGS",
    "check_accumulate",
    "check_gradient_clip",
    "check_limit",
    "check_optional_count",
    "check_val_check_interval",
    "parse_max_time",
    "reject_unknown_args",
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_limit(name: str, value: Any) -> int | float | None:
    """``limit_*_batches``: ``None`` (all), an int >= 0 (batches) or a float in ``[0, 1]`` (fraction).

    Raises:
        ValueError: Any other value.
    """
    if value is None or (_is_int(value) and value >= 0):
        return value
    if isinstance(value, float) and 0.0 <= value <= 1.0:
        return 1.0 if value == 1.0 else value
    raise ValueError(
        f"{name}={value!r}; use an int >= 0 (batches), a float in [0, 1] (fraction of the batches) or None "
        "(all)"
    )


def check_val_check_interval(value: Any) -> int | float | None:
    """``val_check_interval``: ``None``, an int >= 1 (trainer steps) or a float in ``(0, 1]`` (epoch).

    Raises:
        ValueError: Any other value.
    """
    if value is None or (_is_int(value) and value >= 1):
        return value
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return value
    raise ValueError(
        f"val_check_interval={value!r}; use an int >= 1 (every N trainer steps), a float in (0, 1] (every "
        "fraction of an epoch: 0.5 validates twice per epoch) or None (no validation during fit)"
    )


def check_optional_count(name: str, value: Any, minimum: int = 0) -> int | None:
    """``None`` or an int >= ``minimum``.

    Raises:
        ValueError: Any other value.
    """
    if value is None or (_is_int(value) and value >= minimum):
        return value
    raise ValueError(f"{name}={value!r}; use None or an int >= {minimum}")


def check_accumulate(value: Any) -> int:
    """``accumulate_grad_batches``: an int >= 1 (a dict schedule is not supported).

    Raises:
        ValueError: Any other value.
    """
    if _is_int(value) and value >= 1:
        return value
    raise ValueError(
        f"accumulate_grad_batches={value!r}; use an int >= 1 (loader batches per optimizer step; a schedule "
        "that changes it by epoch is not supported: it would change the global batch mid-run)"
    )


def check_gradient_clip(value: Any, algorithm: Any) -> float | None:
    """``gradient_clip_val`` (``None``, or a number >= 0) with ``gradient_clip_algorithm`` ``"norm"``.

    Returns:
        The clip value (``None``: the modules' ``OptimConfig.clip_grad`` applies).

    Raises:
        ValueError: A negative or non-numeric value, or an algorithm other than ``"norm"``.
    """
    if algorithm not in (None, "norm"):
        raise ValueError(
            f"gradient_clip_algorithm={algorithm!r} is not supported; the engines clip the total gradient "
            "norm over all shards (FSDP / ZeRO compute it globally): use gradient_clip_algorithm='norm' "
            "(or None)"
        )
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"gradient_clip_val={value!r}; use a number >= 0 (0: no clipping) or None")
    return float(value)
